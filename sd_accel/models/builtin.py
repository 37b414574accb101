"""Built-in tiny models: ``builtin:tiny-sd15``, ``builtin:tiny-sdxl`` (and ``builtin:tiny-sd2``).

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
BUILTINS: dict[str, str] = {"tiny-sd15": "sd15", "tiny-sd2": "sd2-v", "tiny-sdxl": "sdxl"}
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

    >>> builtin_path("tiny-sd15")  # doctest: +SKIP
    PosixPath('/root/.cache/sd-accel/builtin/tiny-sd15-v1')
    """
    if name.startswith(PREFIX):
        name = name[len(PREFIX) :]
    if name not in BUILTINS:
        raise InvalidValue(
            f"unknown built-in model {name!r}; available: {', '.join(PREFIX + b for b in BUILTINS)}"
        )
    dest = cache_dir() / "builtin" / f"{name}-v{_VERSION}"
    with FileLock(str(dest) + ".lock"):
        if not (dest / "model_index.json").exists():
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            build_tiny_pipeline(BUILTINS[name]).save_pretrained(tmp, safe_serialization=True)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
    return dest
