"""Tiny LCM-distilled pipelines: the tiny family models with a UNet that has ``time_cond_proj_dim``
(the guidance-scale embedding input, ``timestep_cond``) and the LCM scheduler."""

from __future__ import annotations

import torch

COND_DIM = 32  # released LCM UNets: 256


def tiny_lcm_pipeline(family: str = "sd15", seed: int = 0):
    """SD 1.5: a ``LatentConsistencyModelPipeline``; SDXL: a ``StableDiffusionXLPipeline`` with the
    LCM scheduler (what people run LCM-SDXL with)."""
    import diffusers
    from diffusers import LCMScheduler, UNet2DConditionModel

    from sd_accel.models.builtin import build_tiny_pipeline

    base = build_tiny_pipeline(family)
    torch.manual_seed(seed)
    config = {k: v for k, v in base.unet.config.items() if not k.startswith("_")}  # _use_default_values would reset it
    unet = UNet2DConditionModel.from_config({**config, "time_cond_proj_dim": COND_DIM}).eval()
    scheduler = LCMScheduler.from_config(base.scheduler.config)
    parts = {**base.components, "unet": unet, "scheduler": scheduler}
    if family == "sdxl":
        return diffusers.StableDiffusionXLPipeline(**parts)
    parts.pop("image_encoder", None)
    parts.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return diffusers.LatentConsistencyModelPipeline(**parts)
