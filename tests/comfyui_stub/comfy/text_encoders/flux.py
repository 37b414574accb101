"""``comfy.text_encoders.flux``, made tiny: ``FluxClipModel`` (``clip_l`` and ``t5xxl``: the T5
conditioning and CLIP-L's pooled row) and the T5 side of ``SDClipModel`` (``T5XXLModel``: tokens
-> the ``shared`` embeddings -> its ``T5`` as ``transformer(None, None, embeds=..., ...)``, no
attention mask, the last layer), with the tokenizer's form: ``{"l": [...], "t5xxl": [...]}``,
T5's tokens padded with 0 to at least 256, ended by 1."""

from __future__ import annotations

import zlib

import torch

from comfy.sd1_clip import SDClipModel
from comfy.sd1_clip import tokenize as tokenize_l
from comfy.text_encoders.t5 import T5

T5_MIN = 256


class T5XXLModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = T5()
        self.num_layers = self.transformer.num_layers
        self.layer, self.layer_idx = "last", None

    def set_clip_options(self, options):
        pass  # (T5 keeps its last layer: CLIPSetLastLayer acts on CLIP-L)

    def forward(self, tokens):
        ids = torch.tensor([[int(t) for t in chunk] for chunk in tokens])
        embeds = self.transformer.get_input_embeddings()(ids, out_dtype=torch.float32)
        out = self.transformer(None, None, embeds=embeds, num_tokens=[len(c) for c in tokens], intermediate_output=None,
                               final_layer_norm_intermediate=True, dtype=torch.float32, embeds_info=[])
        return out[0].float(), None

    def encode_token_weights(self, token_weight_pairs):
        z, _ = self([[t for t, _ in chunk] for chunk in token_weight_pairs])
        weights = torch.tensor([[w for _, w in chunk] for chunk in token_weight_pairs]).unsqueeze(-1)
        return z * weights, None


class FluxClipModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.clip_l = SDClipModel()
        self.t5xxl = T5XXLModel()

    def set_clip_options(self, options):
        self.clip_l.set_clip_options(options)
        self.t5xxl.set_clip_options(options)

    def encode_token_weights(self, token_weight_pairs):
        t5_out, _ = self.t5xxl.encode_token_weights(token_weight_pairs["t5xxl"])
        _, l_pooled = self.clip_l.encode_token_weights(token_weight_pairs["l"])
        return t5_out, l_pooled


def tokenize(text: str, embeddings: dict | None = None) -> dict:
    words = text.split()
    ids = [(zlib.crc32(w.encode()) % 300 + 2, 1.0) for w in words] + [(1, 1.0)]
    return {"l": tokenize_l(text, embeddings)["l"], "t5xxl": [ids + [(0, 1.0)] * max(0, T5_MIN - len(ids))]}
