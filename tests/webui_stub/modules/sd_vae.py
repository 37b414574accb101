"""``modules/sd_vae.py``: which VAE file is loaded into ``first_stage_model`` (None: the
checkpoint's own), and its short hash as the WebUI gives it."""

from __future__ import annotations

import hashlib
import os

loaded_vae_file = None


def get_loaded_vae_name():
    return None if loaded_vae_file is None else os.path.basename(loaded_vae_file)


def get_loaded_vae_hash():
    if loaded_vae_file is None:
        return None
    return hashlib.sha256(os.path.basename(loaded_vae_file).encode()).hexdigest()[0:10]
