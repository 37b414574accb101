"""Build engines from the UNet the WebUI has loaded.

The WebUI patches its UNet at run time; each patch is undone for the trace and restored after
(:mod:`sd_accel.webui.tracing`).

Builds hold the WebUI's generation lock (``call_queue.queue_lock``): a job never samples with
a UNet that is being moved for export.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sd_accel.build import BuildEvent, EngineJob
from sd_accel.components.ldm_unet import LdmUNetSpec
from sd_accel.core import InvalidValue
from sd_accel.profiles import Profile
from sd_accel.webui import host
from sd_accel.webui.forge_transformer import build_profile, is_forge_transformer
from sd_accel.webui.forge_transformer import family as transformer_family
from sd_accel.webui.identity import LoraSet, checkpoint_hash, describe, forge_loras, merged_loras, weights_id
from sd_accel.webui.tracing import module_context, no_sd_unet, plain_webui_attention

log = logging.getLogger("sd_accel")

# Precisions the WebUI does not build: static int8 calibrates on a diffusers pipeline's prompt runs.
NOT_IN_WEBUI = ("int8",)


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
        """``name [hash] with film (0.8)``; the hash once, whether or not the title has it already."""
        title = self.title if self.ckpt_hash in self.title else f"{self.title} [{self.ckpt_hash}]".strip()
        return f"{title} with {describe(self.loras)}"


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
    why = host.not_on_engines(unet)
    if why is not None:
        raise host.NotOnEngines(why)
    info = host.checkpoint_info(model)
    patcher = host.forge_unet_patcher(model)
    loras = forge_loras(patcher) if patcher is not None else merged_loras(unet)
    ckpt = checkpoint_hash(info) or ("fp-" + fingerprint(unet)[:10])
    if is_forge_transformer(unet):
        family = transformer_family(unet)
    else:
        family = family_of(model, LdmUNetSpec(unet))
    return ExportSource(unet, ckpt, loras, str(getattr(info, "title", "") or getattr(info, "name", "")),
                        str(getattr(info, "model_name", "") or ""), family)


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


@dataclass
class LoadedComponent:
    """One of the loaded model's components to build: its spec, the weights id its engines are
    keyed by, the module (whose patches are undone for the export), and the facts its records
    keep. Each becomes one :class:`~sd_accel.build.EngineJob` per profile."""

    component: str  # user-facing: unet, vae_decoder, vae_encoder, clip
    spec: object
    weights_id: str
    module: torch.nn.Module
    facts: dict


def loaded_components(source: ExportSource, components: tuple[str, ...], model, ctl) -> tuple[list[LoadedComponent], list[str]]:
    """(what to build, what cannot be built here and why) for the user-facing ``components``."""
    from sd_accel.components.ldm_clip import LdmClipSpec
    from sd_accel.components.ldm_vae import LdmVaeDecoderSpec, LdmVaeEncoderSpec
    from sd_accel.webui.stand_ins import COMPONENTS, find_modules, why_not

    jobs, skipped = [], []
    if is_forge_transformer(source.unet):
        return _transformer_components(source, components)
    found = find_modules(model) if any(c not in ("unet", "unet_control") for c in components) else {}
    for name in components:
        component = COMPONENTS[name]
        if name == "unet_control" and not host.is_forge():
            skipped.append(f"{name} (AUTOMATIC1111's ControlNet extension runs the UNet's blocks itself: no call "
                           "reaches this engine; Forge's built-in ControlNet does use it)")
            continue
        if name in ("unet", "unet_control"):
            spec = LdmUNetSpec(source.unet) if name == "unet" else _control_spec(source.unet)
            if spec is None:
                skipped.append(f"{name} (this UNet does not say its block layout: ControlNet calls stay in PyTorch)")
                continue
            jobs.append(LoadedComponent(name, spec, source.weights_id, source.unet,
                            {"loras": [list(e) for e in source.loras]}))
            continue
        module = found.get(component)
        if module is None:
            skipped.append(f"{name} ({why_not(component)})")
            continue
        if name == "clip":
            clip_patcher = getattr(getattr(getattr(model, "forge_objects", None), "clip", None), "patcher", None)
            te_loras = forge_loras(clip_patcher) if clip_patcher is not None else merged_loras(module, "te")
            saved = ctl.job.te_loras
            ctl.job.te_loras = te_loras  # A1111: what is merged now (Forge: its patcher, read the same way)
            try:
                wid = ctl.weights_for(component, model, for_call=False)
            finally:
                ctl.job.te_loras = saved
            jobs.append(LoadedComponent(name, LdmClipSpec(module), wid, module,
                            {"loras": [list(e) for e in te_loras], "lora_text": describe(te_loras)}))
        else:
            spec = (LdmVaeDecoderSpec if name == "vae_decoder" else LdmVaeEncoderSpec)(module)
            jobs.append(LoadedComponent(name, spec, ctl.weights_for(component, model, for_call=False), module,
                            {"vae": host.loaded_vae_hash()}))
    return jobs, skipped


def _transformer_components(source: ExportSource, components: tuple[str, ...]) -> tuple[list[LoadedComponent], list[str]]:
    """Forge's FLUX.1 / SD3.5: ``unet`` is its transformer (diffusers' ``FluxTransformer2DModel`` /
    ``SD3Transformer2DModel`` made from Forge's weights, component ``transformer``); the rest stays
    in Forge's PyTorch."""
    from sd_accel.webui.forge_transformer import spec_and_module, title

    jobs, skipped = [], []
    for name in components:
        if name != "unet":
            skipped.append(f"{name} (with {title(source.unet)} in Forge only the transformer runs on an engine: its "
                           "ControlNet, VAE and text encoders stay in Forge's PyTorch)")
            continue
        spec, transformer = spec_and_module(source.unet)
        jobs.append(LoadedComponent(name, spec, source.weights_id, transformer,
                                    {"loras": [list(e) for e in source.loras], "forge_class": type(source.unet).__name__}))
    return jobs, skipped


def _control_spec(unet: torch.nn.Module):
    """The residual-taking spec of ``unet`` (Forge's ControlNet calls), or None when the module
    does not say its block layout."""
    from sd_accel.components.ldm_control_unet import LdmControlUNetSpec
    from sd_accel.core import UnsupportedComponent

    try:
        return LdmControlUNetSpec(unet)
    except UnsupportedComponent:
        return None


def build_loaded(
    profiles: list[Profile],
    cache,
    backend_name: str = "auto",
    precision: str = "auto",
    progress: Callable[[BuildEvent], None] | None = None,
    cancel: threading.Event | None = None,
    validate: bool = True,
    model=None,
    components: tuple[str, ...] = ("unet",),
    skipped: list[str] | None = None,
) -> list:
    """Engines for the loaded checkpoint's modules (``components``: ``unet``, ``vae_decoder``,
    ``vae_encoder``, ``clip``), one per component and profile (cached ones are reused).

    Returns the cache records; ``skipped`` (a list) receives "component (why)" for each component
    this model has no module for. Raises :class:`~sd_accel.build.BuildCancelled` when ``cancel``
    is set, :class:`EngineError` when a build or its validation fails. An ONNX export that no
    engine ended up using (a failed build) is removed again; the exports the engines were built
    from keep their graph only (:func:`~sd_accel.build.keep_graphs_only`: another profile or a
    LoRA refit takes the weights from the loaded module, as in the diffusers path).
    """
    from sd_accel.backends.registry import check_precision
    from sd_accel.build import keep_graphs_only, run_jobs
    from sd_accel.webui.controller import controller, webui_backend

    be = webui_backend(backend_name, cache_root=cache.root)
    info = be.info()
    precision = default_build_precision(be) if precision in (None, "", "auto") else precision
    if precision in NOT_IN_WEBUI:
        raise InvalidValue("precision int8 (static) calibrates on a diffusers pipeline's prompt runs, which the "
                           "WebUI's models are not; build fp32/fp16/bf16 here, or int8-dynamic on ONNX Runtime")
    check_precision(be, precision)  # here too, not only in the builder: refused before the model lock
    with host.queue_lock():
        model = model if model is not None else host.sd_model()
        source = export_source(model)
        components_to_build, cannot = loaded_components(source, tuple(components), model, controller())
        if skipped is not None:
            skipped.extend(cannot)
        jobs = [engine_job(job, source, profile, precision) for job in components_to_build for profile in profiles]
        modules = {id(job.spec): job.module for job in components_to_build}
        log.info("building %d engine(s) (%s) for %s on %s %s, %s", len(jobs),
                 ", ".join(j.component for j in components_to_build), source.describe(), be.name, info.version,
                 precision)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(no_sd_unet())
                stack.enter_context(plain_webui_attention())
                records = run_jobs(jobs, cache, be, progress=progress or False, cancel=cancel, validate=validate,
                                   context=lambda job: module_context(modules[id(job.spec)]))
            keep_graphs_only(cache, records, [job.spec for job in components_to_build])
            return records
        finally:
            cache.drop_unused_intermediates()  # the export of a build that failed


def engine_job(job: LoadedComponent, source: ExportSource, profile: Profile, precision: str) -> EngineJob:
    """The builder's job for one component and profile: keyed by the weights id, with the WebUI
    facts kept in the record; VAE engines in fp32 under ``--no-half-vae``."""
    if job.component.startswith("vae") and precision in ("fp16", "bf16") and host.cmd_flag("no_half_vae"):
        precision = "fp32"  # --no-half-vae: the VAE computes in fp32, its engines too

    def webui_facts(artifact) -> dict:
        facts = {
            "checkpoint": source.title, "model_name": source.model_name, "hash": source.ckpt_hash,
            "family": source.family, "weights_fingerprint": artifact.fingerprint, "onnx": artifact.folder.name,
            "host": "forge" if host.is_forge() else "a1111", **job.facts,
        }
        if isinstance(job.spec, LdmUNetSpec):
            facts["latent_multiple"] = _latent_multiple(artifact.folder, job.spec)
        return {"webui": facts}

    if getattr(job.spec, "name", None) == "transformer":
        profile = build_profile(profile)  # Forge's T5 length unless the profile names one
    return EngineJob(job.spec, profile, precision, model_id=job.weights_id, record_extra=webui_facts)
