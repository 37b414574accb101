"""Refit copies: the scratch folders of refitted engines under ``<root>/.refit``.

A LoRA refit (:mod:`sd_accel.refit`) writes a patched copy of an engine (or a graph and an
engine built from it) into a folder of its own; the refitted engine runs from there for as
long as its process keeps it, and the folder goes when it is closed. Each folder is named
after the process that wrote it, ``.refit/p<pid>-<engine name>-<random>``, so that what a
crashed (or killed) process left can be told from what a running one uses:

- the copies of processes that are gone are *stale*: the first refit of a process and every
  ``prune`` remove them (:func:`remove_stale`);
- every copy is listed and counted in the cache's disk use (``sd-accel list``,
  :meth:`~sd_accel.cache.store.EngineCache.disk_usage`); ``sd-accel prune --refit-copies``
  removes them all (:func:`remove_copies`; a running host that used one refits again when it
  needs it).

Folders of an older layout (no ``p<pid>-`` prefix) have no owner to ask: they count as stale.

>>> import tempfile
>>> root = Path(tempfile.mkdtemp())
>>> folder = new_copy(root, "unet.cpu.fp32.static.b1.h64.w64.t77.onnxruntime-1.0.0123456789ab.s1")
>>> folder.parent.name, folder.name.startswith(f"p{os.getpid()}-unet.")
('.refit', True)
>>> [(c.pid == os.getpid(), c.stale) for c in refit_copies(root)]
[(True, False)]
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("sd_accel.cache.store")

REFIT_DIR = ".refit"  # under the engine cache root
_NAME = re.compile(r"^p(?P<pid>\d+)-(?P<engine>.+)-[^-]+$")
_cleaned: set[str] = set()  # roots whose stale copies this process removed already


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a pid of this machine)."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        import psutil
    except ImportError:  # POSIX without psutil: signal 0 asks without sending anything
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except (PermissionError, OSError):
            return True
        return True
    return psutil.pid_exists(pid)


def _size(folder: Path) -> int:
    total = 0
    for p in folder.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:  # removed while counted (a refit closing)
            continue
    return total


@dataclass(frozen=True)
class RefitCopy:
    """One refit copy on disk: its folder, the engine it copies, the process that wrote it."""

    name: str  # relative to the cache root: ".refit/p123-unet....-x1y2"
    engine: str  # the base engine's name (as far as the folder's name keeps it), or "" when unknown
    pid: int | None  # the writer's pid; None for a folder of an older layout
    size_bytes: int
    stale: bool  # its process is gone: nothing uses it

    @property
    def status(self) -> str:
        if self.pid is None:
            return "stale (older layout)"
        return f"stale (process {self.pid} is gone)" if self.stale else f"in use by process {self.pid}"

    def to_dict(self) -> dict:
        return {"name": self.name, "engine": self.engine, "pid": self.pid, "size_bytes": self.size_bytes,
                "stale": self.stale, "status": self.status}


def refit_copies(root: Path | str) -> list[RefitCopy]:
    """Every refit copy under ``root`` (an engine cache's root), stale or in use."""
    folder = Path(root) / REFIT_DIR
    if not folder.is_dir():
        return []
    out = []
    for entry in sorted(folder.iterdir()):
        match = _NAME.match(entry.name)
        pid = int(match["pid"]) if match else None
        out.append(RefitCopy(f"{REFIT_DIR}/{entry.name}", match["engine"] if match else "", pid,
                             _size(entry) if entry.is_dir() else _file_size(entry),
                             pid is None or not pid_alive(pid)))
    return out


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _remove(root: Path, copy: RefitCopy) -> bool:
    path = root / copy.name
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    if path.exists():
        log.warning("could not remove all of %s; delete it by hand", path)
        return False
    return True


def remove_stale(root: Path | str) -> list[RefitCopy]:
    """Remove the refit copies of processes that are gone (a crash, a kill); returns them."""
    root = Path(root)
    removed = [c for c in refit_copies(root) if c.stale and _remove(root, c)]
    if removed:
        log.info("removed %d refit cop%s that ended processes left (%d bytes)", len(removed),
                 "y" if len(removed) == 1 else "ies", sum(c.size_bytes for c in removed))
    return removed


def remove_copies(root: Path | str) -> list[RefitCopy]:
    """Remove every refit copy, those of running processes too (``sd-accel prune --refit-copies``):
    a running host keeps the engines it loaded and refits again when it needs another."""
    root = Path(root)
    return [c for c in refit_copies(root) if _remove(root, c)]


def new_copy(root: Path | str, engine_name: str) -> Path:
    """A new, empty folder for a refit copy of ``engine_name``, named after this process. The
    first one of a process in ``root`` removes the stale copies first."""
    root = Path(root)
    if str(root) not in _cleaned:
        _cleaned.add(str(root))
        remove_stale(root)
    folder = root / REFIT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"p{os.getpid()}-{engine_name[:60]}-", dir=folder))


__all__ = ["REFIT_DIR", "RefitCopy", "new_copy", "pid_alive", "refit_copies", "remove_copies", "remove_stale"]
