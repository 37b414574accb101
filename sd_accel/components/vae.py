"""The VAE, as two components: ``vae_decoder`` (latents -> images) and ``vae_encoder`` (images -> moments).

``vae_decoder``: ``latent`` (B, C_lat, H8, W8) -> ``images`` (B, 3, H, W), H = scale * H8. The
input is already divided by ``scaling_factor`` (the pipeline does that before ``vae.decode``).

``vae_encoder``: ``images`` (B, 3, H, W) in [-1, 1] -> ``moments`` (B, 2 * C_lat, H8, W8) =
``quant_conv(encoder(x))``: mean and log-variance; the runtime rebuilds the
``DiagonalGaussianDistribution`` from them, so sampling stays in torch with the caller's generator.

The wrappers call the VAE's own ``encoder``/``decoder`` convolutions rather than
``vae.encode``/``vae.decode`` so that a user's ``enable_slicing``/``enable_tiling`` never gets
baked into the traced graph (the math is the same as the untiled path).
"""

from __future__ import annotations

import torch

from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.components.unet import export_latent_size, to_latent, vae_scale_factor
from sd_accel.core import InvalidValue, UnsupportedComponent
from sd_accel.profiles import Profile, Range


class _DecodeExport(torch.nn.Module):
    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, latent: torch.Tensor) -> tuple[torch.Tensor]:
        vae = self.vae
        if getattr(vae, "post_quant_conv", None) is not None:
            latent = vae.post_quant_conv(latent)
        return (vae.decoder(latent),)


class _EncodeExport(torch.nn.Module):
    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor]:
        moments = self.vae.encoder(images)
        if getattr(self.vae, "quant_conv", None) is not None:
            moments = self.vae.quant_conv(moments)
        return (moments,)


class _VaeSpec(ComponentSpec):
    """What both VAE halves share: the module, the dims, the profile mapping."""

    def __init__(self, pipe) -> None:
        super().__init__(pipe)
        vae = getattr(pipe, "vae", None)
        if vae is None:
            raise InvalidValue(f"the pipeline has no vae; the {self.name!r} component does not apply")
        from diffusers import AutoencoderKL  # here: the WebUI path imports this module without diffusers

        if not isinstance(vae, AutoencoderKL):
            raise UnsupportedComponent(
                f"the VAE is a {type(vae).__name__}; only AutoencoderKL VAEs are exported, this one runs in torch"
            )

    def torch_module(self) -> torch.nn.Module:
        return self.pipe.vae

    @property
    def _cfg(self):
        return self.torch_module().config

    @property
    def pixels_per_latent(self) -> int:
        return vae_scale_factor(self.pipe)

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        s = self.pixels_per_latent
        return {
            "B": profile.batch,
            "H8": to_latent(profile.height, s),
            "W8": to_latent(profile.width, s),
            "H": profile.height,
            "W": profile.width,
        }

    def export_dims(self) -> dict[str, int]:
        # An odd latent side keeps any size-dependent path general, as for the UNet.
        side = export_latent_size(len(self._cfg.block_out_channels) - 1)
        s = self.pixels_per_latent
        return {"B": 2, "H8": side, "W8": side, "H": side * s, "W": side * s}


class VaeDecoderSpec(_VaeSpec):
    """``latent`` (already divided by ``scaling_factor``) -> ``images`` in about [-1, 1]."""

    name = "vae_decoder"

    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("latent", ("B", self._cfg.latent_channels, "H8", "W8"), torch.float32),)

    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("images", ("B", self._cfg.out_channels, "H", "W"), torch.float32),)

    def export_module(self) -> torch.nn.Module:
        return _DecodeExport(self.torch_module())


class VaeEncoderSpec(_VaeSpec):
    """``images`` in [-1, 1] -> ``moments`` (mean and log-variance, concatenated on channels)."""

    name = "vae_encoder"

    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("images", ("B", self._cfg.in_channels, "H", "W"), torch.float32),)

    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("moments", ("B", 2 * self._cfg.latent_channels, "H8", "W8"), torch.float32),)

    def export_module(self) -> torch.nn.Module:
        return _EncodeExport(self.torch_module())

    def sample_feed(self, dims: dict[str, int], seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Images uniform in [-1, 1], the range the pipeline's image processor produces."""
        g = torch.Generator("cpu").manual_seed(seed)
        shape = self.shapes(dims)["images"]
        return {"images": (torch.rand(shape, generator=g) * 2 - 1).to(device)}
