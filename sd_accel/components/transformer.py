"""What the transformer families' denoiser specs share (SD3 / SD3.5's MMDiT in
``components/sd3/``, FLUX.1's in ``components/flux/``): the component name and the module."""

from __future__ import annotations

import torch

from sd_accel.components.spec import ComponentSpec


class TransformerSpec(ComponentSpec):
    """``pipe.transformer``: the family's subclass says its inputs, outputs and export."""

    name = "transformer"
    attribute = "transformer"

    def torch_module(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def _cfg(self):
        return self.pipe.transformer.config


class ControlNetSpecMixin:
    """What a transformer family's ControlNet spec shares (before the family's transformer spec in
    the bases): the net as the module, its config, no consumer, scales in [0.5, 1.5] in samples."""

    name = "controlnet"
    segment_blocks = None  # (a ControlNet is a few blocks: built whole)
    net: torch.nn.Module

    @property
    def attribute(self) -> str:
        return "controlnet"

    def torch_module(self) -> torch.nn.Module:
        return self.net

    @property
    def _cfg(self):
        return self.net.config

    def consumer(self):
        return None  # (its samples feed another engine; judged on their own)

    def sample_feed(self, dims: dict[str, int], seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
        feed = super().sample_feed(dims, seed=seed, device="cpu")  # type: ignore[misc]
        g = torch.Generator("cpu").manual_seed(seed + 2)
        feed["conditioning_scale"] = 0.5 + torch.rand(feed["conditioning_scale"].shape, generator=g)
        return {k: v.to(device) for k, v in feed.items()}
