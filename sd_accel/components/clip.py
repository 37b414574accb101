"""CLIP text encoders: ``clip`` (``pipe.text_encoder``) and ``clip2`` (SDXL's ``pipe.text_encoder_2``).

Engine inputs: ``input_ids`` (B, 77) int32 (TensorRT prefers int32; the runtime casts).
Engine outputs: ``last_hidden_state`` (B, 77, D); ``pooler_output`` (B, D) for a plain
``CLIPTextModel`` or ``text_embeds`` (B, P) for a ``CLIPTextModelWithProjection``; and every
hidden state ``hidden_states.0`` (the embeddings) .. ``hidden_states.N`` (after layer N, before
the final layer norm), so the runtime can serve any ``clip_skip`` and SDXL's penultimate layer
exactly. They cost little: the encoder is small next to the UNet.

The token dimension is fixed at 77: the caller encodes longer prompts in 77-token chunks.
"""

from __future__ import annotations

import torch

from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.core import InvalidValue
from sd_accel.profiles import TOKEN_CHUNK, Profile, Range


def is_clip(module) -> bool:
    """A transformers CLIP text model (with or without projection): SDXL's and SD3's
    ``text_encoder_2`` is one, FLUX.1's is T5."""
    return type(getattr(module, "torch_module", module)).__name__.startswith("CLIP")


class _ClipExport(torch.nn.Module):
    """Positional ``input_ids`` in, a flat tuple out (what the ONNX tracer needs)."""

    def __init__(self, encoder: torch.nn.Module, projected: bool) -> None:
        super().__init__()
        self.encoder = encoder
        self.projected = projected

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.encoder(input_ids, output_hidden_states=True, return_dict=True)
        pooled = out.text_embeds if self.projected else out.pooler_output
        return (out.last_hidden_state, pooled, *out.hidden_states)


class ClipSpec(ComponentSpec):
    """``pipe.text_encoder``: a CLIP text model, with or without the projection head."""

    name = "clip"
    attribute = "text_encoder"

    def torch_module(self) -> torch.nn.Module:
        module = getattr(self.pipe, self.attribute, None)
        if module is None:
            raise InvalidValue(f"the pipeline has no {self.attribute}; the {self.name!r} component does not apply")
        return module

    @property
    def projected(self) -> bool:
        """Whether the encoder has a projection head (SDXL's second encoder): it gives ``text_embeds``."""
        return hasattr(self.torch_module(), "text_projection")

    def _config(self):
        return self.torch_module().config

    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("input_ids", ("B", TOKEN_CHUNK), torch.int32),)

    def outputs(self) -> tuple[TensorSpec, ...]:
        cfg = self._config()
        width = cfg.hidden_size
        if self.projected:
            pooled = TensorSpec("text_embeds", ("B", cfg.projection_dim), torch.float32)
        else:
            pooled = TensorSpec("pooler_output", ("B", width), torch.float32)
        hidden = tuple(
            TensorSpec(f"hidden_states.{i}", ("B", TOKEN_CHUNK, width), torch.float32)
            for i in range(cfg.num_hidden_layers + 1)
        )
        return (TensorSpec("last_hidden_state", ("B", TOKEN_CHUNK, width), torch.float32), pooled, *hidden)

    def export_module(self) -> torch.nn.Module:
        return _ClipExport(self.torch_module(), self.projected)

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        # diffusers encodes the prompt and the negative prompt in separate calls of batch 1 (or
        # one row per prompt), so batch 1 must always be served, static profile or not.
        _, opt, hi = profile.batch
        return {"B": (1, opt, hi)}

    def export_dims(self) -> dict[str, int]:
        return {"B": 2}

    def int_high(self, name: str) -> int:
        return int(self._config().vocab_size)


class Clip2Spec(ClipSpec):
    """SDXL's ``pipe.text_encoder_2`` (``CLIPTextModelWithProjection``)."""

    name = "clip2"
    attribute = "text_encoder_2"
