"""Memory layout of the convolutional modules: channels-last on CUDA in half precision.

cuDNN's half-precision convolution kernels work in NHWC. With diffusers' default NCHW layout
every convolution is wrapped in layout-conversion kernels: on an H200 at 512 px (SD 1.5 UNet
and TAESD, fp16, batch 1) they were 32% of the GPU time and 472 extra launches per image, and
the few-step recipe (4 UNet calls, launch-bound) ran 1.16x faster once the UNet and the
autoencoder were channels-last (scripts/gpu_lcm_breakdown.py). In fp32 (TF32 kernels) and on
CPUs the gain is not established, so nothing changes there.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("sd_accel")

# Set on a module this file put in channels-last, so that a later accelerate() with another
# device or precision puts it back.
_MARK = "_sd_accel_channels_last"


def conv_modules(pipe) -> list[torch.nn.Module]:
    """The pipeline's modules with 2-D convolutions: UNet, VAE (or TAESD) and every ControlNet."""
    from sd_accel.optimize.attention import denoising_modules

    return [module for module in denoising_modules(pipe) if isinstance(module, torch.nn.Module)
            and any(isinstance(m, torch.nn.Conv2d) for m in module.modules())]


def wants_channels_last(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``accelerate`` puts convolutional modules in channels-last: CUDA, fp16 or bf16."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def apply_memory_format(pipe, device: torch.device, dtype: torch.dtype) -> str:
    """Put the convolutional modules in channels-last where :func:`wants_channels_last`, and
    back in the default layout where an earlier call had done so; returns the layout in use
    (``"channels_last"`` or ``"contiguous"``)."""
    last = wants_channels_last(device, dtype)
    for module in conv_modules(pipe):
        if last and not getattr(module, _MARK, False):
            module.to(memory_format=torch.channels_last)
            setattr(module, _MARK, True)
        elif not last and getattr(module, _MARK, False):
            module.to(memory_format=torch.contiguous_format)
            setattr(module, _MARK, False)
    if last:
        log.info("convolutions in channels-last (cuDNN's half-precision layout)")
    return "channels_last" if last else "contiguous"
