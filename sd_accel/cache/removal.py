"""Removing engines: delete one, prune by age or size, and clear what crashed builds left."""

from __future__ import annotations

import builtins
import contextlib
import os
import time

from ..core import EngineError, InvalidValue
from .folder import (
    _LEFTOVER,
    DEFAULT_DELETE_WAIT_S,
    CacheFolder,
    _is_engine_name,
    _name_of,
    _remove_tree,
    logger,
)
from .key import EngineKey
from .record import (
    EngineRecord,
)
from .refits import RefitCopy, remove_copies, remove_stale


class Removal(CacheFolder):
    """Removing engines: delete one, prune by age or size, and clear what crashed builds left."""

    # A part of EngineCache (the facade in store.py): its methods call the other parts'
    # through ``self``.

    def delete(self, name_or_key: str | EngineKey, timeout: float = DEFAULT_DELETE_WAIT_S) -> bool:
        """Remove an engine's folder and index entry under its lock, then every intermediate no
        engine needs any more (:meth:`drop_unused_intermediates`) and the shared weights no engine
        links any more (:meth:`drop_orphan_weights`: weights another engine shares stay). False if
        there was no engine.

        Works on broken folders too. ValueError for a name that is not an engine's.

        ``cache.delete("unet.sm89.fp16.static.b2.h512.w512.t77.tensorrt-10.5.0.0123456789ab.s1")`` -> True:
        the example of :mod:`sd_accel.cache.store` runs it.
        """
        existed = self._delete_engine(name_or_key, timeout)
        if existed:
            self.drop_unused_intermediates()
            self.drop_orphan_weights()
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
        any more are always removed, and so are shared weight files no engine links any more
        (:mod:`sd_accel.cache.shared`). A weight file several engines share counts once, and is
        freed with the last of them; engines from before that layout get their weight files shared
        first (:meth:`share_existing`). Returns the deleted engine records. Skips an engine that is
        being built and whatever a running build may read; never touches broken folders or
        other modules' folders. Also removes temp folders left by dead builds, and the refit
        copies of processes that are gone (:mod:`sd_accel.cache.refits`; those of running
        processes are removed by :meth:`drop_refit_copies`, ``sd-accel prune --refit-copies``).

        >>> import tempfile
        >>> from sd_accel.cache.store import EngineCache
        >>> from sd_accel.units import parse_age, parse_size
        >>> cache = EngineCache(tempfile.mkdtemp())                   # e.g. EngineCache("engines")
        >>> cache.prune(max_bytes=parse_size("20GB"), older_than_s=parse_age("30d"))   # the deleted records
        []
        """
        if max_bytes is not None and max_bytes < 0:
            raise InvalidValue(f"max_bytes must be >= 0, not {max_bytes}")
        now = time.time() if now is None else now
        remove_stale(self.root)
        self.share_existing()
        records = sorted(self.list(), key=lambda r: r.last_used)
        victims = [r for r in records if older_than_s is not None and now - r.last_used > older_than_s]
        removed = [r for r in victims if self._delete_if_free(r.name)]
        self.drop_unused_intermediates()
        self.drop_orphan_weights()
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
                self.drop_unused_intermediates()
                self.drop_orphan_weights()
                total = self.disk_usage().total_bytes  # weights another engine shares were not freed
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

    def drop_refit_copies(self, in_use_too: bool = True) -> builtins.list[RefitCopy]:
        """Remove the LoRA refits' engine copies under ``<root>/.refit``: every one (a running host
        keeps the engines it loaded and refits again when it needs another), or with
        ``in_use_too=False`` those of processes that are gone. Returns them."""
        return remove_copies(self.root) if in_use_too else remove_stale(self.root)
