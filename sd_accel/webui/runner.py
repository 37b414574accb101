"""One UNet call of the WebUI on engines: per-call choice, batch chunks, PyTorch for the rest.

The WebUI's batch is not fixed: cond and uncond come together (2B) or apart (B), Forge packs
as many as free memory allows, hires fix changes the size mid-job, long prompts bring 154 or
more context columns. So every call is matched on its real shapes. A batch larger than any
engine covers is cut into the largest chunks some engine covers (the UNet treats samples
independently, so chunks give the same result); what no engine covers runs in PyTorch, and
:class:`~sd_accel.runtime.stats.ComponentStats` counts it and says why, once per reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sd_accel.components.ldm_unet import latent_ok
from sd_accel.core import covers
from sd_accel.runtime import ComponentEngines, ComponentStats, EngineHandle

TorchCall = Callable[[slice], torch.Tensor]  # runs the torch UNet on a batch slice of the call


def _latent_multiple(handle: EngineHandle) -> int:
    extra = getattr(handle.record, "extra", None) or {}
    return int((extra.get("webui") or {}).get("latent_multiple", 1) or 1)


class LdmEngines:
    """The engines of one weights id, ready to serve ``diffusion_model`` calls.

    ``engines``: what :func:`sd_accel.runtime.engines_for` gave for the weights id and the
    ``ldm_unet`` component (its fallback setting is kept; switch it with :meth:`set_fallback`).
    """

    def __init__(self, weights_id: str, engines: ComponentEngines) -> None:
        self.weights_id = weights_id
        # Engines traced at a divisible latent size serve only multiples of it (see ldm_unet);
        # a call at another size must not reach them. Both sets count in one ComponentStats.
        self._any = engines
        self._general = engines.subset(lambda h: _latent_multiple(h) <= 1)
        self.reset_stats()

    @property
    def handles(self) -> list[EngineHandle]:
        return self._any.handles

    @property
    def component_engines(self) -> ComponentEngines:
        """All of them, as the runtime's :class:`ComponentEngines` (what a refit starts from)."""
        return self._any

    @property
    def stats(self) -> ComponentStats:
        """This job's counters: engine calls, torch calls and why."""
        return self._any.stats

    def set_fallback(self, allowed: bool) -> None:
        """On: a call no engine covers runs the torch UNet. Off: it raises EngineError (stops the job)."""
        self._any.set_fallback(allowed)
        self._general.set_fallback(allowed)

    def reset_stats(self) -> ComponentStats:
        """Start new counters (one job); returns the old ones."""
        old = self._any.reset_stats()
        self._general.stats = self._any.stats
        return old

    def close(self) -> None:
        """Drop loaded runners (TensorRT engines hold GPU memory)."""
        self._any.close()

    def _pick(self, latent_hw: tuple[int, int]) -> ComponentEngines:
        multiples = {_latent_multiple(h) for h in self.handles}
        if all(latent_ok(latent_hw, m) for m in multiples):
            return self._any
        return self._general

    def torch_call(self, reason: str) -> None:
        """Count a call that goes to torch before any engine is asked (and say why, once)."""
        self._any.torch_call(reason)

    def __call__(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                 y: torch.Tensor | None, torch_call: TorchCall,
                 extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The UNet's output for the call, from engines where they cover it, torch elsewhere.
        ``extra``: more inputs with the batch first (a residual-taking UNet's ``control_*``)."""
        batch = x.shape[0]
        t = torch.as_tensor(timesteps, device=x.device).float().reshape(-1)
        if t.numel() == 1 and batch > 1:
            t = t.expand(batch)
        feed = {"x": x.float(), "timesteps": t.contiguous(), "context": context.float()}
        if y is not None:
            feed["y"] = y.float()
        feed.update(extra or {})
        engines = self._pick(tuple(x.shape[-2:]))
        outs = []
        for part in self._chunks(engines, feed, batch):
            chunk = {k: v[part] for k, v in feed.items()} if (part.start, part.stop) != (0, batch) else feed
            out = engines.run(chunk)
            if out is None:  # counted and explained by ComponentEngines
                outs.append(torch_call(part))
            else:
                # copy: the engine reuses its output buffer on the next call, samplers keep results
                outs.append(out["latent"].to(device=x.device, dtype=x.dtype, copy=True))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _chunks(self, engines: ComponentEngines, feed: dict[str, torch.Tensor], batch: int) -> list[slice]:
        return batch_slices(engines, lambda n: {k: v[:n] for k, v in feed.items()}, batch)  # (views: no copy)


def batch_slices(engines: ComponentEngines, feed_of: Callable[[int], dict[str, torch.Tensor]],
                 batch: int) -> list[slice]:
    """Slices of a call's batch: each the largest size some live engine of ``engines`` covers
    (``feed_of(n)``: the engine feed of the call cut to its first ``n`` rows); one slice for the
    whole call when none covers any size (then the call is one counted fallback). The denoisers
    treat samples independently, so the chunks give the call's result."""
    live = [h for h in engines.handles if h.broken is None]

    def served(size: int) -> bool:  # some live engine covers the call cut to ``size`` rows
        part = feed_of(size)
        return any(covers(h.shapes, part) for h in live)

    parts, start = [], 0
    while start < batch:
        left = batch - start
        size = next((b for b in range(left, 0, -1) if served(b)), None)
        if size is None:  # nothing covers what is left: one torch call for all of it
            size = left
        parts.append(slice(start, start + size))
        start += size
    return parts
