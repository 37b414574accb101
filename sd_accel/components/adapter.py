"""T2I-Adapter: ``unet_adapter``, the UNet that takes a T2I-Adapter's features as inputs.

A T2I-Adapter (diffusers ``T2IAdapter`` / ``MultiAdapter``) is a small convolutional network that
runs once per image on the control image (at latent size after its pixel unshuffle); the UNet then
gets its features at every step as ``down_intrablock_additional_residuals`` and adds feature ``k``
to the hidden states of down block ``k`` (after its last resnet/attention pair, before its
downsampler). So the adapter stays in torch (one cheap call per image) and the UNet runs on an
engine with those features as inputs ``adapter_0`` .. ``adapter_{n-1}``: ``(B2, C_k, H8/2^k, W8/2^k)``,
``C_k`` the UNet's ``block_out_channels[k]``. One engine serves any adapter of that UNet, any
``adapter_conditioning_scale`` (already in the features) and the steps past
``adapter_conditioning_factor`` (no features: the plain ``unet`` engine).

Adapters whose feature count is not the UNet's number of down blocks (SDXL's ``full_adapter_xl``
adds one more after the middle block) keep to torch for their calls, with the reason.
"""

from __future__ import annotations

import torch

from sd_accel.components.levels import LevelInputs, LevelInputsExport, _level
from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.components.unet import UNetSpec

ADAPTER_UNET = "unet_adapter"


def adapter_layout(config) -> list[tuple[int, int]]:
    """(channels, level) of each adapter feature a UNet config takes: one per down block.

    >>> adapter_layout({"block_out_channels": [320, 640, 1280, 1280]})
    [(320, 0), (640, 1), (1280, 2), (1280, 3)]
    """
    return [(ch, k) for k, ch in enumerate(config["block_out_channels"])]


def adapter_names(config) -> list[str]:
    """``adapter_0`` .. ``adapter_{n-1}``: the engine's feature inputs."""
    return [f"adapter_{k}" for k in range(len(adapter_layout(config)))]


def _adapter_kwargs(features: tuple) -> dict:
    return {"down_intrablock_additional_residuals": list(features)}


class AdapterUNetSpec(LevelInputs, UNetSpec):
    """``pipe.unet`` with the T2I-Adapter features as inputs (after the plain UNet's)."""

    name = ADAPTER_UNET

    def adapter_names(self) -> list[str]:
        return adapter_names(self._cfg)

    def inputs(self) -> tuple[TensorSpec, ...]:
        f32 = torch.float32
        features = tuple(TensorSpec(f"adapter_{i}", ("B2", ch, _level(lv, "H"), _level(lv, "W")), f32)
                         for i, (ch, lv) in enumerate(adapter_layout(self._cfg)))
        return (*super().inputs(), *features)

    def export_module(self) -> torch.nn.Module:
        return LevelInputsExport(self.pipe.unet, self.xl, _adapter_kwargs)

    extra_names = adapter_names


def adapter_specs(pipe) -> dict[str, ComponentSpec]:
    """``{"unet_adapter": spec}`` for a T2I-Adapter pipeline (one with ``pipe.adapter``), else empty."""
    if getattr(pipe, "adapter", None) is None or getattr(pipe, "unet", None) is None:
        return {}
    return {ADAPTER_UNET: AdapterUNetSpec(pipe)}


__all__ = ["ADAPTER_UNET", "AdapterUNetSpec", "adapter_layout", "adapter_names", "adapter_specs"]
