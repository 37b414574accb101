"""An LCM-LoRA (the few-step LoRAs people load: attention, feed-forward, resnet convolutions and
time projections) on float engines by refit, with the LCM sampler at CFG 1 (one UNet row per
image: a ``cfg=False`` static engine), and a strength change that is one more refit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, refit_engines, stats
from sd_accel.profiles import Profile

pytest.importorskip("peft", reason="peft is not installed (it is in sd-accel[dev]); the LoRA tests need it")

# What LCM-LoRA SD 1.5 targets (its keys name every one of these), convolutions included.
LCM_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
               "conv1", "conv2", "conv_shortcut", "time_emb_proj"]
CFG_OFF = Profile(batch=1, height=64, width=64, cfg=False)


@pytest.fixture(scope="module")
def lcm_lora(tmp_path_factory):
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    folder = tmp_path_factory.mktemp("lcm-lora")
    src = load_pipeline("builtin:tiny-sd15")
    torch.manual_seed(0)
    src.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=LCM_TARGETS, init_lora_weights=False))
    StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=get_peft_model_state_dict(src.unet))
    return folder


@pytest.fixture(scope="module")
def want(lcm_lora):
    """Torch images with the LCM-LoRA at strengths 1 and 0.5."""
    ref = accelerate(load_pipeline("builtin:tiny-sd15"), AccelConfig(precision="fp32", sampler="LCM"))
    ref.load_lora_weights(lcm_lora, adapter_name="lcm")
    out = {1.0: _generate(ref)}
    ref.set_adapters(["lcm"], [0.5])
    out[0.5] = _generate(ref)
    assert np.abs(out[1.0] - out[0.5]).max() > 1e-3  # the strength matters
    return out


def _generate(pipe) -> np.ndarray:
    g = torch.Generator("cpu").manual_seed(0)
    return pipe("a cat", num_inference_steps=4, guidance_scale=1.0, height=64, width=64, generator=g,
                output_type="np").images


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_lcm_lora_on_engines_by_refit_and_a_strength_change_is_a_refit(lcm_lora, want, tmp_path, backend):
    if backend == "openvino":
        pytest.importorskip("openvino")
    config = AccelConfig(precision="fp32", sampler="LCM")

    pipe = load_pipeline("builtin:tiny-sd15")
    # fp32 to compare at 1e-3: OpenVINO's default is bf16 where the CPU has it (AVX512-BF16, AMX)
    build_engines(pipe, profiles=[CFG_OFF], components=["unet"], backend=backend, precision="fp32",
                  engine_dir=tmp_path, progress=False)
    accelerate(pipe, config, engines=True, backend=backend, engine_dir=str(tmp_path))
    pipe.load_lora_weights(lcm_lora, adapter_name="lcm")
    assert set(refit_engines(pipe, progress=False)) == {"unet"}
    np.testing.assert_allclose(_generate(pipe), want[1.0], atol=1e-3)
    pipe.set_adapters(["lcm"], [0.5])
    assert set(refit_engines(pipe, progress=False)) == {"unet"}
    np.testing.assert_allclose(_generate(pipe), want[0.5], atol=1e-3)
    s = stats(pipe)["unet"]
    assert s["engine_calls"] == 8 and s["torch_calls"] == 0  # CFG 1: one row per step, on the static engine


@pytest.mark.slow
def test_int8_engines_need_a_rebuild_and_the_rebuild_with_the_lora_fused_serves_it(lcm_lora, want, tmp_path):
    """A few-step LoRA on int8 engines: the refit is refused with the way out (quantized weights
    with calibrated scales), and that way works: the LoRA fused, int8 built again, run on it."""
    from sd_accel.core import InvalidValue

    config = AccelConfig(precision="fp32", sampler="LCM", engines=True, backend="onnxruntime",
                         engine_dir=str(tmp_path))
    plain = load_pipeline("builtin:tiny-sd15")
    without = _generate(accelerate(load_pipeline("builtin:tiny-sd15"), AccelConfig(precision="fp32", sampler="LCM")))
    build_engines(plain, profiles=[CFG_OFF], components=["unet"], backend="onnxruntime", precision="int8",
                  engine_dir=tmp_path, progress=False)
    accelerate(plain, config)
    plain.load_lora_weights(lcm_lora, adapter_name="lcm")
    with pytest.raises(InvalidValue, match="int8 engines cannot be refitted.*build_engines"):
        refit_engines(plain, progress=False)

    fused = load_pipeline("builtin:tiny-sd15")
    fused.load_lora_weights(lcm_lora, adapter_name="lcm")
    fused.fuse_lora()
    fused.unload_lora_weights()  # the weights keep the LoRA; no adapter layers are left to trace
    (record,) = build_engines(fused, profiles=[CFG_OFF], components=["unet"], backend="onnxruntime",
                              precision="int8", engine_dir=tmp_path, progress=False)
    assert record.key.precision == "int8" and record.validation["ok"]
    accelerate(fused, config)
    got = _generate(fused)
    s = stats(fused)["unet"]
    assert s["engine_calls"] == 4 and s["torch_calls"] == 0  # the new engine, not the stale one
    # int8's error is small against what the LoRA changes: the image is the LoRA's
    assert np.abs(got - want[1.0]).mean() < 0.25 * np.abs(without - want[1.0]).mean()
