"""The tiny autoencoder (TAESD / TAESDXL, diffusers' ``AutoencoderTiny``) as the ``vae_decoder`` and
``vae_encoder`` components: same names as the KL VAE's halves (the faces, the swap and the cache
know those), their own specs, picked by the VAE's class (:func:`sd_accel.components.specs_for`).

``vae_decoder``: ``latent`` (B, C_lat, H8, W8), the UNet's latents as they are (TAESD's
``scaling_factor`` is 1.0) -> ``images`` (B, 3, H, W) in [-1, 1] (``DecoderTiny`` clamps its input
with ``tanh(x / 3) * 3`` and maps [0, 1] to [-1, 1] itself: both are in the graph).

``vae_encoder``: ``images`` (B, 3, H, W) in [-1, 1] -> ``latents`` (B, C_lat, H8, W8): TAESD's
encoder is deterministic, there is no distribution to sample.
"""

from __future__ import annotations

import torch

from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.components.unet import export_latent_size, to_latent, vae_scale_factor
from sd_accel.core import InvalidValue, UnsupportedComponent
from sd_accel.profiles import Profile, Range


def is_tiny_vae(vae) -> bool:
    """Whether ``vae`` is diffusers' ``AutoencoderTiny`` (imported lazily: the WebUI path has no diffusers)."""
    try:
        from diffusers import AutoencoderTiny
    except ImportError:
        return False
    return isinstance(vae, AutoencoderTiny)


class _Half(torch.nn.Module):
    """The decoder or encoder alone: no slicing or tiling is traced."""

    def __init__(self, part: torch.nn.Module) -> None:
        super().__init__()
        self.part = part

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.part(x),)


class _TinySpec(ComponentSpec):
    def __init__(self, pipe) -> None:
        super().__init__(pipe)
        vae = getattr(pipe, "vae", None)
        if vae is None:
            raise InvalidValue(f"the pipeline has no vae; the {self.name!r} component does not apply")
        if not is_tiny_vae(vae):
            raise UnsupportedComponent(f"the VAE is a {type(vae).__name__}, not an AutoencoderTiny")

    def torch_module(self) -> torch.nn.Module:
        return self.pipe.vae

    @property
    def _cfg(self):
        return self.torch_module().config

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        s = vae_scale_factor(self.pipe)
        return {"B": profile.batch, "H8": to_latent(profile.height, s), "W8": to_latent(profile.width, s),
                "H": profile.height, "W": profile.width}

    def export_dims(self) -> dict[str, int]:
        side = export_latent_size(len(self._cfg.decoder_block_out_channels) - 1)
        s = vae_scale_factor(self.pipe)
        return {"B": 2, "H8": side, "W8": side, "H": side * s, "W": side * s}


class TinyVaeDecoderSpec(_TinySpec):
    """``latent`` (the UNet's, unscaled) -> ``images`` in [-1, 1]."""

    name = "vae_decoder"

    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("latent", ("B", self._cfg.latent_channels, "H8", "W8"), torch.float32),)

    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("images", ("B", self._cfg.out_channels, "H", "W"), torch.float32),)

    def export_module(self) -> torch.nn.Module:
        return _Half(self.torch_module().decoder)


class TinyVaeEncoderSpec(_TinySpec):
    """``images`` in [-1, 1] -> ``latents`` (as the UNet takes them)."""

    name = "vae_encoder"

    def __init__(self, pipe) -> None:
        super().__init__(pipe)
        from sd_accel.models.taesd import MissingEncoder

        if isinstance(self.torch_module().encoder, MissingEncoder):
            raise UnsupportedComponent("this tiny VAE was loaded without its encoder file; no encoder engine")

    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("images", ("B", self._cfg.in_channels, "H", "W"), torch.float32),)

    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("latents", ("B", self._cfg.latent_channels, "H8", "W8"), torch.float32),)

    def export_module(self) -> torch.nn.Module:
        return _Half(self.torch_module().encoder)

    def sample_feed(self, dims: dict[str, int], seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Images uniform in [-1, 1], the range the pipeline's image processor produces."""
        g = torch.Generator("cpu").manual_seed(seed)
        shape = self.shapes(dims)["images"]
        return {"images": (torch.rand(shape, generator=g) * 2 - 1).to(device)}
