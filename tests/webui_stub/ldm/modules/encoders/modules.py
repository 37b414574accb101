"""``ldm.modules.encoders.modules.FrozenCLIPEmbedder``: a transformers ``CLIPTextModel`` (the
sd-accel tiny SD 1.5 text encoder config, width 64 = the tiny UNet's context) and a tokenizer.

The tokenizer is a stand-in (a word's id from its bytes; CLIP's BOS 49406 and EOS/pad 49407):
what matters is ids of shape (B, 77) per chunk of 75 words. A word ``ti-<name>`` stands for a
textual-inversion embedding (see ``modules.sd_hijack_clip``).
"""

from __future__ import annotations

import torch
from torch import nn

BOS, EOS = 49406, 49407


def word_id(word: str) -> int:
    return 3 + (sum(word.encode()) * 31) % 49000


class FrozenCLIPEmbedder(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        from transformers import CLIPTextConfig, CLIPTextModel

        from sd_accel.models.builtin import tiny_configs

        cfg = {k: v for k, v in tiny_configs("sd15")["text_encoder/config.json"].items() if not k.startswith("_")}
        with torch.random.fork_rng():
            torch.manual_seed(seed + 11)
            self.transformer = CLIPTextModel(CLIPTextConfig(**cfg)).eval()
        self.max_length = 77

    def tokenize_words(self, text: str) -> list[int]:
        return [word_id(w) for w in text.split()]
