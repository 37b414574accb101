"""The engine cache's root, its locks, and the constants and small helpers every part of it
shares (:class:`sd_accel.cache.store.EngineCache` is the facade over the parts)."""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from ..core import SPEC_VERSION, EngineError
from ..paths import default_engine_dir
from .intermediates import KINDS
from .key import EngineKey
from .record import (
    EngineRecord,
)

logger = logging.getLogger("sd_accel.cache.store")  # one logger for the whole cache (its users filter by it)

INDEX_SCHEMA = 1  # bump when the index or meta.json layout changes meaning
INDEX_FILE = "index.json"
LOCK_DIR = ".locks"
RESERVED = frozenset(KINDS)  # intermediates' folders: never engines (see intermediates.py)

DEFAULT_BUILD_WAIT_S = 3600.0  # a TensorRT build of an SDXL UNet can take tens of minutes
DEFAULT_DELETE_WAIT_S = 10.0
INDEX_LOCK_WAIT_S = 30.0  # the index lock is held for milliseconds; longer means trouble
TOUCH_LOCK_WAIT_S = 1.0

_ENGINE_NAME = re.compile(r"^[A-Za-z0-9_+-][A-Za-z0-9._+-]*\.s\d+$")  # EngineKey.name's shape
_LEFTOVER = re.compile(r"^\.(?:tmp|trash)-(?P<name>.+)-\d+$")
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})


def _tree_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def _remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            logger.warning("could not remove all of %s; delete it by hand", path)


def _is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS


def _name_of(key_or_name: EngineKey | str) -> str:
    return key_or_name.name if isinstance(key_or_name, EngineKey) else str(key_or_name)


def _is_engine_name(name: str) -> bool:
    return name not in RESERVED and _ENGINE_NAME.match(name) is not None


def _check_key(record: EngineRecord, arch: str, backend_version: str, folder: Path) -> None:
    key = record.key
    problems = []
    if key.arch != arch:
        problems.append(f"it was built for {key.arch}, this device is {arch}")
    if key.backend_version != backend_version:
        problems.append(
            f"it was built with {key.backend} {key.backend_version}, this machine has {backend_version}"
        )
    if key.spec_version != SPEC_VERSION:
        problems.append(f"it comes from export spec {key.spec_version}, this sd-accel uses {SPEC_VERSION}")
    if problems:
        raise EngineError(
            f"Engine {record.name} cannot run here: {'; '.join(problems)}: rebuild it with "
            "build_engines(...) or `sd-accel build` (the new engine gets its own folder); "
            f"delete {folder} if no machine needs it any more."
        )


class CacheFolder:
    """The root folder of an engine cache and its locks."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root if root is not None else default_engine_dir()).expanduser().absolute()
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"EngineCache({str(self.root)!r})"

    def engine_dir(self, key_or_name: EngineKey | str) -> Path:
        """The folder of an engine (it may not exist)."""
        return self.root / _name_of(key_or_name)

    def _lock(self, name: str) -> FileLock:
        (self.root / LOCK_DIR).mkdir(parents=True, exist_ok=True)
        return FileLock(self.root / LOCK_DIR / f"{name}.lock")

    def _acquire(self, name: str, timeout: float, purpose: str) -> FileLock:
        """The engine's lock, held; waits up to ``timeout`` s (logs that it waits)."""
        lock = self._lock(name)
        try:
            lock.acquire(timeout=0)
            return lock
        except Timeout:
            if timeout <= 0:
                raise EngineError(f"Engine {name} is being built or deleted by another process.") from None
        logger.info("waiting up to %.0f s for another process working on %s", timeout, name)
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise EngineError(
                f"Could not {purpose} {name}: another process has held its lock ({lock.lock_file}) for "
                f"more than {timeout:.0f} s. Wait for that build to finish, or stop it."
            ) from None
        return lock

    @contextlib.contextmanager
    def _index_lock(self, timeout: float) -> Iterator[None]:
        lock = self._lock("index")
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise EngineError(
                f"The engine index lock {lock.lock_file} stayed busy for {timeout} s."
            ) from None
        try:
            yield
        finally:
            lock.release()

    def _lock_held(self, name: str) -> bool:
        lock = self._lock(name)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return True
        lock.release()
        return False
