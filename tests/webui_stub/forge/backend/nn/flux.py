"""``backend/nn/flux.py``: Forge 2's FLUX.1 (``IntegratedFluxTransformer2DModel``), as Forge dfdcbab has it.

What sd-accel reads of the real class: its constructor's fields kept as attributes (``hidden_size``,
``num_heads``, ``guidance_embed``, ``in_channels`` = latent channels x 4) and layer sizes
(``vector_in.in_layer``, ``txt_in``, ``pe_embedder.axes_dim`` / ``theta``); Black Forest Labs'
parameter names (``double_blocks.0.img_attn.qkv.weight`` ...); and the call
``forward(x, timestep, context, y, guidance=None, **kwargs)`` that ``KModel.apply_model`` makes
(``control`` and ``transformer_options`` land in ``**kwargs``, unused): the latent padded to even
sides (circular), 2x2 patches, image ids (0, row, column), text ids zeros, the timestep (the sigma)
and guidance embedded with ``time_factor=1000``. The blocks' math is FLUX.1's (the ComfyUI stand-in's
blocks, attention through PyTorch's SDPA)."""

import math

import torch
from torch import nn


def rms_norm(x, weight=None, eps=1e-6):
    out = x * torch.rsqrt(torch.mean(x.float() ** 2, dim=-1, keepdim=True) + eps).to(x.dtype)
    return out if weight is None else out * weight.to(x.dtype)


def rope(pos, dim, theta):
    scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64, device=pos.device)
    omega = 1.0 / (theta**scale)
    out = torch.einsum("...n,d->...nd", pos.to(torch.float32), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.reshape(*out.shape[:-1], 2, 2).to(torch.float32)


def _apply_rope(x, freqs_cis):
    x_ = x.to(dtype=freqs_cis.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    x_out = freqs_cis[..., 0] * x_[..., 0] + freqs_cis[..., 1] * x_[..., 1]
    return x_out.reshape(*x.shape).type_as(x)


def attention(q, k, v, pe, mask=None, transformer_options=None):
    q, k = _apply_rope(q, pe), _apply_rope(k, pe)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.permute(0, 2, 1, 3).reshape(out.shape[0], out.shape[2], -1)


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
        self.in_layer = nn.Linear(in_dim, hidden_dim, bias=bias)
        self.silu = nn.SiLU()
        self.out_layer = nn.Linear(hidden_dim, hidden_dim, bias=bias)

    def forward(self, x):
        return self.out_layer(self.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    def __init__(self, dim, dtype=None, device=None, operations=None):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.scale, 1e-6)


class QKNorm(nn.Module):
    def __init__(self, dim, dtype=None, device=None, operations=None):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(self, q, k, v):
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


class SelfAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, proj_bias=True, dtype=None, device=None, operations=None):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)


class ModulationOut:
    def __init__(self, shift, scale, gate):
        self.shift, self.scale, self.gate = shift, scale, gate


def _ops(operations):
    return operations if operations is not None else nn


class Modulation(nn.Module):
    def __init__(self, dim, double, bias=True, dtype=None, device=None, operations=None):
        super().__init__()
        self.is_double = double
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim, bias=bias, dtype=dtype, device=device)

    def forward(self, vec):
        if vec.ndim == 2:
            vec = vec[:, None, :]
        out = self.lin(nn.functional.silu(vec)).chunk(self.multiplier, dim=-1)
        return ModulationOut(*out[:3]), ModulationOut(*out[3:]) if self.is_double else None


def _mlp(hidden, mlp_hidden, operations, dtype, device):
    return nn.Sequential(nn.Linear(hidden, mlp_hidden, bias=True, dtype=dtype, device=device),
                         nn.GELU(approximate="tanh"),
                         nn.Linear(mlp_hidden, hidden, bias=True, dtype=dtype, device=device))


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
        self.linear1 = nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim, dtype=dtype,
                                               device=device)
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size, dtype=dtype,
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
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=bias,
                                              dtype=dtype, device=device)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size,
                                                                                bias=bias, dtype=dtype, device=device))

    def forward(self, x, vec):
        if vec.ndim == 2:
            vec = vec[:, None, :]
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=-1)
        return self.linear(self.norm_final(x) * (1 + scale) + shift)


class IntegratedFluxTransformer2DModel(nn.Module):
    def __init__(self, in_channels, vec_in_dim, context_in_dim, hidden_size, mlp_ratio, num_heads, depth,
                 depth_single_blocks, axes_dim, theta, qkv_bias, guidance_embed):
        super().__init__()
        self.guidance_embed = guidance_embed
        self.in_channels = in_channels * 4
        self.out_channels = self.in_channels
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.pe_embedder = EmbedND(dim=hidden_size // num_heads, theta=theta, axes_dim=axes_dim)
        self.img_in = nn.Linear(self.in_channels, hidden_size, bias=True)
        self.time_in = MLPEmbedder(256, hidden_size)
        self.vector_in = MLPEmbedder(vec_in_dim, hidden_size)
        self.guidance_in = MLPEmbedder(256, hidden_size) if guidance_embed else nn.Identity()
        self.txt_in = nn.Linear(context_in_dim, hidden_size)
        self.double_blocks = nn.ModuleList([DoubleStreamBlock(hidden_size, num_heads, mlp_ratio=mlp_ratio,
                                                              qkv_bias=qkv_bias) for _ in range(depth)])
        self.single_blocks = nn.ModuleList([SingleStreamBlock(hidden_size, num_heads, mlp_ratio=mlp_ratio)
                                            for _ in range(depth_single_blocks)])
        self.final_layer = LastLayer(hidden_size, 1, self.out_channels)

    def inner_forward(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None):
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, 256).to(img.dtype))
        if self.guidance_embed:
            if guidance is None:
                raise ValueError("Didn't get guidance strength for guidance distilled model.")
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
        vec = vec + self.vector_in(y)
        txt = self.txt_in(txt)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe)
        img = torch.cat((txt, img), 1)
        for block in self.single_blocks:
            img = block(img, vec=vec, pe=pe)
        img = img[:, txt.shape[1]:, ...]
        return self.final_layer(img, vec)

    def forward(self, x, timestep, context, y, guidance=None, **kwargs):
        bs, c, h, w = x.shape
        p = 2
        x = torch.nn.functional.pad(x, (0, (p - w % p) % p, 0, (p - h % p) % p), mode="circular")
        hp, wp = x.shape[-2] // p, x.shape[-1] // p
        img = x.reshape(bs, c, hp, p, wp, p).permute(0, 2, 4, 1, 3, 5).reshape(bs, hp * wp, c * p * p)
        h_len, w_len = (h + p // 2) // p, (w + p // 2) // p
        img_ids = torch.zeros((h_len, w_len, 3), dtype=x.dtype)
        img_ids[..., 1] = img_ids[..., 1] + torch.linspace(0, h_len - 1, steps=h_len, dtype=x.dtype)[:, None]
        img_ids[..., 2] = img_ids[..., 2] + torch.linspace(0, w_len - 1, steps=w_len, dtype=x.dtype)[None, :]
        img_ids = img_ids.reshape(1, h_len * w_len, 3).repeat(bs, 1, 1)
        txt_ids = torch.zeros((bs, context.shape[1], 3), dtype=x.dtype)
        out = self.inner_forward(img, img_ids, context, txt_ids, timestep, y, guidance)
        co = out.shape[-1] // (p * p)
        out = out.reshape(bs, h_len, w_len, co, p, p).permute(0, 3, 1, 4, 2, 5).reshape(bs, co, h_len * p, w_len * p)
        return out[:, :, :h, :w]
