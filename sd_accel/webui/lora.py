"""LoRAs on the checkpoint's engine: refitted for the job's LoRA set, not rebuilt per set.

A job whose LoRA set has no engine of its own, on a checkpoint whose base engine exists
(fp32 / fp16 / bf16: INT8 weights were quantized with calibrated scales and need a rebuild),
gets the base engine refitted to the UNet's merged weights (:func:`sd_accel.refit.refit_component`:
the export's graph with the new weights, the backend's build, validated against the torch
UNet). Refits live in memory (and a scratch folder under ``<engines>/.refit`` each), never in
the cache's index; the last few LoRA sets of each checkpoint are kept (setting
``sd_accel_lora_refits``), so switching back costs nothing, and a job without LoRA uses the base
engine as it is. A refit that fails is not tried again for that set until the engines change.

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

DEFAULT_KEPT = 2  # LoRA sets kept refitted per checkpoint (each holds a whole engine in memory)

Merge = Callable[[], "str | None"]  # makes the UNet's weights carry the LoRAs; None, or why it cannot


def lora_text(loras: LoraSet) -> str:
    """``film:0.8, ink:1`` (name:UNet strength), or ``no LoRA``."""
    return ", ".join(f"{n}:{s:g}" for n, s, _ in loras) if loras else "no LoRA"


@dataclass
class Refit:
    """One LoRA set's refitted engines."""

    engines: LdmEngines
    loras: LoraSet
    base: tuple[str, ...]  # the base engines' names
    seconds: float

    def line(self, made_now: bool) -> str:
        """The job's console line: which LoRAs the engine carries."""
        names = ", ".join(self.base)
        how = f"{self.seconds:.1f} s" if made_now else "kept from an earlier job: no refit"
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

    def add(self, where: tuple, refit: Refit, keep: int) -> None:
        kept = self._kept.setdefault(where, OrderedDict())
        kept[refit.loras] = refit
        while len(kept) > max(1, keep):
            _, old = kept.popitem(last=False)
            old.engines.close()
            log.info("sd-accel: dropped the refit for %s (the %d most recent LoRA sets are kept)",
                     lora_text(old.loras), keep)


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


def refit_for(base, loras: LoraSet, ckpt: str, unet: torch.nn.Module, spec=None) -> Refit:
    """Refit the engines ``base`` (a :class:`LdmEngines` of the checkpoint; its INT8 ones are left
    out) to ``unet``'s weights, which carry ``loras`` (see :data:`Merge`). ``spec``: the engines'
    spec (default the plain ``ldm_unet`` one; the residual-taking UNet passes its own)."""
    from sd_accel.components.ldm_unet import LdmUNetSpec
    from sd_accel.onnx.weights import effective_weights
    from sd_accel.refit import needs_rebuild, refit_component

    start = time.perf_counter()
    with refit_context(unet):
        weights = effective_weights(unet)
        refittable = base.component_engines.subset(lambda h: h.broken is None and needs_rebuild(h) is None)
        component = refit_component(refittable, weights, spec or LdmUNetSpec(unet), _console_progress(loras))
    names = tuple(h.name for h in component.handles)
    return Refit(LdmEngines(weights_id(ckpt, loras), component), loras, names, time.perf_counter() - start)


__all__ = ["DEFAULT_KEPT", "LoraRefits", "Refit", "a1111_merge", "forge_merge", "lora_text", "refit_context",
           "refit_for"]
