"""Where sd-accel keeps files on disk. Every location can be moved by an environment variable."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """Derived files that can be rebuilt at any time: resolved model configs, built-in tiny models.

    ``SD_ACCEL_CACHE_DIR`` overrides the platform's user cache folder.
    """
    env = os.environ.get("SD_ACCEL_CACHE_DIR")
    path = Path(env) if env else Path(platformdirs.user_cache_dir("sd-accel"))
    path.mkdir(parents=True, exist_ok=True)
    return path
