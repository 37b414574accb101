"""Weight precision, and a VAE that never returns a black image.

fp16 VAEs overflow to NaN on some latents (SDXL's above all): the decoded image is then black.
The guard keeps an fp16 VAE whose config asks for it (``force_upcast``) in fp32, and re-decodes
once in fp32 when a half-precision decode (fp16 or bf16) produces NaN or inf.

The upcast is for fp16's range (largest value 65504), which is what overflows. bf16 has fp32's
range (8 exponent bits), so under ``precision="bf16"`` the VAE stays in bf16 (``vae_precision=
"fp32"`` asks for fp32 anyway); the NaN guard still watches it. :data:`UPCAST_FOR` says which
pipeline dtypes take the config's upcast.
"""

from __future__ import annotations

import logging
import types

import torch

from sd_accel.core import DeviceError

log = logging.getLogger("sd_accel")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Pipeline dtypes whose range a VAE's ``force_upcast`` is about: only fp16 (bf16 has fp32's range).
UPCAST_FOR = frozenset({torch.float16})


def resolve_precision(requested: str, device: torch.device) -> torch.dtype:
    """The dtype for ``requested`` on ``device``. fp16 on CPU falls back to fp32 (documented)."""
    if requested == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if requested == "fp16" and device.type == "cpu":
        log.warning(
            "precision='fp16' needs a GPU: CPU kernels for fp16 are missing or slow, so this pipeline "
            "runs in fp32 on the CPU. Use precision='bf16' for reduced precision on a CPU."
        )
        return torch.float32
    if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError(
            f"precision='bf16' is not supported by {torch.cuda.get_device_name(device)}; use 'fp16'"
        )
    return DTYPES[requested]


def vae_dtype_for(vae, dtype: torch.dtype, vae_precision: str) -> torch.dtype:
    """The VAE's dtype in a pipeline of ``dtype``: ``fp32`` always fp32; ``same`` the pipeline's;
    ``auto`` fp32 for an fp16 pipeline whose VAE config asks for it (``force_upcast``: SDXL's, and
    diffusers' default), else the pipeline's dtype (a bf16 pipeline keeps a bf16 VAE).

    >>> from types import SimpleNamespace
    >>> vae = SimpleNamespace(config=SimpleNamespace(force_upcast=True))
    >>> vae_dtype_for(vae, torch.float16, "auto"), vae_dtype_for(vae, torch.bfloat16, "auto")
    (torch.float32, torch.bfloat16)
    >>> vae_dtype_for(vae, torch.bfloat16, "fp32")
    torch.float32
    """
    if vae_precision == "fp32":
        return torch.float32
    if vae_precision == "auto" and dtype in UPCAST_FOR and getattr(vae.config, "force_upcast", False):
        return torch.float32
    return dtype


def _bad(t: torch.Tensor) -> bool:
    # One reduction and one host sync per decode (isnan and isinf were two of each).
    return not bool(torch.isfinite(t).all())


class VaeGuard:
    """Wraps ``vae.decode``/``vae.encode``: inputs are cast to the VAE's dtype (so an fp32 VAE
    serves an fp16 pipeline) and a NaN decode is redone once in fp32. Counts what it did."""

    def __init__(self, vae, nan_check: bool) -> None:
        self.vae = vae
        self.nan_check = nan_check
        self.redecodes = 0
        self.nan_after_fp32 = 0
        # The class methods, not the instance attributes, so re-applying never wraps a wrapper.
        self._decode = types.MethodType(type(vae).decode, vae)
        self._encode = types.MethodType(type(vae).encode, vae)

    def decode(self, z: torch.Tensor, *args, **kwargs):
        out = self._decode(z.to(self.vae.dtype), *args, **kwargs)
        sample = out[0] if isinstance(out, tuple) else out.sample
        if not self.nan_check or self.vae.dtype == torch.float32 or not _bad(sample):
            return out
        self.redecodes += 1
        log.warning("VAE decode in %s produced NaN/inf; decoding again in fp32", self.vae.dtype)
        half = self.vae.dtype
        self.vae.to(torch.float32)
        try:
            out = self._decode(z.to(torch.float32), *args, **kwargs)
        finally:
            self.vae.to(half)
        sample = out[0] if isinstance(out, tuple) else out.sample
        if _bad(sample):
            self.nan_after_fp32 += 1
            log.error("VAE decode still produces NaN in fp32: the latents themselves are NaN (UNet overflow?)")
        return out

    def encode(self, x: torch.Tensor, *args, **kwargs):
        return self._encode(x.to(self.vae.dtype), *args, **kwargs)


def install_vae_guard(vae, nan_check: bool) -> VaeGuard:
    guard = VaeGuard(vae, nan_check)
    # Instance attributes shadow the class methods; diffusers pipelines call vae.decode / vae.encode.
    vae.decode = guard.decode
    vae.encode = guard.encode
    vae._sd_accel_guard = guard
    return guard
