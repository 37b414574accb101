"""ONNX Runtime backend: the engine is ORT's optimized model, saved per profile."""

from sd_accel.backends.onnxruntime.builder import OnnxRuntimeBackend

__all__ = ["OnnxRuntimeBackend"]
