"""The one place that reaches into ComfyUI: its modules are imported here, on use.

Names are those of ComfyUI 0.8 (``comfy.patcher_extension.WrappersMP``, ``comfy.utils.ProgressBar``,
``comfy.model_management``'s interrupt flag, ``folder_paths``); tests run the same code against
``tests/comfyui_stub``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("sd_accel")

SOURCE_ATTR = "_sd_accel_source"  # set on the loaded modules: the checkpoint file they came from


def comfy(name: str):
    """``comfy.<name>`` of the running ComfyUI."""
    return importlib.import_module(f"comfy.{name}")


def wrappers():
    """``comfy.patcher_extension.WrappersMP`` (the wrapper types: OUTER_SAMPLE, DIFFUSION_MODEL ...)."""
    return comfy("patcher_extension").WrappersMP


def interrupted() -> bool:
    """The user pressed Cancel (ComfyUI's interrupt flag, ``model_management.processing_interrupted``)."""
    try:
        return bool(comfy("model_management").processing_interrupted())
    except (ImportError, AttributeError):
        return False


def raise_if_interrupted() -> None:
    """ComfyUI's own way out of a node the user cancelled (``InterruptProcessingException``)."""
    comfy("model_management").throw_exception_if_processing_interrupted()


def progress_bar(total: int):
    """``comfy.utils.ProgressBar(total)``: the node's progress in the UI (None where there is none)."""
    try:
        return comfy("utils").ProgressBar(total)
    except (ImportError, AttributeError):
        return None


def models_dir() -> Path:
    """ComfyUI's ``models`` folder (``folder_paths.models_dir``), else ``./models``."""
    try:
        return Path(importlib.import_module("folder_paths").models_dir)
    except (ImportError, AttributeError):
        return Path("models")


def default_engine_dir() -> Path:
    """``$SD_ACCEL_ENGINE_DIR``, else ``<ComfyUI>/models/sd-accel`` beside its other models (the
    WebUI's default is ``<webui>/models/sd-accel``: point both at one folder to share engines)."""
    env = os.environ.get("SD_ACCEL_ENGINE_DIR")
    return Path(env).expanduser() if env else models_dir() / "sd-accel"


def runs_on_cpu() -> bool:
    """ComfyUI computes on the CPU (``--cpu``, or no GPU): auto's backend is then the CPU's."""
    try:
        import torch

        device = comfy("model_management").get_torch_device()
        return getattr(device, "type", str(device)) == "cpu" or not torch.cuda.is_available()
    except Exception:  # noqa: BLE001  (ComfyUI not importable here: judge by torch)
        import torch

        return not torch.cuda.is_available()


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def tag_source(obj: Any, path: str) -> None:
    """Remember on ``obj`` (a module, kept by every ModelPatcher clone) the file it was loaded from,
    with the file's size and modification time then."""
    if obj is not None:
        try:
            object.__setattr__(obj, SOURCE_ATTR, (str(path), _stamp(str(path))))
        except (AttributeError, TypeError):
            pass


def source_of(obj: Any) -> str | None:
    """The file ``obj`` was loaded from, while that file is unchanged. A file overwritten since
    (ComfyUI keeps serving the model it loaded before) gives None, so the weights in memory are
    fingerprinted instead of being keyed by the new file's hash."""
    tag = getattr(obj, SOURCE_ATTR, None)
    if tag is None:
        return None
    path, stamp = tag
    return path if stamp is not None and _stamp(path) == stamp else None


def tag_checkpoint_loads() -> bool:
    """Make ``comfy.sd.load_checkpoint_guess_config`` (what CheckpointLoaderSimple and its kin
    call) remember the file on the MODEL's BaseModel, the CLIP's model and the VAE's autoencoder.
    That is how engines are keyed by the checkpoint's hash, as the WebUI keys them; nothing else
    about loading changes. True when installed (once)."""
    try:
        sd = comfy("sd")
    except ImportError:
        return False
    original = getattr(sd, "load_checkpoint_guess_config", None)
    if original is None or getattr(original, "_sd_accel", False):
        return original is not None

    @functools.wraps(original)
    def load_checkpoint_guess_config(ckpt_path, *args, **kwargs):
        out = original(ckpt_path, *args, **kwargs)
        try:
            model, clip, vae = (list(out) + [None, None, None])[:3]
            tag_source(getattr(model, "model", None), ckpt_path)
            tag_source(getattr(clip, "cond_stage_model", None), ckpt_path)
            tag_source(getattr(vae, "first_stage_model", None), ckpt_path)
        except Exception as exc:  # noqa: BLE001  (never break a load: engines are then keyed by fingerprint)
            log.debug("sd-accel: could not tag the checkpoint's modules: %s", exc)
        return out

    load_checkpoint_guess_config._sd_accel = True
    sd.load_checkpoint_guess_config = load_checkpoint_guess_config
    _tag_diffusion_model_loads(sd)
    return True


def _tag_diffusion_model_loads(sd) -> None:
    """``comfy.sd.load_diffusion_model`` (UNETLoader, "Load Diffusion Model": a FLUX.1 or SD3 file in
    ``models/diffusion_models``) remembers its file on the MODEL's BaseModel too."""
    original = getattr(sd, "load_diffusion_model", None)
    if original is None or getattr(original, "_sd_accel", False):
        return

    @functools.wraps(original)
    def load_diffusion_model(unet_path, *args, **kwargs):
        out = original(unet_path, *args, **kwargs)
        try:
            tag_source(getattr(out, "model", None), unet_path)
        except Exception as exc:  # noqa: BLE001  (never break a load: engines are then keyed by fingerprint)
            log.debug("sd-accel: could not tag the diffusion model: %s", exc)
        return out

    load_diffusion_model._sd_accel = True
    sd.load_diffusion_model = load_diffusion_model
