"""The intermediates the cache keeps beside its engines (ONNX exports, calibration data): disk
use, and their removal under their locks when no engine needs them
(:mod:`sd_accel.cache.intermediates` says which)."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from filelock import FileLock, Timeout

from ..core import SPEC_VERSION, EngineError, InvalidValue
from ..paths import export_dir, export_lock
from ..units import format_size
from .folder import (
    _LEFTOVER,
    CacheFolder,
    _remove_tree,
    logger,
)
from .intermediates import ONNX_DIR, Intermediate, parse_name, paths, scan, serves
from .record import (
    EngineRecord,
)
from .refits import RefitCopy, refit_copies
from .shared import unique_bytes


@dataclass(frozen=True)
class DiskUsage:
    """What the cache holds on disk: engines and the intermediates kept beside them.

    ``cache.disk_usage().describe()`` says, e.g., ``3 engines, 1.9 GB + intermediates 3.3 GB (ONNX
    exports, calibration data) = 5.2 GB`` (the example of :mod:`sd_accel.cache.store` runs it).
    """

    engines: int
    engines_bytes: int  # on disk: a weight file shared by several engines counted once
    intermediates: tuple[Intermediate, ...]
    refit_copies: tuple[RefitCopy, ...] = ()  # LoRA refits' engine copies (sd_accel.cache.refits)
    engines_file_bytes: int | None = None  # the engines' files as each engine lists them (shared ones in each)
    orphan_weights_bytes: int = 0  # shared weights no engine links any more (delete / prune remove them)

    @property
    def intermediates_bytes(self) -> int:
        return sum(i.size_bytes for i in self.intermediates)

    @property
    def refit_bytes(self) -> int:
        return sum(c.size_bytes for c in self.refit_copies)

    @property
    def total_bytes(self) -> int:
        return self.engines_bytes + self.orphan_weights_bytes + self.intermediates_bytes + self.refit_bytes

    @property
    def shared_bytes(self) -> int:
        """What sharing weights across engines saves: their files' sizes less what is on disk."""
        files = self.engines_bytes if self.engines_file_bytes is None else self.engines_file_bytes
        return max(0, files - self.engines_bytes)

    def describe(self) -> str:
        """One line for faces: engines, intermediates and the total."""
        line = f"{self.engines} engine{'s' if self.engines != 1 else ''}, {format_size(self.engines_bytes)}"
        if self.shared_bytes:
            line += f" (weights shared across engines: {format_size(self.shared_bytes)} not stored twice)"
        if self.orphan_weights_bytes:
            line += f" + weights no engine holds {format_size(self.orphan_weights_bytes)} (removed by delete/prune)"
        if self.intermediates:
            unused = sum(i.size_bytes for i in self.intermediates if i.unused)
            line += (f" + intermediates {format_size(self.intermediates_bytes)} (ONNX exports, calibration data"
                     + (f"; {format_size(unused)} unused, removed by delete/prune" if unused else "") + ")")
        if self.refit_copies:
            stale = sum(c.size_bytes for c in self.refit_copies if c.stale)
            line += (f" + refit copies {format_size(self.refit_bytes)} (LoRA refits"
                     + (f"; {format_size(stale)} left by ended processes, removed by prune" if stale else "")
                     + ")")
        return f"{line} = {format_size(self.total_bytes)}"


class KeptIntermediates(CacheFolder):
    """The intermediates the cache keeps beside its engines (ONNX exports, calibration data): disk"""

    # A part of EngineCache (the facade in store.py): its methods call the other parts'
    # through ``self``.

    def intermediates(self) -> builtins.list[Intermediate]:
        """Every ONNX export and calibration file under the root, with the engines it is kept for."""
        return scan(self.root, self.list(), self._components_building())

    def disk_usage(self) -> DiskUsage:
        """Engines plus intermediates: what ``list``, the panel and the WebUI API count. A weight
        file several engines share (:mod:`sd_accel.cache.shared`) counts once."""
        records = self.list()
        files = [self.engine_dir(r.name) / f for r in records for f in r.files]
        return DiskUsage(len(records), unique_bytes(files), tuple(scan(self.root, records, self._components_building())),
                         refit_copies=tuple(refit_copies(self.root)),
                         engines_file_bytes=sum(r.size_bytes for r in records),
                         orphan_weights_bytes=self.orphan_weights_bytes())

    def refit_copies(self) -> builtins.list[RefitCopy]:
        """The LoRA refits' engine copies under ``<root>/.refit`` (:mod:`sd_accel.cache.refits`)."""
        return refit_copies(self.root)

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
