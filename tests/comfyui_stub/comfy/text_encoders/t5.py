"""``comfy.text_encoders.t5.T5``, made tiny: ComfyUI's module names (HF's T5 keys: ``shared``,
``encoder.block[i].layer[0].SelfAttention.{q,k,v,o}``, the first block's
``relative_attention_bias``, ``layer[1].DenseReluDense.{wi_0,wi_1,wo}``, ``final_layer_norm``),
its embedding's ``out_dtype`` keyword, the attention function passed down the blocks, and its
call ``transformer(input_ids, attention_mask, embeds=, num_tokens=, intermediate_output=, ...)``
returning ``(x, intermediate)``."""

from __future__ import annotations

import math

import torch

from comfy.clip_model import attention_basic


class Embedding(torch.nn.Embedding):
    """comfy.ops' Embedding: ``out_dtype`` casts the looked-up rows."""

    def forward(self, input, out_dtype=None):  # noqa: A002  (torch's name)
        out = super().forward(input)
        return out.to(out_dtype) if out_dtype is not None else out


class T5LayerNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight.to(x) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class T5Attention(torch.nn.Module):
    def __init__(self, dim, heads, relative_bias):
        super().__init__()
        self.num_heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.relative_attention_bias = Embedding(32, heads) if relative_bias else None

    @staticmethod
    def bucket(relative, buckets=32, max_distance=128):
        half = buckets // 2
        out = (relative > 0).long() * half
        n = relative.abs()
        exact = half // 2
        large = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
        large = torch.minimum(large, torch.full_like(large, half - 1))
        return out + torch.where(n < exact, n, large)

    def compute_bias(self, length, device, dtype):
        positions = torch.arange(length, dtype=torch.long, device=device)
        buckets = self.bucket(positions[None, :] - positions[:, None])
        return self.relative_attention_bias(buckets, out_dtype=dtype).permute(2, 0, 1).unsqueeze(0)

    def forward(self, x, mask=None, past_bias=None, optimized_attention=None):
        if self.relative_attention_bias is not None:
            past_bias = self.compute_bias(x.shape[1], x.device, x.dtype)
        bias = past_bias if mask is None else mask + past_bias
        d = x.shape[-1] / self.num_heads  # T5 does not scale: k is pre-multiplied to undo the attention's 1/sqrt(d)
        return self.o(optimized_attention(self.q(x), self.k(x) * d ** 0.5, self.v(x), self.num_heads, bias)), past_bias


class T5LayerSelfAttention(torch.nn.Module):
    def __init__(self, dim, heads, relative_bias):
        super().__init__()
        self.SelfAttention = T5Attention(dim, heads, relative_bias)
        self.layer_norm = T5LayerNorm(dim)

    def forward(self, x, mask=None, past_bias=None, optimized_attention=None):
        out, past_bias = self.SelfAttention(self.layer_norm(x), mask, past_bias, optimized_attention)
        x += out
        return x, past_bias


class T5DenseGatedActDense(torch.nn.Module):
    def __init__(self, dim, ff):
        super().__init__()
        self.wi_0, self.wi_1 = torch.nn.Linear(dim, ff, bias=False), torch.nn.Linear(dim, ff, bias=False)
        self.wo = torch.nn.Linear(ff, dim, bias=False)

    def forward(self, x):
        return self.wo(torch.nn.functional.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))


class T5LayerFF(torch.nn.Module):
    def __init__(self, dim, ff):
        super().__init__()
        self.DenseReluDense = T5DenseGatedActDense(dim, ff)
        self.layer_norm = T5LayerNorm(dim)

    def forward(self, x):
        x += self.DenseReluDense(self.layer_norm(x))
        return x


class T5Block(torch.nn.Module):
    def __init__(self, dim, heads, ff, relative_bias):
        super().__init__()
        self.layer = torch.nn.ModuleList([T5LayerSelfAttention(dim, heads, relative_bias), T5LayerFF(dim, ff)])

    def forward(self, x, mask=None, past_bias=None, optimized_attention=None):
        x, past_bias = self.layer[0](x, mask, past_bias, optimized_attention)
        return self.layer[-1](x), past_bias


class T5Stack(torch.nn.Module):
    def __init__(self, layers, dim, heads, ff):
        super().__init__()
        self.block = torch.nn.ModuleList([T5Block(dim, heads, ff, i == 0) for i in range(layers)])
        self.final_layer_norm = T5LayerNorm(dim)

    def forward(self, x, attention_mask=None, intermediate_output=None, final_layer_norm_intermediate=True,
                dtype=None, embeds_info=()):
        mask = None
        if attention_mask is not None:
            mask = (1.0 - attention_mask.to(x.dtype).reshape(attention_mask.shape[0], 1, 1, -1)) * -1e30
        intermediate, past_bias = None, None
        if intermediate_output is not None and intermediate_output < 0:
            intermediate_output += len(self.block)
        for i, block in enumerate(self.block):
            x, past_bias = block(x, mask, past_bias, attention_basic)
            if i == intermediate_output:
                intermediate = x.clone()
        x = self.final_layer_norm(x)
        if intermediate is not None and final_layer_norm_intermediate:
            intermediate = self.final_layer_norm(intermediate)
        return x, intermediate


class T5(torch.nn.Module):
    def __init__(self, layers=2, dim=48, heads=4, ff=96, vocab=320):
        super().__init__()
        self.num_layers = layers
        self.encoder = T5Stack(layers, dim, heads, ff)
        self.shared = Embedding(vocab, dim)

    def get_input_embeddings(self):
        return self.shared

    def forward(self, input_ids, attention_mask, embeds=None, num_tokens=None, **kwargs):
        x = embeds if input_ids is None else self.shared(input_ids, out_dtype=kwargs.get("dtype", torch.float32))
        return self.encoder(x, attention_mask=attention_mask, **kwargs)
