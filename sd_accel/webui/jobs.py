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

from sd_accel.core import DEFAULT_COMPONENTS as SHARED_DEFAULTS
from sd_accel.core import InvalidValue, SdAccelError
from sd_accel.profiles import Profile
from sd_accel.profiles import preset as preset_profile
from sd_accel.webui import host
from sd_accel.webui.controller import Controller, controller
from sd_accel.webui.identity import job_loras
from sd_accel.webui.stand_ins import COMPONENTS  # the user-facing names: the core vocabulary's, less clip2

log = logging.getLogger("sd_accel")


def never_raise(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:
            from sd_accel.webui.console import say

            say(f"{fn.__name__} failed; this job continues without it:\n{traceback.format_exc()}")
            return None

    return wrapper


# --------------------------------------------------------------------------- script hooks


@never_raise
def job_started(p) -> None:
    """``Script.process``: a new job; per-job counters and warnings start afresh, and the VAE and
    text encoder get their engine forwards (once per model; before img2img encodes its image)."""
    from sd_accel.webui.stand_ins import install

    ctl = controller()
    ctl.job_started()
    model = getattr(p, "sd_model", None) or host.loaded_model()
    if model is not None:
        install(model, ctl)


@never_raise
def batch_started(p, **kwargs: Any) -> None:
    """``Script.process_batch``: the batch's extra networks are parsed (``p.extra_network_data``)."""
    ctl = controller()
    data = getattr(p, "extra_network_data", None) or kwargs.get("extra_network_data")
    loras, others = job_loras(data)
    ctl.job.loras = loras
    ctl.job.te_loras = job_loras(data, "te")[0]
    ctl.job.torch_only = (f"extra networks an engine cannot carry ({', '.join(others)}) run in PyTorch"
                          if others else None)
    if not host.is_forge():
        from sd_accel.webui.a1111 import watch_forward_hooks

        watch_forward_hooks(ctl)  # sd-webui-controlnet has hooked the UNet by now (its ``process``)


@never_raise
def before_sampling(p, **kwargs: Any) -> None:
    """``Script.process_before_every_sampling`` (Forge only): patch the UNet for this pass."""
    from sd_accel.webui.forge import patch_for_sampling

    if host.forge_unet_patcher(p.sd_model) is not None:
        batch_started(p, **kwargs)  # Forge parses extra networks before sampling as well
        patch_for_sampling(p)


@never_raise
def job_finished(p) -> None:
    """``Script.postprocess``: one console line on where the UNet calls went; on Forge, the
    parked torch UNet's pages that the job read are handed back."""
    ctl = controller()
    ctl.job_finished()
    if ctl.job.parked is not None:
        from sd_accel.webui.forge import release_parked

        release_parked(ctl)


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
    """Make ``name`` (title, file name, model name or hash; None: the one selected in the WebUI)
    the loaded checkpoint, with the WebUI's own loading functions.

    A1111 and Forge 1 load the selected checkpoint on first use of ``shared.sd_model``
    (``model_data.get_sd_model()``; not yet under ``--skip-load-model-at-start``) and switch with
    ``reload_model_weights``. Forge 2 loads only when it generates: ``forge_model_reload()``
    loads what its checkpoint dropdown selects, ``main_entry.checkpoint_change`` selects another.
    """
    from sd_accel.webui.console import say

    sd_models = host.module("sd_models")
    model = host.loaded_model()
    info = getattr(model, "sd_checkpoint_info", None)
    if info is not None and (not name or _is_loaded(name, info)):
        return
    match = None
    if name:
        match = sd_models.get_closet_checkpoint_match(name)  # sic: the WebUI's spelling
        if match is None:
            raise BuildRefused(404, f"no checkpoint matches {name!r}; GET /sdapi/v1/sd-models lists them")
    what = getattr(match, "title", None) or "the selected checkpoint"
    say(f"loading {what} for the build (the WebUI had {'another' if model is not None else 'none'} loaded)")
    with host.queue_lock():
        reload = getattr(sd_models, "forge_model_reload", None)
        if callable(reload):  # Forge 2
            if match is not None:
                from modules_forge import main_entry

                main_entry.checkpoint_change(match.title)
            reload()
        elif match is not None:
            sd_models.reload_model_weights(info=match)
        else:
            data = getattr(sd_models, "model_data", None)
            if data is not None and callable(getattr(data, "get_sd_model", None)):
                data.get_sd_model()
            else:
                getattr(host.shared(), "sd_model", None)
    if host.loaded_model() is None:
        raise BuildRefused(409, "the WebUI could not load a checkpoint (see its console); pick one in the "
                                "checkpoint dropdown and generate once, then build")


def profiles_for(preset: str | None, profile: dict | None, family: str, ctl: Controller) -> list[Profile]:
    if profile is not None and preset is not None:
        raise InvalidValue("give preset or profile, not both")
    if profile is not None:
        return [Profile.of(profile)]
    return [preset_profile(preset or ctl.preset_for(family))]


def build_for_checkpoint(checkpoint: str | None = None, preset: str | None = None, profile: dict | None = None,
                         backend: str = "auto", precision: str = "auto", ctl: Controller | None = None,
                         progress=None, cancel=None, components=None, skipped: list | None = None) -> list:
    """Build engines for ``checkpoint`` (default: the loaded one, or the selected one loaded
    first) and tell the WebUI. ``components``: user-facing names (``unet``, ``vae_decoder``,
    ``vae_encoder``, ``clip``; default :data:`DEFAULT_COMPONENTS`); ``skipped`` receives
    "component (why)" for those this model has no module for."""
    from sd_accel.webui.export import build_loaded, export_source

    ctl = ctl or controller()
    wanted = components_of(components)
    profiles_for(preset, profile, "sd15", ctl)  # a bad request is refused before any model is loaded
    load_checkpoint(checkpoint)
    try:
        family = export_source().family
    except host.NoModel as exc:
        raise BuildRefused(409, str(exc)) from exc
    profiles = profiles_for(preset, profile, family, ctl)
    backend = ctl.backend_name() if backend in (None, "", "auto") else backend
    try:
        return build_loaded(profiles, ctl.cache(), backend, precision, progress=progress, cancel=cancel,
                            components=wanted, skipped=skipped)
    finally:
        ctl.engines_changed()


# The shared defaults (core.DEFAULT_COMPONENTS) the WebUI's model has, in the WebUI's build order
# (unet, vae_decoder, clip).
DEFAULT_COMPONENTS = tuple(c for c in COMPONENTS if c in SHARED_DEFAULTS)


def components_of(components) -> tuple[str, ...]:
    """User-facing component names checked (``unet``, ``vae_decoder``, ``vae_encoder``, ``clip``,
    ``unet_control``)."""
    wanted = tuple(DEFAULT_COMPONENTS if components is None else components)
    unknown = [c for c in wanted if c not in COMPONENTS]
    if unknown or not wanted:
        raise InvalidValue(f"components {unknown or '[]'}: pick from {', '.join(COMPONENTS)}")
    return wanted
