"""The WebUI extension on Forge (the stand-in Forge in ``tests/webui_stub/forge``).

Forge never calls A1111's SD-UNet, so engines come in through ``process_before_every_sampling``
and the UNet patcher; Forge packs cond/uncond rows by free memory, so batches are cut into
chunks the engines cover.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

STUB = Path(__file__).resolve().parent / "webui_stub"
sys.path.insert(0, str(STUB))
import harness  # noqa: E402

from sd_accel.profiles import Profile  # noqa: E402

DYNAMIC = Profile(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96), tokens=(77, 77, 154))
LONG_PROMPT = " ".join(["word"] * 100)


@pytest.fixture(autouse=True)
def _lean(monkeypatch):
    monkeypatch.setenv("SD_ACCEL_ORT_THREADS", "1")
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    yield
    harness.purge()


def _job_counts():
    from sd_accel.webui.controller import controller

    engines = controller().loaded()
    return sum(e.stats.engine_calls for e in engines), sum(e.stats.torch_calls for e in engines)


def test_forge_job_with_chunks_hires_and_fallback(tmp_path, caplog, capsys):
    # ONNX Runtime fp32 engines (not auto's OpenVINO bf16 on CPUs): the jobs match PyTorch to 2e-3
    webui = harness.start(tmp_path, forge=True, options={"sd_accel_backend": "onnxruntime"})
    from backend import memory_management
    from backend.sampling import sampling_function

    from sd_accel.webui.forge import EngineDiffusionModel
    from sd_accel.webui.jobs import build_for_checkpoint

    cb = webui.script_callbacks.callback_map
    assert not cb["callbacks_list_unets"]  # no SD-UNet entry on Forge: it would never be called
    assert cb["callbacks_ui_tabs"] and cb["callbacks_app_started"]
    assert "sd_accel_forge_enabled" in webui.demo.sd_stub_settings
    records = build_for_checkpoint(profile=DYNAMIC)
    assert records[0].extra["webui"]["host"] == "forge"

    jobs = {
        "batch 3 packed (6 rows: 4 + 2)": (dict(prompt="a cat", steps=2, batch_size=3), 1 << 40),
        "batch 3 apart (3 + 3)": (dict(prompt="a cat", steps=2, batch_size=3), 1),
        "154 tokens + hires": (dict(prompt=LONG_PROMPT, steps=2, enable_hr=True, hr_scale=1.5), 1 << 40),
    }

    def run(free, **kw):
        memory_management.FREE_MEMORY = free
        sampling_function.calls.clear()
        return webui.txt2img(**kw).samples

    webui.shared.opts.data["sd_accel_forge_enabled"] = False
    reference = {name: run(free, **kw) for name, (kw, free) in jobs.items()}
    webui.shared.opts.data["sd_accel_forge_enabled"] = True
    for name, (kw, free) in jobs.items():
        got = run(free, **kw)
        engine, torch_calls = _job_counts()
        assert torch_calls == 0, name
        torch.testing.assert_close(got, reference[name], atol=2e-3, rtol=2e-3)
        if name.startswith("batch 3 packed"):
            assert {c[0] for c in sampling_function.calls} == {6}  # Forge packed all rows in one call
            assert engine == 2 * len(sampling_function.calls)  # each cut into 4 + 2
        elif name.startswith("batch 3 apart"):
            assert {c[0] for c in sampling_function.calls} == {3} and engine == len(sampling_function.calls)
        else:
            assert {c[3] for c in sampling_function.calls} == {154}  # Forge pads uncond to 154 columns
            assert {c[1] for c in sampling_function.calls} == {8, 12}  # both passes, each patched
    # The patch is gone after sampling: Forge's UNet is its own again.
    model = webui.shared.sd_model.forge_objects.unet.model
    assert not isinstance(model.diffusion_model, EngineDiffusionModel)

    # Outside the engines' sizes: PyTorch, said once in the job, summed up at its end.
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        run(1 << 40, prompt="a cat", steps=3, width=128, height=128)
    assert _job_counts() == (0, 3)
    assert sum("running torch for this call" in r.getMessage() for r in caplog.records) == 1
    assert "0 on engines, 3 in PyTorch" in capsys.readouterr().out

    # A LoRA the engines were not built with: the job stays on Forge's UNet and says why.
    run(1 << 40, prompt="a cat <lora:film:1>", steps=1)
    assert "no engine for this checkpoint with film (1)" in capsys.readouterr().out

    # ControlNet residuals or other extensions' UNet patches: that call runs in PyTorch.
    unet = webui.shared.sd_model.forge_objects.unet.model.diffusion_model
    from sd_accel.webui.controller import controller

    engines = controller().engines_for(records[0].key.model)
    stand_in = EngineDiffusionModel(unet, engines)
    x, t, ctx = torch.randn(2, 4, 8, 8), torch.tensor([10.0, 10.0]), torch.randn(2, 77, 64)
    engines.reset_stats()
    stand_in(x, t, context=ctx, transformer_options={"patches": {"attn2_patch": [print]}})
    assert engines.stats.torch_calls == 1 and "attn2_patch" in next(iter(engines.stats.fallbacks))
    assert stand_in.model_channels == unet.model_channels  # attributes read through to Forge's UNet
