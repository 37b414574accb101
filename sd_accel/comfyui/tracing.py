"""ComfyUI's run-time choices undone for a trace (an export, a refit's validation).

ComfyUI picks its attention at start-up (``comfy.ldm.modules.attention.optimized_attention``, a
module global its ``CrossAttention`` calls; each VAE ``AttnBlock`` keeps its own
``optimized_attention``). On a CPU that is often the sub-quadratic one, whose
``baddbmm(torch.empty(...), beta=0)`` exports an uninitialised constant (the NaN the Forge
export met, Forge being ComfyUI's descendant). For the trace both become plain
matmul-softmax-matmul attention, the form every backend fuses; the WebUI's module context
(:func:`sd_accel.webui.tracing.module_context`: no hooks, no checkpointing, layout restored)
comes with it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from sd_accel.webui.tracing import module_context, plain_heads_attention, plain_spatial_attention

_ATTENTION = "comfy.ldm.modules.attention"


def plain_comfy_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                          skip_output_reshape=False, **kwargs):
    """ComfyUI's ``optimized_attention`` signature over plain ops."""
    out = plain_heads_attention(q, k, v, heads, mask=mask, skip_reshape=skip_reshape)
    if skip_output_reshape:  # (B, N, heads * D) -> (B, heads, N, D)
        b, n, inner = out.shape
        out = out.reshape(b, n, heads, inner // heads).transpose(1, 2)
    return out


@contextlib.contextmanager
def plain_attention(module: torch.nn.Module) -> Iterator[None]:
    """ComfyUI's attention functions replaced by plain ones for the block; its own after."""
    saved: list[tuple[object, str, object]] = []
    owner = sys.modules.get(_ATTENTION)
    if owner is not None:
        for attr in ("optimized_attention", "optimized_attention_masked"):
            if callable(getattr(owner, attr, None)):
                saved.append((owner, attr, getattr(owner, attr)))
                setattr(owner, attr, plain_comfy_attention)
    for sub in module.modules():
        if type(sub).__name__ == "AttnBlock" and callable(sub.__dict__.get("optimized_attention")):
            saved.append((sub, "optimized_attention", sub.__dict__["optimized_attention"]))
            sub.__dict__["optimized_attention"] = plain_spatial_attention
    try:
        yield
    finally:
        for obj, attr, old in reversed(saved):
            if isinstance(obj, torch.nn.Module):
                obj.__dict__[attr] = old
            else:
                setattr(obj, attr, old)


@contextlib.contextmanager
def comfy_export_context(module: torch.nn.Module) -> Iterator[None]:
    """Everything a trace of one of ComfyUI's modules needs."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(plain_attention(module))
        stack.enter_context(module_context(module))
        yield
