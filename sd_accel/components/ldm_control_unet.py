"""The host's LDM UNet that takes a ControlNet's residuals as inputs (``ldm_unet_control``).

ComfyUI (and Forge, its descendant) run a ControlNet apart from the UNet and hand the UNet its
output as ``control={"output": [r_0 .. r_{n-1}], "middle": [m]}``: ``r_i`` is added to the skip
connection of input block ``i`` when the output blocks take it (``apply_control(..., "output")``
pops from the end, as the skips are popped), ``m`` to the middle block's output. The ControlNet's
strength and the sum over chained ControlNets are already in those tensors. This spec exports the
host's UNet with them as inputs ``control_0`` .. ``control_{n-1}`` and ``control_mid``, so one
engine serves any ControlNet, any strength and any number of them; a step where every net is off
comes with ``control=None`` and runs the plain ``ldm_unet`` engine.

The residuals have the layout of :func:`sd_accel.components.controlnet.residual_layout` (the input
blocks: ``conv_in``, each level's res blocks, its downsampler), read off the module's
``model_channels``, ``channel_mult`` and ``num_res_blocks``; level ``k`` is ``ceil(H8 / 2^k)``.
T2I-Adapters add to the input blocks (``control["input"]``), which this engine does not carry.
"""

from __future__ import annotations

import torch

from sd_accel.components.controlnet import _residual_specs, residual_layout
from sd_accel.components.ldm_unet import LdmDims, LdmUNetSpec
from sd_accel.components.levels import LevelInputs
from sd_accel.components.spec import TensorSpec
from sd_accel.core import UnsupportedComponent

COMPONENT = "ldm_unet_control"


def ldm_layout(unet: torch.nn.Module) -> dict:
    """The residual layout config (``block_out_channels``, ``layers_per_block``) of an LDM UNet.

    >>> class U(torch.nn.Module):
    ...     model_channels, channel_mult, num_res_blocks = 320, (1, 2, 4, 4), [2, 2, 2, 2]
    >>> ldm_layout(U())
    {'block_out_channels': [320, 640, 1280, 1280], 'layers_per_block': [2, 2, 2, 2]}
    """
    channels = getattr(unet, "model_channels", None)
    mult = getattr(unet, "channel_mult", None)
    blocks = getattr(unet, "num_res_blocks", None)
    if not isinstance(channels, int) or mult is None or blocks is None:
        raise UnsupportedComponent(f"{type(unet).__name__} does not say its block layout (model_channels, "
                                   "channel_mult, num_res_blocks): its ControlNet calls run in PyTorch")
    mult = list(mult)
    per = list(blocks) if isinstance(blocks, list | tuple) else [int(blocks)] * len(mult)
    return {"block_out_channels": [channels * m for m in mult], "layers_per_block": per}


def control_names(layout: dict) -> list[str]:
    """``control_0`` .. ``control_{n-1}``, ``control_mid``: the engine's residual inputs."""
    down, _ = residual_layout(layout)
    return [f"control_{i}" for i in range(len(down))] + ["control_mid"]


class _LdmControlExport(torch.nn.Module):
    """(x, timesteps, context[, y], control_0 .. control_mid) in; the host's call with ``control``."""

    def __init__(self, unet: torch.nn.Module, with_y: bool) -> None:
        super().__init__()
        self.unet = unet
        self.with_y = with_y

    def forward(self, x, timesteps, context, *rest):
        kwargs = {"y": rest[0]} if self.with_y else {}
        residuals = rest[1:] if self.with_y else rest
        # fresh lists: the host pops from them
        control = {"output": list(residuals[:-1]), "middle": [residuals[-1]], "input": []}
        return (self.unet(x, timesteps, context=context, control=control, **kwargs),)


class LdmControlUNetSpec(LevelInputs, LdmUNetSpec):
    """The host's LDM UNet with ``control`` residuals as inputs (after the plain one's).

    (Skipped in the test suite: it needs ComfyUI's or the WebUI's own UNet module;
    tests/test_comfyui_pack.py runs it on a stand-in.)

    >>> spec = LdmControlUNetSpec(comfy_unet)                                # doctest: +SKIP
    >>> spec.control_names()[-2:]                                            # doctest: +SKIP
    ['control_11', 'control_mid']
    """

    name = COMPONENT

    def __init__(self, unet: torch.nn.Module, dims: LdmDims | None = None, num_train_timesteps: int = 1000) -> None:
        super().__init__(unet, dims, num_train_timesteps)
        self.layout = ldm_layout(unet)

    def control_names(self) -> list[str]:
        return control_names(self.layout)

    def inputs(self) -> tuple[TensorSpec, ...]:
        renamed = tuple(TensorSpec(n, t.dims, t.dtype)
                        for n, t in zip(self.control_names(), _residual_specs(self.layout), strict=True))
        return (*super().inputs(), *renamed)

    def export_module(self) -> torch.nn.Module:
        return _LdmControlExport(self.unet, self.xl)

    def level_config(self):
        return self.layout

    extra_names = control_names

    def _runs_at(self, side: int) -> bool:
        # the probe feeds no residuals: the plain call (control=None) tells the same
        return LdmUNetSpec(self.unet, self.dims, self.num_train_timesteps)._runs_at(side)


def sliced_control(control: dict | None, part: slice) -> dict | None:
    """The host's ``control`` for a batch slice of the call (fresh lists: the host's UNet pops
    from them), for the rows an engine does not cover."""
    if control is None:
        return None
    return {k: [None if t is None else t[part] for t in v] if isinstance(v, list) else v for k, v in control.items()}


def control_feed(control: dict | None, names: list[str]) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """The engine inputs for a host's ``control`` dict, or (None, why the engine cannot take it).

    A ``None`` entry (a chained net that gave nothing at some level) sends the call to PyTorch."""
    if control is None:
        return None, None
    if any(t is not None for t in control.get("input") or []):
        return None, "T2I-Adapter residuals (control input) are not in the engine"
    output, middle = list(control.get("output") or []), list(control.get("middle") or [])
    if len(output) != len(names) - 1 or len(middle) != 1:
        return None, (f"the ControlNet gave {len(output)} + {len(middle)} residuals, the engine takes "
                      f"{len(names) - 1} + 1")
    if any(t is None for t in (*output, *middle)):
        return None, "a ControlNet gave no residual for some levels"
    feed = {n: t.float() for n, t in zip(names, (*output, *middle), strict=True)}
    return feed, None


__all__ = ["COMPONENT", "LdmControlUNetSpec", "control_feed", "control_names", "ldm_layout", "sliced_control"]
