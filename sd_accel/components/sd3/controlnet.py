"""SD3 ControlNet: the ``controlnet`` component of a ``StableDiffusion3ControlNetPipeline`` (a
diffusers ``SD3ControlNetModel``: InstantX's kind, with its own position and text embedders) and
``transformer_control``, the MMDiT taking the nets' block samples as inputs.

``controlnet`` inputs: the transformer's (``hidden_states`` (B2, C, H8, W8), ``encoder_hidden_states``,
``pooled_projections``: zeros where the net says ``force_zeros_for_pooled_projection``, the
pipeline passes them; ``timestep``), ``controlnet_cond`` (B2, C, H8, W8): the control image's VAE
latents, ``conditioning_scale`` (B2,). Outputs: ``block_0`` .., one per block of the net, (B2, N, D)
with N = (H8 / p) x (W8 / p) image tokens, already times the scale.

``transformer_control`` takes one residual per block of the transformer, added to the image
tokens after the block: the runtime picks each block's sample as ``SD3Transformer2DModel`` does
(``int(i / (blocks / samples))``), sums several nets', zeros where none reaches: one engine for any
net, any number of them, every scale. diffusers adds none after a ``context_pre_only`` block (the
last): its input is zeros there; ComfyUI's MMDiT adds ``control["output"][i]`` after every block,
the last too, and feeds it (:mod:`sd_accel.comfyui.mmdit`).

SD3.5 Large's nets (no text embedder: they share the transformer's position embedding and take
its embedded tokens) run in torch; their samples still go to ``transformer_control``.
"""

from __future__ import annotations

import torch

from sd_accel.components.sd3.transformer import SD3TransformerSpec, is_sd3_transformer
from sd_accel.components.spec import TensorSpec
from sd_accel.components.transformer import ControlNetSpecMixin
from sd_accel.core import UnsupportedComponent
from sd_accel.profiles import Profile, Range

CONTROL_TRANSFORMER = "transformer_control"


def is_sd3_controlnet(module) -> bool:
    return type(getattr(module, "torch_module", module)).__name__ == "SD3ControlNetModel"


def residual_blocks(transformer: torch.nn.Module) -> list[int]:
    """The transformer blocks that add a ControlNet sample (a ``context_pre_only`` block does not)."""
    return [i for i, b in enumerate(transformer.transformer_blocks) if not getattr(b, "context_pre_only", False)]


def pick(samples, transformer: torch.nn.Module) -> dict[int, int]:
    """Block -> the index of the sample it adds, as ``SD3Transformer2DModel`` picks it."""
    n = len(samples) if samples is not None else 0
    if n == 0:
        return {}
    interval = len(transformer.transformer_blocks) / n
    return {i: int(i / interval) for i in residual_blocks(transformer)}


def _tokens(spec, profile: Profile) -> dict[str, Range]:
    patch = int(spec.pipe.transformer.config.patch_size)
    ranges = SD3TransformerSpec.dim_ranges(spec, profile)
    h, w = ranges["H8"], ranges["W8"]
    return {**ranges, "N": tuple((a // patch) * (b // patch) for a, b in zip(h, w, strict=True))}  # type: ignore[dict-item]


def _export_tokens(spec) -> dict[str, int]:
    dims = SD3TransformerSpec.export_dims(spec)
    patch = int(spec.pipe.transformer.config.patch_size)
    return {**dims, "N": (dims["H8"] // patch) * (dims["W8"] // patch)}


class _NetExport(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, controlnet_cond,
                conditioning_scale):
        (samples,) = self.net(hidden_states=hidden_states, controlnet_cond=controlnet_cond, conditioning_scale=1.0,
                              encoder_hidden_states=encoder_hidden_states, pooled_projections=pooled_projections,
                              timestep=timestep, return_dict=False)
        return tuple(s * conditioning_scale.reshape(-1, 1, 1) for s in samples)


class SD3ControlNetSpec(ControlNetSpecMixin, SD3TransformerSpec):
    """One ``SD3ControlNetModel`` of an SD3 ControlNet pipeline (``pipe.controlnet`` or one of
    an ``SD3MultiControlNetModel``'s ``nets``)."""

    def __init__(self, pipe, net: torch.nn.Module | None = None) -> None:
        super().__init__(pipe)
        self.net = net if net is not None else pipe.controlnet
        if not is_sd3_controlnet(self.net):
            raise UnsupportedComponent(f"{type(self.net).__name__} is not a diffusers SD3ControlNetModel; "
                                       "it keeps running in torch")
        if getattr(self.net, "context_embedder", None) is None or getattr(self.net, "pos_embed", None) is None:
            raise UnsupportedComponent("this SD3 ControlNet has no text or position embedder of its own (SD3.5 "
                                       "Large's kind): it keeps running in torch; its samples still reach the "
                                       "transformer's engine")

    def inputs(self) -> tuple[TensorSpec, ...]:
        f32 = torch.float32
        return (*super().inputs(), TensorSpec("controlnet_cond", ("B2", self._cfg.in_channels, "H8", "W8"), f32),
                TensorSpec("conditioning_scale", ("B2",), f32))

    def outputs(self) -> tuple[TensorSpec, ...]:
        dim = self.net.inner_dim
        return tuple(TensorSpec(f"block_{i}", ("B2", "N", dim), torch.float32)
                     for i in range(len(self.net.transformer_blocks)))

    def export_module(self) -> torch.nn.Module:
        return _NetExport(self.net)

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        return _tokens(self, profile)

    def export_dims(self) -> dict[str, int]:
        return _export_tokens(self)



def _adds(residual: torch.Tensor):
    def hook(_block, _args, out):
        context, hidden = out
        return context, hidden + residual

    return hook


class _ControlTransformerExport(torch.nn.Module):
    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer
        self.pre_only = sorted(set(range(len(transformer.transformer_blocks))) - set(residual_blocks(transformer)))

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, *residuals):
        # one sample per block: the transformer's interval is 1, block i adds samples[i]; a
        # context_pre_only block's (which diffusers skips) is added by a hook on its output
        blocks = self.transformer.transformer_blocks
        hooks = [blocks[i].register_forward_hook(_adds(residuals[i])) for i in self.pre_only]
        try:
            out = self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                   pooled_projections=pooled_projections, timestep=timestep,
                                   block_controlnet_hidden_states=list(residuals), return_dict=False)[0]
        finally:
            for hook in hooks:
                hook.remove()
        return (out,)


class SD3ControlTransformerSpec(SD3TransformerSpec):
    """``pipe.transformer`` of an SD3 ControlNet pipeline with one residual input (``block_{i}``) per
    block, after the plain transformer's inputs."""

    name = CONTROL_TRANSFORMER
    segment_blocks = None  # (whole: a segment's residual inputs are not cut yet)

    def __init__(self, pipe) -> None:
        super().__init__(pipe)
        if not is_sd3_transformer(pipe.transformer):
            raise UnsupportedComponent(f"{type(pipe.transformer).__name__} is not SD3's transformer")

    @property
    def attribute(self) -> str:
        return "transformer"

    def residual_names(self) -> list[str]:
        return [f"block_{i}" for i in range(len(self.pipe.transformer.transformer_blocks))]

    def inputs(self) -> tuple[TensorSpec, ...]:
        dim = self.pipe.transformer.inner_dim
        return (*super().inputs(), *(TensorSpec(n, ("B2", "N", dim), torch.float32) for n in self.residual_names()))

    def export_module(self) -> torch.nn.Module:
        return _ControlTransformerExport(self.pipe.transformer)

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        return _tokens(self, profile)

    def export_dims(self) -> dict[str, int]:
        return _export_tokens(self)

    def scale(self, name: str) -> float:
        return 0.1 if name.startswith("block_") else 1.0  # residuals: small beside the states


def sd3_control_specs(pipe, nets: list[torch.nn.Module], key) -> dict:
    """The specs an SD3 ControlNet pipeline adds (see :func:`sd_accel.components.flux.controlnet.flux_control_specs`)."""
    import logging

    log = logging.getLogger("sd_accel")
    out: dict = {}
    for i, net in enumerate(nets):
        try:
            out[key(i)] = SD3ControlNetSpec(pipe, net)
        except UnsupportedComponent as exc:
            log.warning("%s: %s", key(i), exc)
    try:
        out[CONTROL_TRANSFORMER] = SD3ControlTransformerSpec(pipe)
    except UnsupportedComponent as exc:
        log.warning("%s: %s", CONTROL_TRANSFORMER, exc)
    return out
