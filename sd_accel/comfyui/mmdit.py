"""ComfyUI's SD3 / SD3.5 MMDiT (``comfy.ldm.modules.diffusionmodules.mmdit.OpenAISignatureMMDITWrapper``)
as diffusers' ``SD3Transformer2DModel``, and one of its calls as that engine's feed.

The conversion and the feed are shared with Forge's SD3.5 (:mod:`sd_accel.components.sd3.sai_module`).
"""

from __future__ import annotations

import torch

from sd_accel.components.sd3.sai_module import (  # noqa: F401  (this module's API for the pack)
    FAMILY,
    control_feed,
    feed,
    output,
    to_diffusers,
    unmapped,
    unsupported,
)


def is_mmdit(module: object) -> bool:
    cls = type(module)
    return cls.__name__ == "OpenAISignatureMMDITWrapper" and cls.__module__.startswith("comfy.ldm")


def call_reason(module: torch.nn.Module, y, kwargs: dict, options: dict) -> str | None:
    if y is None:
        return "no pooled text (y) in the call"
    return None
