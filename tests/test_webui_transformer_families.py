"""FLUX.1 / SD3 loaded in the WebUI (issue 45: "A1111 has neither family: the tab says so
plainly"): sd-accel does not put these families on engines inside the WebUI yet (Forge's FLUX.1
and SD3.5 excepted: ``test_webui_forge_flux.py``, ``test_webui_forge_sd3.py``), so the tab's
status, a build request and a generation say so in plain words, and the generation runs in the
WebUI's own PyTorch. Stand-in WebUIs (``tests/webui_stub``) with the loaded diffusion model swapped
for a module of the class Forge 2 (``IntegratedChromaTransformer2DModel``) or A1111 1.10 (``MMDiT``)
loads for those files."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

STUB = Path(__file__).resolve().parent / "webui_stub"
sys.path.insert(0, str(STUB))
import harness  # noqa: E402
from harness import webui_lean  # noqa: E402, F401  (autouse: see its docstring)


def _named(name: str, like: torch.nn.Module) -> torch.nn.Module:
    """A diffusion model of class ``name`` that computes what ``like`` computes (the stand-in
    sampler needs an answer; the point is the class the WebUI loaded)."""

    def forward(self, x, *args, **kwargs):
        return like(x, *args, **kwargs)

    return type(name, (torch.nn.Module,), {"forward": forward})()


@pytest.mark.parametrize(("forge", "cls", "family"), [(True, "IntegratedChromaTransformer2DModel", "Chroma"),
                                                      (False, "MMDiT", "SD3")])
def test_a_transformer_family_says_it_runs_in_the_webuis_pytorch(tmp_path, caplog, forge, cls, family):
    webui = harness.start(tmp_path, forge=forge, options={"sd_accel_backend": "onnxruntime"})
    from sd_accel.webui.tab import status_markdown

    model = webui.shared.sd_model
    holder = model.forge_objects.unet.model if forge else model.model
    holder.diffusion_model = _named(cls, holder.diffusion_model)
    status = status_markdown()
    assert f"the loaded model is {family} ({cls})" in status and "runs in the WebUI's own PyTorch" in status, status
    response = webui.client().post("/sd-accel/build", json={"components": ["unet"]})
    assert response.status_code == 409 and f"{family} on engines" in response.text, response.text
    caplog.set_level(logging.INFO, logger="sd_accel")
    result = webui.txt2img(prompt="a cat", steps=2)  # the WebUI's own PyTorch, no error
    assert result is not None
    if forge:  # Forge's sampling hook says why it left the model alone
        assert f"the loaded model is {family}" in caplog.text
