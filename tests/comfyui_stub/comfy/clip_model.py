"""``comfy.clip_model.CLIPTextModel``, made tiny: ComfyUI's module names (``text_model.embeddings``,
``encoder.layers[i].self_attn.q_proj`` ..., ``final_layer_norm``, ``text_projection``) and its call
``transformer(input_tokens, attention_mask, embeds=, num_tokens=, intermediate_output=,
final_layer_norm_intermediate=, dtype=)`` returning ``(x, intermediate, projected_pooled, pooled)``."""

from __future__ import annotations

import torch


def attention_basic(q, k, v, heads, mask=None):
    b, t, inner = q.shape
    d = inner // heads
    q, k, v = (a.reshape(b, t, heads, d).transpose(1, 2) for a in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, t, inner)


class CLIPAttention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, mask=None, optimized_attention=None):
        return self.out_proj(optimized_attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.heads, mask))


class CLIPLayer(torch.nn.Module):
    def __init__(self, dim, heads, inner):
        super().__init__()
        self.layer_norm1 = torch.nn.LayerNorm(dim)
        self.self_attn = CLIPAttention(dim, heads)
        self.layer_norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, inner), torch.nn.GELU(), torch.nn.Linear(inner, dim))

    def forward(self, x, mask=None, optimized_attention=None):
        x += self.self_attn(self.layer_norm1(x), mask, optimized_attention)  # in place, as ComfyUI's
        x += self.mlp(self.layer_norm2(x))
        return x


class CLIPEncoder(torch.nn.Module):
    def __init__(self, layers, dim, heads, inner):
        super().__init__()
        self.layers = torch.nn.ModuleList([CLIPLayer(dim, heads, inner) for _ in range(layers)])

    def forward(self, x, mask=None, intermediate_output=None):
        if intermediate_output is not None and intermediate_output < 0:
            intermediate_output = len(self.layers) + intermediate_output
        intermediate = None
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, attention_basic)
            if i == intermediate_output:
                intermediate = x.clone()
        return x, intermediate


class CLIPEmbeddings(torch.nn.Module):
    def __init__(self, dim, vocab=49408, positions=77):
        super().__init__()
        self.token_embedding = torch.nn.Embedding(vocab, dim)
        self.position_embedding = torch.nn.Embedding(positions, dim)


class CLIPTextModel_(torch.nn.Module):  # noqa: N801  (ComfyUI's name)
    def __init__(self, layers, dim, heads, inner, eos=49407):
        super().__init__()
        self.eos_token_id = eos
        self.embeddings = CLIPEmbeddings(dim)
        self.encoder = CLIPEncoder(layers, dim, heads, inner)
        self.final_layer_norm = torch.nn.LayerNorm(dim)

    def forward(self, input_tokens=None, attention_mask=None, embeds=None, num_tokens=None, intermediate_output=None,
                final_layer_norm_intermediate=True, dtype=torch.float32, embeds_info=()):
        if embeds is None:
            embeds = self.embeddings.token_embedding(input_tokens)
        x = embeds + self.embeddings.position_embedding.weight.to(dtype)
        t = x.shape[1]
        mask = torch.full((t, t), -torch.finfo(x.dtype).max, dtype=x.dtype).triu_(1)
        if attention_mask is not None:
            pad = (1.0 - attention_mask.to(x.dtype)).reshape(attention_mask.shape[0], 1, 1, t) * -torch.finfo(x.dtype).max
            mask = mask + pad
        x, i = self.encoder(x, mask=mask, intermediate_output=intermediate_output)
        x = self.final_layer_norm(x)
        if i is not None and final_layer_norm_intermediate:
            i = self.final_layer_norm(i)
        if num_tokens is not None:
            pooled = x[list(range(x.shape[0])), [n - 1 for n in num_tokens]]
        else:
            pooled = x[torch.arange(x.shape[0]), (input_tokens == self.eos_token_id).int().argmax(dim=-1)]
        return x, i, pooled


class CLIPTextModel(torch.nn.Module):
    def __init__(self, layers=2, dim=64, heads=2, inner=128):
        super().__init__()
        self.num_layers = layers
        self.text_model = CLIPTextModel_(layers, dim, heads, inner)
        self.text_projection = torch.nn.Linear(dim, dim, bias=False)

    def get_input_embeddings(self):
        return self.text_model.embeddings.token_embedding

    def forward(self, *args, **kwargs):
        x = self.text_model(*args, **kwargs)
        return x[0], x[1], self.text_projection(x[2]), x[2]
