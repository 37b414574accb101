"""TensorRT backend (NVIDIA GPUs): polygraphy builds, name-based runtime API.

Everything here that needs ``tensorrt`` or CUDA imports it inside functions, so the package
imports anywhere; tests that need a GPU skip with the reason.
"""

from sd_accel.backends.tensorrt.builder import TensorRTBackend

__all__ = ["TensorRTBackend"]
