"""Exportable components of a pipeline: one :class:`ComponentSpec` per engine-backed module.

>>> COMPONENTS
('clip', 'clip2', 't5', 'unet', 'transformer', 'vae_decoder', 'vae_encoder')

A family's own specs live in a folder of its name (``components/sd3/``, ``components/flux/``);
what several families share (CLIP, T5, the KL VAE) at the top.
"""

from __future__ import annotations

import logging

from sd_accel.components.clip import Clip2Spec, ClipSpec, is_clip
from sd_accel.components.flux import FluxTransformerSpec, is_flux_transformer
from sd_accel.components.sd3 import SD3TransformerSpec, is_sd3_transformer
from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.components.t5 import T5Spec, is_t5
from sd_accel.components.tiny_vae import TinyVaeDecoderSpec, TinyVaeEncoderSpec, is_tiny_vae
from sd_accel.components.unet import UNetSpec, export_latent_size, vae_scale_factor
from sd_accel.components.vae import VaeDecoderSpec, VaeEncoderSpec
from sd_accel.core import COMPONENTS as NAMES
from sd_accel.core import PIPELINE_ATTRIBUTES, UnsupportedComponent

log = logging.getLogger("sd_accel")

# Each spec with the test of the module it serves (a component name may have one spec per family:
# the transformer; an attribute may hold another component by family: text_encoder_2 is CLIP-G or T5).
_SPECS: tuple[tuple[type[ComponentSpec], object], ...] = (
    (ClipSpec, is_clip), (Clip2Spec, is_clip), (T5Spec, is_t5), (UNetSpec, None),
    (SD3TransformerSpec, is_sd3_transformer), (FluxTransformerSpec, is_flux_transformer),
    (VaeDecoderSpec, None), (VaeEncoderSpec, None),
)
COMPONENTS: tuple[str, ...] = tuple(dict.fromkeys(cls.name for cls, _ in _SPECS))
# The specs are the names core.COMPONENTS lists (the faces read that one without importing torch).
assert COMPONENTS == NAMES, (COMPONENTS, NAMES)
# The tiny autoencoder (TAESD) serves the same two components through its own specs.
_TINY: dict[str, type[ComponentSpec]] = {"vae_decoder": TinyVaeDecoderSpec, "vae_encoder": TinyVaeEncoderSpec}


def specs_for(pipe) -> dict[str, ComponentSpec]:
    """The specs that apply to ``pipe``, in :data:`COMPONENTS` order.

    A module the pipeline lacks (SD 1.x has no ``text_encoder_2``; a refiner has no
    ``text_encoder``) is left out. A module sd-accel cannot export (an unusual UNet conditioning,
    a non-KL VAE) is left out too, with a warning: it keeps running in torch.
    """
    out: dict[str, ComponentSpec] = {}
    for cls, serves in _SPECS:
        module = next((m for m in (getattr(pipe, a, None) for a in PIPELINE_ATTRIBUTES[cls.name])
                       if m is not None and (serves is None or serves(m))), None)
        if module is None or cls.name in out:
            continue
        if cls.name in _TINY and is_tiny_vae(getattr(module, "torch_module", module)):
            cls = _TINY[cls.name]
        try:
            out[cls.name] = cls(pipe)
        except UnsupportedComponent as exc:
            log.warning("%s: %s", cls.name, exc)
    return out


__all__ = [
    "COMPONENTS",
    "Clip2Spec",
    "ClipSpec",
    "ComponentSpec",
    "FluxTransformerSpec",
    "SD3TransformerSpec",
    "T5Spec",
    "TensorSpec",
    "TinyVaeDecoderSpec",
    "TinyVaeEncoderSpec",
    "UNetSpec",
    "UnsupportedComponent",
    "VaeDecoderSpec",
    "VaeEncoderSpec",
    "export_latent_size",
    "specs_for",
    "vae_scale_factor",
]
