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
from dataclasses import dataclass

import torch

from sd_accel.components.ldm_unet import COMPONENT, latent_ok
from sd_accel.runtime.selection import ComponentEngines, EngineHandle
from sd_accel.runtime.stats import ComponentStats

TorchCall = Callable[[slice], torch.Tensor]  # runs the torch UNet on a batch slice of the call


def _latent_multiple(handle: EngineHandle) -> int:
    extra = getattr(handle.record, "extra", None) or {}
    return int((extra.get("webui") or {}).get("latent_multiple", 1) or 1)


def _covers_batch(handle: EngineHandle, shapes: dict[str, tuple[int, ...]], batch: int) -> bool:
    """Whether ``handle`` serves the call's shapes with the batch axis set to ``batch``."""
    if set(shapes) != set(handle.shapes):
        return False
    for name, shape in shapes.items():
        lo, _, hi = handle.shapes[name]
        if len(lo) != len(shape):
            return False
        dims = (batch, *shape[1:])
        if any(not (a <= d <= b) for a, d, b in zip(lo, dims, hi, strict=True)):
            return False
    return True


@dataclass
class LdmEngines:
    """The engines of one weights id, ready to serve ``diffusion_model`` calls."""

    weights_id: str
    handles: list[EngineHandle]
    fallback: bool = True

    def __post_init__(self) -> None:
        self.stats = ComponentStats()
        # Engines traced at a divisible latent size serve only multiples of it (see ldm_unet);
        # a call at another size must not reach them.
        self._any = ComponentEngines(COMPONENT, self.handles, self.fallback)
        general = [h for h in self.handles if _latent_multiple(h) <= 1]
        self._general = ComponentEngines(COMPONENT, general, self.fallback)
        self.reset_stats()

    def reset_stats(self) -> ComponentStats:
        """Start new counters (one job); returns the old ones."""
        old, self.stats = self.stats, ComponentStats()
        self._any.stats = self._general.stats = self.stats
        return old

    def close(self) -> None:
        """Drop loaded runners (TensorRT engines hold GPU memory)."""
        for handle in self.handles:
            if handle.runner is not None:
                handle.runner.close()
                handle.runner = None

    def _pick(self, latent_hw: tuple[int, int]) -> ComponentEngines:
        multiples = {_latent_multiple(h) for h in self.handles}
        if all(latent_ok(latent_hw, m) for m in multiples):
            return self._any
        return self._general

    def torch_call(self, reason: str) -> None:
        """Count a call that goes to torch before any engine is asked (and say why, once)."""
        self._any.torch_call(reason)

    def __call__(self, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
                 y: torch.Tensor | None, torch_call: TorchCall) -> torch.Tensor:
        """The UNet's output for the call, from engines where they cover it, torch elsewhere."""
        batch = x.shape[0]
        t = torch.as_tensor(timesteps, device=x.device).float().reshape(-1)
        if t.numel() == 1 and batch > 1:
            t = t.expand(batch)
        feed = {"x": x.float(), "timesteps": t.contiguous(), "context": context.float()}
        if y is not None:
            feed["y"] = y.float()
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
        """Slices of the batch: each the largest size some live engine covers; one slice for
        the whole call when none covers any size (then the call is one counted fallback)."""
        shapes = {k: tuple(v.shape) for k, v in feed.items()}
        live = [h for h in engines.handles if h.broken is None]
        parts, start = [], 0
        while start < batch:
            left = batch - start
            size = next((b for b in range(left, 0, -1) if any(_covers_batch(h, shapes, b) for h in live)), None)
            if size is None:  # nothing covers what is left: one torch call for all of it
                size = left
            parts.append(slice(start, start + size))
            start += size
        return parts
