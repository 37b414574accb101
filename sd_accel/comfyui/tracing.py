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
from collections.abc import Iterator

import torch

from sd_accel.webui.tracing import module_context, plain_heads_attention, replaced_attention

_ATTENTION = "comfy.ldm.modules.attention"


def plain_comfy_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                          skip_output_reshape=False, **kwargs):
    """ComfyUI's ``optimized_attention`` signature over plain ops."""
    out = plain_heads_attention(q, k, v, heads, mask=mask, skip_reshape=skip_reshape)
    if skip_output_reshape:  # (B, N, heads * D) -> (B, heads, N, D)
        b, n, inner = out.shape
        out = out.reshape(b, n, heads, inner // heads).transpose(1, 2)
    return out


_COMFY_ATTENTION = (
    (_ATTENTION, "optimized_attention", plain_comfy_attention),
    (_ATTENTION, "optimized_attention_masked", plain_comfy_attention),
)


def plain_attention(module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """ComfyUI's attention functions replaced by plain ones for the block; its own after."""
    return replaced_attention(module, _COMFY_ATTENTION)


@contextlib.contextmanager
def comfy_export_context(module: torch.nn.Module) -> Iterator[None]:
    """Everything a trace of one of ComfyUI's modules needs."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(plain_attention(module))
        stack.enter_context(module_context(module))
        yield
