"""Engines from the MODEL and VAE ComfyUI has loaded, keyed as the WebUI keys them.

The MODEL's UNet is exported with the weights ComfyUI samples with: the model is loaded the
way the sampler loads it (``comfy.model_management.load_models_gpu``), so the patches of a
LoRA loader in front of the node are in the weights, and the engine is keyed by the
checkpoint's id plus that patch set (an engine of its own for those patches; the usual way is
to build from the plain MODEL and let LoRAs refit it). The VAE's decoder and encoder are the
LDM ones the WebUI has, exported by the same specs. ``unet_control`` is the same UNet taking
ControlNet residuals as inputs (:mod:`sd_accel.components.ldm_control_unet`), what ComfyUI's
ControlNet apply nodes need; ``clip`` is each of the CLIP's text encoders
(:mod:`sd_accel.components.comfy_clip`), keyed ``ckpt-<hash>.clip_l`` and so on. Each record
keeps the WebUI's facts (its
``webui`` entry: hash, family, latent multiple, ``host: comfyui``), so the WebUI lists these
engines for the same checkpoint and uses them.

Progress goes to ComfyUI's progress bar (``comfy.utils.ProgressBar``); ComfyUI's interrupt
(the Cancel button) stops the build at the next progress tick, leaving nothing partial.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass

import torch

from sd_accel.build import BuildEvent, EngineJob
from sd_accel.comfyui import host
from sd_accel.comfyui.identity import checkpoint_id, describe, patch_set, unet_weights_id
from sd_accel.comfyui.state import State, state
from sd_accel.core import InvalidValue
from sd_accel.profiles import PRESETS, Profile, parse_range

log = logging.getLogger("sd_accel")

COMPONENT_CHOICES = ("unet", "unet+vae_decoder", "unet+vae_decoder+vae_encoder", "unet+clip+vae_decoder",
                     "unet+clip+vae_decoder+vae_encoder", "unet+unet_control",
                     "unet+unet_control+vae_decoder+vae_encoder",
                     "unet+unet_control+clip+vae_decoder+vae_encoder", "unet_control", "clip", "vae_decoder",
                     "vae_decoder+vae_encoder")
CUSTOM = "custom (ranges below)"


def profile_for(preset: str, batch: str = "1", height: str = "512", width: str = "512", tokens: str = "77",
                text: str = "") -> Profile:
    """A preset by name, or (``custom``) the ranges as people type them: ``N``, ``MIN-MAX``, ``MIN-OPT-MAX``.
    ``text``: T5's token range for FLUX / SD3 transformers (empty: ComfyUI's default, FLUX 256, SD3 77)."""
    from dataclasses import replace

    if preset in PRESETS:
        profile = PRESETS[preset]
    elif preset != CUSTOM:
        raise InvalidValue(f"unknown preset {preset!r}: pick one of {', '.join(PRESETS)} or {CUSTOM!r}")
    else:
        profile = Profile(batch=parse_range("batch", batch), height=parse_range("height", height),
                          width=parse_range("width", width), tokens=parse_range("tokens", tokens))
    return replace(profile, text=parse_range("text", text)) if text.strip() else profile


@dataclass
class Part:
    """One module to build: its component name, spec, weights id, the module, its facts."""

    component: str
    spec: object
    weights_id: str
    module: torch.nn.Module
    facts: dict


def _family(model, spec) -> str:
    name = type(getattr(model, "model_config", None)).__name__.lower()
    if spec.xl or "sdxl" in name:
        return "sdxl"
    if spec.dims.context_dim == 1024:
        return "sd2"
    return "sd15"


def _load_for_export(patcher) -> None:
    """Load the MODEL as the sampler does (its patches written into the weights), whole."""
    try:
        mm = host.comfy("model_management")
    except ImportError:
        return
    mm.load_models_gpu([patcher], force_full_load=True)


def unet_part(patcher, st: State, control: bool = False) -> Part:
    from sd_accel.components.ldm_control_unet import LdmControlUNetSpec
    from sd_accel.components.ldm_unet import LdmUNetSpec

    model = patcher.model
    unet = model.diffusion_model
    loras = patch_set(getattr(patcher, "patches", {}) or {})
    if host.source_of(model) is None and loras:
        raise InvalidValue("this MODEL was not loaded from a checkpoint file and carries patches: build from the "
                           "MODEL before the LoRA loaders")
    ckpt = checkpoint_id(model, st.engine_dir(), fingerprint_of=unet)  # before the patches go in
    if loras:
        _load_for_export(patcher)
        if getattr(model, "model_lowvram", False):
            raise InvalidValue("ComfyUI loaded this MODEL partially (low VRAM), so its LoRA patches are not in the "
                               "weights: build from the MODEL before the LoRA loaders (LoRAs then refit the engine)")
        if getattr(model, "current_weight_patches_uuid", None) != getattr(patcher, "patches_uuid", None):
            raise InvalidValue("ComfyUI did not write this MODEL's patches into the weights: build from the MODEL "
                               "before the LoRA loaders")
    elif getattr(model, "current_weight_patches_uuid", None) is not None:
        _load_for_export(patcher)  # another MODEL's LoRA may still be in the weights: ComfyUI takes it out
    spec = LdmControlUNetSpec(unet) if control else LdmUNetSpec(unet)
    facts = {"family": _family(model, spec), "loras": [list(e) for e in loras], "lora_text": describe(loras),
             "model_type": getattr(getattr(model, "model_type", None), "name", None)}
    return Part("unet_control" if control else "unet", spec, unet_weights_id(ckpt, loras), unet, facts)


def transformer_part(patcher, st: State, control: bool = False) -> Part:
    """The build's part for a FLUX.1 / SD3 MODEL: diffusers' transformer with its weights, keyed by
    the checkpoint file; ``control``: the one taking ControlNet residuals (``transformer_control``)."""
    from sd_accel.comfyui.transformer import COMPONENT, CONTROL, family_module, lora_patched, spec_for

    model = patcher.model
    dm = model.diffusion_model
    fam = family_module(dm)
    if lora_patched(patcher):
        raise InvalidValue("this FLUX/SD3 MODEL carries LoRA patches: build from the MODEL before the LoRA loaders "
                           "(a LoRA after the apply node then refits the transformer engine)")
    if getattr(model, "current_weight_patches_uuid", None) is not None:
        _load_for_export(patcher)  # another MODEL's LoRA may still be in the weights: ComfyUI takes it out
    ckpt = checkpoint_id(model, st.engine_dir(), fingerprint_of=dm)
    transformer = fam.to_diffusers(dm)
    spec = spec_for(transformer, control)
    family = ("flux-dev" if dm.params.guidance_embed else "flux-schnell") if fam.FAMILY == "flux" else "sd3"
    return Part(CONTROL if control else COMPONENT, spec, ckpt, transformer, {"family": family, "loras": [], "lora_text": "no LoRA",
                                                     "model_type": getattr(getattr(model, "model_type", None), "name", None)})


def clip_parts(clip, st: State) -> list[Part]:
    from sd_accel.comfyui.clip import clip_weights_id, encoders, patched
    from sd_accel.components.comfy_clip import ComfyClipSpec
    from sd_accel.components.comfy_t5 import ComfyT5Spec, is_comfy_t5

    found = encoders(clip)
    if not found:
        raise InvalidValue("this CLIP has no ComfyUI CLIPTextModel (not an SD 1.x/2.x/XL text encoder): it stays "
                           "in PyTorch")
    parts = []
    for name, module in found:
        if patched(clip, name):
            raise InvalidValue(f"the CLIP's {name} carries LoRA patches: build from the CLIP before the LoRA "
                               "loaders (a patched text encoder runs in PyTorch)")
        spec = ComfyT5Spec(module) if is_comfy_t5(module) else ComfyClipSpec(module)
        parts.append(Part("clip", spec, clip_weights_id(clip, name, module, st), module, {"encoder": name}))
    return parts


def vae_parts(vae, components: tuple[str, ...], st: State) -> list[Part]:
    from sd_accel.components.ldm_vae import (
        LdmVaeDecoderSpec,
        LdmVaeEncoderSpec,
        is_ldm_decoder,
        is_ldm_encoder,
    )

    first = getattr(vae, "first_stage_model", None)
    parts = []
    for name in components:
        module = getattr(first, "decoder" if name == "vae_decoder" else "encoder", None)
        ok = is_ldm_decoder(module) if name == "vae_decoder" else is_ldm_encoder(module)
        if not ok:
            raise InvalidValue(f"this VAE has no LDM {name.split('_')[1]} (not an SD 1.x/2.x/XL autoencoder): "
                               "it stays in PyTorch")
        wid = checkpoint_id(first, st.engine_dir(), fingerprint_of=first)
        spec = (LdmVaeDecoderSpec if name == "vae_decoder" else LdmVaeEncoderSpec)(module)
        parts.append(Part(name, spec, wid, module, {}))
    return parts


def _job(part: Part, profile: Profile, precision: str, ckpt_path: str | None) -> EngineJob:
    from sd_accel.components.ldm_unet import LdmUNetSpec
    from sd_accel.webui.export import _latent_multiple

    def facts(artifact) -> dict:
        wid = part.weights_id
        out = {"hash": wid.split("+")[0].split(".")[0].removeprefix("ckpt-") if wid.startswith("ckpt-") else None,
               "checkpoint": ckpt_path or "", "model_name": (ckpt_path or wid).rsplit("/", 1)[-1],
               "weights_fingerprint": artifact.fingerprint, "onnx": artifact.folder.name, "host": "comfyui",
               **part.facts}
        if isinstance(part.spec, LdmUNetSpec):
            out["latent_multiple"] = _latent_multiple(artifact.folder, part.spec)
        return {"webui": out}

    return EngineJob(part.spec, profile, precision, model_id=part.weights_id, record_extra=facts)


def build(model=None, vae=None, components: tuple[str, ...] = ("unet",), profile: Profile | None = None,
          backend: str = "auto", precision: str = "auto", st: State | None = None, validate: bool = True,
          clip=None) -> list:
    """Build (or reuse) engines for the MODEL's UNet (plain, residual-taking), the CLIP's text
    encoders and the VAE's halves; returns the records.

    Raises :class:`~sd_accel.core.InvalidValue` for what cannot be built (a missing MODEL or VAE,
    an unusable backend: the message says what it needs), ComfyUI's interrupt exception when the
    user cancels. The ONNX exports the engines were built from keep their graph only
    (:func:`~sd_accel.build.keep_graphs_only`): another profile or a LoRA refit takes the weights
    from the loaded module."""
    from sd_accel.backends.registry import check_precision, get_backend
    from sd_accel.build import keep_graphs_only, run_jobs
    from sd_accel.core import BuildCancelled

    st = st or state()
    profile = profile or PRESETS["static-512"]
    try:
        device = "cpu" if backend in ("auto", "", None) and host.runs_on_cpu() else None
        be = get_backend(backend or "auto", cache_root=st.engine_dir(), device=device, live_modules=False)
    except Exception as exc:  # noqa: BLE001  (say it in the node, with the registry's reason)
        raise InvalidValue(f"backend {backend!r} cannot run here: {exc}") from exc
    precision = be.default_precision() if precision in (None, "", "auto") else precision
    check_precision(be, precision)
    parts: list[Part] = []
    with torch.inference_mode(False):
        from sd_accel.comfyui import transformer

        dit = model is not None and transformer.is_transformer(model)
        if "unet" in components:
            if model is None:
                raise InvalidValue("components include the UNet: connect a MODEL")
            # a FLUX.1 / SD3 MODEL: its transformer is the "unet" of the components' names
            parts.append(transformer_part(model, st) if dit else unet_part(model, st))
        if "unet_control" in components:
            if model is None:
                raise InvalidValue("components include unet_control: connect a MODEL")
            # FLUX.1 / SD3: the transformer taking ControlNet residuals (transformer_control)
            parts.append(transformer_part(model, st, control=True) if dit else unet_part(model, st, control=True))
        if "clip" in components:
            if clip is None:
                raise InvalidValue("components include clip: connect a CLIP")
            parts.extend(clip_parts(clip, st))
        wanted = tuple(c for c in components if c.startswith("vae"))
        if wanted:
            if vae is None:
                raise InvalidValue(f"components include {', '.join(wanted)}: connect a VAE")
            parts.extend(vae_parts(vae, wanted, st))
        path = (host.source_of(getattr(model, "model", None)) or host.source_of(getattr(vae, "first_stage_model", None))
                or host.source_of(getattr(clip, "cond_stage_model", None)))
        jobs = [_job(p, transformer.profile_for(profile, p), precision, path) for p in parts]
        modules = {id(j.spec): p.module for j, p in zip(jobs, parts, strict=True)}
        bar = host.progress_bar(100 * len(jobs))
        cancel = threading.Event()

        def progress(ev: BuildEvent | None) -> None:
            if ev is None:
                return
            if bar is not None:
                bar.update_absolute(int(100 * (ev.index + ev.fraction)), 100 * ev.total)
            if host.interrupted():
                cancel.set()

        log.warning("sd-accel: building %d engine(s) (%s) on %s, %s", len(jobs),
                    ", ".join(f"{p.component} {p.weights_id}" for p in parts), be.name, precision)
        cache = st.cache()
        had = {r.name for r in cache.list() if r.status == "ok"}
        changed = True
        try:
            with torch.no_grad():
                records = run_jobs(jobs, cache, be, progress=progress, cancel=cancel, validate=validate,
                                   context=lambda job: _context(modules[id(job.spec)]))
            keep_graphs_only(cache, records, [p.spec for p in parts])
            # ComfyUI runs this node again whenever its cached output was dropped (another graph
            # ran between): with every engine found already built and loaded, the loaded engines
            # and their LoRA refits stay (reloading them and refitting again cost minutes).
            changed = (any(r.name not in had for r in records)
                       or not all(st.loaded(p.weights_id, p.component) for p in parts))
        except BuildCancelled:
            host.raise_if_interrupted()
            raise
        finally:
            cache.drop_unused_intermediates()
            if changed:
                st.engines_changed()
    return records


@contextlib.contextmanager
def _context(module: torch.nn.Module):
    from sd_accel.comfyui.tracing import comfy_export_context

    with comfy_export_context(module):
        yield
