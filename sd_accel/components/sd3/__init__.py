"""Stable Diffusion 3 / 3.5 (MMDiT): the transformer's component spec. Its text encoders are the
shared CLIP (``sd_accel.components.clip``) and T5 (``sd_accel.components.t5``) specs, its VAE the
shared KL VAE's (16 latent channels)."""

from sd_accel.components.sd3.transformer import SD3TransformerSpec, is_sd3_transformer

__all__ = ["SD3TransformerSpec", "is_sd3_transformer"]
