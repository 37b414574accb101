"""``comfy.ldm.flux.math``: rotary embedding as 2x2 rotation matrices per lane pair, attention."""

import torch

from comfy.ldm.modules import attention as _attention


def rope(pos, dim, theta):
    scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64, device=pos.device)
    omega = 1.0 / (theta**scale)
    out = torch.einsum("...n,d->...nd", pos.to(torch.float32), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.reshape(*out.shape[:-1], 2, 2).to(torch.float32)


def apply_rope1(x, freqs_cis):
    x_ = x.to(dtype=freqs_cis.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    x_out = freqs_cis[..., 0] * x_[..., 0] + freqs_cis[..., 1] * x_[..., 1]
    return x_out.reshape(*x.shape).type_as(x)


def apply_rope(xq, xk, freqs_cis):
    return apply_rope1(xq, freqs_cis), apply_rope1(xk, freqs_cis)


def attention(q, k, v, pe, mask=None, transformer_options={}):  # noqa: B006  (ComfyUI's signature)
    if pe is not None:
        q, k = apply_rope(q, k, pe)
    return _attention.optimized_attention(q, k, v, q.shape[1], skip_reshape=True, mask=mask,
                                          transformer_options=transformer_options)
