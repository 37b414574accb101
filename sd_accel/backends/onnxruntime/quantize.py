"""ONNX Runtime INT8 quantization of an exported component.

- ``int8`` (static): QDQ format, per-channel int8 weights, int8 activations whose ranges come
  from calibration feeds (MinMax). By default the linear layers (MatMul with a constant weight,
  Gemm) are quantized; the attention score/value MatMuls (activation x activation) stay fp32 and
  are left to the ``MultiHeadAttention`` fusion (:func:`attention_matmuls`).
  Convolutions stay fp32 too: on the tiny SD UNet quantizing them took the error at high-noise
  steps from ~1% to 17-20%, even on the steps it was calibrated on. ``SD_ACCEL_INT8_OPS``
  (e.g. ``MatMul,Gemm,Conv``) overrides the op list for experiments.
- ``int8-dynamic``: int8 weights, activations quantized on the fly per call; no calibration.
  Only MatMul/Gemm (ORT's dynamic ``ConvInteger`` is slower than fp32 Conv on CPU).

Large models (> 2 GB) are written with one external data file.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from sd_accel.core import CalibrationSet, EngineError, InvalidValue, Progress, ShapeRanges
from sd_accel.onnx.symbols import symbol_values

log = logging.getLogger("sd_accel")

INT8_PRECISIONS: tuple[str, ...] = ("int8", "int8-dynamic")
STATIC_OPS = ["MatMul", "Gemm"]  # see the module docstring: Conv costs 10-20% accuracy
# Layers that read the component's raw inputs (latent in/out convs, the timestep MLP, the cross-
# attention K/V projections of the text embeddings) keep fp32: their input ranges move with the
# prompt, the step and the sampler, and a calibrated range clips whatever it did not see.
SENSITIVE = ("conv_in", "conv_out", "time_embedding", "time_proj", "attn2/to_k", "attn2/to_v", "add_embedding")
DYNAMIC_OPS = ["MatMul", "Gemm"]
_TWO_GB = 2**31 - 1


def static_ops() -> list[str]:
    """The op types static INT8 quantizes (``SD_ACCEL_INT8_OPS`` overrides)."""
    env = os.environ.get("SD_ACCEL_INT8_OPS", "")
    return [op.strip() for op in env.split(",") if op.strip()] or list(STATIC_OPS)


class _Reader:
    """``onnxruntime.quantization.CalibrationDataReader`` over a :class:`CalibrationSet`."""

    def __init__(self, calibration: CalibrationSet, input_names: list[str], progress: Progress) -> None:
        self._names = input_names
        self._feeds = calibration.feeds
        self._it: Iterator[dict[str, np.ndarray]] = iter(self._feeds)
        self._progress = progress
        self._done = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        feed = next(self._it, None)
        if feed is None:
            return None
        self._done += 1
        self._progress(self._done / max(len(self._feeds), 1), f"calibrating {self._done}/{len(self._feeds)}")
        return {k: feed[k] for k in self._names}

    def rewind(self) -> None:
        self._it = iter(self._feeds)

    def __len__(self) -> int:
        return len(self._feeds)


def _fixed_shape_model(onnx_path: Path, shapes: ShapeRanges, work: Path) -> Path:
    """A copy of the model whose symbolic input dims a static profile fixes are pinned, so the
    quantizer's shape inference and ORT's planner see fixed shapes. The external data file is
    copied beside it: ONNX refuses external data behind symbolic or hard links."""
    import onnx


    model = onnx.load(str(onnx_path), load_external_data=False)
    values = symbol_values(onnx_path, shapes)
    for value in (*model.graph.input, *model.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in values:
                dim.dim_value = values[dim.dim_param]
    for item in onnx_path.parent.iterdir():  # external data files sit beside the model
        if item.is_file() and item != onnx_path:
            shutil.copyfile(item, work / item.name)  # the quantizer refuses symbolic and hard links
    out = work / "fixed.onnx"
    onnx.save_model(model, str(out))
    return out


def attention_matmuls(model) -> list[str]:
    """Names of the MatMuls around each Softmax (scores = Q x K^T, output = P x V).

    They multiply two activations: quantizing them puts int8 attention probabilities in the
    image (and ``MatMulConstBOnly`` does not keep the QDQ quantizer off them), and the Q/DQ
    nodes around them would hide the attention block from the ``MultiHeadAttention`` fusion."""
    producer = {out: node for node in model.graph.node for out in node.output}
    names = []
    for node in model.graph.node:
        if node.op_type != "Softmax":
            continue
        before = producer.get(node.input[0])
        if before is not None and before.op_type == "MatMul":
            names.append(before.name)
        names += [n.name for n in model.graph.node if n.op_type == "MatMul" and node.output[0] in n.input]
    return names


def _big(onnx_path: Path) -> bool:
    return sum(f.stat().st_size for f in onnx_path.parent.iterdir() if f.is_file()) > _TWO_GB


def quantize_onnx(
    onnx_path: Path,
    out_path: Path,
    precision: str,
    shapes: ShapeRanges,
    calibration: CalibrationSet | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write an INT8 version of ``onnx_path`` to ``out_path`` (external data beside it when big)."""
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    progress = progress or (lambda f, m: None)
    if precision not in INT8_PRECISIONS:
        raise InvalidValue(f"precision={precision!r}; INT8 precisions are {INT8_PRECISIONS}")
    if precision == "int8" and (calibration is None or not len(calibration)):
        raise EngineError(
            "precision='int8' (static) needs calibration data: build_engines captures it from a few "
            "prompt runs; use precision='int8-dynamic' for INT8 without calibration"
        )
    external = _big(onnx_path)
    with tempfile.TemporaryDirectory(prefix="sd-accel-quant-", dir=out_path.parent) as tmp:
        work = Path(tmp)
        model = _fixed_shape_model(onnx_path, shapes, work)
        try:
            if precision == "int8-dynamic":
                progress(0.1, "quantizing weights (dynamic int8)")
                quantize_dynamic(
                    model, out_path, op_types_to_quantize=DYNAMIC_OPS, per_channel=True,
                    weight_type=QuantType.QInt8, use_external_data_format=external,
                    extra_options={"MatMulConstBOnly": True},
                )
            else:
                import onnx

                proto = onnx.load(str(model), load_external_data=False)
                names = [i.name for i in proto.graph.input]
                exclude = [n.name for n in proto.graph.node if any(k in n.name for k in SENSITIVE)]
                exclude += attention_matmuls(proto)
                reader = _Reader(calibration, names, lambda f, m: progress(0.8 * f, m))
                quantize_static(
                    model, out_path, reader, quant_format=QuantFormat.QDQ, op_types_to_quantize=static_ops(),
                    per_channel=True, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    nodes_to_exclude=exclude, use_external_data_format=external, calibrate_method=CalibrationMethod.MinMax,
                    extra_options={"MatMulConstBOnly": True},  # MinMax keeps only per-tensor min/max
                )
        except EngineError:
            raise
        except Exception as exc:  # the quantizer raises assorted ORT/onnx errors
            raise EngineError(f"quantizing {onnx_path.name} to {precision} failed: {exc}") from exc
    progress(1.0, "quantized")
    return out_path


def remove_quantized(out_path: Path) -> None:
    """Delete a quantized model and its external data (used when a build is abandoned)."""
    for f in out_path.parent.glob(out_path.name + "*"):
        f.unlink(missing_ok=True)
    shutil.rmtree(out_path.parent / "augmented", ignore_errors=True)
