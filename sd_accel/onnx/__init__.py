"""ONNX export of components: plain attention, external data past 2 GB, folding, a load check,
and a cache of exported files keyed by the weights' fingerprint."""

from __future__ import annotations

from sd_accel.onnx.export import (
    MODEL_FILE,
    OnnxArtifact,
    artifact_dir,
    ensure_onnx_artifact,
    export_onnx,
    onnx_artifact,
    validate_artifact,
)
from sd_accel.onnx.fingerprint import clear_fingerprint, fingerprint

__all__ = [
    "MODEL_FILE",
    "OnnxArtifact",
    "artifact_dir",
    "clear_fingerprint",
    "ensure_onnx_artifact",
    "export_onnx",
    "fingerprint",
    "onnx_artifact",
    "validate_artifact",
]
