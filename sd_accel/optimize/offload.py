"""Low-VRAM modes (model or sequential CPU offload) and VAE slicing / tiling."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("sd_accel")


def apply_vae_memory(pipe, slicing: bool, tiling: bool) -> None:
    # diffusers >= 0.40 removed the pipeline-level methods; the VAE's own ones remain.
    vae = getattr(pipe, "vae", None)
    if vae is None:
        return
    if slicing:
        vae.enable_slicing()
    if tiling:
        vae.enable_tiling()


def apply_offload(pipe, mode: str, device: torch.device) -> bool:
    """Enable ``medvram`` / ``lowvram`` offload on CUDA. Returns whether offload is active."""
    if mode == "none":
        return False
    if device.type != "cuda":
        log.warning("offload=%r only saves GPU memory; the pipeline runs on %s, so it is ignored", mode, device)
        return False
    gpu = device.index if device.index is not None else 0
    if mode == "medvram":
        pipe.enable_model_cpu_offload(gpu_id=gpu)
    else:
        pipe.enable_sequential_cpu_offload(gpu_id=gpu)
    log.info("offload: %s", mode)
    return True
