"""``engines="auto"``: a call no engine covers gets an engine built for its shape, then runs on it.

:class:`AutoBuilder` is the ``builder`` of every :class:`~sd_accel.runtime.selection.ComponentEngines`
of a pipeline swapped with ``builder=`` (:func:`sd_accel.runtime.swap_engines`; ``accelerate``
makes one for ``engines="auto"``). It sits above the runtime, which only calls it, because it
builds. On a call no engine covers it works out the static
profile of that call (its batch, height, width and tokens), builds the engine the usual way
(:func:`sd_accel.build.run_jobs`: ONNX export, backend build, validation against torch, the
cache), and hands it to the call. Each shape is built at most once: a failed build is remembered
on the pipeline (accelerating it again does not retry), and calls of that shape run torch with
the reason.

Components are built on their own first uncovered call, so one generation builds the text
encoder, then the UNet, then the VAE decoder as it reaches them (the VAE encoder only when an
image-to-image call needs it).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from sd_accel.build import EngineJob, run_jobs
from sd_accel.components import specs_for
from sd_accel.core import EngineError, ValidationFailed, covers
from sd_accel.profiles import TOKEN_CHUNK, Profile
from sd_accel.runtime.selection import ComponentEngines, EngineHandle, reason_text
from sd_accel.runtime.swap import torch_modules

log = logging.getLogger("sd_accel")


def _shape_key(component: str, feed: dict[str, torch.Tensor]) -> tuple:
    return component, tuple((k, tuple(v.shape)) for k, v in sorted(feed.items()))


def _call_dims(spec, feed: dict[str, torch.Tensor]) -> dict[str, int] | None:
    """The value of each of the spec's symbols (``B2``, ``H8``, ``T`` ...) in this call."""
    dims: dict[str, int] = {}
    for t in spec.inputs():
        tensor = feed.get(t.name)
        if tensor is None or tensor.dim() != len(t.dims):
            return None
        for d, n in zip(t.dims, tensor.shape, strict=True):
            if isinstance(d, str):
                if dims.setdefault(d, int(n)) != int(n):
                    return None
            elif d != n:
                return None
    return dims


def profile_for_call(spec, feed: dict[str, torch.Tensor]) -> Profile | None:
    """The narrowest profile whose engine for ``spec`` serves ``feed``: static where the call's
    shape can be one (a UNet batch of 2B under classifier-free guidance), else the smallest
    dynamic batch range. None when no profile can (tokens that are not a multiple of 77, ...).

    Sizes a component does not see (a text encoder's image size) are the model's default size,
    so that one engine of that component serves every image size.
    """
    from sd_accel.components import vae_scale_factor

    dims = _call_dims(spec, feed)
    if dims is None:
        return None
    scale = vae_scale_factor(spec.pipe)
    denoiser = getattr(spec.pipe, "unet", None) or getattr(spec.pipe, "transformer", None)
    default = int(getattr(getattr(denoiser, "config", None), "sample_size", 64) or 64) * scale
    height = dims.get("H") or dims.get("H8", 0) * scale or default
    width = dims.get("W") or dims.get("W8", 0) * scale or default
    tokens = dims.get("T", TOKEN_CHUNK)
    # the transformer families' T5 length: FLUX.1's and T5's L, or SD3's joint length S = 77 + L
    text = dims.get("L") or (dims["S"] - TOKEN_CHUNK if dims.get("S", 0) > TOKEN_CHUNK else None)
    if "N" in dims and "img_ids" in feed:  # FLUX.1's image tokens: the grid from their positions
        ids = feed["img_ids"].reshape(-1, 3)
        rows, cols = int(ids[:, 1].max().item()) + 1, int(ids[:, 2].max().item()) + 1
        if rows * cols != dims["N"]:
            return None
        side = scale * 2
        height, width = rows * side, cols * side
    if "B2" in dims:  # the UNet: a static profile of batch b serves 2b rows, or b without CFG
        rows = dims["B2"]
        batches = [((rows // 2,) * 3, True)] if rows % 2 == 0 else []
        batches.append(((rows,) * 3, False))  # CFG <= 1, or a guidance-embedded (LCM) UNet
        batches.append(((1, 1, max(2, math.ceil(rows / 2))), True))
    else:
        batches = [((dims.get("B", 1),) * 3, True)]
    for batch, cfg in batches:
        try:
            profile = Profile(batch=batch, height=height, width=width, tokens=tokens, cfg=cfg,
                              text=None if text is None else (text, text, text))
        except ValueError:
            return None
        if covers(spec.shape_ranges(profile), feed):
            return profile
    return None


def _control_spec(pipe, component: str, model: str | None):
    """A ControlNet pipeline's spec of ``component`` (``unet_control``, or the ``controlnet``
    whose weights id is ``model``: a pipeline may hold several)."""
    from sd_accel.components.controlnet import control_specs
    from sd_accel.onnx.fingerprint import fingerprint

    for spec in control_specs(pipe).values():
        if spec.name == component and (component != "controlnet" or fingerprint(spec.torch_module()) == model):
            return spec
    return None


class AutoBuilder:
    """Builds, for a call no engine covers, a static engine of that call's shape (see the module doc).

    ``progress``: True for tqdm bars, False for none, or a callable taking
    :class:`sd_accel.build.BuildEvent`. ``on_built(component)`` runs after each new engine
    (the swap parks the torch weights then). ``fallback_precision``: when an engine of
    ``precision`` misses its accuracy check, build this one instead (``accelerate`` passes fp32
    when the precision is the backend's default, not one the caller asked for): a slower engine
    still beats running that component in torch.
    """

    def __init__(self, pipe, cache, backend, precision: str, progress: bool | Callable[[Any], None] = True,
                 validate: bool = True, fallback_precision: str | None = None) -> None:
        self._pipe = weakref.ref(pipe)
        self.cache = cache
        self.backend = backend
        self.precision = precision
        self.progress = progress
        self.validate = validate
        usable = fallback_precision is not None and fallback_precision != precision
        self.fallback_precision = fallback_precision if usable and fallback_precision in backend.precisions() else None
        # Failed shapes live on the pipeline: accelerating it again must not retry them.
        self.failed: dict[tuple, str] = pipe.__dict__.setdefault("_sd_accel_failed_builds", {})
        self.on_built: Callable[[str], None] | None = None
        # AccelConfig.step_cache: the transformer is built cut for a step cache (step_cache_plan)
        self.step_cache = False

    def __call__(self, engines: ComponentEngines, feed: dict[str, torch.Tensor]) -> EngineHandle | str:
        key = (self.backend.name, self.precision, *_shape_key(engines.component, feed))
        if key in self.failed:
            return self.failed[key]
        got = ", ".join(f"{k}={tuple(v.shape)}" for k, v in feed.items())
        try:
            handle = self._build(engines.component, feed, getattr(engines, "model", None))
        except Exception as exc:  # a failed build must not end the image; interrupts do
            reason = f"no engine covers {got}, and building one failed: {reason_text(exc)}"
            self.failed[key] = reason
            engines.stats.build_failed(reason)
            log.error("%s: %s; calls of this shape run torch for the rest of this process",
                      engines.component, reason)
            return reason
        engines.handles.append(handle)
        engines.stats.built(handle.name)
        if self.on_built is not None:
            self.on_built(engines.component)
        return handle

    def _build(self, component: str, feed: dict[str, torch.Tensor], model: str | None = None) -> EngineHandle:

        pipe = self._pipe()
        if pipe is None:
            raise EngineError("the pipeline these engines were swapped into is gone")
        info = self.backend.info()
        start = time.perf_counter()
        with torch_modules(pipe):  # export and validation need the torch modules in the pipeline
            spec = specs_for(pipe).get(component) or _control_spec(pipe, component, model)
            if spec is None:
                raise EngineError(f"this pipeline has no {component} that engines can serve")
            profile = profile_for_call(spec, feed)
            if profile is None:
                raise EngineError("no engine profile describes this call's shapes")
            log.warning("%s: no engine covers this call; building one (%s, %s, %s) first: engines='auto', "
                        "once per shape, cached", component, self.backend.name, self.precision, profile.tag)
            cut = self.step_cache and component == "transformer"
            try:
                (record,) = run_jobs([EngineJob(spec, profile, self.precision, step_cache=cut)], self.cache, self.backend,
                                     progress=self.progress, validate=self.validate)
            except ValidationFailed as exc:
                if self.fallback_precision is None:
                    raise
                # Reduced precision's error depends on the weights and the size (a random LCM UNet
                # at 512 px missed bf16's gate by 5%, issue 29): the exact precision still runs it.
                log.warning("%s: the %s engine missed its accuracy check (%s); building %s instead",
                            component, self.precision, reason_text(exc), self.fallback_precision)
                (record,) = run_jobs([EngineJob(spec, profile, self.fallback_precision, step_cache=cut)], self.cache,
                                     self.backend, progress=self.progress, validate=self.validate)
        handle = EngineHandle(record, self.backend, self.cache, info.arch, info.version)
        if not covers(handle.shapes, feed):
            raise EngineError(f"the engine built ({record.key.name}) does not cover the call")
        log.warning("%s: engine %s ready after %.1f s", component, record.key.name, time.perf_counter() - start)
        return handle
