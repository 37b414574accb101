"""Torch weights of engine-served modules, moved out of anonymous RAM while engines serve the calls.

An engine-backed stand-in keeps its torch module for the fallback, for ``config``/``dtype``/
``device`` and for whatever else reads the module (export, fingerprints, ``save_pretrained``).
Keeping those weights in RAM beside the engine doubled the memory of a generation. :func:`park`
writes them once to a private spill file and points every parameter and buffer at a
copy-on-write memory map of it (``MAP_PRIVATE``):

- the module stays a normal torch module on the CPU, with real weights: ``dtype``, ``device``,
  ``config``, fingerprints, ``unswap``/``torch_modules`` and ``save_pretrained`` work unchanged;
- while engines serve every call, no page of it is touched, so it costs no resident memory;
- a fallback (or an export) pages the weights in from the file; those pages are file-backed,
  so the kernel can drop them again under pressure, and :func:`release` drops them on purpose;
- an in-place edit (a LoRA fused, ``load_state_dict``) writes private copies of the touched
  pages; the file never changes.

Why not the meta device and a reload from the model source? Only pipelines loaded by
``load_pipeline`` know a source, and it reproduces the weights only if nobody changed them since
(dtype conversions, fused LoRAs, edits): a fallback would then need a check and could still fail
mid-image. Why not a spill file kept in the cache? It would double the disk of every model.
The spill file here lives under the engine cache's ``.spill/`` folder (a real disk, not tmpfs),
and on POSIX it is unlinked as soon as it is mapped: nothing is left behind, even after a crash,
and its disk space returns when the process ends.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from sd_accel.units import format_size

log = logging.getLogger("sd_accel")

SPILL_DIR = ".spill"  # under the engine cache root; never an engine folder name
_ALIGN = 4096  # each storage starts on a page: madvise and SIMD loads both like it
_SPACE_MARGIN = 1 << 30  # leave this much of the disk free
_ATTR = "_sd_accel_parked"


@dataclass
class ParkedWeights:
    """The spill file behind one parked module."""

    path: Path  # where it was written (already unlinked on POSIX)
    nbytes: int
    mapping: mmap.mmap
    signature: tuple  # the module's tensors right after parking (see :func:`_signature`)

    def describe(self) -> str:
        return f"{format_size(self.nbytes)} mapped from {self.path}"


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer once (tied ones are one object)."""
    seen: dict[int, torch.Tensor] = {}
    for _, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        if t is not None:
            seen.setdefault(id(t), t)
    return list(seen.values())


def _signature(module: torch.nn.Module) -> tuple:
    """Which tensors the module holds, where their data lives and their in-place edit counters."""
    return tuple((id(t), t.data_ptr(), t._version) for t in _tensors(module))


def parked(module: torch.nn.Module) -> ParkedWeights | None:
    """The spill file ``module``'s weights live in, or None (not parked, or changed since)."""
    got = module.__dict__.get(_ATTR)
    if got is not None and got.signature != _signature(module):
        del module.__dict__[_ATTR]  # edited or moved since: the map lives on only while tensors use it
        return None
    return got


def _why_not(module: torch.nn.Module, tensors: list[torch.Tensor]) -> str | None:
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


def park(module: torch.nn.Module, folder: Path | str, label: str = "module") -> ParkedWeights | None:
    """Move ``module``'s weights into a private memory-mapped spill file under ``folder``.

    Returns the spill (also kept on the module), or None, with the reason logged, when the
    module cannot be parked (not on the CPU, offload hooks, odd tensors, too little disk). A
    module already parked and unchanged since is left as it is. Values never change: the
    module computes exactly what it did, and its cached fingerprint stays valid.
    """
    from sd_accel.onnx.fingerprint import cached_fingerprint, remember_fingerprint

    done = parked(module)
    if done is not None:
        return done
    tensors = _tensors(module)
    why = _why_not(module, tensors)
    if why is None and not tensors:
        why = "it has no weights"
    storages = _storages(tensors) if why is None else {}
    total = sum(_padded(s.nbytes()) for s in storages.values())
    folder = Path(folder) / SPILL_DIR
    if why is None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(folder).free
            if free < total + _SPACE_MARGIN:
                why = f"{folder} has {format_size(free)} free and the weights need {format_size(total)}"
        except OSError as exc:
            why = f"{folder} is not writable ({exc})"
    if why is not None:
        log.info("%s: torch weights stay in RAM beside the engines: %s", label, why)
        return None
    fingerprint = cached_fingerprint(module)
    try:
        path, offsets = _write(folder, label, storages)
    except OSError as exc:
        log.warning("%s: torch weights stay in RAM beside the engines: writing %s failed (%s)", label, folder, exc)
        return None
    mapping = _map(path, total)
    base = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage() if total else None
    with torch.no_grad():
        for t in tensors:
            start = offsets[t.untyped_storage().data_ptr()]
            size = t.element_size()
            view = torch.empty(0, dtype=t.dtype).set_(base, start // size + t.storage_offset(), t.shape, t.stride())
            t.data = view
    storages.clear()
    _trim_heap()
    spill = ParkedWeights(path, total, mapping, _signature(module))
    object.__setattr__(module, _ATTR, spill)
    if fingerprint is not None:
        remember_fingerprint(module, fingerprint)  # same values, new addresses: no rehash
    log.info("%s: torch weights parked (%s); they load on the first fallback", label, spill.describe())
    return spill


def _padded(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _write(folder: Path, label: str, storages: dict[int, torch.UntypedStorage]) -> tuple[Path, dict[int, int]]:
    fd, name = tempfile.mkstemp(prefix=f"{label}-{os.getpid()}-", suffix=".weights", dir=folder)
    path = Path(name)
    offsets: dict[int, int] = {}
    try:
        with os.fdopen(fd, "wb") as fh:
            pos = 0
            for ptr, storage in storages.items():
                offsets[ptr] = pos
                data = _bytes_of(storage)
                fh.write(data)
                pad = _padded(len(data)) - len(data)
                if pad:
                    fh.write(b"\0" * pad)
                pos += len(data) + pad
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path, offsets


def _map(path: Path, total: int) -> mmap.mmap:
    with open(path, "r+b") as fh:
        # ACCESS_COPY: a private copy-on-write map, writable (torch tensors may be edited in
        # place) without ever writing back to the file.
        mapping = mmap.mmap(fh.fileno(), total, access=mmap.ACCESS_COPY) if total else mmap.mmap(-1, 1)
    try:
        path.unlink()  # POSIX: the map keeps the data; nothing is left behind
    except OSError:  # Windows cannot unlink a mapped file: remove it once the map is gone
        weakref.finalize(mapping, lambda p=path: p.unlink(missing_ok=True))
    return mapping


def release(module: torch.nn.Module) -> bool:
    """Drop the resident pages of a parked, unchanged module (after a fallback or an export paged
    them in); they load again from the file on the next use. False when nothing was dropped."""
    spill = parked(module)
    if spill is None or not spill.nbytes or not hasattr(mmap, "MADV_DONTNEED"):
        return False
    # Pages written in place would be lost: parked() above says the version counters are the
    # ones parking left, so no torch op wrote to these tensors.
    spill.mapping.madvise(mmap.MADV_DONTNEED)
    return True


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise; smaller weights live there)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
