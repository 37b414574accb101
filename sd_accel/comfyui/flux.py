"""ComfyUI's FLUX.1 transformer (``comfy.ldm.flux.model.Flux``): which modules are it, and what in a call
the engine does not compute. The conversion and the feed are shared with Forge's FLUX.1
(:mod:`sd_accel.components.flux.bfl_module`).
"""

from __future__ import annotations

import torch

from sd_accel.components.flux.bfl_module import (  # noqa: F401  (this module's API for the pack)
    FAMILY,
    control_feed,
    feed,
    output,
    params_of,
    patchify,
    plain,
    to_diffusers,
    unmapped,
    unpatchify,
    unsupported,
)


def is_flux(module: object) -> bool:
    """ComfyUI's FLUX.1 class itself (Chroma, Flux 2 and the other subclasses differ in layers)."""
    cls = type(module)
    return cls.__name__ == "Flux" and cls.__module__.startswith("comfy.ldm.flux")


def call_reason(module: torch.nn.Module, guidance, kwargs: dict, options: dict) -> str | None:
    """What in this call the engine does not compute (ComfyUI computes it in PyTorch), or None."""
    if params_of(module).guidance_embed and guidance is None:
        return "no guidance for a guidance-distilled FLUX (ComfyUI then leaves its embedding out)"
    if kwargs.get("ref_latents") is not None:
        return "reference latents (Kontext) are not in the engine"
    if options.get("rope_options") is not None:
        return "rope_options (rotary scaling) are not in the engine"
    return None
