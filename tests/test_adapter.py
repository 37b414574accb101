"""T2I-Adapters on engines (ONNX Runtime, tiny random models): the adapter runs once per image in
torch, the UNet takes its features as inputs (``unet_adapter``); images against torch at two
scales, calls without features on the plain UNet engine, and the counted fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sd_accel import accelerate, build_engines, stats
from sd_accel.models.builtin import build_tiny_pipeline

STEPS = 4
PROFILE = dict(batch=1, height=64, width=64)


def adapter_pipe():
    """A fresh tiny SD 1.5 T2I-Adapter pipeline (the same random weights each time)."""
    import diffusers

    base = build_tiny_pipeline("sd15")
    cfg = base.unet.config
    with torch.random.fork_rng():
        torch.manual_seed(0)
        adapter = diffusers.T2IAdapter(in_channels=3, channels=list(cfg.block_out_channels), num_res_blocks=1,
                                       downscale_factor=8, adapter_type="full_adapter")
        for p in adapter.parameters():
            p.data.normal_(0, 0.1)
    parts = {k: v for k, v in base.components.items() if k not in ("safety_checker", "feature_extractor",
                                                                     "image_encoder")}
    return diffusers.StableDiffusionAdapterPipeline(**parts, adapter=adapter.eval(), safety_checker=None,
                                                    feature_extractor=None, requires_safety_checker=False)


def hint(seed: int = 3) -> torch.Tensor:
    return torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(seed))


def run(pipe, **kwargs) -> np.ndarray:
    g = torch.Generator("cpu").manual_seed(0)
    return pipe("a cat", image=hint(), num_inference_steps=STEPS, height=64, width=64, generator=g,
                output_type="np", **kwargs).images


def torch_ref(**kwargs) -> np.ndarray:
    return run(accelerate(adapter_pipe(), precision="fp32", sampler="Euler"), **kwargs)


@pytest.fixture(scope="module")
def adapter_engines(tmp_path_factory):
    engine_dir = tmp_path_factory.mktemp("adapter-engines")
    records = build_engines(adapter_pipe(), profiles=[PROFILE], backend="onnxruntime", engine_dir=engine_dir,
                            components=["unet", "unet_adapter"], progress=False)
    return engine_dir, records


def test_feature_shapes_follow_the_profile():
    from sd_accel.components.adapter import AdapterUNetSpec
    from sd_accel.components.controlnet import control_specs
    from sd_accel.profiles import Profile

    pipe = adapter_pipe()
    specs = control_specs(pipe)
    assert set(specs) == {"unet_adapter"} and isinstance(specs["unet_adapter"], AdapterUNetSpec)
    spec = specs["unet_adapter"]
    ranges = spec.shape_ranges(Profile.of(dict(batch=(1, 1, 2), height=(64, 72, 96), width=(64, 72, 96))))
    for point in (0, 2):  # min and max: the adapter's real features have the shapes the engine takes
        side = (64, 96)[point // 2]
        with torch.no_grad():
            features = pipe.adapter(torch.rand(1, 3, side, side))
        assert [(1, *f.shape[1:]) for f in features] == [
            (1, *ranges[n][point][1:]) for n in spec.adapter_names()]


def test_adapter_on_engines_matches_torch_and_calls_without_features_use_the_plain_engine(adapter_engines):
    engine_dir, records = adapter_engines
    assert sorted(r.key.component for r in records) == ["unet", "unet_adapter"]
    assert all(r.validation["ok"] for r in records)
    ref = torch_ref(adapter_conditioning_scale=0.8)
    assert np.abs(ref - torch_ref(adapter_conditioning_scale=0.0)).max() > 1e-2  # the adapter does something
    pipe = accelerate(adapter_pipe(), engines=True, engine_dir=str(engine_dir), precision="fp32", sampler="Euler",
                      backend="onnxruntime")
    out = run(pipe, adapter_conditioning_scale=0.8)
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert s["unet_adapter"]["engine_calls"] == STEPS and s["unet_adapter"]["torch_calls"] == 0
    assert s["unet"]["engine_calls"] == 0 and s["unet"]["torch_calls"] == 0
    # another scale: the same engine
    assert np.abs(run(pipe, adapter_conditioning_scale=1.5) - torch_ref(adapter_conditioning_scale=1.5)).max() < 2e-3
    # a call without features (as SDXL's pipeline makes past adapter_conditioning_factor): the plain engine
    x, context = torch.randn(2, 4, 8, 8), torch.randn(2, 77, pipe.unet.config.cross_attention_dim)
    pipe.unet(x, torch.tensor([500.0, 500.0]), context)
    assert stats(pipe)["unet"]["engine_calls"] == 1


def test_features_the_engine_does_not_take_run_torch_counted(adapter_engines):
    engine_dir, _ = adapter_engines
    pipe = accelerate(adapter_pipe(), engines=True, engine_dir=str(engine_dir), precision="fp32", sampler="Euler",
                      backend="onnxruntime")
    x = torch.randn(2, 4, 8, 8)
    context = torch.randn(2, 77, pipe.unet.config.cross_attention_dim)
    features = [torch.randn(2, 32, 8, 8)]  # one feature where the UNet has two down blocks
    out = pipe.unet(x, torch.tensor([500.0, 500.0]), context, down_intrablock_additional_residuals=list(features))
    s = stats(pipe)["unet_adapter"]
    assert s["torch_calls"] == 1 and any("gave 1 features, the engine takes 2" in why for why in s["fallbacks"])
    assert torch.isfinite(out.sample).all()


@pytest.mark.slow
def test_engines_auto_builds_the_feature_taking_unet_on_first_use(tmp_path):
    from sd_accel.runtime.swap import set_build_progress

    pipe = accelerate(adapter_pipe(), engines="auto", engine_dir=str(tmp_path), precision="fp32", sampler="Euler",
                      backend="onnxruntime")
    set_build_progress(pipe, False)
    out = run(pipe, adapter_conditioning_scale=0.8)
    s = stats(pipe)
    assert len(s["unet_adapter"]["builds"]) == 1 and s["unet_adapter"]["engine_calls"] == STEPS
    assert np.abs(out - torch_ref(adapter_conditioning_scale=0.8)).max() < 2e-3


def test_changed_weights_never_run_stale_engines_and_refit_serves_the_adapter_unet(adapter_engines, tmp_path):
    import shutil

    from sd_accel import refit_engines

    engine_dir = shutil.copytree(adapter_engines[0], tmp_path / "engines")
    pipe = accelerate(adapter_pipe(), engines=True, engine_dir=str(engine_dir), precision="fp32", sampler="Euler",
                      backend="onnxruntime")
    with torch.no_grad():  # a weight edit (what a fused LoRA does)
        pipe.unet.torch_module.conv_in.weight.mul_(1.1)
    pipe.unet.touched()
    changed = adapter_pipe()
    with torch.no_grad():
        changed.unet.conv_in.weight.mul_(1.1)
    ref = run(accelerate(changed, precision="fp32", sampler="Euler"), adapter_conditioning_scale=0.8)
    assert np.abs(run(pipe, adapter_conditioning_scale=0.8) - ref).max() < 2e-3
    s = stats(pipe)["unet_adapter"]
    assert s["torch_calls"] == STEPS and any("weights changed" in why for why in s["fallbacks"])
    assert "unet_adapter" in refit_engines(pipe, progress=False)
    assert np.abs(run(pipe, adapter_conditioning_scale=0.8) - ref).max() < 2e-3
    assert stats(pipe)["unet_adapter"]["engine_calls"] == STEPS
