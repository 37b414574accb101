"""``comfy.ldm.modules.attention``: the attention ComfyUI picked at start-up, a module global."""

import torch


def attention_basic(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                    **kwargs):
    if skip_reshape:  # (B, heads, N, D): the transformers' (Flux) layout
        b, _, _, d = q.shape
        inner = heads * d
    else:
        b, n, inner = q.shape
        d = inner // heads
        q, k, v = (t.reshape(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(b, -1, inner)


optimized_attention = attention_basic
optimized_attention_masked = optimized_attention
