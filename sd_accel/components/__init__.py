"""Exportable components of a pipeline: one :class:`ComponentSpec` per engine-backed module.

>>> COMPONENTS
('clip', 'clip2', 'unet', 'vae_decoder', 'vae_encoder')
"""

from __future__ import annotations

import logging

from sd_accel.components.clip import Clip2Spec, ClipSpec
from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.components.tiny_vae import TinyVaeDecoderSpec, TinyVaeEncoderSpec, is_tiny_vae
from sd_accel.components.unet import UNetSpec, export_latent_size, vae_scale_factor
from sd_accel.components.vae import VaeDecoderSpec, VaeEncoderSpec
from sd_accel.core import COMPONENTS as NAMES
from sd_accel.core import PIPELINE_ATTRIBUTE, UnsupportedComponent

log = logging.getLogger("sd_accel")

_SPECS: tuple[type[ComponentSpec], ...] = (ClipSpec, Clip2Spec, UNetSpec, VaeDecoderSpec, VaeEncoderSpec)
COMPONENTS: tuple[str, ...] = tuple(cls.name for cls in _SPECS)
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
    for cls in _SPECS:
        module = getattr(pipe, PIPELINE_ATTRIBUTE[cls.name], None)
        if module is None:
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
