"""The denoising UNet: SD 1.x, SD 2.x, SDXL (``text_embeds``/``time_ids``) and inpainting variants.

Engine inputs: ``sample`` (B2, C_in, H8, W8), ``timestep`` (B2,), ``encoder_hidden_states``
(B2, T, D), and for SDXL ``text_embeds`` (B2, P) and ``time_ids`` (B2, N_ids); for a UNet with
``time_cond_proj_dim`` (every LCM-distilled UNet: the guidance scale goes in as an embedding, no CFG
batch) ``timestep_cond`` (B2, time_cond_proj_dim), last; all float32. What is there is read from the
config, not from a family table, so other shapes (SDXS's slimmer UNet) take the same path.
Engine output: ``latent`` (B2, C_out, H8, W8). ``C_in`` comes from the config, so an inpainting
UNet (9 channels: latents + mask + masked-image latents) needs nothing special.

The trace example uses a latent size that does NOT divide by 2^(number of upsamplers): diffusers
then upsamples each level to its skip connection's size instead of a fixed factor 2, and the
exported graph serves every latent size, not only multiples of 64 px (checked with ONNX Runtime on a
tiny UNet: latents of 16, 24, 17, 9 and 13 all matched torch to 1e-6).
"""

from __future__ import annotations

import math

import torch

from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.core import UnsupportedComponent
from sd_accel.profiles import TOKEN_CHUNK, Profile, Range

# The smallest latent side the trace example may have; odd sizes near it keep the graph general.
_MIN_EXPORT_LATENT = 16


def vae_scale_factor(pipe) -> int:
    """Pixels per latent cell: 2^(VAE levels - 1) from the VAE config (8 for every SD model)."""
    vae = getattr(pipe, "vae", None)
    if vae is not None:
        return 2 ** (len(vae.config.block_out_channels) - 1)
    return int(getattr(pipe, "vae_scale_factor", 8))


def to_latent(r: Range, scale: int) -> Range:
    """A pixel range as a latent range, rounding down as diffusers' pipelines do."""
    return (r[0] // scale, r[1] // scale, r[2] // scale)


def export_latent_size(num_upsamplers: int) -> int:
    """A latent side for the trace example that does not divide by 2^num_upsamplers.

    >>> [export_latent_size(n) for n in (0, 1, 3, 5)]
    [17, 17, 17, 33]
    """
    factor = 2**num_upsamplers
    return factor * max(1, math.ceil(_MIN_EXPORT_LATENT / factor)) + 1


class _UNetExport(torch.nn.Module):
    """Positional inputs in inputs() order, a one-tuple out."""

    def __init__(self, unet: torch.nn.Module, xl: bool, guidance_embedded: bool = False) -> None:
        super().__init__()
        self.unet = unet
        self.xl = xl
        self.guidance_embedded = guidance_embedded

    def forward(self, sample, timestep, encoder_hidden_states, *added):
        added_cond_kwargs = {"text_embeds": added[0], "time_ids": added[1]} if self.xl else None
        timestep_cond = added[-1] if self.guidance_embedded else None
        out = self.unet(
            sample, timestep, encoder_hidden_states, added_cond_kwargs=added_cond_kwargs,
            timestep_cond=timestep_cond, return_dict=False,
        )[0]
        return (out,)


class UNetSpec(ComponentSpec):
    """``pipe.unet`` (a diffusers ``UNet2DConditionModel``)."""

    name = "unet"

    def __init__(self, pipe) -> None:
        super().__init__(pipe)
        self._check_supported()

    def torch_module(self) -> torch.nn.Module:
        return self.pipe.unet

    @property
    def _cfg(self):
        return self.pipe.unet.config

    @property
    def xl(self) -> bool:
        return self._cfg.get("addition_embed_type") == "text_time"

    @property
    def guidance_embedded(self) -> bool:
        """An LCM-distilled UNet: ``timestep_cond`` carries the guidance-scale embedding."""
        return self._cfg.get("time_cond_proj_dim") is not None

    def _check_supported(self) -> None:
        cfg = self._cfg
        problems = []
        if cfg.get("addition_embed_type") not in (None, "text_time"):
            problems.append(f"addition_embed_type={cfg.get('addition_embed_type')!r}")
        if cfg.get("class_embed_type") is not None:
            problems.append(f"class_embed_type={cfg.get('class_embed_type')!r} (class labels)")
        if cfg.get("encoder_hid_dim_type") not in (None, "text_proj"):
            problems.append(f"encoder_hid_dim_type={cfg.get('encoder_hid_dim_type')!r} (image adapters)")
        if problems:
            raise UnsupportedComponent(
                "this UNet has conditioning the exported graph does not carry: "
                + ", ".join(problems)
                + "; it keeps running in torch"
            )

    def _context_dim(self) -> int:
        cfg = self._cfg
        if cfg.get("encoder_hid_dim") is not None:
            return int(cfg.encoder_hid_dim)  # projected inside the UNet to cross_attention_dim
        dim = cfg.cross_attention_dim
        return int(dim[0] if isinstance(dim, list | tuple) else dim)

    def _added_dims(self) -> tuple[int, int]:
        """(P, number of time ids) of SDXL's added conditioning.

        ``projection_class_embeddings_input_dim`` = P + n_ids * addition_time_embed_dim; P is the
        second text encoder's projection width (SDXL base: 1280 + 6*256; the refiner: 1280 + 5*256).
        """
        cfg = self._cfg
        total, per_id = cfg.projection_class_embeddings_input_dim, cfg.addition_time_embed_dim
        enc2 = getattr(self.pipe, "text_encoder_2", None)
        if enc2 is not None:
            pooled = int(enc2.config.projection_dim)
            return pooled, (total - pooled) // per_id
        return total - 6 * per_id, 6

    def inputs(self) -> tuple[TensorSpec, ...]:
        cfg, f32 = self._cfg, torch.float32
        base = (
            TensorSpec("sample", ("B2", cfg.in_channels, "H8", "W8"), f32),
            TensorSpec("timestep", ("B2",), f32),
            TensorSpec("encoder_hidden_states", ("B2", "T", self._context_dim()), f32),
        )
        if self.xl:
            pooled, n_ids = self._added_dims()
            base = (*base, TensorSpec("text_embeds", ("B2", pooled), f32), TensorSpec("time_ids", ("B2", n_ids), f32))
        if self.guidance_embedded:
            base = (*base, TensorSpec("timestep_cond", ("B2", int(cfg.time_cond_proj_dim)), f32))
        return base

    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("latent", ("B2", self._cfg.out_channels, "H8", "W8"), torch.float32),)

    def export_module(self) -> torch.nn.Module:
        return _UNetExport(self.pipe.unet, self.xl, self.guidance_embedded)

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        lo, opt, hi = profile.batch
        if self.guidance_embedded or not profile.cfg:
            # No CFG batch (diffusers never doubles a UNet with time_cond_proj_dim): B rows.
            b2 = profile.batch
        else:
            # Classifier-free guidance runs cond and uncond together (2B) or apart (B).
            b2 = (2 * lo, 2 * opt, 2 * hi) if profile.static else (lo, 2 * opt, 2 * hi)
        scale = vae_scale_factor(self.pipe)
        return {
            "B2": b2,
            "H8": to_latent(profile.height, scale),
            "W8": to_latent(profile.width, scale),
            "T": profile.tokens,
        }

    def export_dims(self) -> dict[str, int]:
        unet = self.pipe.unet
        ups = getattr(unet, "num_upsamplers", len(self._cfg.up_block_types) - 1)
        side = export_latent_size(ups)
        # Batch 2: tracing at batch 1 lets the exporter specialise broadcasts on that axis.
        return {"B2": 2, "H8": side, "W8": side, "T": TOKEN_CHUNK}

    def sample_feed(self, dims: dict[str, int], seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Latents and embeddings ~N(0, 1), timesteps in [0, num_train_timesteps), SDXL time ids
        in pixel units (sizes and crop offsets), as a real denoising step sees them."""
        feed = super().sample_feed(dims, seed=seed, device="cpu")
        g = torch.Generator("cpu").manual_seed(seed + 1)
        steps = self._num_train_timesteps()
        feed["timestep"] = torch.randint(0, steps, feed["timestep"].shape, generator=g).float()
        if "time_ids" in feed:
            feed["time_ids"] = torch.randint(0, 1025, feed["time_ids"].shape, generator=g).float()
        if "timestep_cond" in feed:  # a sin/cos embedding of the guidance scale: values in [-1, 1]
            feed["timestep_cond"] = torch.rand(feed["timestep_cond"].shape, generator=g) * 2 - 1
        return {k: v.to(device) for k, v in feed.items()}

    def _num_train_timesteps(self) -> int:
        scheduler = getattr(self.pipe, "scheduler", None)
        return int(getattr(getattr(scheduler, "config", None), "num_train_timesteps", 1000) or 1000)
