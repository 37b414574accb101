"""sd-accel: faster, safer Stable Diffusion on diffusers.

>>> from sd_accel import load_pipeline, accelerate, AccelConfig
>>> pipe = load_pipeline("builtin:tiny-sd15")
>>> pipe = accelerate(pipe, AccelConfig(sampler="DPM++ 2M Karras"))
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names and the module that holds each. Imported on first use, so that
# `import sd_accel` (the CLI's start, the WebUI's extension scan) does not pull in torch.
_EXPORTS = {
    "AccelConfig": "sd_accel.config",
    "accelerate": "sd_accel.api",
    "load_pipeline": "sd_accel.api",
    "load_controlnet": "sd_accel.api",
    "with_controlnets": "sd_accel.api",
    "build_engines": "sd_accel.build",
    "refit_engines": "sd_accel.refit",
    "stats": "sd_accel.runtime.swap",
    "Profile": "sd_accel.profiles",
    "EngineCache": "sd_accel.cache.store",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sd_accel' has no attribute {name!r}")
