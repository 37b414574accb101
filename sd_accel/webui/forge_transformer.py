"""Forge's transformer families on an engine: FLUX.1 and SD3.5; the build from the loaded model, the
calls during sampling.

Forge 2 loads a FLUX.1 checkpoint into ``backend.nn.flux.IntegratedFluxTransformer2DModel`` (Black
Forest Labs' layout, ComfyUI's ``Flux`` too) and an SD3 / SD3.5 one into
``backend.nn.mmditx.MMDiTX`` (Stability's layout), each wrapped by ``KModel``, whose
``apply_model`` scales the input and calls it as
``diffusion_model(x, t, context=..., control=None, transformer_options={}, y=pooled[, guidance=g])``
(t: FLUX.1's sigma, SD3's sigma x 1000). The engine is diffusers' ``FluxTransformer2DModel`` /
``SD3Transformer2DModel`` (component ``transformer``) made from those weights
(:mod:`sd_accel.components.flux.bfl_module`, :mod:`sd_accel.components.sd3.sai_module`, shared with
ComfyUI's pack), keyed by the checkpoint as the UNet's engines are; a call is fed to it in
diffusers' form and its output given back in Forge's shape.

As for the UNet (:mod:`.forge`): an object patch swaps ``diffusion_model`` for
:class:`EngineTransformerModel` during sampling; it holds the torch module's parameters as its own,
so Forge's LoRA merge finds them by their names, and a LoRA job refits the checkpoint's engine to
the merged weights at its first call (:mod:`.lora`). What the engine does not compute runs in
Forge's PyTorch, counted with the reason: a shape no profile covers, ControlNet residuals,
patches of other extensions, a guidance-distilled call without guidance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from sd_accel.runtime.modules import ProxyModule
from sd_accel.webui import host
from sd_accel.webui.lora import Refit, refit_context
from sd_accel.webui.lora import _console_progress as console_progress

log = logging.getLogger("sd_accel")

COMPONENT = "transformer"
# Forge's T5 pads prompts to 256 tokens for both families (``T5TextProcessingEngine(min_length=256)``;
# SD3's context puts CLIP's 77 columns first); longer prompts grow it, which a text range covers.
TEXT = 256
OBJECT_PATCH = "diffusion_model"
CLASSES = {"IntegratedFluxTransformer2DModel": "flux", "MMDiTX": "sd3"}  # Forge's classes, by family
TITLES = {"flux": "FLUX.1", "sd3": "SD3.5"}


def family_of(module: torch.nn.Module) -> str | None:
    """``flux`` or ``sd3`` for Forge's transformer classes, else None (Chroma's is another layout)."""
    return CLASSES.get(type(getattr(module, "torch_unet", module)).__name__)


def is_forge_transformer(module: torch.nn.Module) -> bool:
    return family_of(module) is not None


def _module(fam: str):
    """The host-neutral conversion and feed of ``fam``."""
    if fam == "flux":
        from sd_accel.components.flux import bfl_module

        return bfl_module
    from sd_accel.components.sd3 import sai_module

    return sai_module


class FluxFromForge:
    """What the library's transformer specs read of a pipeline (named ``Flux…`` / ``StableDiffusion3…``
    for their family lookup): the module and the VAE's scale."""

    vae = None
    vae_scale_factor = 8

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer


class StableDiffusion3FromForge(FluxFromForge):
    """(named for the specs' family lookups)"""


def family(module: torch.nn.Module) -> str:
    """The record's family: ``flux-dev`` (guidance-distilled), ``flux-schnell`` or ``sd3``."""
    if family_of(module) == "sd3":
        return "sd3"
    from sd_accel.components.flux.bfl_module import params_of

    return "flux-dev" if params_of(module).guidance_embed else "flux-schnell"


def title(module: torch.nn.Module) -> str:
    return TITLES.get(family_of(module) or "", "the transformer")


def spec_for(fam: str, transformer: torch.nn.Module):
    """The engine spec of diffusers' transformer ``transformer`` of family ``fam``."""
    if fam == "flux":
        from sd_accel.components.flux import FluxTransformerSpec

        return FluxTransformerSpec(FluxFromForge(transformer))
    from sd_accel.components.sd3 import SD3TransformerSpec

    return SD3TransformerSpec(StableDiffusion3FromForge(transformer))


def spec_and_module(module: torch.nn.Module):
    """(the engine spec, diffusers' transformer with ``module``'s weights in float32)."""
    fam = family_of(module)
    transformer = _module(fam).to_diffusers(module)
    return spec_for(fam, transformer), transformer


def build_profile(profile):
    """A profile for the transformer: Forge's T5 length where the profile names none."""
    return profile if getattr(profile, "text", None) is not None else replace(profile, text=(TEXT, TEXT, TEXT))


def call_reason(module: torch.nn.Module, y, guidance, control, options: dict, kwargs: dict) -> str | None:
    """What in this call the engine does not compute (Forge computes it), or None."""
    from sd_accel.components.flux.bfl_module import params_of

    fam = family_of(module)
    if control is not None:
        return f"ControlNet residuals are not in the {TITLES[fam]} engine inside Forge"
    why = host.forge_call_reason(options, kwargs, "transformer")
    if why is not None:
        return why
    if fam == "flux" and params_of(module).guidance_embed and guidance is None:
        return "no guidance for a guidance-distilled FLUX.1"
    if fam == "sd3" and (y is None or guidance is not None):
        return "no pooled text (y) in the call" if y is None else "a guidance input SD3 does not take"
    return None


class EngineTransformerModel(ProxyModule):
    """Forge's ``diffusion_model`` during sampling: the transformer engine where it covers the call,
    Forge's torch module elsewhere. The torch module's submodules, parameters and buffers are this
    module's own (the same dicts: Forge merges LoRA weights by their names)."""

    _proxied = "torch_unet"

    def __init__(self, torch_unet: torch.nn.Module, engines, resolve: Callable | None = None, base=None) -> None:
        super().__init__()
        object.__setattr__(self, "torch_unet", torch_unet)  # not a submodule (its names stay Forge's)
        self.__dict__["_modules"] = torch_unet._modules
        self.__dict__["_parameters"] = torch_unet._parameters
        self.__dict__["_buffers"] = torch_unet._buffers
        self.__dict__["engines"] = engines
        # engines None: ``resolve()`` gives them at the first call (a LoRA refit, once Forge has
        # merged the LoRAs), or why not; ``base`` then counts the PyTorch calls
        self.__dict__["_resolve"] = resolve
        self.__dict__["_base"] = base
        self.__dict__["_why"] = None

    def __getattr__(self, name: str):
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            return getattr(self.__dict__["torch_unet"], name)

    def _engines(self):
        d = self.__dict__
        if d["engines"] is None and d["_why"] is None and d["_resolve"] is not None:
            engines, why = d["_resolve"]()
            if engines is None:
                d["_why"] = why or "no engine for these LoRAs"
            else:
                d["engines"] = engines
        return d["engines"]

    def forward(self, x, timestep=None, context=None, y=None, guidance=None, control=None, transformer_options=None,
                **kwargs):
        module = self.__dict__["torch_unet"]
        fam = family_of(module)
        options = transformer_options if transformer_options is not None else {}

        batch = x.shape[0]

        def rows(value, part: slice):  # a per-row input cut to ``part`` (a scalar stays as it is)
            return value[part] if torch.is_tensor(value) and value.dim() and value.shape[0] == batch else value

        def in_torch(part: slice = slice(None)) -> torch.Tensor:
            more = dict(kwargs, guidance=rows(guidance, part)) if guidance is not None else kwargs  # (SD3 takes none)
            return module(rows(x, part), rows(timestep, part), context=rows(context, part), y=rows(y, part),
                          control=control, transformer_options=options, **more)

        reason = call_reason(module, y, guidance, control, options, kwargs)
        engines = self._engines() if reason is None else (self.__dict__["engines"] or self.__dict__["_base"])
        if engines is None:
            engines = self.__dict__["_base"]
            reason = reason or self.__dict__["_why"] or "no engine for these weights"
        if reason is not None:
            if engines is not None:
                engines.torch_call(reason)
            return in_torch()
        code = _module(fam)
        feeds: dict[tuple, tuple] = {}  # (the whole call's feed is made once: batch_slices tries it first)

        def feed(part: slice):
            key = part.indices(batch)
            if key not in feeds:
                args = [rows(v, part) for v in (x, timestep, context, y, *((guidance,) if fam == "flux" else ()))]
                feeds[key] = code.feed(module, *args)
            return feeds[key]

        from sd_accel.webui.runner import batch_slices

        # a batch larger than any engine covers (Forge packs cond and uncond, and as many images as
        # memory allows) runs in the largest chunks some engine covers
        parts = batch_slices(engines, lambda n: feed(slice(0, n))[0], batch)
        outs = []
        for part in parts:
            inputs, shape = feed(part)
            out = engines.run(inputs, need=("latent",))
            if out is None:  # counted, with the reason, by the engines
                outs.append(in_torch(part))
            else:  # copy: the engine reuses its output buffer on the next call
                outs.append(code.output(out["latent"], shape).to(device=x.device, dtype=x.dtype, copy=True))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def patch_for_sampling(p, ctl, patcher, park: Callable) -> bool:
    """Swap the checkpoint's transformer engine (refitted for the job's LoRAs) into ``p.sd_model``'s
    FLUX.1 / SD3.5 for the coming sampling pass; True when done (:func:`.forge.patch_for_sampling` calls it,
    with its ``park`` for the torch weights while engines serve)."""
    from sd_accel.webui.identity import checkpoint_hash, describe, forge_loras, weights_id

    torch_unet = patcher.model.diffusion_model
    torch_unet = getattr(torch_unet, "torch_unet", torch_unet)  # a pass before left ours in place
    name = title(torch_unet)
    ctl.job.denoiser = COMPONENT  # the job's line counts the transformer's calls
    ctl.job.denoiser_label = f"{name} transformer"
    ckpt = checkpoint_hash(host.checkpoint_info(p.sd_model))
    if ckpt is None:
        return False
    why = _module(family_of(torch_unet)).unsupported(torch_unet)
    if why is not None:
        ctl.say_once(f"{name} runs in PyTorch: {why}")
        return False
    loras = forge_loras(patcher)
    wid = weights_id(ckpt, loras)
    engines, reason = ctl.engines_or_reason(wid, COMPONENT)
    if reason is not None:
        ctl.note(f"the {name} transformer runs in PyTorch: {reason}")
        return False
    resolve = base = None
    if engines is None:
        base, _ = ctl.engines_or_reason(weights_id(ckpt), COMPONENT)
        if base is None:
            ctl.note(f"no {name} transformer engine for this checkpoint ({ckpt}) yet: it runs in PyTorch (build one "
                     "in the sd-accel tab)")
            return False
        if not loras:
            return False
        from sd_accel.webui.lora import forge_merge

        def resolve():
            found, why = ctl.lora_engines(ckpt, loras, torch_unet, forge_merge(patcher), component=COMPONENT)
            if found is None and why:
                ctl.note(f"no {name} engine for this checkpoint with {describe(loras)}: {why}; the transformer "
                         "runs in PyTorch")
            return found, why

    unet = patcher.clone()
    unet.add_object_patch(OBJECT_PATCH, EngineTransformerModel(torch_unet, engines, resolve, base))
    p.sd_model.forge_objects.unet = unet
    ctl.job.used.add(wid)
    park(ctl, torch_unet)
    return True


class TransformerRefit(Refit):
    """One LoRA set's refitted transformer engines (Forge): each refitted at its first call from
    Forge's module bound last, its LoRA-merged weights converted as the engine was built
    (:func:`sd_accel.components.flux.bfl_module.to_diffusers`, :func:`sd_accel.components.sd3.sai_module.to_diffusers`)."""

    def make(self, handle):
        from sd_accel.core import EngineError
        from sd_accel.onnx.weights import effective_weights
        from sd_accel.refit import conversion_preflight, refit_engine

        module, _, merge, _ = self.source
        report = console_progress(self.loras)
        with refit_context(module):
            why = merge() if merge is not None else None
            if why:
                raise EngineError(why)
            # (Forge keeps float32 on the CPU, taken as it is: only other dtypes are copied)
            conversion_preflight(handle, [t for t in module.state_dict().values() if t.dtype != torch.float32],
                                 "LoRA-merged transformer")
            fam = family_of(module)
            transformer = _module(fam).to_diffusers(module, copy=False)  # Forge's merged weights as they are
            spec = spec_for(fam, transformer)
            return refit_engine(handle, effective_weights(transformer), spec, lambda f, m: report(handle.name, f, m))

    def line(self, made_now: bool) -> str:
        return super().line(made_now).replace("UNet", f"{title(self.source[0])} transformer", 1)


def transformer_refit_for(base, loras, ckpt: str, module: torch.nn.Module, spec=None, merge=None,
                          context=None) -> TransformerRefit:
    """The transformer engines ``base`` (the runtime's ``ComponentEngines``; INT8 ones left
    out) to be refitted to ``module``'s weights (Forge's, carrying ``loras`` once ``merge()``
    returns None), each at its first call. Same signature as :func:`.lora.refit_for`."""
    return TransformerRefit.pending_for(base, loras, module, spec, merge, context)


__all__ = ["CLASSES", "COMPONENT", "EngineTransformerModel", "TransformerRefit", "build_profile", "call_reason", "family",
           "family_of", "is_forge_transformer", "patch_for_sampling", "spec_and_module", "spec_for", "transformer_refit_for"]
