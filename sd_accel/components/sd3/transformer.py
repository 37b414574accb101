"""SD3 / SD3.5's transformer (``SD3Transformer2DModel``: MMDiT; 3.5 Medium's dual-attention layers
and RMS qk-norm included).

Engine inputs: ``hidden_states`` (B2, C, H8, W8) latents, ``encoder_hidden_states`` (B2, S, D):
both CLIPs' penultimate states (padded to T5's width) followed by T5's, so S = 77 + the T5 length;
``pooled_projections`` (B2, P): both CLIPs' pooled projections; ``timestep`` (B2,) in [0, 1000).
All float32. Engine output: ``latent`` (B2, C_out, H8, W8), the velocity the flow-match sampler
takes. Classifier-free guidance doubles the batch as for the UNet.

Exported with the legacy exporter unchanged: the graph stays dynamic in batch, latent size (the
position embedding is cropped from its table by shape) and text length.
"""

from __future__ import annotations

import torch

from sd_accel.components.sd3 import segments
from sd_accel.components.segments import Segment
from sd_accel.components.spec import TensorSpec
from sd_accel.components.t5 import text_range
from sd_accel.components.transformer import TransformerSpec
from sd_accel.components.unet import to_latent, vae_scale_factor
from sd_accel.profiles import TOKEN_CHUNK, Profile, Range


def is_sd3_transformer(module) -> bool:
    return type(getattr(module, "torch_module", module)).__name__ == "SD3Transformer2DModel"


def cfg_batch(profile: Profile) -> Range:
    """The denoiser's batch under classifier-free guidance: cond and uncond together (2B), or apart (B)."""
    lo, opt, hi = profile.batch
    if not profile.cfg:
        return profile.batch
    return (2 * lo, 2 * opt, 2 * hi) if profile.static else (lo, 2 * opt, 2 * hi)


class _SD3Export(torch.nn.Module):
    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep):
        out = self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                               pooled_projections=pooled_projections, timestep=timestep, return_dict=False)[0]
        return (out,)


class SD3TransformerSpec(TransformerSpec):
    """``pipe.transformer`` of a SD3 / SD3.5 pipeline."""

    def inputs(self) -> tuple[TensorSpec, ...]:
        cfg, f32 = self._cfg, torch.float32
        return (
            TensorSpec("hidden_states", ("B2", cfg.in_channels, "H8", "W8"), f32),
            TensorSpec("encoder_hidden_states", ("B2", "S", cfg.joint_attention_dim), f32),
            TensorSpec("pooled_projections", ("B2", cfg.pooled_projection_dim), f32),
            TensorSpec("timestep", ("B2",), f32),
        )

    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("latent", ("B2", self.pipe.transformer.out_channels, "H8", "W8"), torch.float32),)

    def export_module(self) -> torch.nn.Module:
        return _SD3Export(self.pipe.transformer)

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        scale = vae_scale_factor(self.pipe)
        lo, opt, hi = text_range(self.pipe, profile)
        return {
            "B2": cfg_batch(profile),
            "H8": to_latent(profile.height, scale),
            "W8": to_latent(profile.width, scale),
            "S": (TOKEN_CHUNK + lo, TOKEN_CHUNK + opt, TOKEN_CHUNK + hi),
        }

    def export_dims(self) -> dict[str, int]:
        # latents of 2 x 9 patches (no power of two) and 77 + 19 text tokens keep every axis general
        patch = int(self._cfg.patch_size)
        return {"B2": 2, "H8": 9 * patch, "W8": 11 * patch, "S": TOKEN_CHUNK + 19}

    def sample_feed(self, dims: dict[str, int], seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Latents and embeddings ~N(0, 1), timesteps in [0, 1000) as the flow-match sampler gives them."""
        feed = super().sample_feed(dims, seed=seed, device="cpu")
        g = torch.Generator("cpu").manual_seed(seed + 1)
        feed["timestep"] = torch.rand(feed["timestep"].shape, generator=g) * 1000
        return {k: v.to(device) for k, v in feed.items()}

    # ---- segments (sd_accel.components.segments: a build that holds one segment at a time) ----

    def segment_blocks(self) -> tuple[str, ...]:
        return segments.BLOCK_LISTS

    def segment_io(self, segment: Segment) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        return segments.segment_io(self, segment)

    def segment_module(self, segment: Segment) -> torch.nn.Module:
        return segments.SD3Segment(self.pipe.transformer, segment)

    def segment_ranges(self, profile: Profile) -> dict[str, Range]:
        ranges = self.dim_ranges(profile)
        return {**ranges, "T": segments.token_range(ranges["H8"], ranges["W8"], int(self._cfg.patch_size))}

    def segment_dims(self, dims: dict[str, int]) -> dict[str, int]:
        patch = int(self._cfg.patch_size)
        return {**dims, "T": (dims["H8"] // patch) * (dims["W8"] // patch)}
