"""ComfyUI's own T5 text encoder (``comfy.text_encoders.t5.T5``: FLUX.1's and SD3's ``t5xxl``) as an
exportable component.

As for its CLIP (:mod:`sd_accel.components.comfy_clip`), ComfyUI turns the tokens into embeddings
itself (the ``shared`` table, textual-inversion vectors spliced in) and calls its T5 as
``transformer(None, mask, embeds=..., num_tokens=..., intermediate_output=...)``. FLUX.1 and SD3
call it without an attention mask and take the last layer: this engine takes ``embeds``
(B, T, D: one row per prompt, T5's tokens, 256 and more for FLUX.1, 77 and more for SD3) and gives
``last`` (after the final layer norm). The relative position bias is computed inside, from T.
One engine per encoder: the checkpoint's (or the text-encoder file's) id plus ``t5xxl``.
"""

from __future__ import annotations

import torch

from sd_accel.components.comfy_clip import _attention
from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.core import UnsupportedComponent
from sd_accel.profiles import Profile, Range

COMPONENT = "comfy_t5"
# T5's token range where the profile names none: SD3's 77 up to twice FLUX.1's 256
DEFAULT_TEXT: Range = (77, 256, 512)


def is_comfy_t5(module) -> bool:
    """A ComfyUI ``T5``: ``shared`` embeddings and an ``encoder`` of ``block`` s with a final norm."""
    encoder = getattr(module, "encoder", None)
    return (hasattr(module, "shared") and hasattr(encoder, "block") and hasattr(encoder, "final_layer_norm")
            and type(module).__name__ == "T5")


class _ComfyT5Export(torch.nn.Module):
    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(self, embeds):
        stack = self.transformer.encoder
        x, bias = embeds, None
        for block in stack.block:  # (no mask: FLUX.1's and SD3's T5 run without one)
            x, bias = block(x, None, bias, _attention)
        return (stack.final_layer_norm(x),)


class ComfyT5Spec(ComponentSpec):
    """ComfyUI's T5 (``clip.cond_stage_model.t5xxl.transformer``).

    (Skipped in the test suite: it needs ComfyUI's T5 module; tests/test_comfyui_flux_sd3.py runs
    it on a stand-in.)

    >>> spec = ComfyT5Spec(clip.cond_stage_model.t5xxl.transformer)          # doctest: +SKIP
    >>> [t.name for t in spec.outputs()]                                     # doctest: +SKIP
    ['last']
    """

    name = COMPONENT

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__(pipe=None)
        if not is_comfy_t5(transformer):
            raise UnsupportedComponent(f"{type(transformer).__name__} is not ComfyUI's T5: it stays in PyTorch")
        self.transformer = transformer

    @property
    def width(self) -> int:
        return int(self.transformer.encoder.final_layer_norm.weight.shape[0])

    def torch_module(self) -> torch.nn.Module:
        return self.transformer

    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("embeds", ("B", "T", self.width), torch.float32),)

    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("last", ("B", "T", self.width), torch.float32),)

    def export_module(self) -> torch.nn.Module:
        return _ComfyT5Export(self.transformer)

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        # ComfyUI encodes each prompt alone: one row
        return {"B": (1, 1, 1), "T": profile.text if profile.text is not None else DEFAULT_TEXT}

    def export_dims(self) -> dict[str, int]:
        return {"B": 1, "T": 80}

    def scale(self, name: str) -> float:
        return 1.0  # (T5's embeddings are of unit size)


__all__ = ["COMPONENT", "ComfyT5Spec", "is_comfy_t5"]
