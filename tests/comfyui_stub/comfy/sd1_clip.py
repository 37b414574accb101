"""``comfy.sd1_clip``, made tiny: ``SDClipModel`` (tokens -> embeddings -> its ``CLIPTextModel``, the
layer choice of CLIPSetLastLayer) and ``SD1ClipModel`` (``clip_l``), with ComfyUI's token form: a
list of 77-token chunks of (token, weight) pairs, a tensor in place of a token for an embedding."""

from __future__ import annotations

import numbers
import zlib

import torch

from comfy.clip_model import CLIPTextModel

START, END = 49406, 49407


class SDClipModel(torch.nn.Module):
    def __init__(self, layer="last", layer_idx=None, layer_norm_hidden_state=True):
        super().__init__()
        self.transformer = CLIPTextModel()
        self.num_layers = self.transformer.num_layers
        self.layer, self.layer_idx = layer, layer_idx
        self.layer_norm_hidden_state = layer_norm_hidden_state
        self.enable_attention_masks = False

    def set_clip_options(self, options):
        idx = options.get("layer", self.layer_idx)
        if idx is None or abs(idx) > self.num_layers:
            self.layer = "last"
        else:
            self.layer, self.layer_idx = "hidden", idx

    def process_tokens(self, tokens):
        embeds_out, masks, counts = [], [], []
        for chunk in tokens:
            ids, extra, mask, eos = [], [], [], False
            for i, t in enumerate(chunk):
                if isinstance(t, numbers.Integral):
                    mask.append(0 if eos else 1)
                    ids.append(int(t))
                    eos = eos or int(t) == END
                else:
                    extra.append((i, t))
            emb = self.transformer.get_input_embeddings()(torch.tensor([ids]))
            for i, vec in extra:  # textual inversion: the vector takes the place of a token
                emb = torch.cat([emb[:, :i], vec.reshape(1, -1, emb.shape[-1]), emb[:, i:]], dim=1)[:, :77]
                mask.insert(i, 1)
            embeds_out.append(emb)
            masks.append(mask[:77])
            counts.append(sum(mask[:77]))
        return torch.cat(embeds_out), torch.tensor(masks), counts

    def forward(self, tokens):
        embeds, mask, counts = self.process_tokens(tokens)
        out = self.transformer(None, mask if self.enable_attention_masks else None, embeds=embeds, num_tokens=counts,
                               intermediate_output=self.layer_idx if self.layer == "hidden" else None,
                               final_layer_norm_intermediate=self.layer_norm_hidden_state, dtype=torch.float32)
        z = out[0] if self.layer == "last" else out[1]
        return z.float(), out[2].float()

    def encode_token_weights(self, token_weight_pairs):
        tokens = [[t for t, _ in chunk] for chunk in token_weight_pairs]
        z, pooled = self(tokens)
        weights = torch.tensor([[w for _, w in chunk] for chunk in token_weight_pairs]).unsqueeze(-1)
        z = z * weights  # ComfyUI weighs against the empty prompt; plain scaling is enough here
        return torch.cat(list(z), dim=0).unsqueeze(0), pooled[:1]


class SD1ClipModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.clip = "clip_l"
        self.clip_l = SDClipModel()

    def set_clip_options(self, options):
        self.clip_l.set_clip_options(options)

    def encode_token_weights(self, token_weight_pairs):
        return self.clip_l.encode_token_weights(token_weight_pairs["l"])


def tokenize(text: str, embeddings: dict | None = None) -> dict:
    """Words to ids (a stable hash into the vocabulary), ``(word:1.2)`` weights, ``embedding:NAME``
    vectors; 75 per chunk between start and end, padded with the end token."""
    items = []
    for word in text.split():
        weight = 1.0
        if word.startswith("(") and word.endswith(")") and ":" in word:
            word, w = word[1:-1].rsplit(":", 1)
            weight = float(w)
        if word.startswith("embedding:") and embeddings and word[10:] in embeddings:
            items += [(vec, weight) for vec in embeddings[word[10:]]]
        else:
            items.append((zlib.crc32(word.encode()) % 49000 + 1, weight))
    chunks = [items[i:i + 75] for i in range(0, max(len(items), 1), 75)] or [[]]
    out = []
    for chunk in chunks:
        row = [(START, 1.0), *chunk, (END, 1.0)]
        out.append(row + [(END, 1.0)] * (77 - len(row)))
    return {"l": out}
