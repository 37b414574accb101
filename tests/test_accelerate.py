"""accelerate(): attention, precision, safe VAE, offload, config validation; all on CPU."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0, SlicedAttnProcessor

from sd_accel import AccelConfig, accelerate, load_pipeline


def fresh(pipe):
    """A pipeline sharing nothing mutable with the session fixture (deep-copied modules)."""
    import copy

    return type(pipe)(**{k: copy.deepcopy(v) for k, v in pipe.components.items()})


def run(pipe, steps: int = 2, size: int = 64, seed: int = 0) -> np.ndarray:
    g = torch.Generator("cpu").manual_seed(seed)
    return pipe("a photo of a cat", num_inference_steps=steps, height=size, width=size, generator=g,
                output_type="np").images


def processors(module) -> set[type]:
    return {type(p) for p in module.attn_processors.values()}


@pytest.mark.slow
def test_issue_example_runs_on_cpu():
    pipe = load_pipeline("builtin:tiny-sd15")
    pipe = accelerate(pipe, AccelConfig(precision="fp16", attention="auto", offload="none", sampler="DPM++ 2M Karras"))
    image = pipe("a photo of a cat", num_inference_steps=3, height=64, width=64).images[0]
    assert image.size == (64, 64)
    # fp16 on CPU falls back to fp32 (documented), and the sampler preset is in place.
    assert pipe.unet.dtype == torch.float32
    assert type(pipe.scheduler).__name__ == "DPMSolverMultistepScheduler"
    assert pipe.scheduler.config.use_karras_sigmas is True
    assert pipe.sd_accel.sampler == "DPM++ 2M Karras"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("attention", "unet_procs"),
    [("sdpa", {AttnProcessor2_0}), ("auto", {AttnProcessor2_0}), ("sliced", {SlicedAttnProcessor})],
)
def test_attention_backend_is_set_on_modules(tiny_sd15, attention, unet_procs):
    pipe = accelerate(fresh(tiny_sd15), attention=attention)
    assert processors(pipe.unet) == unet_procs
    assert processors(pipe.vae) == {AttnProcessor2_0}
    assert pipe.sd_accel.attention == ("sdpa" if attention == "auto" else attention)
    assert np.isfinite(run(pipe)).all()


def test_xformers_on_cpu_explains_itself(tiny_sd15):
    with pytest.raises(RuntimeError) as err:
        accelerate(fresh(tiny_sd15), attention="xformers")
    msg = str(err.value)
    assert "xformers" in msg.lower()
    assert "sdpa" in msg  # says what to use instead
    assert "install" in msg or "CUDA" in msg


@pytest.mark.slow
def test_bf16_weights_and_output_close_to_fp32(tiny_sd15):
    ref = run(accelerate(fresh(tiny_sd15), precision="fp32"))
    pipe = accelerate(fresh(tiny_sd15), precision="bf16")
    assert pipe.unet.dtype == torch.bfloat16
    assert pipe.text_encoder.dtype == torch.bfloat16
    assert pipe.vae.dtype == torch.bfloat16  # SD 1.x VAE config does not ask for upcast
    out = run(pipe)
    diff = np.abs(out - ref)
    assert diff.max() > 0, "bf16 should not be bit-identical to fp32"
    assert diff.mean() < 0.05, f"bf16 image drifted from fp32 by {diff.mean():.4f} on average"


def test_fp16_on_cpu_falls_back_to_fp32_with_warning(tiny_sd15, caplog):
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        pipe = accelerate(fresh(tiny_sd15), precision="fp16")
    assert pipe.unet.dtype == torch.float32
    assert pipe.sd_accel.dtype == "fp32"
    assert any("fp16" in r.message and "bf16" in r.message for r in caplog.records)


@pytest.mark.slow
def test_sdxl_vae_keeps_bf16_and_the_nan_guard_under_bf16(tiny_sdxl):
    # force_upcast in the SDXL VAE config is about fp16's range; bf16 has fp32's, so no upcast.
    pipe = accelerate(fresh(tiny_sdxl), precision="bf16")
    assert pipe.unet.dtype == torch.bfloat16
    assert pipe.vae.dtype == torch.bfloat16
    assert pipe.sd_accel.vae_dtype == "bf16"
    assert pipe.vae._sd_accel_guard.nan_check  # every half precision keeps the NaN guard
    assert np.isfinite(run(pipe)).all()


def test_vae_upcast_is_decided_per_precision(tiny_sdxl):
    from sd_accel.optimize.precision import vae_dtype_for

    vae = tiny_sdxl.vae
    assert vae.config.force_upcast
    assert vae_dtype_for(vae, torch.float16, "auto") == torch.float32  # fp16 overflows: upcast
    assert vae_dtype_for(vae, torch.bfloat16, "auto") == torch.bfloat16  # bf16 does not
    assert vae_dtype_for(vae, torch.float16, "same") == torch.float16
    assert vae_dtype_for(vae, torch.bfloat16, "fp32") == torch.float32


@pytest.mark.slow
def test_vae_precision_choices(tiny_sd15, tiny_sdxl):
    assert accelerate(fresh(tiny_sd15), precision="bf16", vae_precision="fp32").vae.dtype == torch.float32
    pipe = accelerate(fresh(tiny_sdxl), precision="bf16", vae_precision="fp32")
    assert pipe.vae.dtype == torch.float32 and pipe.sd_accel.vae_dtype == "fp32"
    assert np.isfinite(run(pipe)).all()  # a bf16 UNet's latents decode in an fp32 VAE
    assert accelerate(fresh(tiny_sdxl), precision="bf16", vae_precision="same").vae.dtype == torch.bfloat16


@pytest.mark.slow
def test_nan_decode_is_redone_in_fp32(tiny_sd15, caplog):
    pipe = accelerate(fresh(tiny_sd15), precision="bf16")

    def nan_in_half(module, inputs, output):
        # Simulate the fp16/bf16 VAE overflow that users see as black images.
        return output * float("nan") if output.dtype != torch.float32 else output

    handle = pipe.vae.decoder.conv_out.register_forward_hook(nan_in_half)
    try:
        with caplog.at_level(logging.WARNING, logger="sd_accel"):
            image = run(pipe)
    finally:
        handle.remove()
    assert np.isfinite(image).all()
    assert image.std() > 0  # not a flat (black) image
    guard = pipe.vae._sd_accel_guard
    assert guard.redecodes == 1
    assert pipe.vae.dtype == torch.bfloat16  # restored after the fp32 re-decode
    assert any("fp32" in r.message and "NaN" in r.message for r in caplog.records)


@pytest.mark.slow
def test_nan_check_off_leaves_nan(tiny_sd15):
    pipe = accelerate(fresh(tiny_sd15), precision="bf16", nan_check=False)
    handle = pipe.vae.decoder.conv_out.register_forward_hook(lambda m, i, o: o * float("nan"))
    try:
        image = run(pipe)
    finally:
        handle.remove()
    assert pipe.vae._sd_accel_guard.redecodes == 0
    assert not np.isfinite(image).all() or image.max() == 0


@pytest.mark.slow
def test_accelerate_twice_does_not_stack_wrappers(tiny_sd15):
    pipe = accelerate(fresh(tiny_sd15), precision="bf16")
    pipe = accelerate(pipe, precision="fp32", attention="sliced")
    assert pipe.unet.dtype == torch.float32
    assert processors(pipe.unet) == {SlicedAttnProcessor}
    guard = pipe.vae._sd_accel_guard
    assert guard._decode.__func__ is type(pipe.vae).decode
    assert np.isfinite(run(pipe)).all()


@pytest.mark.slow
def test_offload_on_cpu_is_ignored_and_said(tiny_sd15, caplog):
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        pipe = accelerate(fresh(tiny_sd15), offload="lowvram", vae_slicing=True, vae_tiling=True)
    assert pipe.sd_accel.offload_active is False
    assert any("offload" in r.message and "ignored" in r.message for r in caplog.records)
    assert pipe.vae.use_slicing and pipe.vae.use_tiling
    assert np.isfinite(run(pipe)).all()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("precision", "fp8"),
        ("attention", "flash"),
        ("offload", "ultravram"),
        ("vae_precision", "fp64"),
        ("device", "tpu"),
        ("nan_check", "yes"),
    ],
)
def test_invalid_config_names_field_and_allowed_values(field, value):
    with pytest.raises(ValueError) as err:
        AccelConfig(**{field: value})
    assert f"AccelConfig.{field}" in str(err.value)
    assert repr(value) in str(err.value)


def test_unknown_sampler_suggests_closest():
    with pytest.raises(ValueError) as err:
        AccelConfig(sampler="DPM++ 2M Karas")
    assert "DPM++ 2M Karras" in str(err.value)


def test_cuda_device_without_cuda_is_a_clear_error(tiny_sd15):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error is for machines without it")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        accelerate(fresh(tiny_sd15), device="cuda")


def test_channels_last_on_cuda_half_only_and_undone(tiny_sd15):
    """On CUDA in fp16/bf16 the UNet and VAE convolutions go channels-last (cuDNN's half layout;
    measured on an H200); a later accelerate for another device or precision puts them back. The
    layout is set by the same function accelerate calls, here on CPU tensors (no GPU on CI)."""
    from sd_accel.optimize.memory_format import apply_memory_format, wants_channels_last

    last = torch.channels_last
    assert wants_channels_last(torch.device("cuda"), torch.float16)
    assert wants_channels_last(torch.device("cuda:1"), torch.bfloat16)
    assert not wants_channels_last(torch.device("cuda"), torch.float32)
    assert not wants_channels_last(torch.device("cpu"), torch.bfloat16)

    pipe = fresh(tiny_sd15)
    weights = (pipe.unet.conv_in.weight, pipe.vae.decoder.conv_in.weight)
    assert not any(w.is_contiguous(memory_format=last) for w in weights)
    assert apply_memory_format(pipe, torch.device("cuda"), torch.float16) == "channels_last"
    assert pipe.unet.conv_in.weight.is_contiguous(memory_format=last)
    assert pipe.vae.decoder.conv_in.weight.is_contiguous(memory_format=last)
    before = run(accelerate(fresh(tiny_sd15), precision="fp32"))
    assert np.abs(run(pipe) - before).max() < 1e-4  # the same model, another layout
    pipe = accelerate(pipe, precision="fp32")  # CPU: back to the default layout
    assert pipe.sd_accel.summary()["memory_format"] == "contiguous"
    assert pipe.unet.conv_in.weight.is_contiguous()
    assert not pipe.vae.decoder.conv_in.weight.is_contiguous(memory_format=last)
