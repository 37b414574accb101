"""What the always-on script does at each step of a WebUI job, and builds by checkpoint.

Every hook is wrapped by :func:`never_raise`: a bug in sd-accel prints a traceback and lets the
job go on in PyTorch; it never stops an image.
"""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Callable
from typing import Any

from sd_accel.core import InvalidValue, SdAccelError
from sd_accel.profiles import Profile
from sd_accel.profiles import preset as preset_profile
from sd_accel.webui import host
from sd_accel.webui.controller import Controller, controller
from sd_accel.webui.identity import job_loras

log = logging.getLogger("sd_accel")


def never_raise(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:
            print(f"sd-accel: {fn.__name__} failed; this job continues without it:\n{traceback.format_exc()}")
            return None

    return wrapper


# --------------------------------------------------------------------------- script hooks


@never_raise
def job_started(p) -> None:
    """``Script.process``: a new job; per-job counters and warnings start afresh."""
    controller().job_started()


@never_raise
def batch_started(p, **kwargs: Any) -> None:
    """``Script.process_batch``: the batch's extra networks are parsed (``p.extra_network_data``)."""
    ctl = controller()
    data = getattr(p, "extra_network_data", None) or kwargs.get("extra_network_data")
    loras, others = job_loras(data)
    ctl.job.loras = loras
    ctl.job.torch_only = (f"extra networks an engine cannot carry ({', '.join(others)}) run in PyTorch"
                          if others else None)


@never_raise
def before_sampling(p, **kwargs: Any) -> None:
    """``Script.process_before_every_sampling`` (Forge only): patch the UNet for this pass."""
    from sd_accel.webui.forge import patch_for_sampling

    if host.forge_unet_patcher(p.sd_model) is not None:
        batch_started(p, **kwargs)  # Forge parses extra networks before sampling as well
        patch_for_sampling(p)


@never_raise
def job_finished(p) -> None:
    """``Script.postprocess``: one console line on where the UNet calls went."""
    controller().job_finished()


# --------------------------------------------------------------------------- builds


class BuildRefused(SdAccelError, RuntimeError):
    """A build request that cannot be served as asked; ``status`` is the HTTP code to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _is_loaded(name: str, info) -> bool:
    from sd_accel.webui.identity import checkpoint_hash

    names = {getattr(info, a, None) for a in ("title", "name", "model_name", "shorthash", "hash")}
    return name in names or name == checkpoint_hash(info)


def load_checkpoint(name: str | None) -> None:
    """Make ``name`` (title, file name, model name or hash) the loaded checkpoint (A1111)."""
    model = host.sd_model(required=False)
    info = getattr(model, "sd_checkpoint_info", None)
    if not name or (info is not None and _is_loaded(name, info)):
        return
    sd_models = host.module("sd_models")
    match = sd_models.get_closet_checkpoint_match(name)  # sic: the WebUI's spelling
    if match is None:
        raise BuildRefused(404, f"no checkpoint matches {name!r}")
    if host.is_forge():
        raise BuildRefused(409, f"load {match.title} in the WebUI first: Forge loads checkpoints when it samples")
    with host.queue_lock():
        sd_models.reload_model_weights(info=match)


def profiles_for(preset: str | None, profile: dict | None, family: str, ctl: Controller) -> list[Profile]:
    if profile is not None and preset is not None:
        raise InvalidValue("give preset or profile, not both")
    if profile is not None:
        return [Profile.of(profile)]
    return [preset_profile(preset or ctl.preset_for(family))]


def build_for_checkpoint(checkpoint: str | None = None, preset: str | None = None, profile: dict | None = None,
                         backend: str = "auto", precision: str = "auto", ctl: Controller | None = None,
                         progress=None, cancel=None) -> list:
    """Build engines for ``checkpoint`` (default: the loaded one) and tell the WebUI."""
    from sd_accel.webui.export import build_loaded, export_source

    ctl = ctl or controller()
    load_checkpoint(checkpoint)
    try:
        family = export_source().family
    except host.NoModel as exc:
        raise BuildRefused(409, str(exc)) from exc
    profiles = profiles_for(preset, profile, family, ctl)
    backend = ctl.backend_name() if backend in (None, "", "auto") else backend
    try:
        return build_loaded(profiles, ctl.cache(), backend, precision, progress=progress, cancel=cancel)
    finally:
        ctl.engines_changed()
