"""Where each weight of an OpenVINO engine sits in its ``engine.bin``, so that a refit can write new
weights into a copy of the file instead of converting and compiling again.

The engine's ``engine.blob`` is exported weightless (``CACHE_MODE=OPTIMIZE_SIZE``): at import the
CPU plugin reads the MatMul and Convolution weights from ``engine.bin`` again; biases and norm
scales are folded into the blob at compile time. A LoRA (or any change of Linear / Conv weights)
therefore needs only a patched copy of ``engine.bin``: seconds instead of the convert + compile of a
build (measured on SD 1.5's UNet at 512 px: scripts/BENCHMARKS.md, "LoRA refit vs rebuild").

At build time :func:`write_map` records, for each ONNX initializer read by one MatMul, Gemm or Conv
(``engine.weights.json``), where its stored bytes are (the converter may keep a weight as it is or
transposed, and names most of them anew, so they are found by value: a weight's bytes found in
exactly one constant), and for every other initializer a digest of its value. :func:`patch` then
writes new values of the mapped ones, and refuses (None: the caller builds in full) when any other
initializer's value changed, or a mapped one cannot be placed. :func:`patched_model` replaces the
changed ones in the engine's graph in memory instead (engines that kept ``engine.xml``): compiled,
it leaves no copy of ``engine.bin`` on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import shutil
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from sd_accel.pages import page_out

log = logging.getLogger("sd_accel")

MAP_FILE = "engine.weights.json"
_PATCHABLE_OPS = {"MatMul", "Gemm", "Conv"}
_STORAGE = {"f16": np.float16, "f32": np.float32}
_TORCH_STORAGE = {"f16": torch.float16, "f32": torch.float32}


def _digest(array: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(array, dtype=np.float32).tobytes(), digest_size=16).hexdigest()


_HEAD = 256  # bytes of a constant that index it: one full comparison per weight, not one per same-size constant


def _constants(xml_path: Path, blob: mmap.mmap) -> dict[tuple[str, int, bytes], list[int]]:
    """(element type, size in bytes, first bytes) -> offsets of the IR's constants in its .bin."""
    out: dict[tuple[str, int, bytes], list[int]] = {}
    for layer in ET.parse(xml_path).getroot().iter("layer"):
        if layer.get("type") != "Const":
            continue
        data = layer.find("data")
        if data is None or data.get("offset") is None:
            continue
        offset, size = int(data.get("offset")), int(data.get("size"))
        key = (data.get("element_type", ""), size, blob[offset:offset + min(size, _HEAD)])
        out.setdefault(key, []).append(offset)
    return out


def write_map(onnx_path: Path, xml_path: Path, bin_path: Path, out_path: Path) -> int:
    """Record where the weights of ``onnx_path`` sit in the IR ``xml_path`` / ``bin_path`` (see the
    module docstring) into ``out_path``; returns how many were placed."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path), load_external_data=False)
    readers: dict[str, list[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.op_type)
    placed: dict[str, dict] = {}
    digests: dict[str, str] = {}
    with open(bin_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        constants = _constants(xml_path, blob)
        for init in model.graph.initializer:
            value = numpy_helper.to_array(init, base_dir=str(onnx_path.parent))
            ops = readers.get(init.name, [])
            spot = None
            if value.dtype == np.float32 and value.ndim in (2, 4) and len(ops) == 1 and ops[0] in _PATCHABLE_OPS:
                spot = _place(value, constants, blob)
            if spot is None:
                digests[init.name] = _digest(value)
            else:
                placed[init.name] = spot
            del value
    out_path.write_text(json.dumps({"placed": placed, "digests": digests}))
    log.debug("%s: %d weights placed in %s, %d others kept by digest", onnx_path.parent.name, len(placed),
              bin_path.name, len(digests))
    return len(placed)


def _place(value: np.ndarray, constants: dict[tuple[str, int, bytes], list[int]], blob: mmap.mmap) -> dict | None:
    for element, dtype in _STORAGE.items():
        stored = value.astype(dtype)
        layouts = [("same", stored)] + ([("T", stored.T)] if stored.ndim == 2 else [])
        for layout, arr in layouts:
            raw = np.ascontiguousarray(arr).tobytes()
            candidates = constants.get((element, len(raw), raw[:_HEAD]), [])
            hits = [off for off in candidates if blob[off:off + len(raw)] == raw]
            if len(hits) == 1:
                return {"offset": hits[0], "size": len(raw), "layout": layout, "element": element,
                        "shape": list(value.shape)}
            if len(hits) > 1:  # the same value in several places (ties, an untrained model): not placeable
                return None
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype hold the same bytes (bits, not values: -0.0 is not 0.0, a
    NaN equals itself), compared as integers (torch compares fp16 several times slower)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


class _CannotPatch(Exception):
    """A weight the map places has no value, or another shape: the engine is built in full."""


def _rest_unchanged(engine_dir: Path, table: dict, value: Callable[[str], np.ndarray | None]) -> bool:
    """Whether every weight outside the map (biases and norms, folded into the compiled engine)
    still has the engine's value."""
    for name, digest in table["digests"].items():
        new = value(name)
        if new is None or _digest(new) != digest:
            log.info("%s: %s changed and is folded into the compiled engine; refitting in full", engine_dir.name, name)
            return False
    return True


def _changed(base_path: Path, placed: dict[str, dict], value: Callable[[str], np.ndarray | None],
             counts: dict[str, int]) -> Iterator[tuple[dict, torch.Tensor]]:
    """``(spot, stored)`` for each mapped weight whose stored bytes (``value(name)`` converted to
    the stored type and layout) differ from the engine's in ``base_path``. ``stored`` is a scratch
    buffer, valid until the next item: write or copy it right away. ``counts`` gets ``written``,
    ``same`` and ``bytes_written``. Raises :class:`_CannotPatch`."""
    largest = max((math.prod(s["shape"]) for s in placed.values()), default=0)
    scratch = {element: torch.empty(largest, dtype=dtype) for element, dtype in _TORCH_STORAGE.items()
               if any(s["element"] == element for s in placed.values())}
    counts.update(written=0, same=0, bytes_written=0)
    with open(base_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob, \
            warnings.catch_warnings():
        # the engine's bytes, read in place: torch warns that the mapping is read-only (it is only read)
        warnings.filterwarnings("ignore", "The given (NumPy array|buffer) is not writable")
        for name, spot in placed.items():
            new = value(name)
            if new is None or list(new.shape) != spot["shape"]:
                raise _CannotPatch(name)
            source = torch.from_numpy(new)
            if spot["layout"] == "T":  # the ONNX MatMul layout of a Linear's weight is a view of torch's own
                source = source.t()
            count = source.numel()
            stored = scratch[spot["element"]][:count].view(source.shape)
            stored.copy_(source)  # converted to the stored type, in the stored layout
            engine = torch.frombuffer(blob, dtype=stored.dtype, count=count, offset=spot["offset"])
            unchanged = _same_bits(stored.reshape(-1), engine)
            page_out(engine.data_ptr(), spot["size"])  # read once: not left in the RSS of a host that refits
            if unchanged:
                counts["same"] += 1
                continue
            counts["written"] += 1
            counts["bytes_written"] += spot["size"]
            yield spot, stored


def patch(engine_dir: Path, files: list[str], value: Callable[[str], np.ndarray | None], out_dir: Path,
          weights_file: str, counts: dict[str, int] | None = None) -> list[str] | None:
    """A copy of the engine in ``engine_dir`` with the weights ``value(onnx_name)`` (float32, in the
    ONNX layout; a strided view is fine) written into its ``weights_file``: the engine's files in
    ``out_dir``, or None when the engine has no map or a weight outside the map changed (the
    caller builds in full).

    Only the weights whose stored bytes differ from the engine's are written (a LoRA changes a few
    layers): each new value is converted to its stored type and layout and compared with the
    engine's bytes, so whatever changed is seen (a LoRA, a fused one, an edit through ``.data``,
    ``load_state_dict``), and a weight back at its base value (LoRA A, then B, then A) is the
    engine's again: the copy is always of the base engine, never of an earlier patch.
    ``counts`` (optional) gets ``written``, ``same`` and ``bytes_written``."""
    engine_dir, out_dir = Path(engine_dir), Path(out_dir)
    map_path = engine_dir / MAP_FILE
    if MAP_FILE not in files or not map_path.is_file():
        return None
    table = json.loads(map_path.read_text())
    if not _rest_unchanged(engine_dir, table, value):
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    base_path, out_path = engine_dir / weights_file, out_dir / weights_file
    shutil.copyfile(base_path, out_path)  # the kernel copies (copy_file_range / sendfile)
    tally: dict[str, int] = {}
    try:
        with open(out_path, "r+b") as out:
            for spot, stored in _changed(base_path, table["placed"], value, tally):
                os.pwrite(out.fileno(), stored.numpy(), spot["offset"])
    except _CannotPatch:
        return None
    for name in files:
        if name == weights_file:
            continue
        try:
            os.link(engine_dir / name, out_dir / name)  # the compiled graph is read, never written
        except OSError:
            shutil.copyfile(engine_dir / name, out_dir / name)
    log.info("%s: %d of %d weights differ from the engine's and were written (%.1f MB)", engine_dir.name,
             tally["written"], len(table["placed"]), tally["bytes_written"] / 1e6)
    if counts is not None:
        counts.update(tally)
    return list(files)


def _const_names(xml_path: Path) -> dict[int, list[str]]:
    """Offset in the IR's .bin -> the names of the Const layers stored there."""
    out: dict[int, list[str]] = {}
    for layer in ET.parse(xml_path).getroot().iter("layer"):
        data = layer.find("data")
        if layer.get("type") == "Const" and data is not None and data.get("offset") is not None:
            out.setdefault(int(data.get("offset")), []).append(layer.get("name", ""))
    return out


def patched_model(engine_dir: Path, files: list[str], value: Callable[[str], np.ndarray | None], graph_file: str,
                  weights_file: str, counts: dict[str, int] | None = None):
    """The engine's graph (``graph_file``, an IR, read with its weights memory-mapped from
    ``weights_file``) with the weights that differ from ``value(onnx_name)`` replaced by new
    constants in memory: an ``openvino.Model`` to compile, or None where it cannot be (no map or no
    graph kept, a weight outside the map changed, a constant the map places is not one layer of the
    graph). Nothing is written: a refit compiled from it leaves no copy of the engine on disk."""
    import openvino as ov

    engine_dir = Path(engine_dir)
    map_path, xml_path = engine_dir / MAP_FILE, engine_dir / graph_file
    if not {MAP_FILE, graph_file} <= set(files) or not map_path.is_file() or not xml_path.is_file():
        return None
    table = json.loads(map_path.read_text())
    if not _rest_unchanged(engine_dir, table, value):
        return None
    names = _const_names(xml_path)
    model = ov.Core().read_model(str(xml_path), str(engine_dir / weights_file))
    consts = {op.get_friendly_name(): op for op in model.get_ops() if op.get_type_name() == "Constant"}
    tally: dict[str, int] = {}
    try:
        for spot, stored in _changed(engine_dir / weights_file, table["placed"], value, tally):
            at = names.get(spot["offset"], [])
            op = consts.get(at[0]) if len(at) == 1 else None
            if op is None or list(op.get_output_shape(0)) != list(stored.shape):
                log.info("%s: a weight at offset %d is not one constant of its graph; refitting by a copy",
                         engine_dir.name, spot["offset"])
                return None
            new = ov.op.Constant(stored.numpy(), shared_memory=False)  # a copy: the scratch buffer is reused
            new.set_friendly_name(at[0])
            op.output(0).replace(new.output(0))
    except _CannotPatch:
        return None
    log.info("%s: %d of %d weights differ from the engine's and were replaced in memory (%.1f MB)", engine_dir.name,
             tally["written"], len(table["placed"]), tally["bytes_written"] / 1e6)
    if counts is not None:
        counts.update(tally)
    return model
