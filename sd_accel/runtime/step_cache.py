"""A first-block step cache for the transformer families' engines (issue 44, part 4; opt-in:
``AccelConfig(step_cache=<threshold>)``), the rule of ComfyUI's First-Block Cache (WaveSpeed,
ParaAttention) on a chained engine cut for it (:func:`sd_accel.components.segments.step_cache_plan`).

Each call runs the first segment (the embeddings and the first block), which also gives the first
block's residual ``r`` (its image tokens out minus in). When ``mean|r - r_full| / mean|r_full|``
is below the threshold, ``r_full`` being the residual of the last step computed in full, the
blocks after the first are skipped: their residual from that step (the image tokens before the
final projection minus the first block's output) is added to this step's first-block output, and
only the final norm and projection run. Otherwise every segment runs and the residuals are kept.

Never cached: the first :attr:`StepCacheRule.full_first` steps of a generation and its last
:attr:`StepCacheRule.full_last`, a step the pipeline's scheduler cannot place, and the first call
after a call that ran elsewhere (torch, another engine). The state is kept per stream of calls
(:func:`stream_key`: the shapes and the text conditioning), so FLUX.1's true CFG, which calls the
transformer twice a step with two prompts, never mixes its halves; SD3's CFG is one batch of two
and one stream. A new generation (the scheduler's ``set_timesteps``) starts from nothing.

With threshold 0 nothing is cached (the relative change is never below 0) and the outputs are
those of the engine run whole. How many calls reused the residual is logged at each generation's
last step and counted in ``stats(pipe)["transformer"]["step_cache"]``.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sd_accel.components.segments import FIRST_RESIDUAL
from sd_accel.core import InvalidValue

log = logging.getLogger("sd_accel")

MAX_STREAMS = 4  # streams kept per generation (FLUX.1's true CFG: 2); the oldest goes first


@dataclass(frozen=True)
class StepCacheRule:
    """When a step may reuse the cached residual. ``threshold``: the first block's residual may
    have changed by less than this (relative, mean absolute) since the last step computed in full
    (0.08-0.12 are ComfyUI users' usual values for FLUX.1; 0 caches nothing); ``full_first``,
    ``full_last``: the steps at each end of a generation always computed in full."""

    threshold: float
    full_first: int = 2
    full_last: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float) \
                or not math.isfinite(self.threshold) or self.threshold < 0:
            raise InvalidValue(f"step cache threshold {self.threshold!r}: a finite number >= 0")
        if self.full_first < 1 or self.full_last < 1:
            raise InvalidValue("a step cache computes at least the first and the last step in full")


@dataclass(frozen=True)
class StepPosition:
    """Where a call sits in its generation: ``index`` of ``total`` steps; ``generation`` changes
    with each new schedule (the scheduler's ``set_timesteps``)."""

    index: int
    total: int
    generation: int


def scheduler_position(pipe) -> Callable[[], StepPosition | None]:
    """The position of the current call in ``pipe``'s schedule, read from its scheduler (the one
    on the pipeline at call time: a sampler set later counts). None when the scheduler does not
    say (no ``timesteps`` or ``step_index``): such calls are computed in full."""
    ref = weakref.ref(pipe)

    def position() -> StepPosition | None:
        pipe = ref()
        scheduler = getattr(pipe, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        if timesteps is None or not hasattr(scheduler, "step_index"):
            return None
        index = scheduler.step_index
        begin = getattr(scheduler, "begin_index", None) or 0
        # (step_index is None until the first scheduler.step: the first step of the schedule, or of
        # an img2img run's part of it, which starts at begin_index)
        index = begin if index is None else int(index)
        return StepPosition(index - begin, len(timesteps) - begin, id(timesteps))

    return position


def stream_key(hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
               pooled_projections: torch.Tensor) -> tuple:
    """What tells one stream of calls from another within a generation: the shapes, and sums of the
    text conditioning (FLUX.1's true CFG calls with the prompt's and the negative prompt's)."""
    return (tuple(hidden_states.shape), tuple(encoder_hidden_states.shape),
            float(pooled_projections.double().sum()), float(encoder_hidden_states.double().sum()))


@dataclass
class _Stream:
    first: torch.Tensor | None = None  # the first block's residual at the last step computed in full
    rest: torch.Tensor | None = None  # the other blocks' residual then
    last_index: int | None = None


@dataclass
class StepCacheStats:
    """``calls`` / ``cached``: transformer calls through the step cache and those that reused the
    residual (since the counters were reset); ``last_generation``: the same for the last one."""

    calls: int = 0
    cached: int = 0
    last_generation: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"calls": self.calls, "cached": self.cached, "last_generation": dict(self.last_generation)}


class StepCache:
    """The rule and state of one transformer's step cache (see the module's doc)."""

    def __init__(self, rule: StepCacheRule, position: Callable[[], StepPosition | None]) -> None:
        self.rule = rule
        self.position = position
        self.stats = StepCacheStats()
        self._streams: dict[tuple, _Stream] = {}
        self._generation: int | None = None
        self._said: set[str] = set()
        # the first block's relative change at each call of this generation that had one to compare
        # (step index, change): what a threshold would have to be to cache that step
        self.changes: list[tuple[int, float]] = []
        self._generation_counts = {"calls": 0, "cached": 0}  # every stream's, this generation

    def reset(self) -> None:
        """Forget every stream (the next call of each is computed in full)."""
        self._streams.clear()
        self._generation = None
        self._generation_counts = {"calls": 0, "cached": 0}

    def say_once(self, key: str, message: str, *args) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(message, *args)

    def interrupted(self, key: tuple) -> None:
        """A call of stream ``key`` ran elsewhere (torch, an engine not cut for the cache): its
        next call is computed in full."""
        stream = self._streams.get(key)
        if stream is not None:
            stream.first = stream.rest = None

    def _stream(self, key: tuple, where: StepPosition) -> _Stream:
        if where.generation != self._generation:
            self._streams.clear()
            self.changes = []
            self._generation_counts = {"calls": 0, "cached": 0}
            self._generation = where.generation
        stream = self._streams.pop(key, None) or _Stream()
        self._streams[key] = stream  # (most recent last)
        while len(self._streams) > MAX_STREAMS:
            self._streams.pop(next(iter(self._streams)))
        return stream

    def infer(self, runner, feed: dict[str, torch.Tensor], key: tuple) -> dict[str, torch.Tensor]:
        """The outputs of ``runner`` (a :class:`~sd_accel.backends.chain.ChainRunner` of a
        step-cache plan) for ``feed``: the whole chain, or its first and last segment and the
        cached residual."""
        if not cut_for_step_cache(runner):
            self.interrupted(key)
            return runner.infer(feed)
        where = self.position()
        if where is None:
            self.say_once("position", "step cache: the pipeline's scheduler does not say which step a call is "
                          "(no timesteps / step_index): every step runs in full")
            self.interrupted(key)
            return runner.infer(feed)
        stream = self._stream(key, where)
        links = runner.links
        head = runner.run_links(feed, 0, 1)
        first = head[FIRST_RESIDUAL]
        hidden = head["hidden"]
        change = None
        if stream.first is not None and stream.rest is not None and stream.first.shape == first.shape:
            change = relative_change(first, stream.first)
            self.changes.append((where.index, round(change, 5)))
        reuse = (change is not None and change < self.rule.threshold
                 and self.rule.full_first <= where.index < where.total - self.rule.full_last
                 and stream.last_index is not None and where.index == stream.last_index + 1)
        if reuse:
            state = runner.run_links({**head, "hidden": hidden + stream.rest}, len(links) - 1, len(links))
        else:
            before = runner.run_links(head, 1, len(links) - 1)
            rest = before["hidden"] - hidden
            state = runner.run_links(before, len(links) - 1, len(links))
            stream.first, stream.rest = first.clone(), rest
        out = {name: state[given] for name, given in zip(links[-1].outputs, links[-1].gives, strict=True)}
        stream.last_index = where.index
        self.stats.calls += 1
        self.stats.cached += int(reuse)
        counts = self._generation_counts
        counts["calls"] += 1
        counts["cached"] += int(reuse)
        if where.index == where.total - 1:  # (with several streams, each one's last call: the totals so far)
            self.stats.last_generation = dict(counts)
            log.info("step cache (threshold %g): %d of %d transformer calls of this generation reused the cached "
                     "residual", self.rule.threshold, counts["cached"], counts["calls"])
        return out


def relative_change(now: torch.Tensor, then: torch.Tensor) -> float:
    """``mean|now - then| / mean|then|``: the step cache's measure of how much the first block's
    residual changed (inf when ``then`` is all zeros)."""
    base = then.abs().mean().item()
    return math.inf if base == 0 else (now - then).abs().mean().item() / base


def cut_for_step_cache(runner) -> bool:
    """Whether ``runner`` is a chained engine cut for a step cache (its first segment gives the
    first block's residual; its last holds the final projection alone)."""
    links = getattr(runner, "links", None)
    return bool(links) and len(links) >= 3 and callable(getattr(runner, "run_links", None)) \
        and FIRST_RESIDUAL in links[0].gives


__all__ = ["StepCache", "StepCacheRule", "StepCacheStats", "StepPosition", "cut_for_step_cache",
           "relative_change", "scheduler_position", "stream_key"]
