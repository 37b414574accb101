"""What FLUX.1's transformer needs to export with the legacy exporter (opset 17) and stay dynamic.

Three things, each patched only while ``torch.onnx.export`` traces (the torch module the pipeline
and the validation run is never changed):

- ``torch.nn.RMSNorm`` (its qk-norm) traces as ``aten::rms_norm``, which opset 17 cannot emit: an
  explicit ``x * rsqrt(mean(x^2) + eps) * weight`` in float32, as torch computes it.
- diffusers' rotary embedding splits lanes with ``reshape(*x.shape[:-1], -1, 2)``, which bakes the
  traced sequence length into the graph. Strided slices of the lanes keep it dynamic for ONNX
  Runtime, but OpenVINO's CPU plugin mis-infers their shapes (7 and 8 lanes of 16), and a reshape
  into pairs runs from OpenVINO's IR but fails once its compiled blob is imported: the pair
  rotation (a, b) -> (-b, a) as a constant D x D matmul has no shape logic at all (D = 128: a
  small cost beside attention).
- the rotary frequencies are computed in float64 on the CPU, which TensorRT does not compute:
  float32 here (positions are at most a few hundred; the error is ~1e-6 of torch's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress

import torch


def _rms_norm(module: torch.nn.RMSNorm):
    def forward(x: torch.Tensor) -> torch.Tensor:
        eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        if module.weight is not None:
            y = y * module.weight.float()
        return y.to(x.dtype)
    return forward


def _rotation(dim: int) -> torch.Tensor:
    """The matrix taking each lane pair (a, b) to (-b, a): what diffusers' interleaved rotary builds
    by reshaping into pairs."""
    r = torch.zeros(dim, dim)
    even = torch.arange(0, dim, 2)
    r[even + 1, even] = -1.0
    r[even, even + 1] = 1.0
    return r


def rotary_matmul(x: torch.Tensor, freqs_cis, use_real: bool = True, use_real_unbind_dim: int = -1,
                  sequence_dim: int = 2) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` (real form, interleaved lanes) with the pair rotation as a
    constant matmul: no reshape of the traced shape, so the graph stays dynamic."""
    cos, sin = freqs_cis
    if sequence_dim == 2:
        cos, sin = cos[None, None], sin[None, None]
    else:
        cos, sin = cos[None, :, None], sin[None, :, None]
    rotated = torch.matmul(x.float(), _rotation(int(x.shape[-1])).to(x.device))
    return (x.float() * cos + rotated * sin).to(x.dtype)


def _pos_embed_fp32(embed: torch.nn.Module):
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    def forward(ids: torch.Tensor):
        pos = ids.float()
        cos_out, sin_out = [], []
        for i in range(ids.shape[-1]):
            cos, sin = get_1d_rotary_pos_embed(embed.axes_dim[i], pos[:, i], theta=embed.theta,
                                               repeat_interleave_real=True, use_real=True,
                                               freqs_dtype=torch.float32)
            cos_out.append(cos)
            sin_out.append(sin)
        return torch.cat(cos_out, dim=-1), torch.cat(sin_out, dim=-1)
    return forward


@contextmanager
def export_patches(transformer: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``transformer`` traces into a dynamic opset-17 graph (see the module doc)."""
    import diffusers.models.transformers.transformer_flux as flux

    patched: list[tuple[object, str, object]] = []

    def patch(owner, name: str, value) -> None:
        patched.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    try:
        for module in transformer.modules():
            if isinstance(module, torch.nn.RMSNorm):
                patch(module, "forward", _rms_norm(module))
        if hasattr(transformer, "pos_embed"):
            patch(transformer.pos_embed, "forward", _pos_embed_fp32(transformer.pos_embed))
        patch(flux, "apply_rotary_emb", rotary_matmul)
        yield
    finally:
        for owner, name, old in reversed(patched):
            if old is _MISSING:
                with suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, old)


_MISSING = object()
