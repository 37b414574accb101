"""An fp16 copy of an fp32 ONNX model, for backends that take their precision from the graph's
dtypes (TensorRT 11's strongly typed networks). I/O stay fp32, and so does the timestep embedding:
diffusers computes it in fp32 even in fp16 models (in fp16, ``999 * freq`` is off by up to 0.25 rad
before the sine)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

FP16_ONNX_FILE = "model.fp16.onnx"


def fp32_island(model) -> list[str]:
    """Names of the nodes that must stay fp32 in an fp16 copy: every Sin/Cos and the nodes that
    feed them (the timestep embedding). diffusers computes it in fp32 even in fp16 models: in
    fp16, ``999 * freq`` is off by up to 0.25 rad before the sine."""
    producer = {out: node for node in model.graph.node for out in node.output}
    keep: dict[str, None] = {}
    todo = [n for n in model.graph.node if n.op_type in ("Sin", "Cos")]
    while todo:
        node = todo.pop()
        if node.name in keep:
            continue
        keep[node.name] = None
        todo.extend(producer[i] for i in node.input if i in producer)
    return list(keep)


def _drop_round_trips(model) -> int:
    """Remove the fp32 -> fp16 -> fp32 Cast pairs onnxruntime's converter puts between two fp32
    (blocked) nodes, or between an fp32 graph input and a blocked node: they would round the
    island's values to fp16 after all. Only pairs the converter made are touched."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    rename: dict[str, str] = {}
    dropped = []
    for node in graph.node:
        if node.op_type != "Cast" or not node.name.endswith("_cast_to_fp32_node"):
            continue
        first = producer.get(node.input[0])
        if first is None or first.op_type != "Cast":
            continue
        if first.name.endswith("_cast_to_fp16_node") or first.name.startswith("graph_input_cast"):
            rename[node.output[0]] = first.input[0]
            dropped.append(node)
    if not dropped:
        return 0
    outputs = {o.name for o in graph.output}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    for node in dropped:
        if node.output[0] not in outputs:
            graph.node.remove(node)
    used = {i for n in graph.node for i in n.input} | outputs
    for node in [n for n in graph.node if n.op_type == "Cast" and n.output[0] not in used]:
        graph.node.remove(node)
    return len(dropped)


def _name_nodes(model) -> None:
    for i, node in enumerate(model.graph.node):  # the block list goes by node name
        if not node.name:
            node.name = f"sd_accel_node_{i}"


def _typed(model):
    """``model`` with value_info for its intermediate tensors, or as it was where inference fails."""
    import onnx

    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:
        return model


def fp16_model(model, infer: bool = True):
    """An fp16 copy of an fp32 ONNX model: I/O stay fp32, the timestep embedding stays fp32.

    The converter casts around fp32 nodes only where it knows the tensor types, so the island is
    kept only when shape inference typed the graph (``infer=False``: the caller already did)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    _name_nodes(model)
    if infer:
        model = _typed(model)
    island = fp32_island(model) if len(model.graph.value_info) else []
    model = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True, node_block_list=island)
    _drop_round_trips(model)
    return model


def fp16_onnx(onnx_path: Path) -> Path:
    """An fp16 copy of an ONNX model next to it (see :func:`fp16_model`), for strongly typed
    builds. Written under a lock and renamed into place, so a crash or a concurrent build never
    leaves a half file that later builds would trust."""
    import onnx
    from filelock import FileLock
    from onnx.external_data_helper import load_external_data_for_model

    from sd_accel.onnx.optimize import EXTERNAL_DATA_THRESHOLD

    onnx_path = Path(onnx_path)
    out = onnx_path.with_name(FP16_ONNX_FILE)
    with FileLock(str(out) + ".lock"):
        if out.exists():
            return out
        # Shape inference before the weights are loaded: an in-memory model must stay under 2 GiB.
        model = onnx.load(str(onnx_path), load_external_data=False)
        _name_nodes(model)
        model = _typed(model)
        load_external_data_for_model(model, str(onnx_path.parent))
        model = fp16_model(model, infer=False)
        weights = sum(len(t.raw_data) for t in model.graph.initializer)
        big = weights > EXTERNAL_DATA_THRESHOLD
        tmp = onnx_path.parent / f".fp16-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            onnx.save_model(model, str(tmp / out.name), save_as_external_data=big,
                            all_tensors_to_one_file=True, location=out.name + ".data")
            if big:
                os.replace(tmp / (out.name + ".data"), out.with_name(out.name + ".data"))
            os.replace(tmp / out.name, out)  # the model file last: its presence means "complete"
        finally:
            for leftover in tmp.iterdir():
                leftover.unlink()
            tmp.rmdir()
    return out
