"""Building into the cache: a build slot (a temporary folder under the engine's lock), the
space check, and the install that renames a committed build into place."""

from __future__ import annotations

import builtins
import contextlib
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..core import EngineError, ShapeRanges
from ..units import format_size
from .folder import (
    _LEFTOVER,
    DEFAULT_BUILD_WAIT_S,
    INDEX_SCHEMA,
    CacheFolder,
    _is_disk_full,
    _remove_tree,
    _tree_size,
    logger,
)
from .key import EngineKey
from .record import (
    META_FILE,
    EngineRecord,
    files_checksum,
    files_size,
    plain_json,
    safe_relative,
    write_json_atomic,
)


class BuildSlot:
    """A build in progress: write the engine files into :attr:`dir`, then :meth:`commit`.

    Only :meth:`EngineCache.build_slot` makes these; the slot is valid inside its ``with``.
    """

    def __init__(self, cache: BuildSlots, key: EngineKey, folder: Path) -> None:
        self.key = key
        self.dir = folder
        self.record: EngineRecord | None = None
        self._cache = cache
        self._open = True

    def commit(
        self,
        files: Iterable[str | Path] | None,
        shapes: ShapeRanges,
        build_seconds: float,
        validation: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        share: Iterable[str] = (),
    ) -> EngineRecord:
        """Store the engine: checksum, meta.json, rename into place, index. Returns its record.

        ``files`` are paths inside :attr:`dir` (absolute or relative); None takes every file
        there. A ``validation`` with ``ok`` False stores the engine with status "bad".
        ``share``: the names among ``files`` that hold the engine's weights (the backend's
        ``weights_files``): each is stored once by content and hard-linked here, so engines with
        the same weights hold one copy on disk (:mod:`sd_accel.cache.shared`).

        ``slot.commit(["engine.plan"], shapes, 41.0, {"max_abs": 2e-3, "ok": True})``: the example
        of :mod:`sd_accel.cache.store` runs a build slot to its commit.
        """
        if not self._open or self.record is not None:
            raise EngineError(f"The build slot of {self.key.name} is closed or already committed.")
        names = self._relative(files)
        wanted = set(share)
        if wanted:
            self._cache.share_weights(self.dir, [n for n in names if n in wanted])
        created = time.time()
        validation = plain_json(validation)
        ok = validation is None or bool(validation.get("ok", True))
        record = EngineRecord(
            key=self.key,
            files=names,
            shapes={k: (tuple(lo), tuple(opt), tuple(hi)) for k, (lo, opt, hi) in shapes.items()},
            checksum=files_checksum(self.dir, names),
            size_bytes=files_size(self.dir, names),
            created=created,
            last_used=created,
            build_seconds=float(build_seconds),
            validation=validation,
            status="ok" if ok else "bad",
            bad_reason=None if ok else f"validation against torch failed: {validation}",
            extra=dict(extra or {}),
        )
        write_json_atomic(self.dir / META_FILE, {"schema": INDEX_SCHEMA, **record.to_dict()})
        self._cache._install(self.dir, record)
        self.record = record
        return record

    def _relative(self, files: Iterable[str | Path] | None) -> list[str]:
        if files is None:
            found = [p.relative_to(self.dir).as_posix() for p in self.dir.rglob("*") if p.is_file()]
            files = [f for f in found if f != META_FILE]
        names = sorted({self._one_relative(Path(f)) for f in files})
        if not names:
            raise EngineError(f"The build of {self.key.name} committed no engine files.")
        return names

    def _one_relative(self, path: Path) -> str:
        if path.is_absolute():
            try:
                path = path.resolve().relative_to(self.dir.resolve())
            except ValueError:
                raise EngineError(f"Engine file {path} lies outside the build folder {self.dir}.") from None
        try:
            name = safe_relative(path.as_posix())
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if not (self.dir / name).is_file():
            raise EngineError(f"The build of {self.key.name} did not write {name!r} into {self.dir}.")
        return name


class BuildSlots(CacheFolder):
    """Building into the cache: a build slot (a temporary folder under the engine's lock), the"""

    # A part of EngineCache (the facade in store.py): its methods call the other parts'
    # through ``self``.

    @contextlib.contextmanager
    def build_slot(
        self,
        key: EngineKey,
        timeout: float = DEFAULT_BUILD_WAIT_S,
        *,
        force: bool = False,
        need_bytes: int | None = None,
    ) -> Iterator[BuildSlot | None]:
        """Hold the key's build lock; yield None if the engine exists, else a :class:`BuildSlot`.

        Waits up to ``timeout`` seconds for another builder of the same key (EngineError
        after). An engine stored meanwhile by another process yields None: reuse it. A bad or
        broken engine, or ``force``, yields a slot whose commit replaces it. ``need_bytes``, if
        known, is checked against the free space first. Whatever ends the ``with`` without a
        commit (exception, KeyboardInterrupt, return) removes the temp folder; the lock is
        always released. ENOSPC becomes an EngineError saying the disk is full.

        As in the example of :mod:`sd_accel.cache.store`, which runs it::

            with cache.build_slot(key) as slot:
                if slot is not None:
                    slot.commit(backend.build(onnx, shapes, "fp16", slot.dir, progress), shapes, 30.0)
        """
        name = key.name
        lock = self._acquire(name, timeout, "build")
        try:
            if not force and self._usable(key):
                yield None
                return
            self._check_space(name, need_bytes)
            self._remove_leftovers(name)
            slot = BuildSlot(self, key, self._make_temp(name))
            try:
                yield slot
            except BaseException as exc:
                written = _tree_size(slot.dir)
                self._discard(slot)
                if _is_disk_full(exc):
                    raise self._disk_full(name, written, need_bytes) from exc
                raise
            self._discard(slot)
            if slot.record is None:
                logger.info("build of %s ended without commit; nothing was stored", name)
        finally:
            lock.release()

    def _usable(self, key: EngineKey) -> bool:
        record = self.get(key)
        folder = self.engine_dir(key)
        return (
            record is not None and record.status == "ok" and all((folder / f).is_file() for f in record.files)
        )

    def _make_temp(self, name: str) -> Path:
        try:
            folder = self.root / f".tmp-{name}-{os.getpid()}"
            folder.mkdir()
            return folder
        except OSError as exc:
            if _is_disk_full(exc):
                raise self._disk_full(name, 0, None) from exc
            raise

    def _discard(self, slot: BuildSlot) -> None:
        slot._open = False
        _remove_tree(slot.dir)

    def _check_space(self, name: str, need_bytes: int | None) -> None:
        if need_bytes is None:
            return
        free = shutil.disk_usage(self.root).free
        if free < need_bytes:
            raise EngineError(
                f"Not enough disk space to build {name}: it needs about {format_size(need_bytes)}, "
                f"{format_size(free)} free under {self.root}. Free some space (prune old engines) "
                "or point SD_ACCEL_ENGINE_DIR to a bigger disk."
            )

    def _disk_full(self, name: str, written: int, need_bytes: int | None) -> EngineError:
        try:
            free = format_size(shutil.disk_usage(self.root).free)
        except OSError:
            free = "unknown"
        need = (
            f"it needs about {format_size(need_bytes)}"
            if need_bytes
            else (f"it had written {format_size(written)} when the disk filled, and needs more")
        )
        return EngineError(
            f"The disk is full: building engine {name} under {self.root} failed; {need} "
            f"({free} free now). Nothing was stored and the cache is as it was. Free some space "
            "(prune old engines) or point SD_ACCEL_ENGINE_DIR to a bigger disk, then build again."
        )

    def _install(self, tmp: Path, record: EngineRecord) -> None:
        """Rename a committed temp folder into place (replacing an old one) and index it."""
        target = self.engine_dir(record.name)
        trash = self.root / f".trash-{record.name}-{os.getpid()}"
        old = target.exists() or target.is_symlink()
        if old:
            os.replace(target, trash)
        try:
            os.replace(tmp, target)
        except BaseException:
            if old:
                os.replace(trash, target)
            raise
        if old:
            _remove_tree(trash)
        self._update_index_best_effort({record.name: record})

    def _remove_leftovers(self, name: str) -> None:
        """Remove ``.tmp-<name>-<pid>`` / ``.trash-...`` folders; call with the key's lock held."""
        for entry in self._hidden_leftovers():
            match = _LEFTOVER.match(entry.name)
            if match and match["name"] == name:
                logger.warning("removing %s, left by a build that did not finish", entry)
                _remove_tree(entry)

    def _hidden_leftovers(self) -> builtins.list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if _LEFTOVER.match(p.name)]
