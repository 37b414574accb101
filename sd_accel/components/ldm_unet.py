"""The WebUI's own UNet (LDM / SGM ``UNetModel``, Forge's UNet) as an exportable component.

A1111 and Forge do not run diffusers: their UNet is the original LDM-style module, called as
``diffusion_model(x, timesteps, context=..., y=...)``. This spec exports *that* module, with
the weights the WebUI holds (a merged LoRA included), and names the engine's inputs for the
WebUI's call, so the runtime feeds the call's tensors unchanged:

- ``x`` (B2, C_in, H8, W8): the (scaled) latents; ``C_in`` 9 for inpainting models;
- ``timesteps`` (B2,): float timesteps;
- ``context`` (B2, T, D): the cross-attention context, T = 77 per prompt chunk;
- ``y`` (B2, A), SDXL only: the ADM vector ``label_emb`` consumes (pooled text embedding plus
  the embedded size/crop conditioning: 1280 + 6 x 256 = 2816 for SDXL base).

Output ``latent`` (B2, C_out, H8, W8). Profiles map to shapes by the same rules as
:mod:`sd_accel.components.unet` (batch B or 2B for classifier-free guidance, latents 1/8 of
the image, tokens in columns of 77).

**The latent-size trick.** As for diffusers (:mod:`sd_accel.components.unet`), the trace example's latent side
does not divide by 2^(number of upsamplers), so the graph keeps the path that resizes each
upsampled map to its skip connection and serves any multiple of 8 px. The WebUI's UNets take
that path only where the host makes them (A1111 swaps ``openaimodel.th`` for
``sd_hijack_unet.th``, whose ``cat`` resizes mismatched skips; Forge's and ComfyUI's ``Upsample``
take an output shape), so :meth:`LdmUNetSpec.export_dims` first runs the module once at the
odd size; when that fails it traces at a divisible size and :attr:`latent_multiple` says which
latent sizes the engine then serves (the runtime sends the others to torch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.components.unet import export_latent_size, to_latent
from sd_accel.core import InvalidValue
from sd_accel.profiles import TOKEN_CHUNK, Profile, Range

log = logging.getLogger("sd_accel")

COMPONENT = "ldm_unet"
LATENT_SCALE = 8  # every SD VAE: 4 levels, latents are 1/8 of the image


@dataclass(frozen=True)
class LdmDims:
    """What the spec needs to know about an LDM UNet; :func:`ldm_dims` reads it off the module."""

    context_dim: int
    adm_channels: int = 0  # 0: no ``y`` input (SD 1.x / 2.x)
    in_channels: int = 4
    out_channels: int = 4
    num_upsamplers: int = 3


def linear_in_features(module: torch.nn.Module) -> int | None:
    """Input width of a linear layer, by what it has rather than by class.

    Hosts wrap ``nn.Linear`` in their own classes: ldm_patched's subclasses it, but Forge 2's
    ``ForgeOperations.Linear`` (and its 4-bit / GGUF variants) is a plain ``nn.Module`` with an
    ``in_features`` attribute and a ``weight`` (out, in) that may be None until loaded.
    """
    value = getattr(module, "in_features", None)
    if isinstance(value, int) and value > 0:
        return value
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[1])
    return None


def _first_linear_in(module: torch.nn.Module, suffix: str) -> int | None:
    for name, sub in module.named_modules():
        if name.endswith(suffix):
            width = linear_in_features(sub)
            if width is not None:
                return width
    return None


def _count_upsamplers(module: torch.nn.Module) -> int:
    # LDM/SGM/Forge call the class "Upsample"; diffusers (the test stand-in) "Upsample2D".
    return sum(1 for m in module.modules() if type(m).__name__ in ("Upsample", "Upsample2D"))


def ldm_dims(module: torch.nn.Module) -> LdmDims:
    """Read context width, ADM width, channels and upsampler count from an LDM-style UNet.

    The context width is the input width of the first cross-attention key projection
    (``...attn2.to_k``; 768 SD 1.x, 1024 SD 2.x, 2048 SDXL); the ADM width that of
    ``label_emb[0][0]`` (2816 SDXL base, 2560 the refiner), 0 when there is no ``label_emb``.
    """
    context = _first_linear_in(module, "attn2.to_k")
    if context is None:
        raise InvalidValue(
            f"{type(module).__name__} has no cross-attention (attn2.to_k) layer: not a text-conditioned SD UNet"
        )
    adm = 0
    label_emb = getattr(module, "label_emb", None)
    if label_emb is not None:
        first = label_emb[0][0] if isinstance(label_emb[0], torch.nn.Sequential) else label_emb[0]
        adm = int(linear_in_features(first) or 0)
    return LdmDims(
        context_dim=context,
        adm_channels=adm,
        in_channels=int(getattr(module, "in_channels", 4)),
        out_channels=int(getattr(module, "out_channels", 4)),
        num_upsamplers=_count_upsamplers(module) or 3,
    )


class _LdmExport(torch.nn.Module):
    """Positional (x, timesteps, context[, y]) in, a one-tuple out, calling the WebUI's way."""

    def __init__(self, unet: torch.nn.Module, with_y: bool) -> None:
        super().__init__()
        self.unet = unet
        self.with_y = with_y

    def forward(self, x, timesteps, context, *y):
        kwargs = {"y": y[0]} if self.with_y else {}
        return (self.unet(x, timesteps, context=context, **kwargs),)


class LdmUNetSpec(ComponentSpec):
    """A WebUI's LDM-style UNet (``shared.sd_model.model.diffusion_model`` on A1111).

    (Skipped in the test suite: it needs a WebUI's or ComfyUI's own UNet module;
    tests/test_webui_extension.py runs it on a stand-in.)

    >>> spec = LdmUNetSpec(unet, LdmDims(context_dim=768))               # doctest: +SKIP
    >>> spec.shape_ranges(PRESETS["static-512"])["x"]                     # doctest: +SKIP
    ((2, 4, 64, 64), (2, 4, 64, 64), (2, 4, 64, 64))
    """

    name = COMPONENT

    def __init__(self, unet: torch.nn.Module, dims: LdmDims | None = None, num_train_timesteps: int = 1000) -> None:
        super().__init__(pipe=None)
        self.unet = unet
        self.dims = dims or ldm_dims(unet)
        self.num_train_timesteps = num_train_timesteps
        self._export_side: int | None = None
        self.latent_multiple = 1  # latent sizes the exported graph serves: multiples of this

    @property
    def xl(self) -> bool:
        return self.dims.adm_channels > 0

    def torch_module(self) -> torch.nn.Module:
        return self.unet

    def inputs(self) -> tuple[TensorSpec, ...]:
        d, f32 = self.dims, torch.float32
        base = (
            TensorSpec("x", ("B2", d.in_channels, "H8", "W8"), f32),
            TensorSpec("timesteps", ("B2",), f32),
            TensorSpec("context", ("B2", "T", d.context_dim), f32),
        )
        return (*base, TensorSpec("y", ("B2", d.adm_channels), f32)) if self.xl else base

    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("latent", ("B2", self.dims.out_channels, "H8", "W8"), torch.float32),)

    def export_module(self) -> torch.nn.Module:
        return _LdmExport(self.unet, self.xl)

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        lo, opt, hi = profile.batch
        # The same rule as the diffusers UNet: static engines serve 2B (cond and uncond batched,
        # A1111's default); dynamic ones B..2B, because the WebUI runs cond and uncond apart when
        # their token counts differ, with batch_cond_uncond off, or with s_min_uncond.
        b2 = (2 * lo, 2 * opt, 2 * hi) if profile.static else (lo, 2 * opt, 2 * hi)
        return {
            "B2": b2,
            "H8": to_latent(profile.height, LATENT_SCALE),
            "W8": to_latent(profile.width, LATENT_SCALE),
            "T": profile.tokens,
        }

    def export_dims(self) -> dict[str, int]:
        # Batch 2: tracing at batch 1 lets the exporter specialise broadcasts on that axis.
        return {"B2": 2, "H8": self.export_side(), "W8": self.export_side(), "T": TOKEN_CHUNK}

    def export_side(self) -> int:
        """The trace example's latent side: odd when the module runs there (see the module doc)."""
        if self._export_side is None:
            odd = export_latent_size(self.dims.num_upsamplers)
            if self._runs_at(odd):
                self._export_side, self.latent_multiple = odd, 1
            else:
                factor = 2**self.dims.num_upsamplers
                self._export_side, self.latent_multiple = factor * max(1, 16 // factor), factor
                log.warning(
                    "%s does not run at a latent size of %d (its upsamplers need sizes divisible by %d); "
                    "its engines serve image sizes in multiples of %d px, other sizes run in PyTorch",
                    type(self.unet).__name__, odd, factor, factor * LATENT_SCALE,
                )
        return self._export_side

    def _runs_at(self, side: int) -> bool:
        """One small forward at ``side`` x ``side`` latents, on the module's device and dtype."""
        param = next(self.unet.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
        feed = self.sample_feed({"B2": 1, "H8": side, "W8": side, "T": TOKEN_CHUNK}, device=str(device))
        args = [v.to(dtype) for v in feed.values()]
        try:
            with torch.no_grad():
                out = self.export_module()(*args)[0]
        except RuntimeError as exc:  # "Sizes of tensors must match ..." from an un-resized skip
            log.debug("probe at latent %d failed: %s", side, exc)
            return False
        return tuple(out.shape[-2:]) == (side, side)

    def sample_feed(self, dims: dict[str, int], seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Latents, context and ADM vector ~N(0, 1), timesteps in [0, num_train_timesteps)."""
        feed = super().sample_feed(dims, seed=seed, device="cpu")
        g = torch.Generator("cpu").manual_seed(seed + 1)
        feed["timesteps"] = torch.randint(0, self.num_train_timesteps, feed["timesteps"].shape, generator=g).float()
        return {k: v.to(device) for k, v in feed.items()}


def latent_ok(latent_hw: tuple[int, int], multiple: int) -> bool:
    """Whether an engine exported with ``latent_multiple`` serves this latent size."""
    return multiple <= 1 or all(s % multiple == 0 for s in latent_hw)


__all__ = ["COMPONENT", "LdmDims", "LdmUNetSpec", "latent_ok", "ldm_dims", "linear_in_features"]
