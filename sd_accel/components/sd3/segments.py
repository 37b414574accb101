"""SD3 / SD3.5's transformer in segments (``sd_accel.components.segments``), as
``SD3Transformer2DModel.forward`` computes it in one piece.

The first segment embeds the inputs (``hidden``: T image tokens, T = (H8 / p) x (W8 / p);
``context``; ``temb``); the last applies the final norm and projection and unpatchifies, for which
it also takes the latent ``hidden_states`` (only its shape is read). The last block of SD3 updates
the image tokens only (``context_pre_only``), so it always sits in the last segment.
"""

from __future__ import annotations

import torch

from sd_accel.components.segments import FIRST_RESIDUAL, NEXT, Segment, SegmentModule
from sd_accel.components.spec import TensorSpec
from sd_accel.profiles import Range

BLOCK_LISTS = ("transformer_blocks",)


class SD3Segment(SegmentModule):
    def __init__(self, transformer: torch.nn.Module, segment: Segment) -> None:
        super().__init__()
        self.first, self.last, self.residual = segment.first, segment.last, segment.residual
        if self.first:
            self.pos_embed = transformer.pos_embed
            self.time_text_embed = transformer.time_text_embed
            self.context_embedder = transformer.context_embedder
        self.blocks = torch.nn.ModuleList(transformer.transformer_blocks[i] for _, i in segment.blocks)
        if self.last:
            self.norm_out = transformer.norm_out
            self.proj_out = transformer.proj_out
            self.patch = int(transformer.config.patch_size)
            self.out_channels = int(transformer.out_channels)

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.first:
            latent, encoder_hidden_states, pooled, timestep = args
            hidden = self.pos_embed(latent).contiguous()
            temb = self.time_text_embed(timestep, pooled)
            context = self.context_embedder(encoder_hidden_states)
        elif self.last and not self.blocks:  # (a step-cache plan's last segment: no block)
            hidden, temb, latent = args
        else:
            hidden, context, temb, *rest = args
            latent = rest[0] if rest else None
        embedded = hidden
        for block in self.blocks:
            context, hidden = block(hidden_states=hidden, encoder_hidden_states=context, temb=temb)
        if self.residual:
            return hidden, context, temb, hidden - embedded
        if not self.last:
            # (the last block updates the image tokens only: a segment ending with it passes those on)
            return (hidden, context, temb) if self.first else (hidden,) if context is None else (hidden, context)
        hidden = self.proj_out(self.norm_out(hidden, temb))
        p, c = self.patch, self.out_channels
        height, width = latent.shape[-2] // p, latent.shape[-1] // p
        hidden = hidden.reshape(hidden.shape[0], height, width, p, p, c)
        hidden = torch.einsum("nhwpqc->nchpwq", hidden)
        return (hidden.reshape(hidden.shape[0], c, height * p, width * p),)


def segment_io(spec, segment: Segment) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) of ``segment`` of ``spec`` (a :class:`SD3TransformerSpec`)."""
    cfg, f32 = spec._cfg, torch.float32
    inner = int(cfg.num_attention_heads) * int(cfg.attention_head_dim)
    hidden = TensorSpec("hidden", ("B2", "T", inner), f32)
    context = TensorSpec("context", ("B2", "S", inner), f32)
    temb = TensorSpec("temb", ("B2", inner), f32)
    latent_in = spec.inputs()[0]
    if segment.first:
        inputs: tuple[TensorSpec, ...] = spec.inputs()
    elif segment.last and not segment.blocks:
        inputs = (hidden, temb, latent_in)
    else:
        inputs = (hidden, context, temb, latent_in) if segment.last else (hidden, context, temb)
    passed: tuple[TensorSpec, ...] = (TensorSpec(hidden.name + NEXT, hidden.dims, f32),
                                      TensorSpec(context.name + NEXT, context.dims, f32))
    final = int(cfg.num_layers) - 1
    if not segment.last and not segment.first and ("transformer_blocks", final) in segment.blocks:
        passed = passed[:1]  # (the last block's context is None: context_pre_only)
    outputs = spec.outputs() if segment.last else (*passed, temb) if segment.first else passed
    if segment.residual:
        outputs = (*outputs, TensorSpec(FIRST_RESIDUAL, hidden.dims, f32))
    return inputs, outputs


def token_range(h8: Range, w8: Range, patch: int) -> Range:
    """The image token count T for latent sizes in ``h8`` x ``w8``."""
    return tuple((h // patch) * (w // patch) for h, w in zip(h8, w8, strict=True))  # type: ignore[return-value]
