"""The WebUI's own VAE halves (LDM ``Decoder`` / ``Encoder``) as exportable components.

A1111 and Forge keep the original LDM autoencoder (``first_stage_model``: A1111's
``ldm...AutoencoderKL``, Forge 1's ldm_patched one, Forge 2's ``IntegratedAutoencoderKL``). Its
``decode(z)`` is ``decoder(post_quant_conv(z))`` and its ``encode(x)`` a Gaussian over
``quant_conv(encoder(x))``, in every one of them. The engines stand in for the two big
convolution stacks, ``decoder`` and ``encoder``, called exactly as the host calls them; the 1x1
quant convolutions, the Gaussian and any tiling stay with the host:

- ``ldm_vae_decoder``: ``z`` (B, C_z, H8, W8), after ``post_quant_conv`` -> ``images``
  (B, 3, H, W) in about [-1, 1];
- ``ldm_vae_encoder``: ``images`` (B, 3, H, W) in [-1, 1] -> ``moments`` (B, 2 C_z, H8, W8),
  before ``quant_conv``.

The WebUIs decode and encode one image per call, so batch 1 is always in the profile; the
trace example's latent side is odd (17): the VAE has no skip connections, any multiple of 8 px
works, and the graph stays general.
"""

from __future__ import annotations

import torch

from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.components.unet import export_latent_size, to_latent
from sd_accel.core import InvalidValue
from sd_accel.profiles import Profile, Range

DECODER = "ldm_vae_decoder"
ENCODER = "ldm_vae_encoder"


def _conv_channels(module: torch.nn.Module, name: str, side: str) -> int:
    conv = getattr(module, name, None)
    value = getattr(conv, side, None)
    if not isinstance(value, int):
        weight = getattr(conv, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 4:
            value = int(weight.shape[1] if side == "in_channels" else weight.shape[0])
    if not isinstance(value, int):
        raise InvalidValue(f"{type(module).__name__} has no {name} convolution: not an LDM VAE {side} stack")
    return value


def _count(module: torch.nn.Module, class_name: str) -> int:
    return sum(1 for m in module.modules() if type(m).__name__ == class_name)


class _Call(torch.nn.Module):
    """One positional input, a one-tuple out, calling the module as the host does."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x):
        return (self.module(x),)


class _LdmVaeSpec(ComponentSpec):
    """What both halves share: the module, the pixel scale, the profile mapping."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(pipe=None)
        self.module = module

    def torch_module(self) -> torch.nn.Module:
        return self.module

    def export_module(self) -> torch.nn.Module:
        return _Call(self.module)

    @property
    def levels(self) -> int:
        """Resampling steps between pixels and latents (3 for every SD VAE)."""
        raise NotImplementedError

    @property
    def pixels_per_latent(self) -> int:
        return 2**self.levels

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        s = self.pixels_per_latent
        _, opt, hi = profile.batch
        return {"B": (1, opt, hi), "H8": to_latent(profile.height, s), "W8": to_latent(profile.width, s),
                "H": profile.height, "W": profile.width}

    def export_dims(self) -> dict[str, int]:
        side = export_latent_size(self.levels)
        s = self.pixels_per_latent
        return {"B": 1, "H8": side, "W8": side, "H": side * s, "W": side * s}


class LdmVaeDecoderSpec(_LdmVaeSpec):
    """``first_stage_model.decoder``: ``z`` after ``post_quant_conv`` -> ``images``."""

    name = DECODER

    def __init__(self, decoder: torch.nn.Module) -> None:
        super().__init__(decoder)
        self.z_channels = _conv_channels(decoder, "conv_in", "in_channels")
        self.out_channels = _conv_channels(decoder, "conv_out", "out_channels")

    @property
    def levels(self) -> int:
        return _count(self.module, "Upsample") or 3

    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("z", ("B", self.z_channels, "H8", "W8"), torch.float32),)

    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("images", ("B", self.out_channels, "H", "W"), torch.float32),)


class LdmVaeEncoderSpec(_LdmVaeSpec):
    """``first_stage_model.encoder``: ``images`` in [-1, 1] -> ``moments`` before ``quant_conv``."""

    name = ENCODER

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__(encoder)
        self.in_channels = _conv_channels(encoder, "conv_in", "in_channels")
        self.moment_channels = _conv_channels(encoder, "conv_out", "out_channels")

    @property
    def levels(self) -> int:
        return _count(self.module, "Downsample") or 3

    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("images", ("B", self.in_channels, "H", "W"), torch.float32),)

    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("moments", ("B", self.moment_channels, "H8", "W8"), torch.float32),)

    def sample_feed(self, dims: dict[str, int], seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Images uniform in [-1, 1], the range the WebUI encodes."""
        g = torch.Generator("cpu").manual_seed(seed)
        shape = self.shapes(dims)["images"]
        return {"images": (torch.rand(shape, generator=g) * 2 - 1).to(device)}


def is_ldm_decoder(module) -> bool:
    """Whether ``module`` looks like an LDM VAE decoder stack (conv_in, up blocks, conv_out)."""
    return isinstance(module, torch.nn.Module) and hasattr(module, "conv_in") and hasattr(module, "conv_out") \
        and hasattr(module, "up")


def is_ldm_encoder(module) -> bool:
    """Whether ``module`` looks like an LDM VAE encoder stack (conv_in, down blocks, conv_out)."""
    return isinstance(module, torch.nn.Module) and hasattr(module, "conv_in") and hasattr(module, "conv_out") \
        and hasattr(module, "down")


__all__ = ["DECODER", "ENCODER", "LdmVaeDecoderSpec", "LdmVaeEncoderSpec", "is_ldm_decoder", "is_ldm_encoder"]
