"""A backend that is not part of sd-accel: one module with ``create()`` plus one registry entry
must be all a new backend needs (tests/test_backends.py). It is ONNX Runtime under another name."""

from __future__ import annotations

from pathlib import Path

from sd_accel.backends.base import BackendInfo
from sd_accel.backends.onnxruntime import OnnxRuntimeBackend


class CopyBackend(OnnxRuntimeBackend):
    name = "ortcopy"

    def info(self) -> BackendInfo:
        real = super().info()
        return BackendInfo(self.name, "0.1-" + real.version, real.arch, real.usable, real.why_not)

    def precisions(self) -> tuple[str, ...]:
        return ("fp32",)


def create(cache_root: Path | None = None) -> CopyBackend:
    return CopyBackend("cpu")
