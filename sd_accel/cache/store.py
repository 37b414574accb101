"""The engine cache: engine folders on disk, an index rebuilt from them, and the locks.

What one engine's record holds, and its checksum, is :mod:`sd_accel.cache.record`; where the
root is by default, :func:`sd_accel.paths.default_engine_dir`.

Layout under the root::

    <root>/index.json                  {"schema": 1, "engines": {name: meta}}: a cache of the metas
    <root>/<key.name>/meta.json        the truth for one engine (an EngineRecord)
    <root>/<key.name>/<engine files>   whatever names the backend wrote
    <root>/.locks/<key.name>.lock      held while that engine is built or deleted
    <root>/.locks/index.lock           held for each index / meta.json update (milliseconds)
    <root>/.tmp-<key.name>-<pid>/      a build in progress; renamed into place on commit
    <root>/onnx/, <root>/calibration/  intermediates other modules write (ONNX exports, int8
                                       calibration data): counted, and removed when no engine
                                       needs them (:mod:`sd_accel.cache.intermediates`)
    anything else                      never listed, never pruned

``meta.json`` is what counts: the index is only a fast path, and it is rebuilt from the
folders whenever it is missing, unreadable, of another schema or out of step with them.

>>> cache = EngineCache("/tmp/engines")                               # doctest: +SKIP
>>> with cache.build_slot(key) as slot:                               # doctest: +SKIP
...     if slot is not None:                  # None: another process built it while we waited
...         files = backend.build(onnx, shapes, "fp16", slot.dir, progress)
...         slot.commit(files, shapes, build_seconds=12.5, validation={"ok": True})
>>> record = cache.get(key)                                           # doctest: +SKIP
>>> cache.verify(record, arch="sm89", backend_version="10.5.0")       # doctest: +SKIP
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from ..core import SPEC_VERSION, EngineError, InvalidValue, ShapeRanges
from ..paths import default_engine_dir, export_dir, export_lock
from ..units import format_size
from .intermediates import KINDS, ONNX_DIR, Intermediate, parse_name, paths, scan, serves
from .key import EngineKey
from .record import (
    META_FILE,
    BrokenEngine,
    EngineRecord,
    files_checksum,
    files_size,
    plain_json,
    safe_relative,
    write_json_atomic,
)

logger = logging.getLogger(__name__)

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


# --------------------------------------------------------------------------- file helpers


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


# --------------------------------------------------------------------------- building


class BuildSlot:
    """A build in progress: write the engine files into :attr:`dir`, then :meth:`commit`.

    Only :meth:`EngineCache.build_slot` makes these; the slot is valid inside its ``with``.
    """

    def __init__(self, cache: EngineCache, key: EngineKey, folder: Path) -> None:
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
    ) -> EngineRecord:
        """Store the engine: checksum, meta.json, rename into place, index. Returns its record.

        ``files`` are paths inside :attr:`dir` (absolute or relative); None takes every file
        there. A ``validation`` with ``ok`` False stores the engine with status "bad".

        >>> slot.commit(["engine.plan"], shapes, 41.0, {"max_abs": 2e-3, "ok": True})  # doctest: +SKIP
        """
        if not self._open or self.record is not None:
            raise EngineError(f"The build slot of {self.key.name} is closed or already committed.")
        names = self._relative(files)
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


# --------------------------------------------------------------------------- the cache


@dataclass(frozen=True)
class DiskUsage:
    """What the cache holds on disk: engines and the intermediates kept beside them.

    >>> usage = cache.disk_usage()                                         # doctest: +SKIP
    >>> usage.describe()                                                   # doctest: +SKIP
    '3 engines, 1.9 GB + intermediates 3.3 GB (ONNX exports, calibration data) = 5.2 GB'
    """

    engines: int
    engines_bytes: int
    intermediates: tuple[Intermediate, ...]

    @property
    def intermediates_bytes(self) -> int:
        return sum(i.size_bytes for i in self.intermediates)

    @property
    def total_bytes(self) -> int:
        return self.engines_bytes + self.intermediates_bytes

    def describe(self) -> str:
        """One line for faces: engines, intermediates and the total."""
        line = f"{self.engines} engine{'s' if self.engines != 1 else ''}, {format_size(self.engines_bytes)}"
        if self.intermediates:
            unused = sum(i.size_bytes for i in self.intermediates if i.unused)
            line += (f" + intermediates {format_size(self.intermediates_bytes)} (ONNX exports, calibration data"
                     + (f"; {format_size(unused)} unused, removed by delete/prune" if unused else "") + ")")
        return f"{line} = {format_size(self.total_bytes)}"


@dataclass
class _Snapshot:
    records: dict[str, EngineRecord]
    broken: list[BrokenEngine]
    changes: list[str]  # what differs from the index on disk; empty when it is up to date


class EngineCache:
    """Engine files on disk under ``root`` (default :func:`sd_accel.paths.default_engine_dir`).

    Every method reads the disk afresh (no state is shared between instances or processes),
    so several processes may use one cache at once.

    >>> cache = EngineCache(tmp_path)                                 # doctest: +SKIP
    >>> [r.name for r in cache.find(component="unet", arch="sm89")]   # doctest: +SKIP
    ['unet.sm89.fp16.static.b2.h512.w512.t77.tensorrt-10.5.0.0123456789ab.s1']
    """

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root if root is not None else default_engine_dir()).expanduser().absolute()
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"EngineCache({str(self.root)!r})"

    def engine_dir(self, key_or_name: EngineKey | str) -> Path:
        """The folder of an engine (it may not exist)."""
        return self.root / _name_of(key_or_name)

    # ---- reading

    def list(self) -> builtins.list[EngineRecord]:
        """Every usable-looking engine (status ok or bad), sorted by name. Broken folders: :meth:`broken`."""
        return [r for _, r in sorted(self._snapshot().records.items())]

    def get(self, key: EngineKey) -> EngineRecord | None:
        """The record stored for exactly ``key``, or None."""
        record = self._snapshot().records.get(key.name)
        return record if record is not None and record.key == key else None

    def find(
        self,
        model: str | None = None,
        component: str | None = None,
        backend: str | None = None,
        arch: str | None = None,
    ) -> builtins.list[EngineRecord]:
        """Records whose key matches every given field.

        >>> cache.find(component="unet", backend="onnxruntime")      # doctest: +SKIP
        """
        wanted = {"model": model, "component": component, "backend": backend, "arch": arch}
        return [r for r in self.list() if all(v is None or getattr(r.key, k) == v for k, v in wanted.items())]

    def broken(self) -> builtins.list[BrokenEngine]:
        """Engine folders whose meta.json is missing or unreadable; left for the user to delete."""
        return self._snapshot().broken

    def total_size(self) -> int:
        """Bytes of engine files in listed engines (meta.json and broken folders not counted).
        What the cache holds on disk in all, intermediates included: :meth:`disk_usage`."""
        return sum(r.size_bytes for r in self.list())

    # ---- intermediates: ONNX exports and calibration data (sd_accel.cache.intermediates)

    def intermediates(self) -> builtins.list[Intermediate]:
        """Every ONNX export and calibration file under the root, with the engines it is kept for."""
        return scan(self.root, self.list(), self._components_building())

    def disk_usage(self) -> DiskUsage:
        """Engines plus intermediates: what ``list``, the panel and the WebUI API count."""
        records = self.list()
        return DiskUsage(len(records), sum(r.size_bytes for r in records),
                         tuple(scan(self.root, records, self._components_building())))

    def drop_unused_intermediates(self) -> builtins.list[Intermediate]:
        """Remove every intermediate no engine needs any more (see the rule in
        :mod:`sd_accel.cache.intermediates`); never one a running build may read. Returns them.
        :meth:`delete` and :meth:`prune` call this."""
        return self._drop(lambda item: item.unused)

    def drop_intermediates_of(
        self, records: Iterable[EngineRecord], kinds: Iterable[str] = (ONNX_DIR,)
    ) -> builtins.list[Intermediate]:
        """Remove the intermediates of ``kinds`` that ``records`` were built from, although those
        engines are kept: what ``build_engines(keep_onnx=False)`` calls after its last build (an
        engine runs from its own folder; another profile of it then exports again). Skips one
        that a running build (in any process) may read. Returns what was removed."""
        pairs = {pair for r in records for pair in serves(r)}
        kinds = set(kinds)
        return self._drop(lambda i: i.kind in kinds and (i.component, i.weights) in pairs and not i.building)

    def slim_intermediates_of(
        self, records: Iterable[EngineRecord], torch_shapes: dict[str, dict[str, tuple[int, ...]]]
    ) -> builtins.list[Intermediate]:
        """Keep only the graph of the ONNX exports ``records`` were built from (what
        ``build_engines`` does after its last build, by default): the weights, most of an export,
        come from the module when another engine is built from it or refitted
        (:func:`sd_accel.onnx.weights.slim_export`). ``torch_shapes``: per component, the
        module's tensor shapes by name. Skips one a running build may read; returns those slimmed."""
        from sd_accel.onnx.weights import is_slim, slim_export

        pairs = {pair for r in records for pair in serves(r)}

        def pick(item: Intermediate) -> bool:
            return (item.kind == ONNX_DIR and (item.component, item.weights) in pairs and not item.building
                    and item.component in torch_shapes and not is_slim(self.root / item.name))

        def slim(item: Intermediate) -> None:
            freed = slim_export(self.root / item.name, torch_shapes[item.component])
            logger.info("kept the graph of %s only (%s freed)", item.name, format_size(freed))

        return self._drop(pick, slim)

    def delete_intermediate(self, name: str) -> bool:
        """Remove one intermediate by its listed name (``onnx/unet.0123456789abcdef.s1``), even if
        engines are kept for it. False if there is none; EngineError while a build may read it."""
        parsed = parse_name(name)
        if parsed is None:
            raise InvalidValue(f"{name!r} is not an intermediate's name (onnx/... or calibration/..., "
                               "as `sd-accel list` shows them); nothing deleted.")
        wanted = "/".join(parsed)
        item = next((i for i in self.intermediates() if i.name == wanted), None)
        if item is None:
            return False
        if not self._drop(lambda i: i.name == wanted and not i.building):
            raise EngineError(f"{wanted} is in use by a running build; delete it when the build is done.")
        return True

    def _drop(
        self, select: Callable[[Intermediate], bool], act: Callable[[Intermediate], None] | None = None
    ) -> builtins.list[Intermediate]:
        """Remove the intermediates ``select`` picks (or ``act`` on them instead: slimming an export
        leaves what other caches sharing it need), each under its export's lock and checked
        again there. The order matters against a build in another process: ``build.run_jobs`` holds
        its engine lock (and has its temp folder) before it asks for the export, and asking
        takes the export's lock; so with that lock held here, either the build shows in
        :meth:`_components_building` or it waits for the removal and exports again."""
        removed = []
        for item in self.intermediates():
            if not select(item):
                continue
            if act is None and (self.root / item.kind).is_symlink():  # shared with other caches (the benchmark's rows)
                logger.info("kept %s: %s is a link to a folder other caches share", item.name, item.kind)
                continue
            with self._intermediate_lock(item) as held:
                if not held:
                    logger.info("kept %s: an export of it is running", item.name)
                    continue
                current = next((i for i in self.intermediates() if i.name == item.name), None)
                if current is None or not select(current):
                    continue
                if act is not None:
                    act(current)
                    removed.append(current)
                    continue
                for path in paths(self.root, current):
                    _remove_tree(path)
                logger.info("removed %s (%s, %s)", current.name, current.label, format_size(current.size_bytes))
                removed.append(current)
        return removed

    @contextlib.contextmanager
    def _intermediate_lock(self, item: Intermediate) -> Iterator[bool]:
        """The lock ``sd_accel.onnx.export.ensure_onnx_artifact`` takes for the export of the
        item's component and weights, held without waiting; yields False when it is busy."""
        if not item.component:  # a name of another layout: nothing in sd-accel reads it
            yield True
            return
        spec = item.spec_version if item.spec_version is not None else SPEC_VERSION
        (self.root / ONNX_DIR).mkdir(parents=True, exist_ok=True)
        lock = FileLock(export_lock(export_dir(self.root, item.component, item.weights, spec)))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    def _components_building(self) -> set[str]:
        """Components of the engines being built now, in any process: a ``.tmp-<name>-<pid>``
        folder whose engine lock is held."""
        building = set()
        for entry in self._hidden_leftovers():
            match = _LEFTOVER.match(entry.name)
            if match and entry.name.startswith(".tmp-") and self._lock_held(match["name"]):
                building.add(match["name"].split(".", 1)[0])
        return building

    def _lock_held(self, name: str) -> bool:
        lock = self._lock(name)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return True
        lock.release()
        return False

    def rebuild_index(self) -> builtins.list[EngineRecord]:
        """Forget the index and write it again from the folders' meta.json files."""
        with self._index_lock(INDEX_LOCK_WAIT_S):
            (self.root / INDEX_FILE).unlink(missing_ok=True)
        return self.list()

    # ---- checking

    def verify(self, record: EngineRecord, arch: str, backend_version: str) -> None:
        """Raise :class:`EngineError` unless ``record`` can be loaded here, files intact.

        Checks arch, backend version and spec version, status, presence, size, then the
        checksum (streamed; seconds per GB).

        >>> cache.verify(record, arch="sm89", backend_version="10.5.0")  # doctest: +SKIP
        """
        folder = self.engine_dir(record.name)
        _check_key(record, arch, backend_version, folder)
        if record.status != "ok":
            raise EngineError(
                f"Engine {record.name} is marked bad: {record.bad_reason}. "
                f"Delete {folder} and build it again."
            )
        missing = [f for f in record.files if not (folder / f).is_file()]
        if missing:
            raise EngineError(
                f"Engine {record.name} is incomplete: {', '.join(missing)} missing from {folder}. "
                "Delete the folder and build the engine again."
            )
        size = files_size(folder, record.files)
        if size != record.size_bytes:
            raise EngineError(
                f"Engine {record.name} was truncated or replaced: its files hold {size} bytes, "
                f"{record.size_bytes} were written. Delete {folder} and build it again."
            )
        if files_checksum(folder, record.files) != record.checksum:
            raise EngineError(
                f"Engine {record.name} failed its checksum: a file in {folder} is corrupt or "
                "comes from another engine. Delete the folder and build the engine again."
            )

    # ---- building

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

        >>> with cache.build_slot(key) as slot:                        # doctest: +SKIP
        ...     if slot is not None:
        ...         slot.commit(backend.build(onnx, shapes, "fp16", slot.dir, progress), shapes, 30.0)
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

    # ---- changing

    def mark_bad(self, key: EngineKey, reason: str) -> EngineRecord | None:
        """Set status "bad" with ``reason`` (meta.json and index). None if the engine is not here."""
        return self._update_record(
            key, lambda r: dataclasses.replace(r, status="bad", bad_reason=reason), INDEX_LOCK_WAIT_S
        )

    def touch(self, key: EngineKey) -> None:
        """Record a use now (for least-recently-used pruning). Never raises; a no-op if absent."""
        now = time.time()
        try:
            self._update_record(key, lambda r: dataclasses.replace(r, last_used=now), TOUCH_LOCK_WAIT_S)
        except (OSError, EngineError) as exc:
            logger.debug("could not record the use of %s: %s", key.name, exc)

    def delete(self, name_or_key: str | EngineKey, timeout: float = DEFAULT_DELETE_WAIT_S) -> bool:
        """Remove an engine's folder and index entry under its lock, then every intermediate no
        engine needs any more (:meth:`drop_unused_intermediates`). False if there was no engine.

        Works on broken folders too. ValueError for a name that is not an engine's.

        >>> cache.delete("unet.sm89.fp16.static.b2.h512.w512.t77.tensorrt-10.5.0.0123456789ab.s1")  # doctest: +SKIP
        True
        """
        existed = self._delete_engine(name_or_key, timeout)
        if existed:
            self.drop_unused_intermediates()
        return existed

    def _delete_engine(self, name_or_key: str | EngineKey, timeout: float) -> bool:
        name = _name_of(name_or_key)
        if not _is_engine_name(name):
            raise InvalidValue(f"{name!r} is not an engine name (see `list()`); nothing deleted.")
        lock = self._acquire(name, timeout, "delete")
        try:
            folder = self.engine_dir(name)
            existed = folder.exists() or folder.is_symlink()
            if existed:
                trash = self.root / f".trash-{name}-{os.getpid()}"
                os.replace(folder, trash)
                _remove_tree(trash)
            self._update_index_best_effort()  # drops the entry: its folder is gone
            return existed
        finally:
            lock.release()

    def prune(
        self, max_bytes: int | None = None, older_than_s: float | None = None, *, now: float | None = None
    ) -> builtins.list[EngineRecord]:
        """Delete engines unused for ``older_than_s``, then bring what the cache holds on disk
        (engines plus intermediates, :meth:`disk_usage`) to at most ``max_bytes``: first the
        intermediates kept for engines that stay (an engine runs without them), least recently
        used engines' first, then least-recently-used engines. Intermediates no engine needs
        any more are always removed. Returns the deleted engine records. Skips an engine that is
        being built and whatever a running build may read; never touches broken folders or
        other modules' folders. Also removes temp folders left by dead builds.

        >>> from sd_accel.units import parse_age, parse_size
        >>> cache.prune(max_bytes=parse_size("20GB"), older_than_s=parse_age("30d"))  # doctest: +SKIP
        """
        if max_bytes is not None and max_bytes < 0:
            raise InvalidValue(f"max_bytes must be >= 0, not {max_bytes}")
        now = time.time() if now is None else now
        records = sorted(self.list(), key=lambda r: r.last_used)
        victims = [r for r in records if older_than_s is not None and now - r.last_used > older_than_s]
        removed = [r for r in victims if self._delete_if_free(r.name)]
        self.drop_unused_intermediates()
        if max_bytes is not None:
            removed += self._prune_to(max_bytes)
        self._remove_dead_leftovers()
        return removed

    def _prune_to(self, max_bytes: int) -> builtins.list[EngineRecord]:
        usage = self.disk_usage()
        if usage.total_bytes <= max_bytes:
            return []
        records = sorted(self.list(), key=lambda r: r.last_used)
        # intermediates kept for engines that stay: those of the least recently used engines first
        last_use = {r.name: r.last_used for r in records}
        kept = sorted((i for i in usage.intermediates if i.engines and not i.building),
                      key=lambda i: max(last_use.get(n, 0.0) for n in i.engines))
        total = usage.total_bytes
        for item in kept:
            if total <= max_bytes:
                return []
            total -= sum(i.size_bytes for i in self._drop(lambda i, name=item.name: i.name == name and not i.building))
        removed = []
        for record in records:
            if total <= max_bytes:
                break
            if self._delete_if_free(record.name):
                removed.append(record)
                total -= record.size_bytes
                total -= sum(i.size_bytes for i in self.drop_unused_intermediates())
        return removed

    def _delete_if_free(self, name: str) -> bool:
        try:
            return self._delete_engine(name, timeout=0)
        except EngineError as exc:
            logger.warning("prune skipped %s: %s", name, exc)
            return False

    def _remove_dead_leftovers(self) -> None:
        for entry in self._hidden_leftovers():
            name = _LEFTOVER.match(entry.name)["name"]  # type: ignore[index]
            with contextlib.suppress(EngineError):
                lock = self._acquire(name, 0, "clean")
                try:
                    self._remove_leftovers(name)
                finally:
                    lock.release()

    # ---- locks

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

    # ---- index

    def _snapshot(self) -> _Snapshot:
        """Records as on disk; rewrites the index (under its lock) when it is out of step."""
        snap = self._compute()
        if snap.changes:
            try:
                with self._index_lock(INDEX_LOCK_WAIT_S):
                    snap = self._compute()
                    if snap.changes:
                        self._write_index(snap.records)
            except (OSError, EngineError) as exc:
                logger.warning("engine index %s not rewritten: %s", self.root / INDEX_FILE, exc)
            for change in snap.changes:
                logger.warning("engine index %s rebuilt: %s", self.root / INDEX_FILE, change)
        self._report_broken(snap.broken)
        return snap

    def _compute(self) -> _Snapshot:
        """Merge the index with the folders (meta.json wins for anything the index lacks)."""
        folders = self._engine_folders()
        index, problem = self._read_index()
        if problem and not folders:
            return _Snapshot({}, [], [])
        changes = [problem] if problem else []
        records = {n: r for n, r in index.items() if n in folders}
        dropped = sorted(set(index) - folders)
        if dropped:
            changes.append(f"dropped {len(dropped)} entries whose folder is gone: {', '.join(dropped)}")
        broken: list[BrokenEngine] = []
        added: list[str] = []
        for name in sorted(folders - set(records)):
            got = self._read_meta(name)
            if isinstance(got, BrokenEngine):
                broken.append(got)
            else:
                records[name] = got
                added.append(name)
        if added and not problem:
            changes.append(f"added {len(added)} engines found on disk: {', '.join(added)}")
        return _Snapshot(records, broken, changes)

    def _engine_folders(self) -> set[str]:
        """Names of top-level folders that are (or claim to be) engines."""
        if not self.root.is_dir():
            return set()
        return {p.name for p in self.root.iterdir() if p.is_dir() and _is_engine_name(p.name)}

    def _read_index(self) -> tuple[dict[str, EngineRecord], str | None]:
        """Index entries, and why the index was not usable (None when it was)."""
        path = self.root / INDEX_FILE
        if not path.exists():
            return {}, f"{INDEX_FILE} missing; read every meta.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return {}, f"{INDEX_FILE} unreadable ({exc}); read every meta.json"
        if not isinstance(data, dict) or data.get("schema") != INDEX_SCHEMA:
            schema = data.get("schema") if isinstance(data, dict) else None
            return {}, f"{INDEX_FILE} has schema {schema!r}, not {INDEX_SCHEMA}; read every meta.json"
        entries: dict[str, EngineRecord] = {}
        for name, meta in dict(data.get("engines") or {}).items():
            with contextlib.suppress(ValueError, TypeError):
                record = EngineRecord.from_dict(meta)
                if record.name == name:
                    entries[name] = record
        return entries, None

    def _read_meta(self, name: str) -> EngineRecord | BrokenEngine:
        folder = self.root / name
        try:
            data = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
            record = EngineRecord.from_dict(data)
        except FileNotFoundError:
            return BrokenEngine(name, folder, f"no {META_FILE} (an interrupted copy or delete?)")
        except (OSError, ValueError, TypeError) as exc:
            return BrokenEngine(name, folder, f"{META_FILE} unreadable: {exc}")
        if record.name != name:
            return BrokenEngine(name, folder, f"{META_FILE} describes {record.name} (folder renamed?)")
        return record

    def _write_index(self, records: dict[str, EngineRecord]) -> None:
        """Write the index; on failure remove it, so that the next read rebuilds it. Never raises OSError."""
        data = {"schema": INDEX_SCHEMA, "engines": {n: records[n].to_dict() for n in sorted(records)}}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.root / INDEX_FILE, data)
        except OSError as exc:
            logger.warning("could not write %s (%s); it will be rebuilt from the folders", INDEX_FILE, exc)
            with contextlib.suppress(OSError):
                (self.root / INDEX_FILE).unlink(missing_ok=True)

    def _update_index_best_effort(self, put: dict[str, EngineRecord] | None = None) -> None:
        """Write the index from the folders plus ``put``; a failure only delays it to the next read."""
        try:
            with self._index_lock(INDEX_LOCK_WAIT_S):
                records = self._compute().records
                records.update(put or {})
                self._write_index(records)
        except (OSError, EngineError) as exc:
            logger.warning("%s; the index will be rebuilt from the folders", exc)

    def _update_record(
        self, key: EngineKey, change: Callable[[EngineRecord], EngineRecord], lock_wait: float
    ) -> EngineRecord | None:
        """Change one record in its meta.json, then in the index, under the index lock."""
        if not (self.root / key.name).is_dir():
            return None
        with self._index_lock(lock_wait):
            current = self._read_meta(key.name)
            if isinstance(current, BrokenEngine) or current.key != key:
                return None
            record = change(current)
            write_json_atomic(self.root / key.name / META_FILE, {"schema": INDEX_SCHEMA, **record.to_dict()})
            records = self._compute().records
            records[key.name] = record
            self._write_index(records)
            return record

    def _report_broken(self, broken: builtins.list[BrokenEngine]) -> None:
        for item in broken:
            if item.name not in self._warned:
                self._warned.add(item.name)
                logger.warning(
                    "engine folder %s is not usable: %s. Delete it (or build that engine again).",
                    item.path,
                    item.reason,
                )


# --------------------------------------------------------------------------- small helpers


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
