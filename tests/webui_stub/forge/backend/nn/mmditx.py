"""``backend/nn/mmditx.py``: Forge 2's SD3 / SD3.5 MMDiT (``MMDiTX``, Stability's reference code), as
Forge dfdcbab has it.

What sd-accel reads of the real class: Stability's parameter names (``x_embedder.proj``,
``pos_embed`` (a buffer), ``t_embedder.mlp``, ``y_embedder.mlp``, ``context_embedder``,
``joint_blocks.N.{context_block,x_block}.{attn,attn2,mlp,adaLN_modulation}``, ``final_layer``), the
attributes ``patch_size``, ``pos_embed_max_size``, ``register_length`` and
``forward(x, t, y=None, context=None, control=None, transformer_options={}, **kwargs)``, which
``KModel.apply_model`` calls with t = sigma x 1000 (``PredictionDiscreteFlow``). The blocks' math is
the ComfyUI stand-in's (the same reference code; attention through PyTorch's SDPA)."""

from __future__ import annotations

import math

import torch
from torch import nn


def pad_to_patch_size(img, patch_size=(2, 2)):
    pad = ()
    for i in range(img.ndim - 2):
        pad = (0, (patch_size[i] - img.shape[i + 2] % patch_size[i]) % patch_size[i]) + pad
    return torch.nn.functional.pad(img, pad, mode="circular")


def rms_norm(x, weight=None, eps=1e-6):
    out = x * torch.rsqrt(torch.mean(x.float() ** 2, dim=-1, keepdim=True) + eps).to(x.dtype)
    return out if weight is None else out * weight.to(x.dtype)


def timestep_embedding(timesteps, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=timesteps.device) / half)
    args = timesteps[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class _Attention:
    @staticmethod
    def optimized_attention(q, k, v, heads):
        b, _, inner = q.shape
        q, k, v = (t.reshape(b, -1, heads, inner // heads).transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(b, -1, inner)


_attention = _Attention


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class RMSNorm(nn.Module):
    def __init__(self, dim, elementwise_affine=False, eps=1e-6, device=None, dtype=None, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype)) if elementwise_affine else None

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features, dtype=None, device=None, operations=None):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SelfAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False, pre_only=False, qk_norm=None, dtype=None, device=None,
                 operations=None, **kwargs):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        if not pre_only:
            self.proj = nn.Linear(dim, dim)
        self.pre_only = pre_only
        if qk_norm == "rms":
            self.ln_q = RMSNorm(self.head_dim, elementwise_affine=True, eps=1.0e-6)
            self.ln_k = RMSNorm(self.head_dim, elementwise_affine=True, eps=1.0e-6)
        else:
            self.ln_q = self.ln_k = nn.Identity()

    def pre_attention(self, x):
        qkv = self.qkv(x).reshape(x.shape[0], x.shape[1], 3, -1, self.head_dim).movedim(2, 0)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = self.ln_q(q).reshape(q.shape[0], q.shape[1], -1)
        k = self.ln_k(k).reshape(q.shape[0], q.shape[1], -1)
        return q, k, v.reshape(q.shape[0], q.shape[1], -1)

    def post_attention(self, x):
        return self.proj(x)


class DismantledBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, qkv_bias=False, pre_only=False, qk_norm=None,
                 x_block_self_attn=False, dtype=None, device=None, operations=None, **kwargs):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(hidden_size, num_heads, qkv_bias=qkv_bias, pre_only=pre_only, qk_norm=qk_norm)
        self.x_block_self_attn = x_block_self_attn
        if x_block_self_attn:
            self.attn2 = SelfAttention(hidden_size, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm)
        if not pre_only:
            self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
            self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        n_mods = 9 if x_block_self_attn else (6 if not pre_only else 2)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, n_mods * hidden_size))
        self.pre_only = pre_only

    def pre_attention(self, x, c):
        mods = self.adaLN_modulation(c).chunk(2 if self.pre_only else 6, dim=1)
        qkv = self.attn.pre_attention(modulate(self.norm1(x), mods[0], mods[1]))
        return qkv, None if self.pre_only else (x, mods[2], mods[3], mods[4], mods[5])

    def pre_attention_x(self, x, c):
        m = self.adaLN_modulation(c).chunk(9, dim=1)
        x_norm = self.norm1(x)
        qkv = self.attn.pre_attention(modulate(x_norm, m[0], m[1]))
        qkv2 = self.attn2.pre_attention(modulate(x_norm, m[6], m[7]))
        return qkv, qkv2, (x, m[2], m[3], m[4], m[5], m[8])

    def post_attention(self, attn, x, gate_msa, shift_mlp, scale_mlp, gate_mlp):
        x = x + gate_msa.unsqueeze(1) * self.attn.post_attention(attn)
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))

    def post_attention_x(self, attn, attn2, x, gate_msa, shift_mlp, scale_mlp, gate_mlp, gate_msa2):
        x = x + gate_msa.unsqueeze(1) * self.attn.post_attention(attn) + gate_msa2.unsqueeze(1) * self.attn2.post_attention(attn2)
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class JointBlock(nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
        pre_only = kwargs.pop("pre_only")
        qk_norm = kwargs.pop("qk_norm", None)
        x_block_self_attn = kwargs.pop("x_block_self_attn", False)
        self.context_block = DismantledBlock(*args, pre_only=pre_only, qk_norm=qk_norm, **kwargs)
        self.x_block = DismantledBlock(*args, pre_only=False, qk_norm=qk_norm, x_block_self_attn=x_block_self_attn,
                                       **kwargs)

    def forward(self, context, x, c, transformer_options={}, **kwargs):  # noqa: B006
        heads = self.x_block.attn.num_heads
        context_qkv, context_rest = self.context_block.pre_attention(context, c)
        if self.x_block.x_block_self_attn:
            x_qkv, x_qkv2, x_rest = self.x_block.pre_attention_x(x, c)
        else:
            x_qkv, x_rest = self.x_block.pre_attention(x, c)
        attn = _attention.optimized_attention(*(torch.cat((a, b), dim=1) for a, b in zip(context_qkv, x_qkv, strict=True)),
                                              heads=heads)
        n = context_qkv[0].shape[1]
        context_attn, x_attn = attn[:, :n], attn[:, n:]
        context = None if self.context_block.pre_only else self.context_block.post_attention(context_attn, *context_rest)
        if self.x_block.x_block_self_attn:
            attn2 = _attention.optimized_attention(*x_qkv2, heads=heads)
            x = self.x_block.post_attention_x(x_attn, attn2, *x_rest)
        else:
            x = self.x_block.post_attention(x_attn, *x_rest)
        return context, x


class MMDiT(nn.Module):
    def __init__(self, input_size=32, patch_size=2, in_channels=4, depth=28, mlp_ratio=4.0, adm_in_channels=None,
                 context_embedder_config=None, out_channels=None, pos_embed_max_size=None, num_patches=None,
                 qk_norm=None, qkv_bias=True, x_block_self_attn_layers=(), dtype=None, device=None, operations=None,
                 **kwargs):
        super().__init__()
        self.dtype = dtype
        self.in_channels = in_channels
        self.out_channels = out_channels or in_channels
        self.patch_size = patch_size
        self.pos_embed_max_size = pos_embed_max_size
        self.hidden_size = 64 * depth
        self.num_heads = depth
        self.x_embedder = nn.Module()
        self.x_embedder.proj = nn.Conv2d(in_channels, self.hidden_size, kernel_size=patch_size, stride=patch_size)
        self.t_embedder = nn.Module()
        self.t_embedder.mlp = nn.Sequential(nn.Linear(256, self.hidden_size), nn.SiLU(),
                                            nn.Linear(self.hidden_size, self.hidden_size))
        self.y_embedder = nn.Module()
        self.y_embedder.mlp = nn.Sequential(nn.Linear(adm_in_channels, self.hidden_size), nn.SiLU(),
                                            nn.Linear(self.hidden_size, self.hidden_size))
        self.context_embedder = nn.Linear(**context_embedder_config["params"])
        self.register_buffer("pos_embed", torch.zeros(1, num_patches, self.hidden_size))
        self.joint_blocks = nn.ModuleList([
            JointBlock(self.hidden_size, depth, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, pre_only=i == depth - 1,
                       qk_norm=qk_norm, x_block_self_attn=i in x_block_self_attn_layers) for i in range(depth)])
        self.final_layer = nn.Module()
        self.final_layer.norm_final = nn.LayerNorm(self.hidden_size, elementwise_affine=False, eps=1e-6)
        self.final_layer.linear = nn.Linear(self.hidden_size, patch_size * patch_size * self.out_channels)
        self.final_layer.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(self.hidden_size, 2 * self.hidden_size))

    def cropped_pos_embed(self, hw):
        p = self.patch_size
        h, w = (hw[0] + 1) // p, (hw[1] + 1) // p
        top, left = (self.pos_embed_max_size - h) // 2, (self.pos_embed_max_size - w) // 2
        grid = self.pos_embed.reshape(1, self.pos_embed_max_size, self.pos_embed_max_size, -1)
        return grid[:, top:top + h, left:left + w, :].reshape(1, h * w, -1)

    def unpatchify(self, x, hw):
        c, p = self.out_channels, self.patch_size
        h, w = (hw[0] + 1) // p, (hw[1] + 1) // p
        x = torch.einsum("nhwpqc->nchpwq", x.reshape(x.shape[0], h, w, p, p, c))
        return x.reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x, t, y=None, context=None, control=None, transformer_options={}):  # noqa: B006
        hw = x.shape[-2:]
        x = self.x_embedder.proj(pad_to_patch_size(x, (self.patch_size, self.patch_size))).flatten(2).transpose(1, 2)
        x = x + self.cropped_pos_embed(hw).to(x)
        c = self.t_embedder.mlp(timestep_embedding(t, 256).to(x.dtype))
        if y is not None:
            c = c + self.y_embedder.mlp(y)
        context = self.context_embedder(context)
        for i, block in enumerate(self.joint_blocks):
            context, x = block(context, x, c=c, transformer_options=transformer_options)
            if control is not None:
                control_o = control.get("output")
                if i < len(control_o) and control_o[i] is not None:
                    x = x + control_o[i]
        shift, scale = self.final_layer.adaLN_modulation(c).chunk(2, dim=1)
        x = self.final_layer.linear(modulate(self.final_layer.norm_final(x), shift, scale))
        return self.unpatchify(x, hw)[:, :, :hw[-2], :hw[-1]]


class MMDiTX(MMDiT):
    register_length = 0

    def forward(self, x, t, y=None, context=None, control=None, transformer_options={}, **kwargs):  # noqa: B006
        return super().forward(x, t, y=y, context=context, control=control, transformer_options=transformer_options)
