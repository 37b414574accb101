"""The compiled PyTorch backend: torch.compile (Inductor) + CUDA graphs per fixed shape.

For NVIDIA GPUs without TensorRT (``auto`` picks it there); opt-in on CPUs, where OpenVINO is
faster (scripts/BENCHMARKS-compile.md). See builder.py for how it keeps the backend contract
without ONNX, graphs.py for the CUDA-graph bookkeeping, runner.py for a call.
"""

from pathlib import Path

from sd_accel.backends.compile.builder import CompileBackend, CompileFailed, CompileSettings, architecture_id

__all__ = ["CompileBackend", "CompileFailed", "CompileSettings", "architecture_id", "create"]


def create(cache_root: Path | None = None) -> CompileBackend:
    """The registry's constructor: runs where torch runs the pipeline (CUDA when torch sees a GPU)."""
    import torch

    return CompileBackend("cuda" if torch.cuda.is_available() else "cpu", cache_root=cache_root)
