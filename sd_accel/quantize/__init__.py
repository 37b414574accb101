"""INT8 quantization: calibration data captured from real pipeline runs; ONNX Runtime static
(QDQ, per-channel weights, calibrated activations) or dynamic (weights only ahead of time,
activations quantized per call) quantization (``ort.py``); OpenVINO static quantization with NNCF
(``openvino.py``: convolutions and linear layers in int8, the fastest CPU engines measured here).

Precisions: ``"int8"`` is static quantization and needs calibration data (``build_engines``
captures it by running the pipeline on a few prompts); ``"int8-dynamic"`` (ONNX Runtime) needs none.

>>> from sd_accel.quantize import INT8_PRECISIONS
>>> INT8_PRECISIONS
('int8', 'int8-dynamic')
"""

from __future__ import annotations

from sd_accel.quantize.calibration import (
    CALIBRATION_PROMPTS,
    CalibrationSet,
    calibration_for,
    capture_calibration,
    split_holdout,
)
from sd_accel.quantize.ort import INT8_PRECISIONS, quantize_onnx

__all__ = [
    "CALIBRATION_PROMPTS",
    "INT8_PRECISIONS",
    "CalibrationSet",
    "calibration_for",
    "capture_calibration",
    "quantize_onnx",
    "split_holdout",
]
