"""The weights of an exported graph, by torch name.

An export holds two things: the graph (small) and the module's weights (3.4 GB of fp32 for the
SD 1.5 UNet, more than the engines built from it). The weights are already on disk in the
model the user loaded, so once the engines are built the export keeps only its graph
(:func:`slim_export`): every initializer that is a torch weight becomes a graph input, and
``weights.json`` says which torch weight it is. :func:`write_full` writes a complete model again
from a graph and a module's weights, one tensor at a time: for another profile's build (no
re-export: the trace is the slow, memory-hungry step) and for a refit with changed weights.

Names: the exporter keeps the torch names of most weights (``unet.conv_in.weight``); the ones it
transposes or reshapes (a ``Linear``'s weight into a ``MatMul``, a ``GroupNorm``'s into a
``Mul``/``Add``) get anonymous names (``onnx::MatMul_1565``), and are found by the node that
reads them, whose name is the module's path (``/unet/down_blocks.0/.../to_k/MatMul``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from sd_accel.core import EngineError, InvalidValue, peft_layer
from sd_accel.onnx.optimize import _MIN_EXTERNAL_BYTES, DATA_SUFFIX, _read_external, append_tensor

log = logging.getLogger("sd_accel")

WEIGHTS_FILE = "weights.json"


# --------------------------------------------------------------------------- torch side


def effective_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers under their own names (as without PEFT), each the
    value the module computes with now: a LoRA layer's base weight plus the delta of each active,
    unmerged adapter at its current scale (a merged one is in the base weight already)."""
    lora_layers = {name: m for name, m in module.named_modules() if peft_layer(m)}
    out: dict[str, torch.Tensor] = {}
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        parts = name.split(".")
        if any(p.startswith("lora_") for p in parts):  # the adapters' own weights: in the delta
            continue
        if "base_layer" not in parts:
            out[name] = t.detach()
            continue
        cut = len(parts) - 1 - parts[::-1].index("base_layer")  # the innermost wrapped layer
        layer_name = ".".join(parts[:cut])
        leaf = ".".join(parts[cut + 1:])
        value = t.detach()
        layer = lora_layers.get(layer_name)
        if layer is not None and leaf == "weight":
            value = value + _delta(layer, layer_name)
        out[f"{layer_name}.{leaf}" if layer_name else leaf] = value
    return out


def _delta(layer: torch.nn.Module, name: str) -> torch.Tensor:
    merged = set(layer.merged_adapters)
    if getattr(layer, "disable_adapters", False):
        if merged:
            raise EngineError(f"{name}: LoRA adapters are disabled but {sorted(merged)} merged; "
                              "unmerge them (pipe.unfuse_lora()) before refitting")
        return torch.zeros((), dtype=layer.get_base_layer().weight.dtype)
    delta = torch.zeros((), dtype=layer.get_base_layer().weight.dtype)
    with torch.no_grad():
        for adapter in layer.active_adapters:
            if adapter in merged or adapter not in getattr(layer, "lora_A", {}):
                continue
            delta = delta + layer.get_delta_weight(adapter)
    return delta


# --------------------------------------------------------------------------- torch names -> ONNX


@dataclass(frozen=True)
class Target:
    """Where a torch weight goes in the ONNX graph."""

    torch_name: str
    transpose: bool  # a Linear's weight read by MatMul
    shape: tuple[int, ...]


_ANON_PARAM = {"MatMul": "weight", "Gemm": "weight", "Mul": "weight", "Add": "bias"}


def initializer_map(model: onnx.ModelProto, torch_shapes: dict[str, tuple[int, ...]]) -> dict[str, Target]:
    """ONNX initializer name -> the torch weight it holds, for the graph ``model`` exported from a
    module whose weights have ``torch_shapes``. Initializers that are not a weight (shape
    constants, folded values) are left out."""
    out: dict[str, Target] = {}
    inits = {i.name: tuple(i.dims) for i in model.graph.initializer}
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            if name in inits:
                readers.setdefault(name, []).append(node)
    for name, shape in inits.items():
        size = _numel(shape)
        # named: "<wrapper attribute>.<torch name>" (or the torch name itself)
        for candidate in (name, name.partition(".")[2]):
            want = torch_shapes.get(candidate)
            if want is not None and _numel(want) != size:  # a new vocabulary (an embedding), a new layer size
                raise EngineError(f"{candidate} is {list(want)} now and {list(shape)} in the engine: the graph "
                                  "changed, not only its weights; build new engines (build_engines(pipe))")
            if want is not None:
                out[name] = Target(candidate, False, shape)
                break
        else:
            nodes = readers.get(name, [])
            if len(nodes) != 1 or nodes[0].op_type not in _ANON_PARAM:
                continue
            node = nodes[0]
            # "/unet/down_blocks.0/attentions.0/.../to_k/MatMul" -> "down_blocks.0.attentions.0....to_k"
            parts = node.name.strip("/").split("/")
            if len(parts) < 3:
                continue
            scopes: list[str] = []
            for scope in parts[1:-1]:
                if scopes and scope.startswith(scopes[-1] + "."):  # a called Sequential: "inner", "inner.0"
                    scopes.pop()
                scopes.append(scope)
            path = ".".join(scopes)
            candidate = f"{path}.{_ANON_PARAM[node.op_type]}"
            want = torch_shapes.get(candidate)
            if want is None or _numel(want) != size:
                continue
            transpose = node.op_type == "MatMul" and len(want) == 2 and tuple(reversed(want)) == shape
            out[name] = Target(candidate, transpose, shape)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _array(value: torch.Tensor, target: Target, dtype: np.dtype) -> np.ndarray:
    value = value.detach().to("cpu", torch.float32)
    if target.transpose:
        value = value.t()
    return value.contiguous().reshape(target.shape).numpy().astype(dtype, copy=False)


def _view(value: torch.Tensor, target: Target) -> np.ndarray:
    """The float32 array in the ONNX layout, without copying where it can: a transposed one is a
    strided view of the torch tensor (a consumer that wants torch's layout back, an engine that
    stores the weight as torch does, transposes the view again for free)."""
    value = value.detach().to("cpu", torch.float32)
    if target.transpose:
        value = value.t()
    if tuple(value.shape) != tuple(target.shape):
        value = value.reshape(target.shape)
    return value.numpy()


def replace_weights(model: onnx.ModelProto, targets: dict[str, Target], weights: dict[str, torch.Tensor]) -> int:
    """Write ``weights`` (torch names) into ``model``'s initializers (in place); the count written."""
    written = 0
    for init in model.graph.initializer:
        target = targets.get(init.name)
        if target is None or target.torch_name not in weights:
            continue
        dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
        init.CopyFrom(numpy_helper.from_array(_array(weights[target.torch_name], target, dtype), init.name))
        written += 1
    return written


# --------------------------------------------------------------------------- slim exports


@dataclass(frozen=True)
class SlimWeight:
    """One initializer a slim export leaves out: its ONNX name, and where its value comes from."""

    onnx_name: str
    torch_name: str
    transpose: bool
    shape: tuple[int, ...]
    data_type: int  # onnx.TensorProto's

    @property
    def target(self) -> Target:
        return Target(self.torch_name, self.transpose, self.shape)


def is_slim(folder: Path) -> bool:
    """Whether the export in ``folder`` holds its graph only (weights come from the module)."""
    return (Path(folder) / WEIGHTS_FILE).is_file()


def slim_weights(folder: Path) -> list[SlimWeight]:
    """What ``weights.json`` of a slim export lists."""
    entries = json.loads((Path(folder) / WEIGHTS_FILE).read_text())["weights"]
    return [SlimWeight(e["onnx_name"], e["torch_name"], e["transpose"], tuple(e["shape"]), e["data_type"])
            for e in entries]


def slim_export(folder: Path, torch_shapes: dict[str, tuple[int, ...]], model_file: str = "model.onnx",
                meta_file: str = "meta.json") -> int:
    """Leave only the graph in the export in ``folder``: the initializers that are weights of the
    module (``torch_shapes``: its tensors' shapes by name) become graph inputs, listed in
    ``weights.json``; what is not a weight (folded constants) stays. Returns the bytes freed.

    The caller holds the export's lock. Crash-safe in this order: a meta.json whose sizes do not
    match the files makes the folder invalid (exported again), never a wrong model."""
    folder = Path(folder)
    path = folder / model_file
    before = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    model = onnx.load(str(path), load_external_data=False)
    targets = initializer_map(model, torch_shapes)
    graph = model.graph
    for t in _attribute_tensors(graph):  # Constant nodes' values (a wide model's norm constants): inline too
        if t.data_location == onnx.TensorProto.EXTERNAL:
            t.raw_data = _read_external(t, folder.resolve())
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
    kept, slim = [], []
    for init in graph.initializer:
        target = targets.get(init.name)
        if target is None:
            if init.data_location == onnx.TensorProto.EXTERNAL:  # a folded constant: keep its value inline
                init.raw_data = _read_external(init, folder.resolve())
                init.data_location = onnx.TensorProto.DEFAULT
                del init.external_data[:]
            kept.append(init)
            continue
        slim.append(SlimWeight(init.name, target.torch_name, target.transpose, tuple(init.dims), init.data_type))
        graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    if not slim:
        return 0
    del graph.initializer[:]
    graph.initializer.extend(kept)
    tmp = folder / f".{model_file}.slim-{os.getpid()}"
    onnx.save_model(model, str(tmp))
    (folder / WEIGHTS_FILE).write_text(json.dumps({"weights": [asdict(w) for w in slim]}))
    meta_path = folder / meta_file
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta["files"] = {model_file: tmp.stat().st_size, WEIGHTS_FILE: (folder / WEIGHTS_FILE).stat().st_size}
    meta["slim"] = True
    meta_path.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, path)
    (folder / (model_file + DATA_SUFFIX)).unlink(missing_ok=True)
    after = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    log.info("kept the graph of %s only (%d weights come from the module): %.1f MB freed",
             folder.name, len(slim), (before - after) / 1e6)
    return before - after


def write_full(folder: Path, weights: dict[str, torch.Tensor], dest: Path, model_file: str = "model.onnx",
               replace: bool = False) -> tuple[Path, int]:
    """Write a complete model into the folder ``dest`` (``model.onnx`` + ``model.onnx.data``):
    the graph of the export in ``folder`` with ``weights`` (torch names) in it, streamed one
    tensor at a time. A slim export takes every weight it lists from ``weights`` (a missing one
    is an error); a full one takes its own, or, with ``replace``, the ones ``weights`` has (a
    refit). Returns the model's path and the count of weights taken from ``weights``."""
    folder, dest = Path(folder), Path(dest)
    model = onnx.load(str(folder / model_file), load_external_data=False)
    graph = model.graph
    if is_slim(folder):
        listed = {w.onnx_name: w for w in slim_weights(folder)}
        missing = sorted({w.torch_name for w in listed.values()} - set(weights))
        if missing:
            raise EngineError(f"the graph in {folder} needs weights the module does not have ({missing[:4]}...): "
                              "the module changed shape, not only its weights; build new engines")
        inputs = [i for i in graph.input if i.name not in listed]
        del graph.input[:]
        graph.input.extend(inputs)
        for w in listed.values():
            init = graph.initializer.add()
            init.name, init.data_type = w.onnx_name, w.data_type
            init.dims.extend(w.shape)
        targets = {name: w.target for name, w in listed.items()}
    else:
        targets = initializer_map(model, {k: tuple(v.shape) for k, v in weights.items()}) if replace else {}
    dest.mkdir(parents=True, exist_ok=True)
    data_name = model_file + DATA_SUFFIX
    written = 0
    with open(dest / data_name, "wb") as out:
        for init in graph.initializer:
            target = targets.get(init.name)
            if target is not None and target.torch_name in weights:
                dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
                blob = _array(weights[target.torch_name], target, dtype).tobytes()
                written += 1
            elif init.data_location == onnx.TensorProto.EXTERNAL:
                blob = _read_external(init, folder.resolve())
            elif len(init.raw_data) >= _MIN_EXTERNAL_BYTES:
                blob = init.raw_data
            else:
                continue
            append_tensor(out, init, blob, data_name)
            del blob
        for t in _attribute_tensors(graph):  # Constant nodes' values kept out of the graph: along too
            if t.data_location == onnx.TensorProto.EXTERNAL:
                try:
                    blob = _read_external(t, folder.resolve())
                except (OSError, InvalidValue) as exc:
                    raise EngineError(f"the export in {folder} lost the value of a constant ({exc}): an older "
                                      "sd-accel kept its graph only without it; delete that export folder and "
                                      "build the engines again") from exc
                append_tensor(out, t, blob, data_name)
    onnx.save_model(model, str(dest / model_file))
    return dest / model_file, written


def _attribute_tensors(graph: onnx.GraphProto):
    """The tensors held by the nodes' attributes (Constant values), subgraphs' initializers too."""
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from sub.initializer
                yield from _attribute_tensors(sub)


def onnx_values(folder: Path, weights: dict[str, torch.Tensor], model_file: str = "model.onnx"
                ) -> Callable[[str], np.ndarray | None]:
    """``value(onnx_name)``: the float32 array (ONNX layout) an initializer of the export in
    ``folder`` holds with ``weights`` (torch names) in place of the export's own; the export's own
    value for an initializer that is not a weight; None for a name it does not know. Computed on
    each call, so a caller walking a 3 GB graph holds one tensor at a time. A weight's array is a
    view of the torch tensor where it can be (a transposed one is strided, not contiguous); treat
    it as read-only."""
    folder = Path(folder)
    model = onnx.load(str(folder / model_file), load_external_data=False)
    if is_slim(folder):
        targets = {w.onnx_name: w.target for w in slim_weights(folder)}
    else:
        targets = initializer_map(model, {k: tuple(v.shape) for k, v in weights.items()})
    inits = {i.name: i for i in model.graph.initializer}

    def value(name: str) -> np.ndarray | None:
        target = targets.get(name)
        if target is not None and target.torch_name in weights:
            return _view(weights[target.torch_name], target)
        init = inits.get(name)
        return None if init is None else numpy_helper.to_array(init, base_dir=str(folder))

    return value


__all__ = [
    "WEIGHTS_FILE",
    "SlimWeight",
    "Target",
    "effective_weights",
    "initializer_map",
    "is_slim",
    "onnx_values",
    "peft_layer",
    "replace_weights",
    "slim_export",
    "slim_weights",
    "write_full",
]
