"""Pick a backend by name; ``auto`` is TensorRT on NVIDIA GPUs where it imports, else ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

from sd_accel.config import BACKENDS
from sd_accel.core import DeviceError, InvalidValue


def get_backend(name: str = "auto", cache_root: Path | None = None):
    from sd_accel.backends.onnxruntime import OnnxRuntimeBackend
    from sd_accel.backends.tensorrt import TensorRTBackend
    from sd_accel.backends.tensorrt.builder import trt_status

    if name not in BACKENDS:
        raise InvalidValue(f"backend={name!r} is not valid; allowed: {', '.join(BACKENDS)}")
    if name == "auto":
        name = "tensorrt" if trt_status()[0] else "onnxruntime"
    if name == "openvino":
        from sd_accel.backends.openvino import OpenVinoBackend

        backend = OpenVinoBackend()
        info = backend.info()
        if not info.usable:
            raise DeviceError(f"backend='openvino' cannot run here: {info.why_not}")
        return backend
    if name == "tensorrt":
        backend = TensorRTBackend(cache_root)
        info = backend.info()
        if not info.usable:
            raise DeviceError(f"backend='tensorrt' cannot run here: {info.why_not}")
        return backend
    import torch

    # The CUDA provider is used when onnxruntime-gpu has it and torch sees a GPU; else the CPU.
    return OnnxRuntimeBackend("cuda" if torch.cuda.is_available() else "cpu")


def default_precision(backend_name: str) -> str:
    if backend_name == "openvino":
        from sd_accel.backends.openvino.builder import has_bf16

        return "bf16" if has_bf16() else "fp32"
    return "fp16" if backend_name == "tensorrt" else "fp32"
