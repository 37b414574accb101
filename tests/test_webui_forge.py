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
from harness import webui_lean  # noqa: E402, F401  (autouse: see its docstring)

from sd_accel.profiles import Profile  # noqa: E402

DYNAMIC = Profile(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96), tokens=(77, 77, 154))
LONG_PROMPT = " ".join(["word"] * 100)




def _job_counts(component: str = "ldm_unet"):
    from sd_accel.webui.controller import controller

    engines = controller().loaded(component)
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
        out = webui.txt2img(**kw)
        run.images = out.images
        return out.samples

    def engines_on(on: bool) -> None:
        webui.shared.opts.data["sd_accel_forge_enabled"] = on
        webui.shared.opts.data["sd_accel_vae_clip_enabled"] = on

    engines_on(False)
    reference = {}
    for name, (kw, free) in jobs.items():
        reference[name] = (run(free, **kw), run.images)
    engines_on(True)
    for name, (kw, free) in jobs.items():
        got = run(free, **kw)
        engine, torch_calls = _job_counts()
        assert torch_calls == 0, name
        torch.testing.assert_close(got, reference[name][0], atol=2e-3, rtol=2e-3)
        # Forge's VAE (its patcher decodes through first_stage_model.decoder) and CLIP on engines.
        assert _job_counts("ldm_vae_decoder") == (kw.get("batch_size", 1), 0), name
        assert _job_counts("ldm_clip")[1] == 0 and _job_counts("ldm_clip")[0] >= 2, name
        torch.testing.assert_close(run.images, reference[name][1], atol=2e-3, rtol=2e-3)
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
    assert sum("ldm_unet: running torch for this call" in r.getMessage() for r in caplog.records) == 1
    assert "0 on engines, 3 in PyTorch" in capsys.readouterr().out

    # A LoRA the engines were not built with: the checkpoint's engines refitted for it (see
    # test_webui_lora for the images).
    run(1 << 40, prompt="a cat <lora:film:1>", steps=1)
    assert "refitted for film:1 (" in capsys.readouterr().out and _job_counts()[1] == 0
    assert _job_counts("ldm_clip") == (0, 0)  # the LoRA is in Forge's CLIP too: PyTorch encodes

    # ControlNet residuals or other extensions' UNet patches: that call runs in PyTorch.
    unet = webui.shared.sd_model.forge_objects.unet.model.diffusion_model
    from sd_accel.webui.controller import controller

    engines = controller().engines_for(records[0].key.model)
    stand_in = EngineDiffusionModel(unet, engines)
    x, t, ctx = torch.randn(2, 4, 8, 8), torch.tensor([10.0, 10.0]), torch.randn(2, 77, 64)
    engines.reset_stats()
    with torch.no_grad():  # Forge samples without autograd (its weights are inference tensors)
        stand_in(x, t, context=ctx, transformer_options={"patches": {"attn2_patch": [print]}})
    assert engines.stats.torch_calls == 1 and "attn2_patch" in next(iter(engines.stats.fallbacks))
    assert stand_in.model_channels == unet.model_channels  # attributes read through to Forge's UNet


def test_forge_build_before_the_first_generation_loads_the_checkpoint(tmp_path, capsys):
    """Forge 2 loads a checkpoint only when it generates: a build before that loads the selected
    one with Forge's own ``forge_model_reload``, and the status says what happens meanwhile."""
    webui = harness.start(tmp_path, forge=True, load=False)
    from modules import sd_models

    from sd_accel.webui.tab import status_markdown

    assert type(sd_models.model_data.sd_model).__name__ == "FakeInitialModel"
    assert "no checkpoint is loaded in Forge yet" in status_markdown() and "a build loads it first" in status_markdown()
    capsys.readouterr()
    response = webui.client().post("/sd-accel/build", json={"profile": DYNAMIC.to_dict(), "components": ["unet"]})
    assert response.status_code == 200, response.text
    assert sd_models.model_data.loads == [webui.checkpoint.title]
    assert "loading the selected checkpoint for the build" in capsys.readouterr().out
    assert "1 UNet engine(s) for these weights" in status_markdown()
    webui.txt2img(prompt="a cat", steps=2)  # Forge's own reload finds it loaded: no second load
    assert sd_models.model_data.loads == [webui.checkpoint.title] and _job_counts()[0] > 0


def test_forge_attention_is_plain_in_the_export(tmp_path, monkeypatch):
    """Forge's CPU attention (sub-quadratic: ``baddbmm`` over an uninitialised bias with beta=0)
    exports as NaN; the export swaps in plain attention. Without the swap the stand-in Forge
    reproduces the field failure (Forge 2024: "latent has NaN/inf")."""
    harness.start(tmp_path, forge=True)
    from sd_accel.core import EngineError
    from sd_accel.webui import tracing
    from sd_accel.webui.jobs import build_for_checkpoint

    monkeypatch.setattr(tracing, "_FORGE_ATTENTION", ())
    with pytest.raises(EngineError, match="NaN"):
        build_for_checkpoint(profile=STATIC_FORGE.to_dict(), components=["unet"])
    monkeypatch.undo()
    records = build_for_checkpoint(profile=STATIC_FORGE.to_dict(), components=["unet"])
    assert records[0].validation["rel_l2"] < 1e-3
    # The failed build left no export behind; the good one's export is there for its engine.
    exports = [p.name for p in (tmp_path / "engines" / "onnx").iterdir() if p.is_dir()]
    assert exports == [records[0].extra["webui"]["onnx"]]


STATIC_FORGE = Profile(batch=1, height=64, width=64)


def test_plain_forge_attention_swaps_forge_1_and_2_functions_and_restores_them(monkeypatch):
    import types

    from sd_accel.webui.tracing import plain_forge_attention, plain_heads_attention, plain_spatial_attention

    def sub_quad(q, k, v, heads, mask=None):
        return q

    forge1 = types.ModuleType("ldm_patched.ldm.modules.attention")
    forge1.optimized_attention = forge1.optimized_attention_masked = sub_quad
    monkeypatch.setitem(sys.modules, "ldm_patched.ldm.modules.attention", forge1)

    class AttnBlock(torch.nn.Module):  # Forge 1's VAE block keeps its attention per instance
        def __init__(self):
            super().__init__()
            self.optimized_attention = sub_quad

    model = torch.nn.Sequential(AttnBlock())
    with plain_forge_attention(model):
        assert forge1.optimized_attention is plain_heads_attention
        assert forge1.optimized_attention_masked is plain_heads_attention
        assert model[0].optimized_attention is plain_spatial_attention
    assert forge1.optimized_attention is sub_quad and model[0].optimized_attention is sub_quad
    # The plain forms compute attention (against torch's SDPA).
    q, k, v = (torch.randn(2, 5, 16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.reshape(2, 5, 4, 4).transpose(1, 2) for t in (q, k, v))).transpose(1, 2).reshape(2, 5, 16)
    torch.testing.assert_close(plain_heads_attention(q, k, v, 4), ref)
    q, k, v = (torch.randn(1, 8, 3, 3) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.reshape(1, 1, 8, 9).transpose(-1, -2) for t in (q, k, v))).transpose(-1, -2).reshape(1, 8, 3, 3)
    torch.testing.assert_close(plain_spatial_attention(q, k, v), ref)


def test_forge_linear_and_inference_tensors():
    """Forge 2's ``ForgeOperations.Linear`` (a plain Module) is found by what it has, and the
    weights fingerprint works on inference tensors (no version counter) and still sees new weights."""
    harness.purge()
    sys.path[:0] = [str(STUB), str(STUB / "forge")]
    from backend.operations import forge_linears
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    from sd_accel.components.ldm_unet import ldm_dims
    from sd_accel.onnx.fingerprint import fingerprint

    unet = UNetModel("sd15")
    forge_linears(unet.unet)
    to_k = dict(unet.named_modules())["unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k"]
    assert not isinstance(to_k, torch.nn.Linear) and to_k.weight.is_inference()
    assert ldm_dims(unet).context_dim == 64
    first = fingerprint(unet)
    assert fingerprint(unet) == first
    with torch.inference_mode():
        to_k.weight = torch.nn.Parameter(to_k.weight * 2, requires_grad=False)
    assert fingerprint(unet) != first
    harness.purge()


def test_always_cpu_forge_gets_no_tensorrt_advice(tmp_path, monkeypatch):
    harness.start(tmp_path, forge=True)
    import torch as torch_module
    from backend import args as forge_args

    from sd_accel.webui.tab import status_markdown

    monkeypatch.setattr(torch_module.version, "cuda", "12.1")
    monkeypatch.setattr(torch_module.cuda, "is_available", lambda: True)
    monkeypatch.setattr(forge_args.args, "always_cpu", True)
    text = status_markdown()
    assert "tensorrt-cu" not in text and "This WebUI computes on the CPU" in text and "OpenVINO" in text


def test_forge_parks_the_torch_unet_while_engines_serve(tmp_path):
    """Forge keeps its whole torch UNet in RAM whatever computes the calls: in a real Forge (SD 1.5,
    CPU) the engine runs peaked above Forge's own PyTorch runs. While engines serve a job its
    weights are parked (memory-mapped, resident only where read) and the job's end hands back what
    it read; the values never change, so a later PyTorch job computes exactly what it did."""
    webui = harness.start(tmp_path, forge=True, options={"sd_accel_backend": "onnxruntime"})
    from sd_accel.runtime.weights import parked
    from sd_accel.webui.controller import controller
    from sd_accel.webui.jobs import build_for_checkpoint

    build_for_checkpoint(profile=DYNAMIC)
    unet = webui.shared.sd_model.forge_objects.unet.model.diffusion_model
    webui.shared.opts.data["sd_accel_forge_enabled"] = False
    reference = webui.txt2img(prompt="a cat", steps=2).samples
    assert parked(unet) is None  # a job in PyTorch parks nothing
    webui.shared.opts.data["sd_accel_forge_enabled"] = True
    got = webui.txt2img(prompt="a cat", steps=2).samples
    assert _job_counts()[1] == 0 and _job_counts()[0] > 0
    assert parked(unet) is not None and controller().job.parked is None  # released at the job's end
    torch.testing.assert_close(got, reference, atol=2e-3, rtol=2e-3)
    webui.shared.opts.data["sd_accel_forge_enabled"] = False
    torch.testing.assert_close(webui.txt2img(prompt="a cat", steps=2).samples, reference, atol=0, rtol=0)
