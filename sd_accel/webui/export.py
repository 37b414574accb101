"""Build engines from the UNet the WebUI has loaded.

The WebUI patches its UNet at run time; each patch is undone for the trace and restored after,
whatever happens in between:

- ``sd_unet.current_unet`` (A1111 sends every UNet call to the active SD-UNet, which may be
  ours) is set to None;
- cross-attention optimizations (``--xformers``, SDP, Doggettx ..., set by
  ``sd_hijack.model_hijack.apply_optimizations``) are switched to "None", plain matmul and
  softmax attention, and re-applied from the settings after;
- ``--medvram`` / ``--lowvram`` forward pre-hooks (``modules.lowvram``), which move blocks to
  the GPU when called, are lifted, so the trace sees the module on one device (the CPU, fp32);
- gradient checkpointing flags (``use_checkpoint`` / ``checkpoint``) are switched off;
- every weight returns to its own device and dtype (lowvram keeps blocks on several devices).

Builds hold the WebUI's generation lock (``call_queue.queue_lock``): a job never samples with
a UNet that is being moved for export.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from sd_accel.build import BuildEvent, make_tick
from sd_accel.components.ldm_unet import COMPONENT, LdmUNetSpec
from sd_accel.core import InvalidValue
from sd_accel.profiles import Profile
from sd_accel.webui import host
from sd_accel.webui.identity import LoraSet, checkpoint_hash, describe, forge_loras, merged_loras, weights_id

log = logging.getLogger("sd_accel")


@dataclass(frozen=True)
class ExportSource:
    """What an export reads: the module, and who its weights are."""

    unet: torch.nn.Module
    ckpt_hash: str
    loras: LoraSet
    title: str
    model_name: str
    family: str

    @property
    def weights_id(self) -> str:
        return weights_id(self.ckpt_hash, self.loras)

    def describe(self) -> str:
        return f"{self.title} [{self.ckpt_hash}] with {describe(self.loras)}"


def family_of(model, spec: LdmUNetSpec) -> str:
    """``sdxl``, ``sd2`` or ``sd15``, from the WebUI's flags or else the context width."""
    if getattr(model, "is_sdxl", False) or spec.xl:
        return "sdxl"
    if getattr(model, "is_sd2", False) or spec.dims.context_dim == 1024:
        return "sd2"
    return "sd15"


def export_source(model=None) -> ExportSource:
    """The loaded checkpoint's UNet and its weights id (checkpoint hash plus merged LoRAs)."""
    from sd_accel.onnx.fingerprint import fingerprint

    model = model if model is not None else host.sd_model()
    unet = host.loaded_unet(model)
    info = host.checkpoint_info(model)
    patcher = host.forge_unet_patcher(model)
    loras = forge_loras(patcher) if patcher is not None else merged_loras(unet)
    ckpt = checkpoint_hash(info) or ("fp-" + fingerprint(unet)[:10])
    spec = LdmUNetSpec(unet)
    return ExportSource(unet, ckpt, loras, str(getattr(info, "title", "") or getattr(info, "name", "")),
                        str(getattr(info, "model_name", "") or ""), family_of(model, spec))


# --------------------------------------------------------------------------- undoing the hijacks


@contextlib.contextmanager
def no_sd_unet() -> Iterator[None]:
    """``sd_unet.current_unet`` None for the block (A1111's UNet forward dispatches to it)."""
    try:
        sd_unet = host.module("sd_unet")
    except ImportError:
        yield
        return
    saved = getattr(sd_unet, "current_unet", None)
    sd_unet.current_unet = None
    try:
        yield
    finally:
        sd_unet.current_unet = saved


@contextlib.contextmanager
def plain_webui_attention() -> Iterator[None]:
    """The WebUI's attention optimization off ("None") for the block, re-applied after."""
    try:
        sd_hijack = host.module("sd_hijack")
        hijack = sd_hijack.model_hijack
    except (ImportError, AttributeError):  # Forge 2 picks attention at start-up; nothing to switch
        yield
        return
    before = getattr(getattr(sd_hijack, "current_optimizer", None), "name", None)
    try:
        hijack.apply_optimizations("None")
    except Exception as exc:  # a WebUI whose hijack works otherwise (Forge 2): trace as it is
        log.warning("could not switch the attention optimization off for the export: %s", exc)
        yield
        return
    try:
        yield
    finally:
        hijack.apply_optimizations()  # no option: what the settings and flags choose, as at start
        after = getattr(getattr(sd_hijack, "current_optimizer", None), "name", None)
        if after != before:
            log.warning("attention optimization was %s before the export and is %s after", before, after)


@contextlib.contextmanager
def no_forward_hooks(module: torch.nn.Module) -> Iterator[None]:
    """Forward pre-hooks of ``module`` and its children lifted for the block (lowvram's
    ``send_me_to_gpu`` would move blocks to the GPU in the middle of a CPU trace)."""
    saved = {}
    for sub in module.modules():
        if sub._forward_pre_hooks:
            saved[sub] = dict(sub._forward_pre_hooks)
            sub._forward_pre_hooks.clear()
    try:
        yield
    finally:
        for sub, hooks in saved.items():
            sub._forward_pre_hooks.update(hooks)


@contextlib.contextmanager
def no_checkpointing(module: torch.nn.Module) -> Iterator[None]:
    """Gradient checkpointing flags off (LDM's ``use_checkpoint``, ``checkpoint``) for the block."""
    flipped = []
    for sub in module.modules():
        for attr in ("use_checkpoint", "checkpoint"):
            if getattr(sub, attr, None) is True:
                setattr(sub, attr, False)
                flipped.append((sub, attr))
    try:
        yield
    finally:
        for sub, attr in flipped:
            setattr(sub, attr, True)


@contextlib.contextmanager
def preserve_layout(module: torch.nn.Module) -> Iterator[None]:
    """Every parameter and buffer back on its own device and dtype after the block (the
    validation moves the whole module; lowvram spreads it over devices)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    before = {name: (t.device, t.dtype) for name, t in tensors.items()}
    try:
        yield
    finally:
        for name, t in {**dict(module.named_parameters()), **dict(module.named_buffers())}.items():
            device, dtype = before.get(name, (t.device, t.dtype))
            if t.device != device or t.dtype != dtype:
                t.data = t.data.to(device=device, dtype=dtype)


@contextlib.contextmanager
def export_context(unet: torch.nn.Module) -> Iterator[None]:
    """All of the above, in the order that undoes them cleanly."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(preserve_layout(unet))
        stack.enter_context(no_sd_unet())
        stack.enter_context(plain_webui_attention())
        stack.enter_context(no_forward_hooks(unet))
        stack.enter_context(no_checkpointing(unet))
        yield


# --------------------------------------------------------------------------- the build


def default_build_precision(backend) -> str:
    """The backend's default, except fp32 for an fp16 default when the WebUI runs with ``--no-half``."""
    default = backend.default_precision()
    return "fp32" if default == "fp16" and host.cmd_flag("no_half") else default


def _latent_multiple(artifact_folder, spec: LdmUNetSpec) -> int:
    """From the export's meta.json (a reused export was traced by an earlier spec object)."""
    try:
        meta = json.loads((artifact_folder / "meta.json").read_text())
        side = int(meta["export_dims"]["H8"])
    except (OSError, ValueError, KeyError, TypeError):
        return spec.latent_multiple
    return 1 if side % 2 else 2**spec.dims.num_upsamplers


def build_loaded(
    profiles: list[Profile],
    cache,
    backend_name: str = "auto",
    precision: str = "auto",
    progress: Callable[[BuildEvent], None] | None = None,
    cancel: threading.Event | None = None,
    validate: bool = True,
    model=None,
) -> list:
    """Engines for the loaded checkpoint's UNet, one per profile (cached ones are reused).

    Returns the cache records. Raises :class:`~sd_accel.build.BuildCancelled` when ``cancel``
    is set, :class:`EngineError` when a build or its validation fails.
    """
    from sd_accel.backends.registry import get_backend

    be = get_backend(backend_name, cache_root=cache.root)
    info = be.info()
    precision = default_build_precision(be) if precision in (None, "", "auto") else precision
    if precision not in be.precisions():
        raise InvalidValue(f"precision={precision!r}: the {be.name} backend builds {', '.join(be.precisions())}")
    report = progress or (lambda ev: None)
    records = []
    with host.queue_lock():
        source = export_source(model)
        log.info("sd-accel: building %s engine(s) for %s", len(profiles), source.describe())
        with export_context(source.unet):
            spec = LdmUNetSpec(source.unet)
            for index, profile in enumerate(profiles):
                tick = make_tick(report, cancel, index, len(profiles), COMPONENT, profile.tag)
                records.append(_build_one(cache, be, info, spec, source, profile, precision, tick, validate))
    return records


def _build_one(cache, be, info, spec: LdmUNetSpec, source: ExportSource, profile: Profile, precision: str,
               tick, validate_it: bool):
    """:func:`sd_accel.build.build_one`, keyed by the weights id, with the WebUI facts kept."""
    from sd_accel.build import build_one

    def webui_facts(artifact) -> dict:
        return {"webui": {
            "checkpoint": source.title, "model_name": source.model_name, "hash": source.ckpt_hash,
            "loras": [list(e) for e in source.loras], "family": source.family,
            "latent_multiple": _latent_multiple(artifact.folder, spec),
            "weights_fingerprint": artifact.fingerprint, "host": "forge" if host.is_forge() else "a1111",
        }}

    return build_one(cache, be, info, spec, profile, precision, tick, validate_it,
                     model_id=source.weights_id, record_extra=webui_facts)
