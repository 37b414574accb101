"""FLUX.1's transformer in segments (``sd_accel.components.segments``): what each one takes,
computes and passes on, as ``FluxTransformer2DModel.forward`` does it in one piece.

The first segment embeds the inputs (``hidden``, ``context``, ``temb``); every segment computes the
rotary positions again from ``img_ids`` / ``txt_ids`` (no weights; (N + L) x 128 values: cheaper to
recompute than to pass on); the last applies the final norm and projection (``latent``).

A step-cache plan's first segment also gives its block's residual (``first_residual``), and its
last segment holds no block: it takes only ``hidden`` and ``temb``.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from sd_accel.components.flux.export import export_patches
from sd_accel.components.segments import FIRST_RESIDUAL, NEXT, Segment, SegmentModule
from sd_accel.components.spec import TensorSpec

BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")


class FluxSegment(SegmentModule):
    def __init__(self, transformer: torch.nn.Module, segment: Segment, guidance: bool) -> None:
        super().__init__()
        self.first, self.last, self.guidance = segment.first, segment.last, guidance
        self.residual, self.blockless = segment.residual, not segment.blocks
        self.pos_embed = transformer.pos_embed
        if self.first:
            self.x_embedder = transformer.x_embedder
            self.time_text_embed = transformer.time_text_embed
            self.context_embedder = transformer.context_embedder
        self.double_blocks = torch.nn.ModuleList(transformer.transformer_blocks[i] for name, i in segment.blocks
                                          if name == "transformer_blocks")
        self.single_blocks = torch.nn.ModuleList(transformer.single_transformer_blocks[i] for name, i in segment.blocks
                                          if name == "single_transformer_blocks")
        if self.last:
            self.norm_out = transformer.norm_out
            self.proj_out = transformer.proj_out

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with export_patches(self) if torch.onnx.is_in_onnx_export() else nullcontext():
            return self._run(*args)

    def _run(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.first:
            hidden_states, encoder_hidden_states, pooled, timestep, img_ids, txt_ids, *guidance = args
            hidden = self.x_embedder(hidden_states)
            timestep = timestep.to(hidden.dtype) * 1000
            temb = (self.time_text_embed(timestep, guidance[0].to(hidden.dtype) * 1000, pooled) if self.guidance
                    else self.time_text_embed(timestep, pooled))
            context = self.context_embedder(encoder_hidden_states)
        elif self.blockless:  # (a step-cache plan's last segment: the final norm and projection)
            hidden, temb = args
        else:
            hidden, context, temb, img_ids, txt_ids = args
        embedded = hidden
        if not self.blockless:
            rotary = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        for block in (*self.double_blocks, *self.single_blocks):
            context, hidden = block(hidden_states=hidden, encoder_hidden_states=context, temb=temb,
                                    image_rotary_emb=rotary)
        if self.last:
            return (self.proj_out(self.norm_out(hidden, temb)),)
        if self.residual:
            return hidden, context, temb, hidden - embedded
        return (hidden, context, temb) if self.first else (hidden, context)


def segment_io(spec, segment: Segment) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) of ``segment`` of ``spec`` (a :class:`FluxTransformerSpec`)."""
    cfg, f32 = spec._cfg, torch.float32
    inner = int(cfg.num_attention_heads) * int(cfg.attention_head_dim)
    hidden = TensorSpec("hidden", ("B", "N", inner), f32)
    context = TensorSpec("context", ("B", "L", inner), f32)
    temb = TensorSpec("temb", ("B", inner), f32)
    outer = {t.name: t for t in spec.inputs()}
    ids = (outer["img_ids"], outer["txt_ids"])
    inputs = spec.inputs() if segment.first else (hidden, temb) if not segment.blocks else (hidden, context, temb, *ids)
    passed = (TensorSpec(hidden.name + NEXT, hidden.dims, f32), TensorSpec(context.name + NEXT, context.dims, f32))
    outputs = spec.outputs() if segment.last else (*passed, temb) if segment.first else passed
    if segment.residual:
        outputs = (*outputs, TensorSpec(FIRST_RESIDUAL, hidden.dims, f32))
    return tuple(inputs), tuple(outputs)
