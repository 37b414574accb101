"""Forge's FLUX.1 on a transformer engine: the build from the loaded model, the calls during sampling.

Forge 2 loads a FLUX.1 checkpoint into ``backend.nn.flux.IntegratedFluxTransformer2DModel``
(Black Forest Labs' layout, the same as ComfyUI's ``Flux``), wrapped by ``KModel``, whose
``apply_model`` scales the input and calls it as
``diffusion_model(x, sigma, context=t5, control=None, transformer_options={}, y=clip_pooled, guidance=g)``.
The engine is diffusers' ``FluxTransformer2DModel`` (component ``transformer``) made from those
weights (:mod:`sd_accel.components.flux.bfl_module`, shared with ComfyUI's pack), keyed by the
checkpoint as the UNet's engines are; a call is fed to it in diffusers' form (2x2 patch tokens,
rotary ids, the sigma as the timestep) and its output given back in Forge's shape.

As for the UNet (:mod:`.forge`): an object patch swaps ``diffusion_model`` for
:class:`EngineFluxModel` during sampling; it holds the torch module's parameters as its own, so
Forge's LoRA merge finds them by their names, and a LoRA job refits the checkpoint's engine to
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
CLASS = "IntegratedFluxTransformer2DModel"
# Forge's T5 pads FLUX.1 prompts to 256 tokens (``T5TextProcessingEngine(min_length=256)``); longer
# prompts grow it, which a profile with a text range covers.
TEXT = 256
OBJECT_PATCH = "diffusion_model"
INFORMATIONAL = ("control_model",)  # keyword arguments Forge passes that the model does not compute with


def is_forge_flux(module: torch.nn.Module) -> bool:
    """Forge's FLUX.1 class (Chroma's, a subclass of another layout, is not)."""
    return type(getattr(module, "torch_unet", module)).__name__ == CLASS


class FluxFromForge:
    """What the library's transformer specs read of a pipeline (named ``Flux…`` for their family
    lookup): the module and the VAE's scale."""

    vae = None
    vae_scale_factor = 8

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer


def family(module: torch.nn.Module) -> str:
    """``flux-dev`` (guidance-distilled) or ``flux-schnell``."""
    from sd_accel.components.flux.bfl_module import params_of

    return "flux-dev" if params_of(module).guidance_embed else "flux-schnell"


def spec_and_module(module: torch.nn.Module):
    """(the engine spec, diffusers' transformer with ``module``'s weights in float32)."""
    from sd_accel.components.flux import FluxTransformerSpec
    from sd_accel.components.flux.bfl_module import to_diffusers

    transformer = to_diffusers(module)
    return FluxTransformerSpec(FluxFromForge(transformer)), transformer


def build_profile(profile):
    """A profile for the transformer: Forge's T5 length where the profile names none."""
    return profile if getattr(profile, "text", None) is not None else replace(profile, text=(TEXT, TEXT, TEXT))


def call_reason(module: torch.nn.Module, guidance, control, options: dict, kwargs: dict) -> str | None:
    """What in this call the engine does not compute (Forge computes it), or None."""
    from sd_accel.components.flux.bfl_module import params_of

    if control is not None:
        return "ControlNet residuals are not in the FLUX.1 engine inside Forge"
    patches = [k for k in ("patches", "patches_replace") if options.get(k)]
    if patches:
        names = sorted({n for k in patches for n in options[k]})
        return f"transformer patches from other extensions ({', '.join(names)}) are not in the engine"
    extra = sorted(k for k, v in kwargs.items() if v is not None and k not in INFORMATIONAL)
    if extra:
        return f"arguments the engine was not built for: {', '.join(extra)}"
    if params_of(module).guidance_embed and guidance is None:
        return "no guidance for a guidance-distilled FLUX.1"
    return None


class EngineFluxModel(ProxyModule):
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
        from sd_accel.components.flux.bfl_module import feed, output

        module = self.__dict__["torch_unet"]
        options = transformer_options if transformer_options is not None else {}

        def in_torch() -> torch.Tensor:
            return module(x, timestep, context=context, y=y, guidance=guidance, control=control,
                          transformer_options=options, **kwargs)

        reason = call_reason(module, guidance, control, options, kwargs)
        engines = self._engines() if reason is None else (self.__dict__["engines"] or self.__dict__["_base"])
        if engines is None:
            engines = self.__dict__["_base"]
            reason = reason or self.__dict__["_why"] or "no engine for these weights"
        if reason is not None:
            if engines is not None:
                engines.torch_call(reason)
            return in_torch()
        inputs, shape = feed(module, x, timestep, context, y, guidance)
        out = engines.run(inputs, need=("latent",))
        if out is None:  # counted, with the reason, by the engines
            return in_torch()
        # copy: the engine reuses its output buffer on the next call
        return output(out["latent"], shape).to(device=x.device, dtype=x.dtype, copy=True)


def patch_for_sampling(p, ctl, patcher, park: Callable) -> bool:
    """Swap the checkpoint's transformer engine (refitted for the job's LoRAs) into ``p.sd_model``'s
    FLUX.1 for the coming sampling pass; True when done (:func:`.forge.patch_for_sampling` calls it,
    with its ``park`` for the torch weights while engines serve)."""
    from sd_accel.webui.identity import checkpoint_hash, describe, forge_loras, weights_id

    ctl.job.denoiser = COMPONENT  # the job's line counts the transformer's calls
    ckpt = checkpoint_hash(host.checkpoint_info(p.sd_model))
    if ckpt is None:
        return False
    from sd_accel.components.flux.bfl_module import unsupported

    torch_unet = patcher.model.diffusion_model
    torch_unet = getattr(torch_unet, "torch_unet", torch_unet)  # a pass before left ours in place
    why = unsupported(torch_unet)
    if why is not None:
        ctl.say_once(f"FLUX.1 runs in PyTorch: {why}")
        return False
    loras = forge_loras(patcher)
    wid = weights_id(ckpt, loras)
    engines, reason = ctl.engines_or_reason(wid, COMPONENT)
    if reason is not None:
        ctl.note(f"the FLUX.1 transformer runs in PyTorch: {reason}")
        return False
    resolve = base = None
    if engines is None:
        base, _ = ctl.engines_or_reason(weights_id(ckpt), COMPONENT)
        if base is None:
            ctl.note(f"no FLUX.1 transformer engine for this checkpoint ({ckpt}) yet: it runs in PyTorch (build one "
                     "in the sd-accel tab)")
            return False
        if not loras:
            return False
        from sd_accel.webui.lora import forge_merge

        def resolve():
            found, why = ctl.lora_engines(ckpt, loras, torch_unet, forge_merge(patcher), component=COMPONENT)
            if found is None and why:
                ctl.note(f"no FLUX.1 engine for this checkpoint with {describe(loras)}: {why}; the transformer "
                         "runs in PyTorch")
            return found, why

    unet = patcher.clone()
    unet.add_object_patch(OBJECT_PATCH, EngineFluxModel(torch_unet, engines, resolve, base))
    p.sd_model.forge_objects.unet = unet
    ctl.job.used.add(wid)
    park(ctl, torch_unet)
    return True


class FluxRefit(Refit):
    """One LoRA set's refitted FLUX.1 transformer engines (Forge): each refitted at its first call
    from Forge's module bound last, its LoRA-merged weights converted as the engine was built
    (:func:`sd_accel.components.flux.bfl_module.to_diffusers`)."""

    def make(self, handle):
        from sd_accel.components.flux import FluxTransformerSpec
        from sd_accel.components.flux.bfl_module import to_diffusers
        from sd_accel.core import EngineError
        from sd_accel.onnx.weights import effective_weights
        from sd_accel.refit import refit_engine

        module, _, merge, _ = self.source
        report = console_progress(self.loras)
        with refit_context(module):
            why = merge() if merge is not None else None
            if why:
                raise EngineError(why)
            _copy_fits(module, handle)
            transformer = to_diffusers(module, copy=False)  # Forge's merged weights as they are
            spec = FluxTransformerSpec(FluxFromForge(transformer))
            return refit_engine(handle, effective_weights(transformer), spec, lambda f, m: report(handle.name, f, m))

    def line(self, made_now: bool) -> str:
        return super().line(made_now).replace("UNet", "FLUX.1 transformer", 1)


def _copy_fits(module: torch.nn.Module, handle) -> None:
    """Raise EngineError before a refit whose float32 copies of the (LoRA-merged) transformer's
    weights that are not float32 already (Forge keeps float32 on the CPU: none; fp8 / bf16 storage
    on a GPU: all, 48 GB at FLUX.1's real size) and the refitted engine would not fit in the memory
    available now: the job then goes on in Forge's PyTorch, Forge untouched."""
    from sd_accel.core import EngineError
    from sd_accel.refit import _gib as gib
    from sd_accel.refit import available_memory

    free = available_memory()
    if free is None:
        return
    need = 4 * sum(t.numel() for t in module.state_dict().values() if t.dtype != torch.float32)
    need += int(getattr(handle.record, "size_bytes", 0) or 0)
    if need > free:
        raise EngineError(f"not enough memory to refit {handle.name}: a float32 copy of the LoRA-merged transformer "
                          f"and the engine need ~{gib(need)}, {gib(free)} available; close other applications, or "
                          "build an engine with these LoRAs applied")


def flux_refit_for(base, loras, ckpt: str, module: torch.nn.Module, spec=None, merge=None,
                   context=None) -> FluxRefit:
    """The FLUX.1 transformer engines ``base`` (the runtime's ``ComponentEngines``; INT8 ones left
    out) to be refitted to ``module``'s weights (Forge's, carrying ``loras`` once ``merge()``
    returns None), each at its first call. Same signature as :func:`.lora.refit_for`."""
    from sd_accel.refit import needs_rebuild, pending_component

    refittable = base.subset(lambda h: h.broken is None and needs_rebuild(h) is None)
    refit = FluxRefit(None, loras, tuple(h.name for h in refittable.handles))
    refit.bind(module, spec, merge, context)
    refit.engines = pending_component(refittable, refit.make)
    return refit


__all__ = ["COMPONENT", "EngineFluxModel", "FluxFromForge", "FluxRefit", "flux_refit_for", "build_profile", "call_reason", "family",
           "is_forge_flux", "patch_for_sampling", "spec_and_module"]
