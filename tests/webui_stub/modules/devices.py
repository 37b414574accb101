"""``modules/devices.py``: the sampling device (the CPU here) and ``torch_gc``."""

from __future__ import annotations

import contextlib

import torch

cpu = torch.device("cpu")
device = device_interrogate = device_gfpgan = device_esrgan = device_codeformer = cpu
dtype = dtype_vae = dtype_unet = torch.float32


def torch_gc():
    pass


def autocast(disable=False):
    return contextlib.nullcontext()
