"""The level layout of a diffusion UNet's down path, shared by what feeds it extra inputs
(ControlNet residuals, T2I-Adapter features): which channels at which level, and the symbols and
ranges of each level's size (level ``k`` is ``ceil(H8 / 2^k)``: a stride-2 convolution with
padding 1 rounds up; symbols ``H8d{k}``/``W8d{k}``, level 0 is ``H8``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from sd_accel.profiles import Range


def residual_layout(config) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(channels, level) of each down residual, and of the mid residual, of a UNet or ControlNet
    config (both have the same layout: conv_in, then each block's resnets and its downsampler).

    >>> residual_layout({"block_out_channels": [32, 64], "layers_per_block": 1})
    ([(32, 0), (32, 0), (32, 1), (64, 1)], (64, 1))
    """
    blocks = list(config["block_out_channels"])
    per = config["layers_per_block"]
    out = [(blocks[0], 0)]
    for i, ch in enumerate(blocks):
        n = per if isinstance(per, int) else per[i]
        out += [(ch, i)] * n
        if i < len(blocks) - 1:
            out.append((ch, i + 1))
    return out, (blocks[-1], len(blocks) - 1)


def _level(level: int, axis: str) -> str:
    return f"{axis}8" if level == 0 else f"{axis}8d{level}"


def _level_range(r: Range, level: int) -> Range:
    f = 2**level
    return (math.ceil(r[0] / f), math.ceil(r[1] / f), math.ceil(r[2] / f))


def _level_ranges(config, h8: Range, w8: Range) -> dict[str, Range]:
    down, (_, mid_level) = residual_layout(config)
    levels = {lv for _, lv in down} | {mid_level}
    out: dict[str, Range] = {}
    for lv in sorted(levels - {0}):
        out[_level(lv, "H")] = _level_range(h8, lv)
        out[_level(lv, "W")] = _level_range(w8, lv)
    return out


def _level_dims(config, dims: dict[str, int]) -> dict[str, int]:
    ranges = _level_ranges(config, (dims["H8"],) * 3, (dims["W8"],) * 3)
    return {k: v[0] for k, v in ranges.items()}


class LevelInputs:
    """Mixin for a UNet spec whose extra inputs sit at the down path's levels (ControlNet
    residuals, T2I-Adapter features), listed before the plain UNet spec among the bases: the
    levels' symbols get ranges and export sizes after the plain UNet's, and the sample feed gives
    the extra inputs ~N(0, 0.5), so that validation sees them change the output. The spec says
    which layout (``level_config``: a UNet config, or an LDM UNet's layout) and which inputs
    (``extra_names``)."""

    def level_config(self):
        return self._cfg

    def extra_names(self) -> list[str]:
        return []

    def dim_ranges(self, profile) -> dict[str, Range]:
        ranges = super().dim_ranges(profile)
        return {**ranges, **_level_ranges(self.level_config(), ranges["H8"], ranges["W8"])}

    def export_dims(self) -> dict[str, int]:
        dims = super().export_dims()
        return {**dims, **_level_dims(self.level_config(), dims)}

    def sample_feed(self, dims: dict[str, int], seed: int = 0, device: str = "cpu") -> dict:
        feed = super().sample_feed(dims, seed=seed, device="cpu")
        for name in self.extra_names():
            feed[name] = feed[name] * 0.5
        return {k: v.to(device) for k, v in feed.items()}


class LevelInputsExport(torch.nn.Module):
    """What the ONNX export of such a spec traces: ``pipe.unet`` called with the plain UNet's
    inputs (SDXL's two added conditions after the text), the rest handed to the UNet as the
    keywords ``route`` makes of them (a module-level function: the export stays picklable)."""

    def __init__(self, unet: torch.nn.Module, xl: bool, route: Callable[[tuple], dict]) -> None:
        super().__init__()
        self.unet = unet
        self.xl = xl
        self.route = route

    def forward(self, sample, timestep, encoder_hidden_states, *rest):
        n_added = 2 if self.xl else 0
        added, extras = rest[:n_added], rest[n_added:]
        added_cond_kwargs = {"text_embeds": added[0], "time_ids": added[1]} if self.xl else None
        out = self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added_cond_kwargs,
                        return_dict=False, **self.route(extras))[0]
        return (out,)
