"""Torch weights of engine-served modules, kept out of resident memory while engines serve the calls.

An engine-backed stand-in keeps its torch module for the fallback, for ``config``/``dtype``/
``device`` and for whatever else reads the module (export, fingerprints, ``save_pretrained``).
Those weights resident beside the engine doubled the memory of a generation. :func:`park` makes
them cost nothing until used, while the module stays a normal torch module on the CPU with its
real weights (``dtype``, ``device``, ``config``, fingerprints, ``unswap``/``torch_modules``,
``save_pretrained`` all work unchanged):

- weights memory-mapped from a file (diffusers and transformers map ``.safetensors`` files
  as they load them) stay where they are; only their resident pages are handed back
  (``MADV_PAGEOUT``: data-safe, clean file pages are simply read again when used);
- weights in anonymous memory (a single-file checkpoint converted at load, a dtype change, an
  edit) are written once to a private spill file, and the tensors point at a copy-on-write
  memory map of it (``MAP_PRIVATE``), so the anonymous copy is freed.

A fallback (or an export, a validation) pages the weights in again, said once per module by the
stand-in; those pages are file-backed, so the kernel may drop them under pressure, and
:func:`release` drops them on purpose. An in-place edit (a LoRA fused, ``load_state_dict``)
writes private copies of the touched pages and never reaches a file.

Why not the meta device and a reload from the model source? Only pipelines loaded by
``load_pipeline`` know a source, and it reproduces the weights only if nobody changed them since
(dtype conversions, fused LoRAs, edits): a fallback would need a check and could still fail
mid-image. Why not a spill file kept in the cache? It doubles the disk of every model, and most
weights are already memory-mapped from their own file. The spill file lives under the engine
cache's ``.spill/`` folder (a real disk, where ``/tmp`` may be RAM), and on POSIX it is unlinked
as soon as it is mapped: nothing is left behind, even after a crash; its disk space returns when
the process ends.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from sd_accel.pages import FileMaps, PageDropper, trim_heap
from sd_accel.pages import page_out as _page_out
from sd_accel.units import format_size

log = logging.getLogger("sd_accel")

SPILL_DIR = ".spill"  # under the engine cache root; never an engine folder name
_ALIGN = 4096  # each spilled storage starts on a page: page-outs and SIMD loads both like it
_SPACE_MARGIN = 1 << 30  # leave this much of the disk free
_ATTR = "_sd_accel_parked"


@dataclass
class ParkedWeights:
    """Where one parked module's weights live."""

    mapped_bytes: int  # left memory-mapped from their own files
    spilled_bytes: int  # written to the spill file
    path: Path | None  # the spill file (already unlinked on POSIX), None when nothing was spilled
    mapping: mmap.mmap | None
    signature: tuple  # the module's tensors right after parking (see :func:`_signature`)

    # A copy of a parked module (``copy.deepcopy``, pickle: ``torch.save``, a pipeline copied for a
    # second use) holds new tensors in ordinary memory, so it is not parked; and a memory map can
    # be neither copied nor pickled, which made every copy of a once-accelerated pipeline fail.
    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return _not_parked, ()

    def describe(self) -> str:
        parts = []
        if self.mapped_bytes:
            parts.append(f"{format_size(self.mapped_bytes)} memory-mapped from the model files")
        if self.spilled_bytes:
            parts.append(f"{format_size(self.spilled_bytes)} from the spill file {self.path}")
        return ", ".join(parts) or "no weights"


def _not_parked() -> None:
    return None


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer once (tied ones are one object)."""
    seen: dict[int, torch.Tensor] = {}
    for _, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        if t is not None:
            seen.setdefault(id(t), t)
    return list(seen.values())


def _signature(module: torch.nn.Module) -> tuple:
    """Which tensors the module holds, where their data lives and their in-place edit counters."""
    return tuple((id(t), t.data_ptr(), _edits(t)) for t in _tensors(module))


def _edits(t: torch.Tensor) -> int:
    """The tensor's in-place edit counter; -1 for an inference tensor (ComfyUI loads its models
    under ``torch.inference_mode``), which keeps none: its identity and data pointer say it."""
    try:
        return t._version
    except RuntimeError:
        return -1


def parked(module: torch.nn.Module) -> ParkedWeights | None:
    """How ``module``'s weights were parked, or None (never, or edited or moved since)."""
    got = module.__dict__.get(_ATTR)
    if got is not None and got.signature != _signature(module):
        del module.__dict__[_ATTR]  # a spill map lives on only while tensors still use it
        return None
    return got


# --------------------------------------------------------------------------- file-backed memory


# FileMaps and PageDropper live in sd_accel.pages (the export's fp32 conversion and the
# fingerprint use them too); imported above.


def release(module: torch.nn.Module) -> int:
    """Hand back the resident pages of ``module``'s file-backed weights (after a fallback, an
    export or a validation paged them in); they load again from their files when used. Returns
    the bytes advised. Data-safe: pages written in place are kept."""
    dropper = PageDropper()
    for storage in _storages(_tensors(module)).values():
        if storage.nbytes() and dropper.maps.holds(storage.data_ptr(), storage.nbytes()):
            dropper.dropped += _page_out(storage.data_ptr(), storage.nbytes())
    return dropper.dropped


def hand_back_hooks(module: torch.nn.Module, dropper: PageDropper) -> list:
    """Forward hooks on each submodule of ``module`` with tensors of its own that hand their
    file-backed pages to ``dropper`` right after its forward; the caller removes them (or keeps
    them: :mod:`sd_accel.runtime.paged_encoders`). A block computing on cast copies of its stored
    weights (``models.stored_dtype``: diffusers' hook registry on it) hands back every tensor
    under it after its forward: while its layers run, their weights are the copies."""

    def hand_back(mod: torch.nn.Module, args, output) -> None:
        whole = hasattr(mod, "_diffusers_hook")
        for t in (*mod.parameters(recurse=whole), *mod.buffers(recurse=whole)):
            dropper(t)

    return [m.register_forward_hook(hand_back) for m in module.modules()
            if next(m.parameters(recurse=False), None) is not None or next(m.buffers(recurse=False), None) is not None
            or hasattr(m, "_diffusers_hook")]


@contextlib.contextmanager
def handed_back_after_use(module: torch.nn.Module) -> Iterator[PageDropper]:
    """Within the block, each submodule of ``module`` hands back the resident pages of its own
    file-backed weights right after its forward: a check that runs the whole module once (a
    refit's validation against torch) holds one layer's weights resident at a time, not the whole
    module beside the engine (SD 1.5's UNet: 3.4 GB). Anonymous weights are never touched."""
    dropper = PageDropper()
    hooks = hand_back_hooks(module, dropper)
    try:
        yield dropper
    finally:
        for hook in hooks:
            hook.remove()
        release(module)  # what ran outside a forward (a weight read directly) goes too


# --------------------------------------------------------------------------- parking


def _why_not(module: torch.nn.Module, tensors: list[torch.Tensor]) -> str | None:
    if not tensors:
        return "it has no weights"
    if any(hasattr(m, "_hf_hook") for m in module.modules()):
        return "it is managed by accelerate's offload hooks"
    for t in tensors:
        if t.device.type != "cpu":
            return f"its weights are on {t.device}, not the CPU"
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_quantized or t.layout != torch.strided:
            return f"it holds a {type(t).__name__} tensor ({t.layout}) that cannot be memory-mapped"
    return None


def _storages(tensors: list[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        out.setdefault(storage.data_ptr(), storage)
    return out


def _bytes_of(storage: torch.UntypedStorage) -> memoryview:
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return memoryview(flat.numpy())


def _padded(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def park(module: torch.nn.Module, folder: Path | str, label: str = "module") -> ParkedWeights | None:
    """Make ``module``'s weights cost no resident memory until used (see the module docstring).

    ``folder``: where a spill file may go (under ``folder/.spill``). Returns how they were
    parked (also kept on the module), or None, with the reason logged, when the module cannot be
    (not on the CPU, offload hooks, odd tensors, too little disk for its anonymous weights). A
    module parked and unchanged since is only paged out again. Values never change: the module
    computes exactly what it did, and its cached fingerprint stays valid.
    """
    from sd_accel.onnx.fingerprint import cached_fingerprint, remember_fingerprint

    done = parked(module)
    if done is not None:
        release(module)
        return done
    tensors = _tensors(module)
    why = _why_not(module, tensors)
    if why is not None:
        log.info("%s: torch weights stay in RAM beside the engines: %s", label, why)
        return None
    maps = FileMaps()
    storages = _storages(tensors)
    anonymous = {p: s for p, s in storages.items() if s.nbytes() and not maps.holds(p, s.nbytes())}
    mapped = sum(s.nbytes() for p, s in storages.items() if p not in anonymous)
    path = mapping = None
    spilled = 0
    if anonymous:
        fingerprint = cached_fingerprint(module)
        try:
            path, mapping, spilled = _spill(module, tensors, anonymous, Path(folder) / SPILL_DIR, label)
        except OSError as exc:
            log.warning("%s: torch weights stay in RAM beside the engines: %s", label, exc)
            return None
        anonymous.clear()
        storages = {}
        trim_heap()
        if fingerprint is not None:
            remember_fingerprint(module, fingerprint)  # same values, new addresses: no rehash
    result = ParkedWeights(mapped, spilled, path, mapping, _signature(module))
    object.__setattr__(module, _ATTR, result)
    release(module)
    log.info("%s: torch weights parked (%s); they load on the first fallback", label, result.describe())
    return result


def _spill(module: torch.nn.Module, tensors: list[torch.Tensor], anonymous: dict[int, torch.UntypedStorage],
           folder: Path, label: str) -> tuple[Path, mmap.mmap, int]:
    """Write the anonymous storages to a spill file, map it, point their tensors at the map."""
    total = sum(_padded(s.nbytes()) for s in anonymous.values())
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < total + _SPACE_MARGIN:
        raise OSError(f"{folder} has {format_size(free)} free and the weights need {format_size(total)}")
    fd, name = tempfile.mkstemp(prefix=f"{label}-{os.getpid()}-", suffix=".weights", dir=folder)
    path = Path(name)
    offsets: dict[int, int] = {}
    try:
        with os.fdopen(fd, "wb") as fh:
            pos = 0
            for ptr, storage in anonymous.items():
                offsets[ptr] = pos
                data = _bytes_of(storage)
                fh.write(data)
                pad = _padded(len(data)) - len(data)
                if pad:
                    fh.write(b"\0" * pad)
                pos += len(data) + pad
        mapping = _map(path, total)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    base = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()
    with torch.no_grad():
        for t in tensors:
            start = offsets.get(t.untyped_storage().data_ptr())
            if start is None:
                continue  # file-backed already: left where it is
            size = t.element_size()
            # an inference tensor (ComfyUI's weights) takes new data only as an inference tensor
            with torch.inference_mode(t.is_inference()):
                t.data = torch.empty(0, dtype=t.dtype).set_(base, start // size + t.storage_offset(), t.shape,
                                                            t.stride())
    return path, mapping, total


def _map(path: Path, total: int) -> mmap.mmap:
    with open(path, "r+b") as fh:
        # ACCESS_COPY: a private copy-on-write map, writable (torch tensors may be edited in
        # place) without ever writing back to the file.
        mapping = mmap.mmap(fh.fileno(), total, access=mmap.ACCESS_COPY)
    try:
        path.unlink()  # POSIX: the map keeps the data; nothing is left behind
    except OSError:  # Windows cannot unlink a mapped file: remove it once the map is gone
        weakref.finalize(mapping, lambda p=path: p.unlink(missing_ok=True))
    return mapping
