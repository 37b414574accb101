"""Memory pages handed back to the OS: file-backed pages a library read once (a model's weights it
memory-mapped and then copied into its own buffers) and heap memory malloc keeps after frees.
Both count in a process's RSS until handed back; neither loses data (clean file pages are read
again when used). Linux only (``madvise(MADV_PAGEOUT)``, glibc's ``malloc_trim``); elsewhere
every function here does nothing."""

from __future__ import annotations

import array
import bisect
import contextlib
import ctypes
import ctypes.util
import mmap
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# MADV_PAGEOUT (Linux >= 5.4): reclaim a range; anonymous pages go to swap (or stay), clean file
# pages are dropped, dirty ones written back. Never loses data, unlike MADV_DONTNEED.
_MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21 if sys.platform.startswith("linux") else None)
_PAGE = mmap.PAGESIZE


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc() if _MADV_PAGEOUT is not None else None


def resident_bytes(ptr: int, nbytes: int) -> int | None:
    """The bytes of ``[ptr, ptr + nbytes)`` mapped into this process now (``/proc/self/pagemap``'s
    present bit, whole pages counted; a file's pages in the page cache but not mapped here do not
    count, unlike ``mincore``); None where that cannot be asked."""
    if nbytes <= 0:
        return None
    lo = ptr // _PAGE
    pages = (ptr + nbytes + _PAGE - 1) // _PAGE - lo
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as fh:
            fh.seek(lo * 8)
            raw = fh.read(pages * 8)
    except OSError:
        return None
    if len(raw) != pages * 8:
        return None
    entries = array.array("Q")
    entries.frombytes(raw)
    return sum(1 for e in entries if e >> 63) * _PAGE


def page_out(ptr: int, nbytes: int) -> int:
    """Hand back the whole pages of a file-backed range; the bytes advised (0 if unsupported)."""
    if _LIBC is None:
        return 0
    lo = (ptr + _PAGE - 1) // _PAGE * _PAGE
    hi = (ptr + nbytes) // _PAGE * _PAGE
    if hi <= lo or _LIBC.madvise(lo, hi - lo, _MADV_PAGEOUT) != 0:
        return 0
    return hi - lo


def release_file(path: Path | str) -> int:
    """Hand back the resident pages of every mapping of the file ``path`` (or of the files under
    it, for a folder) in this process: a library (OpenVINO) that memory-mapped a model's weights
    from it and copied them into its own buffers leaves them resident otherwise, counted in the
    process's RSS. Returns the bytes advised. Data-safe: clean file pages are read again when
    used."""
    target = os.path.realpath(path)
    total = 0
    try:
        with open("/proc/self/maps") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return 0
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or parts[5].endswith(" (deleted)"):
            continue
        name = parts[5]
        if name != target and not name.startswith(target.rstrip(os.sep) + os.sep):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        total += page_out(lo, hi - lo)
    return total


@contextlib.contextmanager
def kept_released(path: Path | str, every: float = 2.0) -> Iterator[None]:
    """Within the block, every ``every`` seconds, hand back the resident pages of the mappings of
    ``path`` (:func:`release_file`) and the heap memory malloc keeps after frees
    (:func:`trim_heap`), from a background thread. For a library that reads memory-mapped
    weights once to copy them (OpenVINO compiling, NNCF quantizing) and frees big buffers between
    steps: neither stays counted in the process's RSS while the next step allocates. Pages still
    in use are read again from the file (data-safe)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every):
            release_file(path)
            trim_heap()

    thread = threading.Thread(target=run, name="sd-accel-release", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        release_file(path)
        trim_heap()


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise; smaller weights live there)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


class FileMaps:
    """The file-backed mappings of this process (``/proc/self/maps``; none where it is absent)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        try:
            with open("/proc/self/maps") as fh:
                lines = fh.read().splitlines()
        except OSError:
            return
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or parts[4] == "0" or parts[5].startswith("["):
                continue  # anonymous, heap, stack
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if self.ends and lo == self.ends[-1]:
                self.ends[-1] = hi  # one file mapped as adjacent pieces
            else:
                self.starts.append(lo)
                self.ends.append(hi)

    def holds(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies in one file-backed mapping."""
        i = bisect.bisect_right(self.starts, ptr) - 1
        return i >= 0 and ptr + nbytes <= self.ends[i]


class PageDropper:
    """``dropper(tensor)``: hand back the resident pages of ``tensor``'s storage if it is
    memory-mapped from a file (anonymous memory is never touched). For hashing a model one
    tensor at a time without leaving it all resident."""

    def __init__(self) -> None:
        self.maps = FileMaps()
        self.dropped = 0

    def mapped(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage lies in a file-backed mapping."""
        if tensor.device.type != "cpu":
            return False
        storage = tensor.untyped_storage()
        return bool(storage.nbytes()) and self.maps.holds(storage.data_ptr(), storage.nbytes())

    def __call__(self, tensor: torch.Tensor) -> None:
        if self.mapped(tensor):
            storage = tensor.untyped_storage()
            self.dropped += page_out(storage.data_ptr(), storage.nbytes())


def mostly_resident(tensor: torch.Tensor) -> bool:
    """Whether at least half of ``tensor``'s storage is in memory now (True where that cannot be
    asked: the caller then leaves it as it is)."""
    storage = tensor.untyped_storage()
    resident = resident_bytes(storage.data_ptr(), storage.nbytes())
    return resident is None or 2 * resident >= storage.nbytes()
