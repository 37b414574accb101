"""The engines of one component and the choice of one per call, on the call's real shapes.

What a failing engine costs depends on whose fault it is (:func:`classify`):

- the engine's own (a checksum mismatch, a load or deserialize error, inputs or outputs other
  than its record says: :class:`~sd_accel.core.EngineFault`, or anything while loading): it is
  marked bad in the cache and never loaded again until rebuilt;
- not the engine's (out of memory, a call the runner refuses, another run-time error): it is
  skipped for that call only, counted in ``stats`` with the reason and said once; the cache is
  left as it was and later calls use it again. An engine whose calls fail
  :data:`SUSPEND_AFTER` times in a row with errors that are not out-of-memory is set aside
  for the rest of the process, still without touching the cache;
- an interrupt (``KeyboardInterrupt``) is never caught: it ends the call as it would in torch.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sd_accel.backends.chain import load_engine
from sd_accel.core import EngineError, EngineFault, ShapeRanges, covers, distance
from sd_accel.runtime.coverage import uncovered
from sd_accel.runtime.stats import ComponentStats

log = logging.getLogger("sd_accel")

REFIT_CLOSED = "its refit was closed: run refit_engines(pipe) again"
SUSPEND_AFTER = 3  # consecutive unexplained run-time failures before an engine is set aside (this process)

# Out of memory as each library words it: ONNX Runtime ("Failed to allocate memory for requested
# buffer", "bad_alloc"), OpenVINO ("std::bad_alloc"), torch ("DefaultCPUAllocator: can't allocate
# memory", "CUDA out of memory"), TensorRT and CUDA ("out of memory"), the OS ("Cannot allocate memory").
_OOM = re.compile(r"out of memory|bad[_ ]alloc|failed to allocate|can't allocate|cannot allocate|outofmemory",
                  re.IGNORECASE)


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says memory ran out."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError) or _OOM.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def reason_text(exc: BaseException, limit: int = 240) -> str:
    """One line saying why a call or a build failed, for stats and logs."""
    text = str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def classify(exc: Exception, stage: str) -> tuple[str, str]:
    """``(kind, reason)`` for an engine failure while ``stage`` (``"load"`` or ``"infer"``).

    kind ``"fault"``: the engine's own, mark it bad; ``"oom"``: out of memory, skip it for this
    call; ``"skip"``: anything else at run time, skip it for this call (and count towards
    :data:`SUSPEND_AFTER`).

    >>> classify(MemoryError(), "infer")[0], classify(EngineFault("bad outputs"), "infer")[0]
    ('oom', 'fault')
    >>> classify(EngineError("Could not deserialize"), "load")[0], classify(ValueError("x"), "infer")[0]
    ('fault', 'skip')
    """
    if out_of_memory(exc):
        return "oom", f"out of memory ({reason_text(exc)})"
    if stage == "load" or isinstance(exc, EngineFault):
        return "fault", reason_text(exc)
    return "skip", reason_text(exc)


def _shape_tuple(shapes) -> ShapeRanges:
    return {k: tuple(tuple(int(d) for d in s) for s in v) for k, v in shapes.items()}


@dataclass
class EngineHandle:
    """One cached engine, loaded on first use (only the profiles a job really hits are loaded)."""

    record: object  # cache.record.EngineRecord
    backend: object
    cache: object
    arch: str
    backend_version: str
    runner: object | None = None
    broken: str | None = None  # why it is not used any more (this process; faults are in the cache too)
    failures: int = 0  # run-time failures in a row (reset by a good call)
    refit: object | None = None  # the runner refit_engines made (this process); the cache keeps the base engine
    shapes: ShapeRanges = field(init=False)

    def __post_init__(self) -> None:
        self.shapes = _shape_tuple(self.record.shapes)

    @property
    def name(self) -> str:
        return self.record.key.name

    @property
    def static(self) -> bool:
        return all(lo == hi for lo, _, hi in self.shapes.values())

    def get_runner(self):
        if self.runner is None:
            self.cache.verify(self.record, self.arch, self.backend_version)
            self.runner = load_engine(self.backend, self.cache.root / self.name, list(self.record.files),
                                      self.shapes, streaming=None)
            self.cache.touch(self.record.key)
        return self.runner


# Among engines that cover a call equally well, the faster precision goes first.
_PRECISION_RANK = {"int4": 0, "int8": 1, "int8-dynamic": 2, "fp16": 3, "bf16": 4, "fp32": 5}


class ComponentEngines:
    """Chooses, for each call, a covering engine: the preferred precision (when one is set) first,
    then static ones, then the nearest to opt, then the faster precision.

    Made by :func:`sd_accel.runtime.loader.engines_for`. ``fallback_allowed`` (switch it with
    :meth:`set_fallback`): a call no engine covers runs torch, else raises. ``stats`` counts
    where the calls went.
    """

    def __init__(self, component: str, handles: list[EngineHandle], fallback: bool = True,
                 prefer_precision: str | None = None) -> None:
        self.component = component
        self.handles = handles
        self.fallback_allowed = fallback
        self.prefer_precision = prefer_precision
        self._stats = ComponentStats()
        self._counts_in: ComponentEngines | None = None
        self._also: list[ComponentEngines] = []  # engines counting in this one (count_in)
        self.model: str | None = None  # the weights id the engines were found for (engines_for sets it)
        # engines="auto": called with (self, feed) when no engine covers a call; returns a new
        # handle that covers it, or the reason the call runs torch (see sd_accel.autobuild).
        self.builder: Callable[[ComponentEngines, dict[str, torch.Tensor]], EngineHandle | str] | None = None

    @property
    def stats(self) -> ComponentStats:
        """Where the calls went; those of another component's engines when :meth:`count_in` said so."""
        return self._counts_in.stats if self._counts_in is not None else self._stats

    @stats.setter
    def stats(self, value: ComponentStats) -> None:
        self._stats = value

    def count_in(self, other: ComponentEngines) -> None:
        """Count this one's calls in ``other``'s stats (now and after ``other.reset_stats()``): the
        WebUI's and ComfyUI's engines serving a pipeline's UNet count as the UNet's calls."""
        self._counts_in = other
        other._also.append(self)

    def covering(self, feed: dict[str, torch.Tensor]) -> list[EngineHandle]:
        """The usable engines whose profile covers ``feed`` (nothing is loaded or counted)."""
        return [h for h in self.handles if h.broken is None and covers(h.shapes, feed)]

    def set_fallback(self, allowed: bool) -> None:
        """On: a call no engine covers runs torch (counted, said once). Off: it raises EngineError."""
        self.fallback_allowed = bool(allowed)

    def reset_stats(self) -> ComponentStats:
        """Start new counters (a new job); returns the old ones."""
        old, self._stats = self._stats, ComponentStats()
        return old

    def subset(self, keep: Callable[[EngineHandle], bool]) -> ComponentEngines:
        """The engines ``keep`` accepts, with this one's fallback, preference and counters (the
        counters are shared: calls served by either count in one place)."""
        part = ComponentEngines(self.component, [h for h in self.handles if keep(h)], self.fallback_allowed,
                                self.prefer_precision)
        part.stats = self.stats
        part.model = self.model
        return part

    def close(self) -> None:
        """Drop loaded runners (TensorRT engines hold GPU memory); a later call loads them again."""
        for handle in self.handles:
            if handle.runner is not None:
                handle.runner.close()
                handle.runner = None
            if handle.refit is not None:  # loading again would bring back the weights it was built with
                handle.refit = None
                handle.broken = REFIT_CLOSED

    def _order(self, handle: EngineHandle, feed: dict[str, torch.Tensor]) -> tuple:
        precision = handle.record.key.precision
        return (self.prefer_precision is not None and precision != self.prefer_precision,
                not handle.static, distance(handle.shapes, feed), _PRECISION_RANK.get(precision, 9))

    def run(self, feed: dict[str, torch.Tensor], need: tuple[str, ...] = (),
            check: Callable[[dict[str, torch.Tensor]], str | None] | None = None,
            infer: Callable[[Any, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
            ) -> dict[str, torch.Tensor] | None:
        """Engine outputs for ``feed``, or None when the caller must run torch (already counted).

        ``need``: output names the caller reads; an engine without them is at fault.
        ``check``: the caller's test of the outputs (a reason to run torch, or None); the call is
        counted on the engine only after it passes, so a rejected output is one torch call.
        ``infer(runner, feed)``: runs the chosen engine instead of ``runner.infer`` (a step cache
        runs a chained engine's segments itself: :mod:`sd_accel.runtime.step_cache`).
        """
        live = [h for h in self.handles if h.broken is None]
        candidates = sorted((h for h in live if covers(h.shapes, feed)), key=lambda h: self._order(h, feed))
        if not candidates and self.builder is not None:
            built = self.builder(self, feed)
            if isinstance(built, str):
                return self._fallback(built)
            candidates = [built]
        if not candidates:
            others = [h for e in self._also for h in e.handles if h.broken is None]
            reason = uncovered(feed, live + others) if live or others else "no usable engine for this model"
            return self._fallback(reason)
        failures: list[str] = []
        skipped: list[tuple[str, str]] = []
        for handle in candidates:  # a failing engine hands the call to the next one that covers it
            stage = "load"
            try:
                runner = handle.get_runner()
                stage = "infer"
                out = runner.infer(feed) if infer is None else infer(runner, feed)
                missing = [n for n in need if n not in out]
                if missing:
                    raise EngineFault(f"engine {handle.name} returned {sorted(out)}, without {missing}")
            except Exception as exc:  # an engine failing must not end the image (interrupts do)
                failures.append(self._failed(handle, exc, stage, skipped))
                continue
            handle.failures = 0
            rejected = check(out) if check is not None else None
            if rejected is not None:
                for name, reason in skipped:  # the fallback's warning says it
                    self.stats.skip(self.component, name, reason, warn=False)
                return self._fallback(rejected)
            for name, reason in skipped:  # served after all: say why the others were passed over
                self.stats.skip(self.component, name, reason, warn=True)
            self.stats.engine(handle.name)
            return out
        for name, reason in skipped:  # the fallback's warning says it
            self.stats.skip(self.component, name, reason, warn=False)
        return self._fallback("; ".join(failures))

    def _failed(self, handle: EngineHandle, exc: Exception, stage: str, skipped: list[tuple[str, str]]) -> str:
        kind, reason = classify(exc, stage)
        if kind == "fault":
            return self._fault(handle, reason)
        if kind == "skip":
            handle.failures += 1
            if handle.failures >= SUSPEND_AFTER:
                handle.broken = reason
                log.error("%s: engine %s failed %d calls in a row and is set aside until this process ends "
                          "(the cache keeps it): %s", self.component, handle.name, handle.failures, reason)
        skipped.append((handle.name, reason))
        return f"engine {handle.name} skipped for this call (still in use for the next): {reason}"

    def _fault(self, handle: EngineHandle, reason: str) -> str:
        handle.broken = reason
        log.error("%s: engine %s failed and is marked bad: %s", self.component, handle.name, reason)
        # Arch and version mismatches never reach here (the loader refuses them), so what fails
        # is the engine itself: a bad checksum, a load error, I/O other than its record says.
        try:
            handle.cache.mark_bad(handle.record.key, reason)
        except Exception as mark_exc:  # the index may be read-only; the fallback still happens
            log.warning("could not mark %s bad in the index: %s", handle.name, mark_exc)
        return f"engine {handle.name} failed: {reason}"

    def _fallback(self, reason: str):
        if not self.fallback_allowed:
            raise EngineError(f"{self.component}: {reason}, and torch fallback is off")
        self.stats.fallback(self.component, reason)
        return None

    def torch_call(self, reason: str) -> None:
        """Count a call the module could not even offer to an engine (unsupported arguments)."""
        self._fallback(reason)
