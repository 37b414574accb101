"""The engines of one component and the choice of one per call, on the call's real shapes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sd_accel.core import EngineError, ShapeRanges, covers, distance
from sd_accel.runtime.stats import ComponentStats

log = logging.getLogger("sd_accel")


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
    broken: str | None = None
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
            self.runner = self.backend.load(self.cache.root / self.name, list(self.record.files), self.shapes)
            self.cache.touch(self.record.key)
        return self.runner


# Among engines that cover a call equally well, the faster precision goes first.
_PRECISION_RANK = {"int8": 0, "int8-dynamic": 1, "fp16": 2, "bf16": 3, "fp32": 4}


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
        self.stats = ComponentStats()

    def set_fallback(self, allowed: bool) -> None:
        """On: a call no engine covers runs torch (counted, said once). Off: it raises EngineError."""
        self.fallback_allowed = bool(allowed)

    def reset_stats(self) -> ComponentStats:
        """Start new counters (a new job); returns the old ones."""
        old, self.stats = self.stats, ComponentStats()
        return old

    def subset(self, keep: Callable[[EngineHandle], bool]) -> ComponentEngines:
        """The engines ``keep`` accepts, with this one's fallback, preference and counters (the
        counters are shared: calls served by either count in one place)."""
        part = ComponentEngines(self.component, [h for h in self.handles if keep(h)], self.fallback_allowed,
                                self.prefer_precision)
        part.stats = self.stats
        return part

    def close(self) -> None:
        """Drop loaded runners (TensorRT engines hold GPU memory); a later call loads them again."""
        for handle in self.handles:
            if handle.runner is not None:
                handle.runner.close()
                handle.runner = None

    def _order(self, handle: EngineHandle, feed: dict[str, torch.Tensor]) -> tuple:
        precision = handle.record.key.precision
        return (self.prefer_precision is not None and precision != self.prefer_precision,
                not handle.static, distance(handle.shapes, feed), _PRECISION_RANK.get(precision, 9))

    def run(self, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Engine outputs for ``feed``, or None when the caller must run torch (already counted)."""
        live = [h for h in self.handles if h.broken is None]
        candidates = sorted((h for h in live if covers(h.shapes, feed)), key=lambda h: self._order(h, feed))
        if not candidates:
            got = ", ".join(f"{k}={tuple(v.shape)}" for k, v in feed.items())
            reason = (f"no engine covers {got}" if live else "no usable engine for this model")
            return self._fallback(reason)
        failures = []
        for handle in candidates:  # a broken engine hands the call to the next one that covers it
            try:
                out = handle.get_runner().infer(feed)
            except Exception as exc:  # an engine failing at run time must not end the image
                failures.append(self._broken(handle, exc))
                continue
            self.stats.engine(handle.name)
            return out
        return self._fallback("; ".join(failures))

    def _broken(self, handle: EngineHandle, exc: Exception) -> str:
        reason = str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
        handle.broken = reason
        log.error("%s: engine %s failed and is marked bad: %s", self.component, handle.name, reason)
        # Arch and version mismatches never reach here (the loader refuses them), so what fails now
        # is the engine itself: a bad checksum, a load or a run error.
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
