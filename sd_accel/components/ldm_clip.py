"""The WebUI's CLIP text encoder (a transformers ``CLIPTextModel``) as an exportable component.

A1111 (``FrozenCLIPEmbedder.transformer``, wrapped by its prompt-weighting hijack), Forge 1
(ldm_patched's ``SDClipModel.transformer``) and Forge 2 (``IntegratedCLIP.transformer``) all call
a transformers ``CLIPTextModel`` as
``transformer(input_ids=tokens, output_hidden_states=...)`` on chunks of 77 tokens and then pick
the last or an earlier hidden state (clip skip) and apply the final layer norm themselves. The
engine is :class:`~sd_accel.components.clip.ClipSpec`'s (``input_ids`` in; the last hidden
state, the pooled output and every hidden state out), named ``ldm_clip`` so that it is keyed
with the WebUI's weights ids. OpenCLIP text encoders (SD 2.x, SDXL's second) are not
transformers models and stay in PyTorch.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sd_accel.components.clip import ClipSpec

COMPONENT = "ldm_clip"


class LdmClipSpec(ClipSpec):
    """A WebUI's transformers ``CLIPTextModel``."""

    name = COMPONENT

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__(SimpleNamespace(text_encoder=transformer))

    @property
    def projected(self) -> bool:
        """Never: a ``CLIPTextModel`` gives ``pooler_output``. Forge 2 hangs a ``text_projection``
        Linear on it (``IntegratedCLIP(..., add_text_projection=True)``, for its own pooled
        output), which :class:`ClipSpec`'s test took for a projection head: the export then asked
        for ``text_embeds`` and failed on a real Forge 2."""
        return False


def is_clip_text_model(module) -> bool:
    """A transformers ``CLIPTextModel`` (not one with a projection head, not an OpenCLIP model)."""
    return type(module).__name__ == "CLIPTextModel" and hasattr(module, "config")


__all__ = ["COMPONENT", "LdmClipSpec", "is_clip_text_model"]
