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


def default_engine_dir() -> Path:
    """The engine cache's default root: ``$SD_ACCEL_ENGINE_DIR``, else ``./engines``.

    ``./engines`` is relative to the current working directory at the time of the call; unlike
    :func:`cache_dir`, the folder is not created here (the cache creates it on its first write).

    >>> default_engine_dir()  # with SD_ACCEL_ENGINE_DIR=/data/engines      # doctest: +SKIP
    PosixPath('/data/engines')
    """
    env = os.environ.get("SD_ACCEL_ENGINE_DIR")
    return Path(env).expanduser() if env else Path.cwd() / "engines"
