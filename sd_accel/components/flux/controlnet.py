"""FLUX.1 ControlNet: the ``controlnet`` component of a ``FluxControlNetPipeline`` (a diffusers
``FluxControlNetModel``, the union kind too) and ``transformer_control``, the transformer taking
the nets' block samples as inputs.

``controlnet`` inputs: the transformer's (``hidden_states`` ... ``txt_ids``, ``guidance`` when the
net embeds one), ``controlnet_cond`` (B, N, C): the control image as the pipeline hands it, VAE
latents packed like ``hidden_states``; ``controlnet_mode`` (B, 1) int64 for a union net (which
control: canny, depth ...); ``conditioning_scale`` (B,). Outputs: ``block_0`` .. and
``single_0`` .., one per double- and single-stream block of the net, already times the scale.

``transformer_control`` takes one residual per block of the *transformer* (``block_{i}`` for its
double-stream blocks, ``single_{i}`` for its single-stream ones): the runtime spreads a net's
samples over the blocks as diffusers does (block i gets sample ``i // ceil(blocks / samples)``, or
``i % samples`` for XLabs' repeat), summing several nets'; a block no net feeds gets zeros. So one
engine serves any net, any number of them, of any depth, and both spreads; its residual inputs
share the nets' output buffers (the same tensor for each block of one sample).

Only nets that take the control image as packed latents (InstantX, the union nets, Shakker's) are
exported; a net with its own image encoder (``input_hint_block``: XLabs') runs in torch, while its
samples still go to ``transformer_control``.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from sd_accel.components.flux.export import export_patches
from sd_accel.components.flux.transformer import FluxTransformerSpec, is_flux_transformer
from sd_accel.components.spec import TensorSpec
from sd_accel.components.transformer import ControlNetSpecMixin
from sd_accel.core import UnsupportedComponent

CONTROL_TRANSFORMER = "transformer_control"


def is_flux_controlnet(module) -> bool:
    return type(getattr(module, "torch_module", module)).__name__ == "FluxControlNetModel"


def block_names(transformer_config) -> list[str]:
    """The transformer's residual inputs: ``block_0`` .. then ``single_0`` .."""
    return ([f"block_{i}" for i in range(transformer_config.num_layers)]
            + [f"single_{i}" for i in range(transformer_config.num_single_layers)])


def spread(samples, blocks: int, repeat: bool = False) -> list[int | None]:
    """Which of a net's ``samples`` each of ``blocks`` transformer blocks adds (None: none), as
    ``FluxTransformer2DModel`` spreads them: ``i // ceil(blocks / samples)``, or ``i % samples``
    with ``controlnet_blocks_repeat`` (XLabs)."""
    n = len(samples) if samples is not None else 0
    if n == 0:
        return [None] * blocks
    if repeat:
        return [i % n for i in range(blocks)]
    interval = -(-blocks // n)
    return [i // interval if i // interval < n else None for i in range(blocks)]


class _NetExport(torch.nn.Module):
    """Positional inputs in inputs() order; the samples, each times its row's scale, out."""

    def __init__(self, net: torch.nn.Module, guidance: bool, union: bool) -> None:
        super().__init__()
        self.net = net
        self.guidance = guidance
        self.union = union

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                *rest):
        rest = list(rest)
        guidance = rest.pop(0) if self.guidance else None
        controlnet_cond = rest.pop(0)
        mode = rest.pop(0) if self.union else None
        scale = rest.pop(0).reshape(-1, 1, 1)
        with export_patches(self.net) if torch.onnx.is_in_onnx_export() else nullcontext():
            blocks, singles = self.net(hidden_states=hidden_states, controlnet_cond=controlnet_cond,
                                       controlnet_mode=mode, conditioning_scale=1.0,
                                       encoder_hidden_states=encoder_hidden_states,
                                       pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                                       txt_ids=txt_ids, guidance=guidance, return_dict=False)
        return tuple(s * scale for s in (*(blocks or ()), *(singles or ())))


class FluxControlNetSpec(ControlNetSpecMixin, FluxTransformerSpec):
    """One ``FluxControlNetModel`` of a FLUX.1 ControlNet pipeline (``pipe.controlnet``, or one of
    a ``FluxMultiControlNetModel``'s ``nets``). Shapes as the transformer's (B, N, L)."""

    def __init__(self, pipe, net: torch.nn.Module | None = None) -> None:
        super().__init__(pipe)
        self.net = net if net is not None else pipe.controlnet
        if not is_flux_controlnet(self.net):
            raise UnsupportedComponent(f"{type(self.net).__name__} is not a diffusers FluxControlNetModel; "
                                       "it keeps running in torch")
        if getattr(self.net, "input_hint_block", None) is not None:
            raise UnsupportedComponent("this FLUX ControlNet encodes the control image itself (input_hint_block, "
                                       "XLabs' kind): it keeps running in torch; its samples still reach the "
                                       "transformer's engine")

    @property
    def union(self) -> bool:
        return self._cfg.get("num_mode") is not None

    def inputs(self) -> tuple[TensorSpec, ...]:
        f32 = torch.float32
        extra = [TensorSpec("controlnet_cond", ("B", "N", self._cfg.in_channels), f32)]
        if self.union:
            extra.append(TensorSpec("controlnet_mode", ("B", 1), torch.int64))
        extra.append(TensorSpec("conditioning_scale", ("B",), f32))
        return (*super().inputs(), *extra)

    def outputs(self) -> tuple[TensorSpec, ...]:
        dim = self.net.inner_dim
        return tuple(TensorSpec(n, ("B", "N", dim), torch.float32) for n in self.output_names())

    def output_names(self) -> list[str]:
        return block_names(self._cfg)

    def export_module(self) -> torch.nn.Module:
        return _NetExport(self.net, self.guidance, self.union)

    def int_high(self, name: str) -> int:
        return int(self._cfg.get("num_mode") or 1)



class _ControlTransformerExport(torch.nn.Module):
    def __init__(self, transformer: torch.nn.Module, guidance: bool) -> None:
        super().__init__()
        self.transformer = transformer
        self.guidance = guidance
        self.double = len(transformer.transformer_blocks)

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                *rest):
        guidance = rest[0] if self.guidance else None
        residuals = list(rest[1:] if self.guidance else rest)
        blocks, singles = residuals[: self.double], residuals[self.double:]
        with export_patches(self.transformer) if torch.onnx.is_in_onnx_export() else nullcontext():
            out = self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                   pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                                   txt_ids=txt_ids, guidance=guidance,
                                   controlnet_block_samples=blocks or None,
                                   controlnet_single_block_samples=singles or None, return_dict=False)[0]
        return (out,)


class FluxControlTransformerSpec(FluxTransformerSpec):
    """``pipe.transformer`` of a FLUX.1 ControlNet pipeline with one residual input per block
    (:func:`block_names`), after the plain transformer's inputs."""

    name = CONTROL_TRANSFORMER
    segment_blocks = None  # (whole: a segment's residual inputs are not cut yet)

    def __init__(self, pipe) -> None:
        super().__init__(pipe)
        if not is_flux_transformer(pipe.transformer):
            raise UnsupportedComponent(f"{type(pipe.transformer).__name__} is not FLUX.1's transformer")

    @property
    def attribute(self) -> str:
        return "transformer"

    def residual_names(self) -> list[str]:
        return block_names(self._cfg)

    def inputs(self) -> tuple[TensorSpec, ...]:
        dim = self.pipe.transformer.inner_dim
        return (*super().inputs(),
                *(TensorSpec(n, ("B", "N", dim), torch.float32) for n in self.residual_names()))

    def export_module(self) -> torch.nn.Module:
        return _ControlTransformerExport(self.pipe.transformer, self.guidance)

    def scale(self, name: str) -> float:
        return 0.1 if name.startswith(("block_", "single_")) else 1.0  # residuals: small beside the states


def flux_control_specs(pipe, nets: list[torch.nn.Module], key) -> dict:
    """The specs a FLUX.1 ControlNet pipeline adds: one per net that exports (``key(i)`` names
    them) and the residual-taking transformer. Those that cannot be exported are left out with
    the reason in the log (they run in torch)."""
    import logging

    log = logging.getLogger("sd_accel")
    out: dict = {}
    for i, net in enumerate(nets):
        try:
            out[key(i)] = FluxControlNetSpec(pipe, net)
        except UnsupportedComponent as exc:
            log.warning("%s: %s", key(i), exc)
    try:
        out[CONTROL_TRANSFORMER] = FluxControlTransformerSpec(pipe)
    except UnsupportedComponent as exc:
        log.warning("%s: %s", CONTROL_TRANSFORMER, exc)
    return out
