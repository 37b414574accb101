"""ComfyUI's own CLIP text encoder (``comfy.clip_model.CLIPTextModel``) as an exportable component.

ComfyUI does not run a transformers model: its ``SDClipModel`` turns the tokens into embeddings
itself (``process_tokens``: the token embedding table, textual-inversion vectors spliced in) and
calls its ``CLIPTextModel`` as ``transformer(None, mask, embeds=..., num_tokens=...,
intermediate_output=layer_idx, final_layer_norm_intermediate=...)``, then takes the last or an
earlier layer (``CLIPSetLastLayer``, SDXL's and SD 2.x's penultimate) and the pooled row. So
this engine takes ``embeds`` (B, 77, D: one row per 77-token chunk), adds the position
embedding and runs the causal encoder; it gives ``last`` (after the final layer norm) and
``hidden`` (B, L, 77, D: every layer's output, before it), which serve any layer choice. The
pooled row and its projection are a gather and one small matmul: the runtime does them in torch
(:mod:`sd_accel.comfyui.clip`). One engine per encoder (``clip_l``, ``clip_g``, ``clip_h``): the
checkpoint's id plus the encoder's name is its weights id.
"""

from __future__ import annotations

import math

import torch

from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.core import UnsupportedComponent
from sd_accel.profiles import TOKEN_CHUNK, Profile, Range

COMPONENT = "comfy_clip"


def is_comfy_clip(module) -> bool:
    """A ComfyUI ``CLIPTextModel``: ``text_model`` with embeddings, an encoder and a final norm."""
    tm = getattr(module, "text_model", None)
    return (tm is not None and hasattr(tm, "encoder") and hasattr(tm, "final_layer_norm")
            and hasattr(getattr(tm, "embeddings", None), "position_embedding")
            and hasattr(module, "num_layers"))


def _attention(q, k, v, heads, mask=None, **kwargs):
    """ComfyUI's ``optimized_attention(q, k, v, heads, mask)`` in plain ops (what every backend fuses)."""
    b, t, inner = q.shape
    d = inner // heads
    q, k, v = (a.reshape(b, t, heads, d).transpose(1, 2) for a in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if mask is not None:
        scores = scores + mask
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(b, t, inner)


class _ComfyClipExport(torch.nn.Module):
    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(self, embeds):
        tm = self.transformer.text_model
        pos = tm.embeddings.position_embedding.weight
        x = embeds + pos.to(embeds.dtype)[: embeds.shape[1]]
        t = embeds.shape[1]
        causal = torch.full((t, t), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device).triu(1)
        hidden = []
        for layer in tm.encoder.layers:
            x = layer(x, causal, _attention)
            hidden.append(x.clone())  # the layers add in place
        return tm.final_layer_norm(x), torch.stack(hidden, dim=1)


class ComfyClipSpec(ComponentSpec):
    """One of ComfyUI's CLIP text encoders (``clip.cond_stage_model.clip_l.transformer`` ...).

    (Skipped in the test suite: it needs ComfyUI's CLIP module; tests/test_comfyui_pack.py runs it
    on a stand-in.)

    >>> spec = ComfyClipSpec(clip.cond_stage_model.clip_l.transformer)       # doctest: +SKIP
    >>> [t.name for t in spec.outputs()]                                     # doctest: +SKIP
    ['last', 'hidden']
    """

    name = COMPONENT

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__(pipe=None)
        if not is_comfy_clip(transformer):
            raise UnsupportedComponent(f"{type(transformer).__name__} is not ComfyUI's CLIPTextModel: it stays in "
                                       "PyTorch")
        self.transformer = transformer

    @property
    def width(self) -> int:
        return int(self.transformer.text_model.final_layer_norm.weight.shape[0])

    @property
    def layers(self) -> int:
        return len(self.transformer.text_model.encoder.layers)

    def torch_module(self) -> torch.nn.Module:
        return self.transformer

    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("embeds", ("B", TOKEN_CHUNK, self.width), torch.float32),)

    def outputs(self) -> tuple[TensorSpec, ...]:
        f32 = torch.float32
        return (TensorSpec("last", ("B", TOKEN_CHUNK, self.width), f32),
                TensorSpec("hidden", ("B", self.layers, TOKEN_CHUNK, self.width), f32))

    def export_module(self) -> torch.nn.Module:
        return _ComfyClipExport(self.transformer)

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        # ComfyUI encodes each prompt alone, one row per 77-token chunk: 1 .. the profile's chunks.
        chunks = max(1, math.ceil(profile.tokens[2] / TOKEN_CHUNK))
        return {"B": (1, 1, chunks)}

    def export_dims(self) -> dict[str, int]:
        return {"B": 2}

    def scale(self, name: str) -> float:
        return 0.02  # token embeddings are of this size


__all__ = ["COMPONENT", "ComfyClipSpec", "is_comfy_clip"]
