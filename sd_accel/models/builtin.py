"""Built-in tiny models: ``builtin:tiny-sd15``, ``builtin:tiny-sdxl`` (and ``builtin:tiny-sd2``),
``builtin:tiny-sd15-lcm`` (an LCM-distilled UNet: ``time_cond_proj_dim``, the LCM scheduler), the
transformer families ``builtin:tiny-sd3`` (SD 3.5 Medium's MMDiT with its dual-attention layer and
qk-norm, two CLIPs and T5), ``builtin:tiny-flux`` (FLUX.1 schnell: no guidance embedding) and
``builtin:tiny-flux-dev`` (with it), and
the tiny autoencoder ``builtin:taesd`` (TAESD's architecture: ``--tiny-vae builtin:taesd``).

Built once from configs with seeded random weights, saved as a diffusers folder in the cache,
and loaded from there afterwards. Their images are noise; a real checkpoint gives real pictures.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import diffusers
from filelock import FileLock

from sd_accel.core import InvalidValue
from sd_accel.models.components import random_pipeline
from sd_accel.models.families import FAMILIES, load_family_configs, merged
from sd_accel.models.tiny import TINY_OVERRIDES
from sd_accel.paths import cache_dir

PREFIX = "builtin:"
BUILTINS: dict[str, str] = {"tiny-sd15": "sd15", "tiny-sd2": "sd2-v", "tiny-sdxl": "sdxl", "tiny-sd15-lcm": "sd15",
                            "tiny-sd3": "sd3", "tiny-flux": "flux-schnell", "tiny-flux-dev": "flux-dev"}
# what a built-in model changes in its family's tiny configs: the LCM one is what LCM-distilled
# checkpoints (LCM Dreamshaper v7) are, the guidance embedding of 256 included
_CHANGES: dict[str, dict[str, dict]] = {"tiny-sd15-lcm": {
    "unet/config.json": {"time_cond_proj_dim": 256},
    "scheduler/scheduler_config.json": {"_class_name": "LCMScheduler", "original_inference_steps": 50},
    "model_index.json": {"_class_name": "LatentConsistencyModelPipeline", "scheduler": ["diffusers", "LCMScheduler"]},
}}
TINY_VAES = ("taesd",)  # built-in AutoencoderTiny folders (not pipelines)
_TAESD_CONFIG = Path(__file__).resolve().parent / "configs" / "taesd"  # (models/taesd.py reads the same)
_SEED = 1234
# Bump when the tiny configs change, so old cached folders are not reused.
_VERSION = 2


def tiny_configs(family: str) -> dict:
    """The full config set of a family's tiny model."""
    return merged(load_family_configs(FAMILIES[family]), TINY_OVERRIDES[family])


def build_tiny_pipeline(family: str, seed: int = _SEED) -> diffusers.DiffusionPipeline:
    """A fresh tiny pipeline of ``family`` (``"sd15"``, ``"sd2-v"``, ``"sd2-base"``, ``"sdxl"``)."""
    return random_pipeline(tiny_configs(family), seed=seed)


def builtin_path(name: str) -> Path:
    """The diffusers folder of a built-in model, building it on first use.

    >>> builtin_path("tiny-sd15").name    # a folder in the cache: ~/.cache/sd-accel/builtin/ on Linux
    'tiny-sd15-v2'
    """
    if name.startswith(PREFIX):
        name = name[len(PREFIX) :]
    if name in TINY_VAES:
        raise InvalidValue(f"builtin:{name} is a tiny autoencoder, not a model: pass it as the tiny VAE "
                           f"(--tiny-vae builtin:{name}, AccelConfig(vae='tiny:builtin:{name}'))")
    if name not in BUILTINS:
        raise InvalidValue(
            f"unknown built-in model {name!r}; available: {', '.join(PREFIX + b for b in BUILTINS)}"
        )
    dest = cache_dir() / "builtin" / f"{name}-v{_VERSION}"
    with FileLock(str(dest) + ".lock"):
        if not (dest / "model_index.json").exists():
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            family = BUILTINS[name]
            pipe = random_pipeline(merged(tiny_configs(family), _CHANGES[name]), seed=_SEED) if name in _CHANGES \
                else build_tiny_pipeline(family)
            pipe.save_pretrained(tmp, safe_serialization=True)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
    return dest


def builtin_tiny_vae_path(name: str) -> Path:
    """The diffusers folder of a built-in tiny autoencoder (``builtin:taesd``: TAESD's architecture
    and config, seeded random weights), built on first use. Its images are noise, like the models'.
    """
    from diffusers import AutoencoderTiny
    from torch import manual_seed

    name = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if name not in TINY_VAES:
        raise InvalidValue(f"unknown built-in tiny autoencoder {name!r}; available: "
                           f"{', '.join(PREFIX + b for b in TINY_VAES)}")
    dest = cache_dir() / "builtin" / f"{name}-v{_VERSION}"
    with FileLock(str(dest) + ".lock"):
        if not (dest / "config.json").exists():
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            manual_seed(_SEED)
            AutoencoderTiny.from_config(AutoencoderTiny.load_config(_TAESD_CONFIG)).eval().save_pretrained(
                tmp, safe_serialization=True)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
    return dest
