"""Forge's FLUX.1 on a transformer engine (issue 45, "Forge runs FLUX: the transformer on the engine
there too, with its own text encoders").

The stand-in Forge (``tests/webui_stub/forge``) with its loaded model's diffusion model swapped for
``backend.nn.flux.IntegratedFluxTransformer2DModel`` (the real class's attributes, parameter names
and ``forward(x, timestep, context, y, guidance, **kwargs)``, tiny widths, random weights). The
build goes through the WebUI API's ``POST /sd-accel/build``; the calls are made as Forge's
``KModel.apply_model`` makes them, through the object patch sd-accel adds before sampling, and
compared with Forge's own module; a LoRA is merged by Forge's loader and the engine refitted.
"""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch

STUB = Path(__file__).resolve().parent / "webui_stub"
sys.path.insert(0, str(STUB))
import harness  # noqa: E402
from harness import webui_lean  # noqa: E402, F401  (autouse: see its docstring)

# tiny widths of FLUX.1-dev's layout (guidance embedding): 2 heads of 32 lanes, rotary axes 4/14/14
CONFIG = dict(in_channels=16, vec_in_dim=32, context_in_dim=48, hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=1,
              depth_single_blocks=2, axes_dim=[4, 14, 14], theta=10000, qkv_bias=True, guidance_embed=True)
TEXT = 8  # T5 tokens of the engine's profile (Forge's own is 256)


def _flux(seed: int = 0) -> torch.nn.Module:
    from backend.nn.flux import IntegratedFluxTransformer2DModel

    torch.manual_seed(seed)
    module = IntegratedFluxTransformer2DModel(**CONFIG).eval()
    with torch.no_grad():
        for p in module.parameters():  # (std 0.1: the outputs stay finite and LoRA-sensitive)
            p.copy_(torch.randn_like(p) * 0.1)
    from backend.operations import forge_linears

    forge_linears(module)  # Forge's own Linear class, inference-tensor weights, as its loader leaves them
    return module.requires_grad_(False)


def _call(seed: int, batch: int = 2, side: int = 8) -> dict:
    """One call's arguments as Forge's ``KModel.apply_model`` passes them (the sigma as timestep,
    T5 states as context, CLIP-L's pooled output as y, the distilled guidance)."""
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(batch, 16, side, side, generator=g), timestep=torch.rand(batch, generator=g),
                context=torch.randn(batch, TEXT, 48, generator=g), y=torch.randn(batch, 32, generator=g),
                guidance=torch.full((batch,), 3.5), control=None, transformer_options={})


def _stats():
    from sd_accel.webui.controller import controller

    engines = controller().loaded("transformer")
    return sum(e.stats.engine_calls for e in engines), sum(e.stats.torch_calls for e in engines)


@pytest.fixture
def forge_flux(tmp_path):
    webui = harness.start(tmp_path, forge=True, options={"sd_accel_backend": "onnxruntime"})
    model = webui.shared.sd_model
    module = _flux()
    model.forge_objects.unet.model.diffusion_model = module
    return webui, model, module


def _sample(model, call: dict, loras: bool = False) -> torch.Tensor:
    """What Forge does around a sampling pass: sd-accel's hook first (``process_before_every_sampling``),
    then the model loaded for sampling (LoRAs merged, object patches in place), then the call."""
    from sd_accel.webui.forge import patch_for_sampling

    patch_for_sampling(types.SimpleNamespace(sd_model=model))
    patcher = model.forge_objects.unet
    if loras:
        patcher.refresh_loras()
    patcher.patch_model()
    try:
        with torch.no_grad():
            return patcher.model.diffusion_model(**call)
    finally:
        patcher.unpatch_model()


def test_forge_flux_builds_and_runs_on_the_transformer_engine(forge_flux, caplog):
    webui, model, module = forge_flux
    from sd_accel.webui.controller import controller

    ctl = controller()
    ctl.job_started()  # before any build: Forge's module, and the job's line says why
    first = _call(0)
    torch.testing.assert_close(_sample(model, first), module(**first))
    line = ctl.job_finished()
    assert "FLUX.1 transformer calls this job: 0 on engines" in line, line
    assert "no FLUX.1 transformer engine for this checkpoint" in line and "UNet" not in line, line

    profile = {"batch": [1, 1, 2], "height": [64, 64, 64], "width": [64, 64, 64], "text": [TEXT, TEXT, TEXT]}
    response = webui.client().post("/sd-accel/build", json={"components": ["unet", "vae_decoder"],
                                                           "profile": profile})
    assert response.status_code == 200, response.text
    assert "vae_decoder (with FLUX.1 in Forge only the transformer runs on an engine" in response.text, response.text
    records = controller().cache().list()
    flux = [r for r in records if r.key.component == "transformer"]
    assert len(flux) == 1 and flux[0].extra["webui"]["family"] == "flux-dev", [r.key for r in records]
    assert flux[0].extra["webui"]["host"] == "forge"

    from sd_accel.webui.tab import status_markdown

    status = status_markdown()  # the tab reads the loaded FLUX.1 without an LDM UNet's spec
    assert "runs in the WebUI's own PyTorch" not in status, status
    caplog.set_level(logging.INFO, logger="sd_accel")
    ctl.job_started()
    call = _call(1)
    with torch.no_grad():
        want = module(**call)
    got = _sample(model, call)
    assert got.shape == want.shape == (2, 16, 8, 8)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    assert _stats() == (1, 0)
    # what the engine does not compute goes to Forge's module, counted with the reason
    residual = dict(call, control={"input": [torch.zeros(2, 16, 64)], "output": []})
    torch.testing.assert_close(_sample(model, residual), module(**residual))
    wide = _call(2, side=12)  # 96 px: the static-64 engine does not cover it
    torch.testing.assert_close(_sample(model, wide), module(**wide))
    assert _stats() == (1, 2)
    line = ctl.job_finished()
    assert "FLUX.1 transformer calls this job: 1 on engines, 2 in PyTorch" in line, line
    assert "ControlNet residuals are not in the FLUX.1 engine" in line, line
    # a batch of 4 (Forge packs as many as memory allows) on an engine of batch 1-2: two chunks of 2
    ctl.job_started()
    four = _call(3, batch=4)
    with torch.no_grad():
        want = module(**four)
    torch.testing.assert_close(_sample(model, four), want, atol=2e-4, rtol=2e-4)
    assert _stats() == (2, 0)
    three = _call(4, batch=3)  # 2 + 1
    with torch.no_grad():
        want = module(**three)
    torch.testing.assert_close(_sample(model, three), want, atol=2e-4, rtol=2e-4)
    assert _stats() == (4, 0)
    ctl.job_finished()


def test_forge_flux_lora_refits_the_engine_never_serving_stale_weights(forge_flux):
    webui, model, module = forge_flux
    from backend.loader import lora_patches

    from sd_accel.webui.controller import controller
    from sd_accel.webui.jobs import build_for_checkpoint

    build_for_checkpoint(profile={"batch": [2, 2, 2], "height": [64, 64, 64], "width": [64, 64, 64],
                                  "text": [TEXT, TEXT, TEXT]}, components=["unet"])
    ctl = controller()
    base_patcher = model.forge_objects.unet
    call = _call(3)
    with torch.no_grad():
        base = module(**call)
    outs = {}
    for strength in (0.7, 1.0):
        ctl.job_started()
        unet = base_patcher.clone()
        name = "/models/Lora/film.safetensors"
        taken = unet.add_patches(filename=name, patches=lora_patches(unet.model, name), strength_patch=strength)
        assert any(k.startswith("diffusion_model.double_blocks.0.img_attn.qkv") for k in taken)
        model.forge_objects.unet = unet
        got = _sample(model, call, loras=True)
        with torch.no_grad():
            want = module(**call)  # Forge's module, its weights carrying the merged LoRA now
        assert (want - base).abs().max() > 1e-2  # the LoRA moves the output: a stale engine would show
        # (the stand-in LoRA's deltas are large: outputs of ~20, compared relative to their size)
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-3)
        assert _stats()[0] >= 1 and _stats()[1] == 0, _stats()
        line = ctl.job_finished()
        assert "FLUX.1 transformer on engine" in line and f"film:{strength:g}" in line, line
        outs[strength] = got
    assert (outs[0.7] - outs[1.0]).abs().max() > 1e-3
    # back to no LoRA: Forge restores the weights, the base engine serves them
    ctl.job_started()
    model.forge_objects.unet = base_patcher
    base_patcher.refresh_loras()
    torch.testing.assert_close(_sample(model, call), base, atol=2e-4, rtol=2e-4)
    assert _stats() == (1, 0)
