"""The one place that reaches into the WebUI: its modules are imported here, on use.

Real module and attribute names of AUTOMATIC1111 (1.6-1.10) and Forge (both eras) are used;
anything that differs between them is probed with ``getattr`` so that a missing attribute
means "not this WebUI", never a crash. Tests run the same code against ``tests/webui_stub``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from sd_accel.core import SdAccelError


class NoModel(SdAccelError, RuntimeError):
    """No checkpoint is loaded (A1111 before the first load, Forge's ``FakeInitialModel``)."""


def module(name: str):
    """``modules.<name>`` of the running WebUI (``shared``, ``sd_unet``, ``script_callbacks`` ...)."""
    return importlib.import_module(f"modules.{name}")


def is_forge() -> bool:
    """Forge (either era) ships the ``modules_forge`` package beside A1111's ``modules``."""
    return importlib.util.find_spec("modules_forge") is not None


def shared():
    return module("shared")


def sd_model(required: bool = True):
    """``shared.sd_model``; :class:`NoModel` when none is loaded and ``required``."""
    model = getattr(shared(), "sd_model", None)
    if required and (model is None or getattr(model, "sd_checkpoint_info", None) is None):
        raise NoModel("no checkpoint is loaded in the WebUI; pick one in the checkpoint dropdown first")
    return model


def forge_unet_patcher(model=None):
    """Forge's ``UnetPatcher`` of the model (``forge_objects.unet``), or None outside Forge."""
    model = model if model is not None else sd_model(required=False)
    objects = getattr(model, "forge_objects", None)
    return getattr(objects, "unet", None)


def loaded_unet(model=None) -> torch.nn.Module:
    """The UNet module the WebUI samples with, as the WebUI has it (LoRA merged included).

    A1111: ``sd_model.model.diffusion_model`` (LDM / SGM ``UNetModel``). Forge:
    ``sd_model.forge_objects.unet.model.diffusion_model``; an sd-accel stand-in that a running
    job patched in is unwrapped to the torch module it wraps.
    """
    model = model if model is not None else sd_model()
    patcher = forge_unet_patcher(model)
    if patcher is not None:
        unet = patcher.model.diffusion_model
    else:
        wrapper = getattr(model, "model", None)
        unet = getattr(wrapper, "diffusion_model", None)
    if unet is None:
        raise NoModel(f"{type(model).__name__} has no UNet (diffusion_model); load an SD checkpoint")
    return getattr(unet, "torch_unet", unet)


def checkpoint_info(model=None):
    """``sd_model.sd_checkpoint_info`` (``modules.sd_models.CheckpointInfo``)."""
    return (model if model is not None else sd_model()).sd_checkpoint_info


def cmd_flag(name: str) -> bool:
    """A WebUI command-line flag (``medvram``, ``lowvram``, ``xformers``, ``no_half_vae`` ...)."""
    return bool(getattr(getattr(shared(), "cmd_opts", None), name, False))


def opt(key: str, default: Any = None) -> Any:
    """A value from the settings page (``shared.opts``), ``default`` while unset."""
    opts = getattr(shared(), "opts", None)
    data = getattr(opts, "data", None) or {}
    if key in data:
        return data[key]
    try:
        value = getattr(opts, key)
    except (AttributeError, KeyError):
        return default
    return default if value is None else value


def models_dir() -> Path:
    """The WebUI's ``models`` folder (``modules.paths.models_path``), else ``./models``."""
    try:
        return Path(module("paths").models_path)
    except (ImportError, AttributeError):
        return Path.cwd() / "models"


def default_engine_dir() -> Path:
    """``$SD_ACCEL_ENGINE_DIR``, else ``<webui>/models/sd-accel`` beside the WebUI's other models."""
    env = os.environ.get("SD_ACCEL_ENGINE_DIR")
    return Path(env).expanduser() if env else models_dir() / "sd-accel"


def queue_lock():
    """The WebUI's generation lock (``modules.call_queue.queue_lock``): builds hold it, so that
    the UNet is never moved for export while a job samples with it."""
    try:
        return module("call_queue").queue_lock
    except (ImportError, AttributeError):
        import threading

        return threading.Lock()
