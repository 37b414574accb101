"""T5's encoder in segments (``sd_accel.components.segments``): T5-XXL is 4.8B parameters (19 GB in
fp32), past what one export holds on a 24 GB machine, like the transformers it feeds.

The first segment embeds the ids and computes, in its first block, the relative position bias
every later block adds to its attention scores: it passes on ``hidden`` and ``position_bias``
(1, heads, L, L; 64 MB at L = 512 for T5-XXL's 64 heads); the last applies the final norm
(``last_hidden_state``). No attention mask: the pipelines call T5 without one, as the engine does.
"""

from __future__ import annotations

import torch

from sd_accel.components.segments import NEXT, Segment, SegmentModule
from sd_accel.components.spec import TensorSpec

BLOCK_LISTS = ("encoder.block",)


class T5Segment(SegmentModule):
    def __init__(self, model: torch.nn.Module, segment: Segment) -> None:
        super().__init__()
        self.first, self.last = segment.first, segment.last
        encoder = model.encoder
        # the model, unregistered (not a submodule: the export's fp32 conversion must not reach
        # the other segments' weights), for its attention setting (sd_accel.onnx.attention)
        self.__dict__["_model"] = model
        self.config = model.config
        if self.first:
            self.embed_tokens = encoder.embed_tokens
        self.blocks = torch.nn.ModuleList(encoder.block[i] for _, i in segment.blocks)
        if self.last:
            self.final_layer_norm = encoder.final_layer_norm

    def set_attn_implementation(self, implementation) -> None:
        self._model.set_attn_implementation(implementation)

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.first:
            (input_ids,) = args
            hidden, bias = self.embed_tokens(input_ids), None
        else:
            hidden, bias = args
        for block in self.blocks:
            hidden, bias, _ = block(hidden, None, bias)
        if self.last:
            return (self.final_layer_norm(hidden),)
        return (hidden, bias) if self.first else (hidden,)


def segment_io(spec, segment: Segment) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) of ``segment`` of ``spec`` (a :class:`~sd_accel.components.t5.T5Spec`)."""
    cfg, f32 = spec.torch_module().config, torch.float32
    hidden = TensorSpec("hidden", ("B", "L", int(cfg.d_model)), f32)
    bias = TensorSpec("position_bias", (1, int(cfg.num_heads), "L", "L"), f32)
    inputs = spec.inputs() if segment.first else (hidden, bias)
    passed = TensorSpec(hidden.name + NEXT, hidden.dims, f32)
    outputs = spec.outputs() if segment.last else (passed, bias) if segment.first else (passed,)
    return tuple(inputs), tuple(outputs)
