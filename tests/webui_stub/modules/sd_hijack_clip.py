"""``modules/sd_hijack_clip.py``: A1111's prompt chunking around the CLIP text encoder.

``FrozenCLIPEmbedderWithCustomWords`` cuts each prompt into chunks of 75 tokens (77 with BOS and
EOS), pads every prompt of the batch to the same chunk count, and calls
``wrapped.transformer(input_ids=tokens, output_hidden_states=-opts.CLIP_stop_at_last_layers)``
once per chunk: the last hidden state, or with clip skip an earlier one through the final layer
norm. A textual-inversion word (``ti-<name>``) puts a fix in ``hijack.fixes`` for the call, which
``EmbeddingsWithFixes`` (the token embedding's wrapper, installed by ``sd_hijack``) applies.
"""

from __future__ import annotations

import torch

from modules import shared


class EmbeddingsWithFixes(torch.nn.Module):
    def __init__(self, wrapped, embeddings):
        super().__init__()
        self.wrapped = wrapped
        self.embeddings = embeddings

    def forward(self, input_ids):
        batch_fixes = self.embeddings.fixes
        self.embeddings.fixes = None
        inputs_embeds = self.wrapped(input_ids)
        if batch_fixes is None or len(batch_fixes) == 0 or max([len(x) for x in batch_fixes]) == 0:
            return inputs_embeds
        vecs = []
        for fixes, tensor in zip(batch_fixes, inputs_embeds, strict=True):
            for offset, embedding in fixes:
                tensor = torch.cat([tensor[0:offset + 1], embedding[None], tensor[offset + 2:]])
            vecs.append(tensor)
        return torch.stack(vecs)


class FrozenCLIPEmbedderWithCustomWords(torch.nn.Module):
    def __init__(self, wrapped, hijack):
        super().__init__()
        self.wrapped = wrapped
        self.hijack = hijack
        self.chunk_length = 75

    def tokenize_line(self, line):
        from ldm.modules.encoders.modules import word_id

        tokens, fixes = [], []
        for word in line.split():
            if word.startswith("ti-"):
                width = self.wrapped.transformer.config.hidden_size
                fixes.append((len(tokens), torch.full((width,), 0.5)))
            tokens.append(word_id(word))
        return tokens, fixes

    def forward(self, texts):
        lines = [self.tokenize_line(t) for t in texts]
        chunks = max(max(1, -(-len(tokens) // self.chunk_length)) for tokens, _ in lines)
        zs = []
        for i in range(chunks):
            a, b = i * self.chunk_length, (i + 1) * self.chunk_length
            ids, batch_fixes = [], []
            for tokens, fixes in lines:
                part = tokens[a:b]
                from ldm.modules.encoders.modules import BOS, EOS

                ids.append([BOS, *part, *([EOS] * (self.chunk_length + 1 - len(part)))])
                batch_fixes.append([(o - a, e) for o, e in fixes if a <= o < b])
            self.hijack.fixes = batch_fixes
            zs.append(self.encode_with_transformers(torch.tensor(ids)))
        return torch.cat(zs, dim=1)

    def encode_with_transformers(self, tokens):
        outputs = self.wrapped.transformer(input_ids=tokens, output_hidden_states=-shared.opts.CLIP_stop_at_last_layers)
        if shared.opts.CLIP_stop_at_last_layers > 1:
            z = outputs.hidden_states[-shared.opts.CLIP_stop_at_last_layers]
            z = getattr(self.wrapped.transformer, "text_model", self.wrapped.transformer).final_layer_norm(z)
        else:
            z = outputs.last_hidden_state
        return z
