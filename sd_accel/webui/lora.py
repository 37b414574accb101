"""LoRAs on the checkpoint's engine: refitted for the job's LoRA set, not rebuilt per set.

A job whose LoRA set has no engine of its own, on a checkpoint whose base engine exists
(fp32 / fp16 / bf16: INT8 weights were quantized with calibrated scales and need a rebuild),
gets the base engine refitted to the UNet's merged weights (:func:`sd_accel.refit.refit_engine`:
the export's graph with the new weights, the backend's build, validated against the torch
UNet). Refits live in memory (and a scratch folder under ``<engines>/.refit`` each), never in
the cache's index. Each engine (profile) is refitted at its first call, not all of them when the
set changes (:class:`~sd_accel.refit.PendingRefit`): a LoRA change patches only the profiles the
jobs call. One LoRA set per checkpoint is kept refitted by default (setting
``sd_accel_lora_refits``: more keeps more sets, each a patched copy of the engines in memory);
the set that gives way is released before the next one is refitted, so a strength change never
holds two patched copies; the plain UNet's and the residual-taking UNet's (ControlNet) refits count
together, and one that served no call of the running job gives way before the other kind is
refitted (:meth:`~sd_accel.webui.controller.Controller.release_idle`). A job without LoRA uses the
base engine as it is. A refit that fails,
or that would not fit in the memory available (said before it starts), is not tried again for
that set until the engines change; the job goes on in PyTorch.

Where the merged weights come from:

- A1111: its built-in Lora extension merges a layer's LoRA weights in that layer's patched
  ``forward`` (``networks.network_apply_weights``); on an engine those forwards never run, so the
  extension calls ``network_apply_weights`` on each of the UNet's layers itself before the refit
  (what the first PyTorch step would have done; A1111 keeps its backups and later restores
  them as usual), then checks that what is merged is the job's set.
- Forge 2: the UNet patcher's LoRA patches are merged into the weights when Forge loads the
  UNet for sampling (``LoraLoader.refresh``), before the first UNet call; the refit happens at
  that call. LoRAs applied "online" (computed in each forward) are never in the weights.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from sd_accel.webui.identity import LoraSet, weights_id
from sd_accel.webui.runner import LdmEngines

log = logging.getLogger("sd_accel")

DEFAULT_KEPT = 1  # LoRA sets kept refitted per checkpoint (each holds its patched engines in memory)

Merge = Callable[[], "str | None"]  # makes the UNet's weights carry the LoRAs; None, or why it cannot


def lora_text(loras: LoraSet) -> str:
    """``film:0.8, ink:1`` (name:UNet strength), or ``no LoRA``."""
    return ", ".join(f"{n}:{s:g}" for n, s, _ in loras) if loras else "no LoRA"


@dataclass
class Refit:
    """One LoRA set's refitted engines: each refitted at its first call (:meth:`make`), from the
    weights of the torch UNet the set was last bound to (:meth:`bind`)."""

    engines: LdmEngines | None
    loras: LoraSet
    base: tuple[str, ...]  # the base engines' names
    source: tuple = ()  # (unet, spec, merge, context): where a pending engine's weights come from
    _seen: float = 0.0  # refit seconds already told in a job's line

    @property
    def seconds(self) -> float:
        """What the refits made so far took."""
        return sum(p.seconds for p in self.pending())

    def pending(self) -> list:
        """The engines' :class:`~sd_accel.refit.PendingRefit` stand-ins."""
        from sd_accel.refit import PendingRefit

        handles = self.engines.handles if self.engines is not None else []
        return [h.refit for h in handles if isinstance(h.refit, PendingRefit)]

    @classmethod
    def pending_for(cls, base, loras: LoraSet, *source):
        """A refit of the engines of ``base`` (a runtime ``ComponentEngines``; INT8 and broken ones
        left out) to the weights of ``source`` (:meth:`bind`'s arguments), each engine refitted at
        its first call (:class:`~sd_accel.refit.PendingRefit`): nothing is patched here. Its
        ``engines`` are the pending ones; a host wraps them as it needs (:func:`refit_for`)."""
        from sd_accel.refit import needs_rebuild, pending_component

        refittable = base.subset(lambda h: h.broken is None and needs_rebuild(h) is None)
        refit = cls(None, loras, tuple(h.name for h in refittable.handles))
        refit.bind(*source)
        refit.engines = pending_component(refittable, refit.make)
        return refit

    def bind(self, unet: torch.nn.Module, spec=None, merge: Merge | None = None, context=None) -> None:
        """The torch UNet (and how to make it carry the set: ``merge``; the host's trace
        ``context``) a pending engine is refitted from at its first call."""
        self.source = (unet, spec, merge, context)

    def make(self, handle):
        """Refit ``handle``'s engine to the bound UNet's weights (a :class:`PendingRefit`'s ``make``)."""
        from sd_accel.components.ldm_unet import LdmUNetSpec
        from sd_accel.core import EngineError
        from sd_accel.onnx.weights import effective_weights
        from sd_accel.refit import refit_engine

        unet, spec, merge, context = self.source
        report = _console_progress(self.loras)
        with contextlib.ExitStack() as stack:
            if context is not None:
                stack.enter_context(context())
            stack.enter_context(refit_context(unet))
            why = merge() if merge is not None else None
            if why:
                raise EngineError(why)
            weights = effective_weights(unet)
            return refit_engine(handle, weights, spec or LdmUNetSpec(unet), lambda f, m: report(handle.name, f, m))

    def line(self, made_now: bool) -> str:
        """The job's console line: which LoRAs the engine carries (and the refits made since the
        last line: the profiles called for the first time)."""
        names = ", ".join(self.base)
        seconds = self.seconds
        fresh, self._seen = seconds - self._seen, seconds
        done = sum(p.done for p in self.pending())
        failed = [p.why for p in self.pending() if p.why and not p.done]
        if failed and not done:  # (not "refitted": every profile's refit failed, the calls ran in PyTorch)
            return f"UNet engine {names} not refitted for {lora_text(self.loras)}: {failed[0]}"
        if fresh > 0:
            how = f"{fresh:.1f} s"
        elif made_now and not done:
            how = "each profile refitted at its first call"
        else:
            how = "kept from an earlier job: no refit"
        return f"UNet on engine {names} refitted for {lora_text(self.loras)} ({how})"


class LoraRefits:
    """The refits of this process: per checkpoint (and backend, cache, engine generation), the
    most recently used LoRA sets first to stay; failures remembered per set."""

    def __init__(self) -> None:
        self._kept: dict[tuple, OrderedDict[LoraSet, Refit]] = {}
        self._failed: dict[tuple, str] = {}

    def engines(self, component: str | None = None) -> list[LdmEngines]:
        """The refitted engines kept, of ``component`` (``ldm_unet`` or ``ldm_unet_control``: the
        fifth item of a ``where``, absent for the plain UNet's) or all."""
        from sd_accel.components.ldm_unet import COMPONENT

        return [r.engines for where, kept in self._kept.items() for r in kept.values()
                if component is None or (where[4] if len(where) > 4 else COMPONENT) == component]

    def close(self) -> None:
        """Close every refit (their scratch folders go); a later job refits again."""
        self.drop(lambda where: True)

    def drop(self, which: Callable[[tuple], bool]) -> None:
        """Close the refits of every ``where`` that ``which`` picks (their checkpoint is unloaded)."""
        for where in [w for w in self._kept if which(w)]:
            for refit in self._kept.pop(where).values():
                refit.engines.close()
        for key in [k for k in self._failed if which(k[0])]:
            del self._failed[key]

    def count(self, ckpt: str) -> int:
        """LoRA sets kept refitted for checkpoint ``ckpt``, both UNet kinds together."""
        return sum(len(kept) for where, kept in self._kept.items() if where[0] == ckpt)

    def drop_idle(self, ckpt: str, component: str) -> list[str]:
        """Close the refits of ``ckpt``'s ``component`` engines (``ldm_unet`` or
        ``ldm_unet_control``) that made no engine call in the running job (its counters), so
        their patched weights leave memory before the other component's engine is refitted for this
        job; a later job that asks for one refits it again. The LoRA sets dropped, as text."""
        from sd_accel.components.ldm_unet import COMPONENT

        dropped = []
        for where, kept in self._kept.items():
            if where[0] != ckpt or (where[4] if len(where) > 4 else COMPONENT) != component:
                continue
            for loras in [k for k, r in kept.items() if r.engines.stats.engine_calls == 0]:
                refit = kept.pop(loras)
                if any(h.runner is not None and getattr(h.runner, "done", True) for h in refit.engines.handles):
                    dropped.append(lora_text(loras))
                refit.engines.close()
        return dropped

    def get(self, where: tuple, loras: LoraSet) -> Refit | None:
        kept = self._kept.get(where)
        refit = kept.get(loras) if kept else None
        if refit is not None:
            kept.move_to_end(loras)
        return refit

    def failed(self, where: tuple, loras: LoraSet) -> str | None:
        return self._failed.get((where, loras))

    def fail(self, where: tuple, loras: LoraSet, why: str) -> None:
        self._failed[(where, loras)] = why

    def make_room(self, where: tuple, keep: int) -> None:
        """Release the least recently used sets of ``where`` until a new one fits within ``keep``
        (their patched engines leave memory before the next set is refitted)."""
        kept = self._kept.get(where)
        while kept and len(kept) >= max(1, keep):
            _, old = kept.popitem(last=False)
            old.engines.close()
            log.info("sd-accel: dropped the refit for %s (the %d most recent LoRA set%s kept)",
                     lora_text(old.loras), keep, " is" if keep == 1 else "s are")

    def add(self, where: tuple, refit: Refit, keep: int) -> None:
        self.make_room(where, keep)
        self._kept.setdefault(where, OrderedDict())[refit.loras] = refit


@contextlib.contextmanager
def refit_context(unet: torch.nn.Module) -> Iterator[None]:
    """What the validation of a refit needs inside a job: the UNet's own forward (no SD-UNet
    dispatch, plain attention, no offload hooks: as for an export), no autocast, no autograd."""
    from sd_accel.webui.tracing import export_context

    with contextlib.ExitStack() as stack:
        stack.enter_context(export_context(unet))
        stack.enter_context(torch.no_grad())
        for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            with contextlib.suppress(RuntimeError, ValueError):
                stack.enter_context(torch.autocast(device_type=device, enabled=False))
        yield


def _console_progress(loras: LoraSet) -> Callable[[str, float, str], None]:
    """One console line per refit stage (not per percent)."""
    from sd_accel.webui.console import say

    start = time.perf_counter()
    last: dict[str, str] = {}

    def report(name: str, fraction: float, message: str) -> None:
        stage = re.sub(r"\d+(\.\d+)?", "#", message)
        if last.get(name) == stage:
            return
        last[name] = stage
        say(f"refitting {name} for {lora_text(loras)}: {message} ({time.perf_counter() - start:.0f} s)")

    return report


def a1111_merge(unet: torch.nn.Module, loras: LoraSet) -> Merge:
    """A1111: merge the job's LoRAs into ``unet`` with the Lora extension's own function, then
    check that what is merged (``network_current_names``) is the job's set."""

    def merge() -> str | None:
        from sd_accel.webui import host
        from sd_accel.webui.identity import describe, merged_loras

        if host.a1111_networks() is None:
            return "A1111's built-in Lora extension (networks) is not loaded, so its LoRAs cannot be merged"
        host.apply_a1111_loras(unet)
        merged = merged_loras(unet)
        if merged != loras:
            return (f"the WebUI merged {describe(merged)} into the UNet where the prompt asks for "
                    f"{describe(loras)}")
        return None

    return merge


def forge_merge(patcher) -> Merge:
    """Forge: the patcher's LoRAs are merged by Forge itself before the first UNet call; this
    only checks that they are."""
    from sd_accel.webui import host

    return lambda: host.forge_lora_state(patcher)


def refit_for(base, loras: LoraSet, ckpt: str, unet: torch.nn.Module, spec=None, merge: Merge | None = None,
              context=None) -> Refit:
    """The engines ``base`` (a :class:`LdmEngines` of the checkpoint; its INT8 ones are left out)
    to be refitted to ``unet``'s weights, which carry ``loras`` (once ``merge()``, if given,
    returned None), each at its first call (:class:`~sd_accel.refit.PendingRefit`): nothing is
    patched here. ``spec``: the engines' spec (default the plain ``ldm_unet`` one; the
    residual-taking UNet passes its own); ``context``: a host's trace context, entered around
    each refit. Later jobs :meth:`Refit.bind` their own UNet and merge."""
    refit = Refit.pending_for(base.component_engines, loras, unet, spec, merge, context)
    refit.engines = LdmEngines(weights_id(ckpt, loras), refit.engines)
    return refit


__all__ = ["DEFAULT_KEPT", "LoraRefits", "Refit", "a1111_merge", "forge_merge", "lora_text", "refit_context",
           "refit_for"]
