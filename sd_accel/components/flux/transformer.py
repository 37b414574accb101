"""FLUX.1's transformer (``FluxTransformer2DModel``: double- and single-stream blocks).

Engine inputs (float32): ``hidden_states`` (B, N, C) packed latents (2x2 patches: C = 64),
``encoder_hidden_states`` (B, L, D) T5's states, ``pooled_projections`` (B, P) CLIP-L's pooled
output, ``timestep`` (B,) in [0, 1] (the pipeline divides by 1000), ``img_ids`` (N, 3) and
``txt_ids`` (L, 3) the rotary positions, and for dev (``guidance_embeds``) ``guidance`` (B,).
Engine output: ``latent`` (B, N, C_out). No classifier-free guidance batch: FLUX.1 dev takes the
guidance as an embedding, ``true_cfg_scale`` runs the negative prompt as a call of its own.

N, the image tokens, is (H / 16) x (W / 16): a profile's pixel ranges make its range, and one
dynamic engine serves every size whose token count lies in it. L is the profile's ``text`` range.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from sd_accel.components.flux import segments
from sd_accel.components.flux.export import export_patches
from sd_accel.components.segments import Segment
from sd_accel.components.spec import TensorSpec
from sd_accel.components.t5 import text_range
from sd_accel.components.transformer import TransformerSpec
from sd_accel.components.unet import vae_scale_factor
from sd_accel.profiles import Profile, Range


def is_flux_transformer(module) -> bool:
    return type(getattr(module, "torch_module", module)).__name__ == "FluxTransformer2DModel"


def image_ids(rows: int, cols: int) -> torch.Tensor:
    """The rotary positions of a rows x cols grid of image tokens, as FluxPipeline makes them."""
    ids = torch.zeros(rows, cols, 3)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3)


def _grid(tokens: int) -> tuple[int, int]:
    """A rows x cols grid of ``tokens`` cells, as square as the number allows."""
    rows = max(d for d in range(1, math.isqrt(tokens) + 1) if tokens % d == 0)
    return rows, tokens // rows


class _FluxExport(torch.nn.Module):
    def __init__(self, transformer: torch.nn.Module, guidance: bool) -> None:
        super().__init__()
        self.transformer = transformer
        self.guidance = guidance

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                *guidance):
        with export_patches(self.transformer) if torch.onnx.is_in_onnx_export() else nullcontext():
            out = self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                   pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                                   txt_ids=txt_ids, guidance=guidance[0] if self.guidance else None,
                                   return_dict=False)[0]
        return (out,)


class FluxTransformerSpec(TransformerSpec):
    """``pipe.transformer`` of a FLUX.1 pipeline."""

    @property
    def guidance(self) -> bool:
        """FLUX.1 dev: the guidance scale goes in as an embedding (schnell has none)."""
        return bool(self._cfg.get("guidance_embeds"))

    def inputs(self) -> tuple[TensorSpec, ...]:
        cfg, f32 = self._cfg, torch.float32
        base = (
            TensorSpec("hidden_states", ("B", "N", cfg.in_channels), f32),
            TensorSpec("encoder_hidden_states", ("B", "L", cfg.joint_attention_dim), f32),
            TensorSpec("pooled_projections", ("B", cfg.pooled_projection_dim), f32),
            TensorSpec("timestep", ("B",), f32),
            TensorSpec("img_ids", ("N", 3), f32),
            TensorSpec("txt_ids", ("L", 3), f32),
        )
        return (*base, TensorSpec("guidance", ("B",), f32)) if self.guidance else base

    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("latent", ("B", "N", self.pipe.transformer.out_channels), torch.float32),)

    def export_module(self) -> torch.nn.Module:
        return _FluxExport(self.pipe.transformer, self.guidance)

    def pixels_per_token(self) -> int:
        return vae_scale_factor(self.pipe) * 2  # 2x2 latent patches

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        side = self.pixels_per_token()
        tokens = tuple((h // side) * (w // side) for h, w in zip(profile.height, profile.width, strict=True))
        return {"B": profile.batch, "N": tokens, "L": text_range(self.pipe, profile)}  # type: ignore[dict-item]

    def export_dims(self) -> dict[str, int]:
        return {"B": 2, "N": 9 * 11, "L": 19}

    def sample_feed(self, dims: dict[str, int], seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Latents and embeddings ~N(0, 1), timesteps in [0, 1], the positions of a real grid of N
        image tokens and L text tokens (zeros, as the pipeline gives them), guidance 1..5."""
        feed = super().sample_feed(dims, seed=seed, device="cpu")
        g = torch.Generator("cpu").manual_seed(seed + 1)
        feed["timestep"] = torch.rand(feed["timestep"].shape, generator=g)
        feed["img_ids"] = image_ids(*_grid(dims["N"]))
        feed["txt_ids"] = torch.zeros(dims["L"], 3)
        if "guidance" in feed:
            feed["guidance"] = 1 + torch.rand(feed["guidance"].shape, generator=g) * 4
        return {k: v.to(device) for k, v in feed.items()}

    # ---- segments (sd_accel.components.segments: a build that holds one segment at a time) ----

    def segment_blocks(self) -> tuple[str, ...]:
        return segments.BLOCK_LISTS

    def segment_io(self, segment: Segment) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        return segments.segment_io(self, segment)

    def segment_module(self, segment: Segment) -> torch.nn.Module:
        return segments.FluxSegment(self.pipe.transformer, segment, self.guidance)

    def segment_ranges(self, profile: Profile) -> dict[str, Range]:
        return self.dim_ranges(profile)

    def segment_dims(self, dims: dict[str, int]) -> dict[str, int]:
        return dict(dims)
