"""Attention backends: xFormers, PyTorch SDPA, or sliced attention."""

from __future__ import annotations

import logging
from functools import lru_cache

import torch
import torch.nn.functional as F

from sd_accel.core import DeviceError

log = logging.getLogger("sd_accel")

XFORMERS_HINT = (
    "install it with `pip install 'sd-accel[xformers]'` (it needs a CUDA build of torch that matches "
    "the xformers wheel), or use attention='sdpa'"
)


@lru_cache(maxsize=1)
def xformers_status() -> tuple[bool, str]:
    """(usable, why not). Cached: importing xformers is slow and its answer does not change."""
    try:
        import xformers.ops  # noqa: F401
    except Exception as exc:  # ImportError, or a broken build failing at import
        return False, f"xFormers is not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return False, "xFormers is installed but runs attention only on CUDA, and no CUDA device is present"
    try:
        q = torch.zeros(1, 8, 1, 64, device="cuda", dtype=torch.float16)
        xformers.ops.memory_efficient_attention(q, q, q)
    except Exception as exc:
        return False, f"xFormers is installed but its CUDA kernels failed ({type(exc).__name__}: {exc})"
    return True, ""


def resolve_attention(requested: str, device: torch.device) -> str:
    """The backend to use for ``requested`` on ``device``; raises when an explicit choice cannot run."""
    if requested == "auto":
        if device.type == "cuda" and xformers_status()[0]:
            return "xformers"
        return "sdpa" if hasattr(F, "scaled_dot_product_attention") else "sliced"
    if requested == "xformers":
        ok, why = xformers_status()
        if not ok:
            raise DeviceError(f"attention='xformers' cannot run here: {why}; {XFORMERS_HINT}")
        if device.type != "cuda":
            raise DeviceError(f"attention='xformers' needs the pipeline on CUDA, it is on {device}; use 'sdpa'")
        return "xformers"
    if requested == "sdpa" and not hasattr(F, "scaled_dot_product_attention"):
        raise DeviceError("attention='sdpa' needs torch >= 2.0; upgrade torch or use 'sliced'")
    return requested


def denoising_modules(pipe) -> list:
    """The pipeline's UNet, VAE and every ControlNet (a ``MultiControlNetModel`` holds its nets in
    ``nets``), those it has: what the torch-level options (attention, memory layout) apply to."""
    control = getattr(pipe, "controlnet", None)
    nets = list(getattr(control, "nets", None) or ([control] if control is not None else []))
    return [m for m in (getattr(pipe, "unet", None), getattr(pipe, "vae", None), *nets) if m is not None]


def _attention_modules(pipe) -> list:
    # A module without attention layers (the tiny autoencoder, TAESD) has nothing to set. The
    # FLUX.1 / SD3 ControlNets' joint attention takes its own processors (already SDPA); the UNet
    # families' processor there breaks their calls, as it would the transformer's.
    transformer_nets = set()
    if getattr(pipe, "transformer", None) is not None:
        control = getattr(pipe, "controlnet", None)
        transformer_nets = {id(m) for m in (getattr(control, "nets", None) or [control]) if m is not None}
    return [m for m in denoising_modules(pipe) if hasattr(m, "set_attn_processor") and id(m) not in transformer_nets]


def apply_attention(pipe, backend: str) -> None:
    """Set one attention backend on every attention layer of the UNet, the VAE and the ControlNets."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    modules = _attention_modules(pipe)
    for module in modules:
        if backend == "xformers":
            module.enable_xformers_memory_efficient_attention()
        else:
            module.set_attn_processor(AttnProcessor2_0())
    if backend == "sliced":
        for module in modules:
            if module is not getattr(pipe, "vae", None) and hasattr(module, "set_attention_slice"):
                module.set_attention_slice("auto")
    log.info("attention backend: %s", backend)
