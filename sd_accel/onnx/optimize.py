"""Clean-up, constant folding, saving (with external data past 2 GB), shape inference, checking.

Two paths, chosen by what the exporter wrote:

* a single file (the model fits in a protobuf): load it whole, fold, save as one file;
* a file plus scattered weight files (the legacy exporter writes one file per tensor past 2 GB):
  load the graph WITHOUT the weights, fold (graphsurgeon folds shape arithmetic; the weights are
  never needed, torch already folded weight-only subgraphs), then stream every tensor into ONE
  ``model.onnx.data``, one tensor at a time. For the SD 1.5 UNet this keeps the peak at the
  exporter's own (~4-5 GB) instead of the ~14 GB that loading, folding and re-saving the whole
  model in memory takes.

Folding needs ``onnx-graphsurgeon`` (the ``tensorrt`` and ``dev`` extras). Without it the graph is
saved as exported: ONNX Runtime folds while creating a session anyway; TensorRT is the one that
benefits, which is why its extra brings graphsurgeon.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo

from sd_accel.core import InvalidValue, Progress

log = logging.getLogger("sd_accel")

DATA_SUFFIX = ".data"  # model.onnx -> model.onnx.data
# Protobuf cannot serialise a message past 2 GiB; keep headroom for the graph structure itself.
EXTERNAL_DATA_THRESHOLD = int(1.8 * 2**30)
_MIN_EXTERNAL_BYTES = 1024  # smaller tensors stay inside model.onnx
_ALIGN_FROM = 1 << 20  # tensors of 1 MiB and more start on a 64 KiB boundary (lets runtimes mmap)
_ALIGNMENT = 1 << 16


def _quiet(frac: float, msg: str) -> None:
    return None


def optimize_file(src: Path, dst: Path, progress: Progress | None = None) -> bool:
    """Fold and clean the exported ``src`` and save it as ``dst`` (+ ``dst.data`` when large).

    ``dst`` is one file when its tensors fit in a protobuf, else ``dst`` plus ONE external data
    file ``<dst name>.data`` next to it. Shape inference runs on the saved file. Returns whether
    external data was used. ``progress`` gets fractions of this step (0..1).
    """
    progress = progress or _quiet
    scattered = any(p.name != src.name for p in src.parent.iterdir())
    progress(0.0, "loading the exported graph" + (" (weights left on disk)" if scattered else ""))
    model = onnx.load(str(src), load_external_data=not scattered)
    if scattered:
        _load_foldable_weights(model, src.parent)
    progress(0.2, "folding constants")
    model = fold_constants(model)
    external = scattered or initializer_bytes(model) > EXTERNAL_DATA_THRESHOLD
    progress(0.6, "saving" + (" with one external data file" if external else ""))
    if scattered:
        gather_external_data(model, src.parent, dst)
    else:
        save_model(model, dst, external)
    del model
    progress(0.8, "inferring shapes")
    infer_shapes(dst)
    return external


def fold_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """graphsurgeon clean-up + toposort + constant folding; the input when graphsurgeon is missing."""
    try:
        import onnx_graphsurgeon as gs
    except ImportError:
        # Not a warning: only TensorRT gains from the folding, and its extra installs graphsurgeon.
        log.debug("onnx-graphsurgeon is not installed; saving the ONNX graph without constant folding")
        return model
    graph = gs.import_onnx(model)
    graph.cleanup().toposort()
    # error_ok: a subgraph ONNX Runtime cannot evaluate is left as it is, not fatal.
    with _ort_errors_only():
        graph.fold_constants(error_ok=True).cleanup().toposort()
    # Constants graphsurgeon did not touch are exported as the original TensorProtos, so
    # weights left on disk stay external references (nothing is loaded here).
    folded = gs.export_onnx(graph)
    # graphsurgeon writes its own defaults; keep the exporter's IR version and producer.
    folded.ir_version = model.ir_version
    folded.producer_name, folded.producer_version = model.producer_name, model.producer_version
    return folded


@contextlib.contextmanager
def _ort_errors_only():
    """graphsurgeon folds with ONNX Runtime sessions of default options, whose optimizer warns on
    every export ("UnsqueezeElimination cannot remove node ...") of nothing a user can act on."""
    try:
        import onnxruntime as ort
    except ImportError:
        yield
        return
    ort.set_default_logger_severity(3)
    try:
        yield
    finally:
        ort.set_default_logger_severity(2)  # ORT's own default (warnings); it has no getter


def _load_foldable_weights(model: onnx.ModelProto, base_dir: Path) -> None:
    """Load the external initializers that constant folding will evaluate, and only those.

    A tensor is evaluated when it feeds a node whose inputs are all constants (directly or
    through such nodes). ONNX Runtime, which graphsurgeon folds with, cannot read the others'
    data from a model held in memory; the big weights never feed such nodes.
    """
    graph = model.graph
    constant = {t.name for t in graph.initializer}
    needed: set[str] = set()
    for node in graph.node:  # exporters write nodes in topological order
        inputs = [i for i in node.input if i]
        if node.op_type == "Constant" or all(i in constant for i in inputs):
            constant.update(node.output)
            needed.update(inputs)
    loaded = 0
    for t in graph.initializer:
        if t.name in needed and t.data_location == onnx.TensorProto.EXTERNAL:
            t.raw_data = _read_external(t, base_dir.resolve())
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
            loaded += len(t.raw_data)
    log.debug("loaded %.1f MB of weights that constant folding evaluates", loaded / 1e6)


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of all initializers, from their dims (no serialisation, external ones included)."""
    total = 0
    for t in model.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        total += n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


def save_model(model: onnx.ModelProto, path: Path, external: bool) -> None:
    """Save as one file, or as ``path`` + one ``<name>.data`` file holding every tensor."""
    if not external:
        onnx.save_model(model, str(path))
        return
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=path.name + DATA_SUFFIX,
        size_threshold=_MIN_EXTERNAL_BYTES,
    )


def gather_external_data(model: onnx.ModelProto, src_dir: Path, dst: Path) -> None:
    """Save ``model`` as ``dst`` with every sizeable tensor in ONE ``dst.data`` file.

    Tensors still on disk (external references relative to ``src_dir``) are copied one at a
    time, so at most one tensor is in memory; tensors held in memory are moved out too.
    """
    data_name = dst.name + DATA_SUFFIX
    src_root = src_dir.resolve()
    with open(dst.parent / data_name, "wb") as out:
        for tensor in _all_tensors(model.graph):
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                blob = _read_external(tensor, src_root)
            elif len(tensor.raw_data) >= _MIN_EXTERNAL_BYTES:
                blob = tensor.raw_data
            else:
                continue
            append_tensor(out, tensor, blob, data_name)
    onnx.save_model(model, str(dst))


def append_tensor(out, tensor: onnx.TensorProto, blob: bytes, data_name: str) -> None:
    """Write ``blob`` at the end of the open data file ``out`` (big ones on a 64 KiB boundary) and
    point ``tensor`` at it."""
    if len(blob) >= _ALIGN_FROM and out.tell() % _ALIGNMENT:
        out.write(b"\0" * (_ALIGNMENT - out.tell() % _ALIGNMENT))
    offset = out.tell()
    out.write(blob)
    _point_to(tensor, data_name, offset, len(blob))


def _all_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Initializers and tensor attributes, through subgraphs too."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _all_tensors(attr.g)
            for sub in attr.graphs:
                yield from _all_tensors(sub)


def _read_external(tensor: onnx.TensorProto, root: Path) -> bytes:
    info = ExternalDataInfo(tensor)
    path = (root / info.location).resolve()
    if root not in path.parents:
        raise InvalidValue(f"external data of {tensor.name!r} points outside {root}: {info.location!r}")
    with open(path, "rb") as f:
        f.seek(info.offset or 0)
        blob = f.read(info.length) if info.length else f.read()
    if info.length and len(blob) != info.length:
        raise InvalidValue(f"external data of {tensor.name!r} is truncated: {len(blob)} of {info.length} bytes")
    return blob


def _point_to(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def infer_shapes(path: Path) -> None:
    """Shape inference in place, on the file (the only way that works past 2 GB).

    Inference failing is not fatal: the graph stays valid, backends infer shapes themselves.
    """
    try:
        onnx.shape_inference.infer_shapes_path(str(path), str(path))
    except Exception as exc:  # onnx raises InferenceError, RuntimeError, ... by op
        log.warning("ONNX shape inference failed on %s (%s); keeping the graph without it", path.name, exc)


def check_model(path: Path) -> None:
    """``onnx.checker`` on the path (so external data is checked where it lies); raises when invalid."""
    onnx.checker.check_model(str(path))
