"""The cache's index: reading the engines (list, get, find, broken), the index file rebuilt
from the engine folders' ``meta.json`` whenever it is missing or out of step, and record updates
(mark bad, last use), each under the index lock."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..core import EngineError
from .folder import (
    INDEX_FILE,
    INDEX_LOCK_WAIT_S,
    INDEX_SCHEMA,
    TOUCH_LOCK_WAIT_S,
    CacheFolder,
    _check_key,
    _is_engine_name,
    logger,
)
from .key import EngineKey
from .record import (
    META_FILE,
    BrokenEngine,
    EngineRecord,
    files_checksum,
    files_size,
    write_json_atomic,
)


@dataclass
class _Snapshot:
    records: dict[str, EngineRecord]
    broken: list[BrokenEngine]
    changes: list[str]  # what differs from the index on disk; empty when it is up to date


class EngineIndex(CacheFolder):
    """The cache's index: reading the engines (list, get, find, broken), the index file rebuilt"""

    # A part of EngineCache (the facade in store.py): its methods call the other parts'
    # through ``self``.

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

        ``cache.find(component="unet", backend="onnxruntime")``: the example of
        :mod:`sd_accel.cache.store` runs it.
        """
        wanted = {"model": model, "component": component, "backend": backend, "arch": arch}
        return [r for r in self.list() if all(v is None or getattr(r.key, k) == v for k, v in wanted.items())]

    def broken(self) -> builtins.list[BrokenEngine]:
        """Engine folders whose meta.json is missing or unreadable; left for the user to delete."""
        return self._snapshot().broken

    def total_size(self) -> int:
        """Bytes on disk of engine files in listed engines (meta.json and broken folders not
        counted; a weight file shared by several engines counted once). What the cache holds on
        disk in all, intermediates included: :meth:`disk_usage`."""
        from .shared import unique_bytes

        return unique_bytes(self.engine_dir(r.name) / f for r in self.list() for f in r.files)

    def rebuild_index(self) -> builtins.list[EngineRecord]:
        """Forget the index and write it again from the folders' meta.json files."""
        with self._index_lock(INDEX_LOCK_WAIT_S):
            (self.root / INDEX_FILE).unlink(missing_ok=True)
        return self.list()

    def verify(self, record: EngineRecord, arch: str, backend_version: str) -> None:
        """Raise :class:`EngineError` unless ``record`` can be loaded here, files intact.

        Checks arch, backend version and spec version, status, presence, size, then the
        checksum (streamed; seconds per GB).

        ``cache.verify(record, arch="sm89", backend_version="10.5.0")``: the example of
        :mod:`sd_accel.cache.store` runs it.
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
