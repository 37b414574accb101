"""``backend/text_processing/classic_engine.py``: Forge 2's prompt chunking around CLIP.

``encode_with_transformers`` calls ``text_encoder.transformer(tokens, output_hidden_states=True)``
and takes ``hidden_states[-clip_skip]`` through the final layer norm. Textual-inversion words
(``ti-<name>``) go through ``EmbeddingsWithFixes`` and ``self.fixes``, as in Forge.
"""

from __future__ import annotations

import torch


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
        rows = []
        for fixes, tensor in zip(batch_fixes, inputs_embeds, strict=True):
            for offset, embedding in fixes:
                tensor = torch.cat([tensor[0:offset + 1], embedding[None], tensor[offset + 2:]])
            rows.append(tensor)
        return torch.stack(rows)


class ClassicTextProcessingEngine:
    def __init__(self, text_encoder, clip_skip=1):
        self.text_encoder = text_encoder
        self.clip_skip = clip_skip
        self.fixes = None
        self.embeddings = self
        emb = getattr(text_encoder.transformer, "text_model", text_encoder.transformer).embeddings
        emb.token_embedding = EmbeddingsWithFixes(emb.token_embedding, self)

    def __call__(self, texts):
        from ldm.modules.encoders.modules import BOS, EOS, word_id

        lines = []
        for text in texts:
            tokens, fixes = [], []
            for word in text.split():
                if word.startswith("ti-"):
                    fixes.append((len(tokens), torch.full((self.text_encoder.transformer.config.hidden_size,), 0.5)))
                tokens.append(word_id(word))
            lines.append((tokens, fixes))
        chunks = max(max(1, -(-len(t) // 75)) for t, _ in lines)
        zs = []
        for i in range(chunks):
            a, b = i * 75, (i + 1) * 75
            ids = [[BOS, *t[a:b], *([EOS] * (76 - len(t[a:b])))] for t, _ in lines]
            self.fixes = [[(o - a, e) for o, e in f if a <= o < b] for _, f in lines]
            zs.append(self.encode_with_transformers(torch.tensor(ids)))
        return torch.cat(zs, dim=1)

    def encode_with_transformers(self, tokens):
        outputs = self.text_encoder.transformer(tokens, output_hidden_states=True)
        z = outputs.hidden_states[-max(self.clip_skip, 1)]
        return getattr(self.text_encoder.transformer, "text_model", self.text_encoder.transformer).final_layer_norm(z)
