"""What differs between TensorRT 10.x and 11.x, in one place.

TensorRT 11 builds strongly typed networks only: the FP16/INT8 builder flags, the INT8
calibrator, ``platform_has_fast_fp16`` and ``device_memory_size`` are gone, so precision comes from
the ONNX dtypes (an fp16 ONNX for fp16 engines, Q/DQ nodes for INT8). 10.x builds fp16 engines
from the fp32 ONNX with the FP16 builder flag.

Weight streaming (``BuilderFlag.WEIGHT_STREAMING``, then a budget of GPU memory for the weights
at load: ``ICudaEngine.weight_streaming_budget_v2``) is in 10.1 and later: an engine larger than
the card (FLUX.1's transformer in fp16, 24 GB) runs with its weights streamed from host memory.
It needs a strongly typed network, so such an engine's precision comes from the ONNX on 10.x too.

Every branch on these features is mirrored by a group of names in the tests'
``support/trt/api_names.py`` (``ONLY_10_FP16``, ``ONLY_11``), which ``tests/test_trt_names.py``
checks against the real binding modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from sd_accel.core import InvalidValue


@dataclass(frozen=True)
class TrtFeatures:
    major: int
    strongly_typed_only: bool  # 11.x: no precision flags; precision comes from the ONNX
    precision_flags: bool  # 10.x: BuilderFlag.FP16 / INT8 exist
    weight_streaming: bool = False  # 10.1+: BuilderFlag.WEIGHT_STREAMING and weight_streaming_budget_v2


def features(version: str) -> TrtFeatures:
    """What TensorRT ``version`` (``trt.__version__``) has; ValueError for versions before 10.

    >>> features("10.13.3").precision_flags
    True
    >>> features("11.4.0").strongly_typed_only
    True
    >>> features("10.0.1").weight_streaming, features("10.16.1").weight_streaming
    (False, True)
    """
    try:
        major = int(version.split(".")[0])
    except ValueError:
        raise InvalidValue(f"not a TensorRT version: {version!r}") from None
    if major < 10:
        raise InvalidValue(
            f"TensorRT {version} is too old: sd-accel needs 10.x or 11.x (the name-based tensor API)"
        )
    parts = version.split(".")
    minor = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    if major >= 11:
        return TrtFeatures(major, strongly_typed_only=True, precision_flags=False, weight_streaming=True)
    return TrtFeatures(major, strongly_typed_only=False, precision_flags=True, weight_streaming=minor >= 1)


def onnx_precision(precision: str, feats: TrtFeatures, streaming: bool = False) -> str:
    """The dtype the exported ONNX must carry: strongly typed builds (11.x, and weight-streamed
    engines on 10.x) take precision from it.

    >>> onnx_precision("fp16", features("10.16.1")), onnx_precision("fp16", features("10.16.1"), streaming=True)
    ('fp32', 'fp16')
    """
    if (feats.strongly_typed_only or streaming) and precision == "fp16":
        return "fp16"
    return "fp32"
