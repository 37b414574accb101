"""TensorRT backend (NVIDIA GPUs): polygraphy builds, name-based runtime API.

Everything here that needs ``tensorrt`` or CUDA imports it inside functions, so the package
imports anywhere; tests that need a GPU skip with the reason.
"""

from pathlib import Path

from sd_accel.backends.tensorrt.builder import TensorRTBackend

__all__ = ["TensorRTBackend", "create"]


def create(cache_root: Path | None = None) -> TensorRTBackend:
    """The registry's constructor: the timing cache lives under the engine cache's root."""
    return TensorRTBackend(cache_root)
