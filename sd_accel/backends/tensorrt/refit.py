"""New weights into a TensorRT engine without building it again (``trt.Refitter``).

Engines are built refittable (``BuilderFlag.REFIT``, see :func:`..builder.config_kwargs`), and a
small ``engine.json`` beside the plan says so. A refit deserializes the *base* engine from the
cache, sets every refittable weight to the value it must hold now (by ONNX initializer name: the
ONNX parser names TensorRT's weights after the initializers), and serializes the result: full
weights each time, never a delta on top of an earlier refit, so LoRA A, then B, then A gives A.

Besides the initializers, the ONNX parser makes a few weights of its own, which no initializer
names: the values of ``Constant`` / ``ConstantOfShape`` nodes (fixed by the graph: no torch
weight changes them), and, for ``BatchNormalization``, scales folded from four initializers. A
refit leaves the graph's constants at the base engine's values, and gives up (None: the caller
builds from the changed graph) on an engine whose graph has folded or nested weights, or when
TensorRT lists more unnamed weights than the graph has constants.

TensorRT cannot run on the machines that test this; the names used here are checked against
the real bindings (``tests/support/trt/api_names.py``, group ``REFIT``) and the code runs on the
tests' stand-in ``tensorrt``, whose CPU engines compute with the refitted weights.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger("sd_accel")

META_FILE = "engine.json"
# Ops for which the ONNX parser makes weights no initializer names: BatchNormalization folds its
# four initializers into two new weights, If/Loop/Scan hold initializers of their own.
DERIVED_WEIGHT_OPS = ("BatchNormalization", "If", "Loop", "Scan")


def graph_facts(onnx_path: Path) -> dict:
    """What a refit must know of the ONNX graph an engine was parsed from (graph only, no
    weights are read): how many weights the parser makes from the graph's own constants, and
    whether it derives weights from initializers."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    ops = Counter(node.op_type for node in model.graph.node)
    return {
        "graph_constants": ops["Constant"] + ops["ConstantOfShape"],
        "derived_weights": any(ops[op] for op in DERIVED_WEIGHT_OPS),
    }


def engine_meta(engine_dir: Path, files: list[str]) -> dict:
    """The ``engine.json`` of an engine; {} for an engine built before refits existed."""
    if META_FILE not in files or not (Path(engine_dir) / META_FILE).is_file():
        return {}
    return json.loads((Path(engine_dir) / META_FILE).read_text())


def _numpy_types(trt) -> dict:
    """numpy dtypes of the ``trt.DataType`` values weights can have here (no numpy bf16)."""
    return {
        trt.DataType.FLOAT: np.float32,
        trt.DataType.HALF: np.float16,
        trt.DataType.INT8: np.int8,
        trt.DataType.UINT8: np.uint8,
        trt.DataType.INT32: np.int32,
        trt.DataType.INT64: np.int64,
        trt.DataType.BOOL: np.bool_,
    }


def refit_plan(plan: bytes, value: Callable[[str], np.ndarray | None], meta: dict, label: str = "engine"
               ) -> bytes | None:
    """A serialized copy of the engine ``plan`` with every refittable weight set to
    ``value(name)`` (converted to the dtype the engine holds it in: fp16 for an fp16 ONNX on
    TensorRT 11), or None where this engine cannot take the weights so (the reason is logged)."""
    import tensorrt as trt

    from sd_accel.backends.tensorrt.runner import _shared_logger

    def refuse(why: str) -> None:
        log.info("%s: not refitted in place (%s); building from the changed graph instead", label, why)

    logger = _shared_logger(trt)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        return refuse("TensorRT could not deserialize it")
    refitter = trt.Refitter(engine, logger)
    numpy_of = _numpy_types(trt)
    allowed = 0 if meta.get("derived_weights", True) else int(meta.get("graph_constants", 0))
    keep = []  # trt.Weights does not copy: each array must live until refit_cuda_engine returns
    unnamed = 0
    for name in refitter.get_all_weights():
        array = value(name)
        if array is None:  # a weight of the parser's own: kept at the base engine's value, when allowed
            unnamed += 1
            if unnamed > allowed:
                return refuse(f"TensorRT weight {name!r} is not an initializer of the exported graph")
            continue
        prototype = refitter.get_weights_prototype(name)
        dtype = numpy_of.get(prototype.dtype)
        if dtype is None or np.size(array) != prototype.size:
            return refuse(f"weight {name!r} holds {prototype.size} {prototype.dtype}, the graph gives "
                          f"{np.size(array)} {np.asarray(array).dtype}")
        keep.append(np.ascontiguousarray(array, dtype=dtype))
        if not refitter.set_named_weights(name, trt.Weights(keep[-1])):
            return refuse(f"TensorRT refused the new value of {name!r}; see the TensorRT log above")
    if not keep:
        return refuse("TensorRT lists no refittable weights")
    if refitter.get_missing_weights():
        return refuse(f"TensorRT still misses weights {list(refitter.get_missing_weights())[:5]}")
    if not refitter.refit_cuda_engine():
        return refuse("refit_cuda_engine failed; see the TensorRT log above")
    return bytes(engine.serialize())
