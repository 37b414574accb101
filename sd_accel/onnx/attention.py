"""Attention as the engines need it: traced in a form every backend fuses, never as a full score
tensor folded into a constant.

diffusers' plain ``AttnProcessor`` computes scores with ``torch.baddbmm(torch.empty(...), q, k^T,
beta=0, alpha=scale)``. The exporter turns ``empty * beta`` into a zero tensor of the full score
shape; at fixed shapes a backend constant-folds it into a ``[batch * heads, N, N]`` weight per
attention layer (N = latent tokens): 215 MB for a 3.7 MB tiny UNet at 256 px, 3.4 GB at 512 px.
And its 3-D ``[batch * heads, N, d]`` layout is not the pattern fused attention kernels look for.

:class:`ExportAttnProcessor` traces instead, per attention layer::

    q = to_q(x) -> Reshape [B, S, H, d] -> Transpose(0, 2, 1, 3) -> Mul(scale)     # [B, H, S, d]
    k = to_k(c) -> Reshape [B, L, H, d] -> Transpose(0, 2, 3, 1)                   # [B, H, d, L]
    v = to_v(c) -> Reshape [B, L, H, d] -> Transpose(0, 2, 1, 3)                   # [B, H, L, d]
    MatMul(q, k) -> Softmax(-1) -> MatMul(., v) -> Transpose(0, 2, 1, 3) -> Reshape [B, S, H*d]

which is what each backend turns into attention that never holds the N x N scores:

- TensorRT fuses ``MatMul -> Softmax -> MatMul`` on 4-D ``[B, H, S, d]`` operands into its MHA
  kernels; it wants the scale applied to Q *before* the first MatMul (NVIDIA, "Fused Attention").
- OpenVINO's CPU plugin fuses the same pattern into ``ScaledDotProductAttention`` (checked on the
  compiled model's runtime graph by the tests).
- ONNX Runtime does not fuse it by itself: its builder rewrites each such block into the
  ``com.microsoft.MultiHeadAttention`` contrib op (``backends/onnxruntime/attention.py``), whose CPU
  kernel is a flash attention (tiles of Q x K in L2 cache) and whose CUDA kernels are fused too.

:func:`sdpa_attention` is the torch side of validation: ``F.scaled_dot_product_attention``, which
on CPU and CUDA runs without the full score tensor, so checking a big profile fits in memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class ExportAttnProcessor:
    """A diffusers attention processor for tracing: 4-D heads, scale on Q, plain softmax.

    Same math as ``AttnProcessor`` (``attn.scale``, masks, group/spatial norms, residual and
    rescale), without the zero ``baddbmm`` bias and with the layout fused kernels match.
    ``sdpa=True`` computes the same attention with ``F.scaled_dot_product_attention`` (and
    ``attn.scale``, which diffusers' ``AttnProcessor2_0`` ignores): the torch reference.
    """

    def __init__(self, sdpa: bool = False) -> None:
        self.sdpa = sdpa

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channel, height * width).transpose(1, 2)
        batch = hidden_states.shape[0]
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        heads = attn.heads
        head_dim = key.shape[-1] // heads
        query = query.view(batch, -1, heads, head_dim).transpose(1, 2)
        key = key.view(batch, -1, heads, head_dim)  # [B, L, H, d]: one Transpose to [B, H, d, L]
        value = value.view(batch, -1, heads, head_dim).transpose(1, 2)
        if attn.norm_q is not None:  # norms over the last (head) dim: the layout does not matter
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        mask = None
        if attention_mask is not None:
            mask = attn.prepare_attention_mask(attention_mask, key.shape[1], batch)
            mask = mask.view(batch, heads, -1, mask.shape[-1])
        dtype = query.dtype
        if attn.upcast_attention and dtype != torch.float32:
            query, key = query.float(), key.float()
        if self.sdpa:
            hidden_states = torch.nn.functional.scaled_dot_product_attention(
                query, key.transpose(1, 2), value.to(query.dtype), attn_mask=mask, scale=attn.scale
            )
        else:
            scores = torch.matmul(query * attn.scale, key.permute(0, 2, 3, 1))  # [B, H, S, L]
            if mask is not None:
                scores = scores + mask
            if attn.upcast_softmax and scores.dtype != torch.float32:
                scores = scores.float()
            probs = scores.softmax(dim=-1)
            # A Cast between Softmax and MatMul would hide the pattern; only where dtypes differ.
            hidden_states = torch.matmul(probs if probs.dtype == value.dtype else probs.to(value.dtype), value)
        if hidden_states.dtype != dtype:
            hidden_states = hidden_states.to(dtype)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch, -1, heads * head_dim)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


def _matmul_softmax(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    if is_causal or dropout_p or enable_gqa:
        raise NotImplementedError("export attention: causal, dropout and GQA are not exported")
    head_dim = int(query.shape[-1])  # fixed by the model: a constant in the graph
    # the scale after the first MatMul: on Q, OpenVINO folds it into the qk-norm's weight before
    # (one per-lane constant) and then refuses that as the fused attention's scale
    scores = torch.matmul(query, key.transpose(-1, -2)) * (scale if scale is not None else head_dim**-0.5)
    if attn_mask is not None:
        scores = scores + attn_mask
    return torch.matmul(scores.softmax(dim=-1), value)


@contextlib.contextmanager
def _explicit_sdpa() -> Iterator[None]:
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _matmul_softmax
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _joint(processor) -> bool:
    name = type(processor).__name__
    return "Joint" in name or "Flux" in name


@contextlib.contextmanager
def _diffusers_processor(module: torch.nn.Module, processor) -> Iterator[None]:
    """``processor`` on every attention layer of a diffusers ``module``; the previous ones after."""
    if not (hasattr(module, "attn_processors") and hasattr(module, "set_attn_processor")):
        yield
        return
    saved = module.attn_processors  # a fresh dict of the current processor objects
    if any(_joint(p) for p in saved.values()):
        # SD3's and FLUX.1's joint attention (text and image tokens in one softmax) keep their own
        # processors, which call F.scaled_dot_product_attention on 4-D heads: for export it is
        # written as the pattern above (the exporter's own decomposition computes the scale from
        # the traced shape, which OpenVINO's CPU plugin fails to infer on dynamic graphs)
        with _explicit_sdpa() if not getattr(processor, "sdpa", True) else contextlib.nullcontext():
            yield
        return
    module.set_attn_processor(processor)
    try:
        yield
    finally:
        module.set_attn_processor(saved)


@contextlib.contextmanager
def export_attention(module: torch.nn.Module) -> Iterator[None]:
    """Attention for tracing on ``module`` for the duration; the previous state after, even when
    the body raises.

    diffusers models get :class:`ExportAttnProcessor`; transformers models (the CLIP text
    encoders: 77 tokens, so the scores are small) get ``"eager"`` attention, whose graph is plain
    ``MatMul``/``Softmax`` (SDPA would trace through shape-specialised branches).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(_diffusers_processor(module, ExportAttnProcessor()))
        config = getattr(module, "config", None)
        if hasattr(module, "set_attn_implementation") and hasattr(config, "_attn_implementation"):
            previous = config._attn_implementation
            if previous != "eager":
                module.set_attn_implementation("eager")
                stack.callback(module.set_attn_implementation, previous)
        yield


@contextlib.contextmanager
def sdpa_attention(module: torch.nn.Module) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` on every diffusers attention layer of ``module`` for the
    duration (the torch reference of validation: memory linear in tokens, whatever processor the
    user's pipeline had, sliced or plain ones included)."""
    with _diffusers_processor(module, ExportAttnProcessor(sdpa=True)):
        yield


__all__ = ["ExportAttnProcessor", "export_attention", "sdpa_attention"]
