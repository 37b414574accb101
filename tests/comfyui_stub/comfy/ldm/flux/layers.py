"""``comfy.ldm.flux.layers``: FLUX.1's blocks with Black Forest Labs' parameter names (``img_mod.lin``,
``img_attn.qkv``, ``img_attn.norm.query_norm.scale``, ``linear1``/``linear2`` ...), the math of
ComfyUI 0.8's (plain MLPs with tanh GELU, per-block modulation)."""

import math

import torch
from torch import nn

from comfy.ldm.common_dit import rms_norm
from comfy.ldm.flux.math import attention, rope


def _ops(operations):
    return operations if operations is not None else nn


class EmbedND(nn.Module):
    def __init__(self, dim, theta, axes_dim):
        super().__init__()
        self.dim, self.theta, self.axes_dim = dim, theta, axes_dim

    def forward(self, ids):
        emb = torch.cat([rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(ids.shape[-1])], dim=-3)
        return emb.unsqueeze(1)


def timestep_embedding(t, dim, max_period=10000, time_factor: float = 1000.0):
    t = time_factor * t
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return embedding.to(t) if torch.is_floating_point(t) else embedding


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim, hidden_dim, bias=True, dtype=None, device=None, operations=None):
        super().__init__()
        self.in_layer = _ops(operations).Linear(in_dim, hidden_dim, bias=bias, dtype=dtype, device=device)
        self.silu = nn.SiLU()
        self.out_layer = _ops(operations).Linear(hidden_dim, hidden_dim, bias=bias, dtype=dtype, device=device)

    def forward(self, x):
        return self.out_layer(self.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    def __init__(self, dim, dtype=None, device=None, operations=None):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x):
        return rms_norm(x, self.scale, 1e-6)


class QKNorm(nn.Module):
    def __init__(self, dim, dtype=None, device=None, operations=None):
        super().__init__()
        self.query_norm = RMSNorm(dim, dtype=dtype, device=device)
        self.key_norm = RMSNorm(dim, dtype=dtype, device=device)

    def forward(self, q, k, v):
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


class SelfAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, proj_bias=True, dtype=None, device=None, operations=None):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = _ops(operations).Linear(dim, dim * 3, bias=qkv_bias, dtype=dtype, device=device)
        self.norm = QKNorm(dim // num_heads, dtype=dtype, device=device)
        self.proj = _ops(operations).Linear(dim, dim, bias=proj_bias, dtype=dtype, device=device)


class ModulationOut:
    def __init__(self, shift, scale, gate):
        self.shift, self.scale, self.gate = shift, scale, gate


class Modulation(nn.Module):
    def __init__(self, dim, double, bias=True, dtype=None, device=None, operations=None):
        super().__init__()
        self.is_double = double
        self.multiplier = 6 if double else 3
        self.lin = _ops(operations).Linear(dim, self.multiplier * dim, bias=bias, dtype=dtype, device=device)

    def forward(self, vec):
        if vec.ndim == 2:
            vec = vec[:, None, :]
        out = self.lin(nn.functional.silu(vec)).chunk(self.multiplier, dim=-1)
        return ModulationOut(*out[:3]), ModulationOut(*out[3:]) if self.is_double else None


def _mlp(hidden, mlp_hidden, operations, dtype, device):
    return nn.Sequential(_ops(operations).Linear(hidden, mlp_hidden, bias=True, dtype=dtype, device=device),
                         nn.GELU(approximate="tanh"),
                         _ops(operations).Linear(mlp_hidden, hidden, bias=True, dtype=dtype, device=device))


def _split_heads(qkv, heads):  # (B, L, 3 * H * D) -> 3 x (B, H, L, D)
    return qkv.view(qkv.shape[0], qkv.shape[1], 3, heads, -1).permute(2, 0, 3, 1, 4)


class DoubleStreamBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio, qkv_bias=False, dtype=None, device=None, operations=None,
                 **kwargs):
        super().__init__()
        mlp_hidden = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        norm = {"elementwise_affine": False, "eps": 1e-6}
        for side in ("img", "txt"):
            setattr(self, f"{side}_mod", Modulation(hidden_size, double=True, dtype=dtype, device=device,
                                                     operations=operations))
            setattr(self, f"{side}_norm1", nn.LayerNorm(hidden_size, **norm))
            setattr(self, f"{side}_attn", SelfAttention(hidden_size, num_heads, qkv_bias=qkv_bias, dtype=dtype,
                                                        device=device, operations=operations))
            setattr(self, f"{side}_norm2", nn.LayerNorm(hidden_size, **norm))
            setattr(self, f"{side}_mlp", _mlp(hidden_size, mlp_hidden, operations, dtype, device))

    def forward(self, img, txt, vec, pe, attn_mask=None, transformer_options={}):  # noqa: B006
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)
        img_q, img_k, img_v = _split_heads(self.img_attn.qkv(self.img_norm1(img) * (1 + img_mod1.scale)
                                                             + img_mod1.shift), self.num_heads)
        img_q, img_k = self.img_attn.norm(img_q, img_k, img_v)
        txt_q, txt_k, txt_v = _split_heads(self.txt_attn.qkv(self.txt_norm1(txt) * (1 + txt_mod1.scale)
                                                             + txt_mod1.shift), self.num_heads)
        txt_q, txt_k = self.txt_attn.norm(txt_q, txt_k, txt_v)
        attn = attention(torch.cat((txt_q, img_q), dim=2), torch.cat((txt_k, img_k), dim=2),
                         torch.cat((txt_v, img_v), dim=2), pe=pe, mask=attn_mask,
                         transformer_options=transformer_options)
        txt_attn, img_attn = attn[:, :txt.shape[1]], attn[:, txt.shape[1]:]
        img = img + self.img_attn.proj(img_attn) * img_mod1.gate
        img = img + self.img_mlp(self.img_norm2(img) * (1 + img_mod2.scale) + img_mod2.shift) * img_mod2.gate
        txt = txt + self.txt_attn.proj(txt_attn) * txt_mod1.gate
        txt = txt + self.txt_mlp(self.txt_norm2(txt) * (1 + txt_mod2.scale) + txt_mod2.shift) * txt_mod2.gate
        return img, txt


class SingleStreamBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, dtype=None, device=None, operations=None, **kwargs):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.linear1 = _ops(operations).Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim, dtype=dtype,
                                               device=device)
        self.linear2 = _ops(operations).Linear(hidden_size + self.mlp_hidden_dim, hidden_size, dtype=dtype,
                                               device=device)
        self.norm = QKNorm(hidden_size // num_heads, dtype=dtype, device=device)
        self.pre_norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = Modulation(hidden_size, double=False, dtype=dtype, device=device, operations=operations)

    def forward(self, x, vec, pe, attn_mask=None, transformer_options={}):  # noqa: B006
        mod, _ = self.modulation(vec)
        qkv, mlp = torch.split(self.linear1(self.pre_norm(x) * (1 + mod.scale) + mod.shift),
                               [3 * self.hidden_size, self.mlp_hidden_dim], dim=-1)
        q, k, v = _split_heads(qkv, self.num_heads)
        q, k = self.norm(q, k, v)
        attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
        return x + self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2)) * mod.gate


class LastLayer(nn.Module):
    def __init__(self, hidden_size, patch_size, out_channels, bias=True, dtype=None, device=None, operations=None):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = _ops(operations).Linear(hidden_size, patch_size * patch_size * out_channels, bias=bias,
                                              dtype=dtype, device=device)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), _ops(operations).Linear(hidden_size, 2 * hidden_size,
                                                                                bias=bias, dtype=dtype, device=device))

    def forward(self, x, vec):
        if vec.ndim == 2:
            vec = vec[:, None, :]
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=-1)
        return self.linear(self.norm_final(x) * (1 + scale) + shift)
