"""``backend/nn/unet.py``: Forge 2's UNet calls attention through the module global
``attention_function`` (imported from ``backend.attention``), chosen at start-up.

On a CPU without ``--attention-pytorch`` that is the sub-quadratic one, whose
``torch.baddbmm(torch.empty(1, 1, 1), q, k^T, alpha=scale, beta=0)`` ignores the uninitialised
bias in eager torch but exports as ``bias * 0 + scores``. The stand-in uses a NaN bias, what
``torch.empty`` gives often enough: a trace through it yields NaN, as Forge 1 did in the field.

``ForgeAttnProcessor`` makes the tiny diffusers UNet call attention the same way.
"""

from __future__ import annotations

import torch


def attention_sub_quad(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False):
    b, _, inner = q.shape
    dim_head = inner // heads
    q, k, v = (t.reshape(b, -1, heads, dim_head).transpose(1, 2).reshape(b * heads, -1, dim_head) for t in (q, k, v))
    scores = torch.baddbmm(torch.full((1, 1, 1), float("nan"), dtype=q.dtype), q, k.transpose(1, 2),
                           alpha=dim_head**-0.5, beta=0)
    out = torch.bmm(scores.softmax(dim=-1), v)
    return out.reshape(b, heads, -1, dim_head).transpose(1, 2).reshape(b, -1, heads * dim_head)


attention_function = attention_sub_quad


class ForgeAttnProcessor:
    """A diffusers attention processor that computes attention with this module's global."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        import backend.nn.unet as forge_unet

        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        out = forge_unet.attention_function(q, k, v, attn.heads)
        return attn.to_out[1](attn.to_out[0](out))
