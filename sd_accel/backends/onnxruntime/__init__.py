"""ONNX Runtime backend: the engine is ORT's optimized model, saved per profile."""

from pathlib import Path

from sd_accel.backends.onnxruntime.builder import OnnxRuntimeBackend

__all__ = ["OnnxRuntimeBackend", "create"]


def create(cache_root: Path | None = None) -> OnnxRuntimeBackend:
    """The registry's constructor: the CUDA provider when onnxruntime-gpu has it and torch sees a GPU."""
    import torch

    return OnnxRuntimeBackend("cuda" if torch.cuda.is_available() else "cpu")
