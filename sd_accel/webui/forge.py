"""Forge: engines through the UNet patcher, before every sampling pass.

Forge never calls A1111's ``sd_unet.current_unet`` (its sampler runs its own UNet through
``forge_objects.unet``, a ``UnetPatcher``), so the SD-UNet list is not used there. Instead the
always-on script's ``process_before_every_sampling`` (called before each pass: twice with hires
fix) clones the patcher, adds an object patch that swaps ``diffusion_model`` for
:class:`EngineDiffusionModel` during sampling, and assigns the clone back, the way Forge's own
extensions patch the UNet. Forge's ``KModel.apply_model`` keeps doing the input/output scaling
and calls our module exactly as it calls its UNet:
``diffusion_model(x, t, context=..., control=..., transformer_options=..., y=...)``.

Forge packs as many cond/uncond rows into one call as free memory allows, so the batch is not
known in advance: :class:`~sd_accel.webui.runner.LdmEngines` cuts it into chunks the engines
cover. The torch UNet stays registered inside the stand-in, so Forge's memory manager loads it
as usual and a call no engine covers runs at once.

Forge's ControlNet (its built-in ``sd_forge_controlnet``: the nets chained on the patcher, run by
the sampling function) hands the UNet ``control={"output": [...], "middle": [...]}``, ComfyUI's
format, strengths and chained nets already summed. Those calls go to the residual-taking engine
(``ldm_unet_control``, built with the ``unet_control`` component) of the same weights, refitted
with the UNet's for LoRAs; without one they run in PyTorch, counted with the reason. The
ControlNet itself runs in Forge (it is Forge's module, called before the UNet).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from sd_accel.components.ldm_control_unet import COMPONENT as CONTROL
from sd_accel.components.ldm_control_unet import control_feed, control_names, ldm_layout, sliced_control
from sd_accel.components.ldm_unet import COMPONENT
from sd_accel.runtime.modules import ProxyModule
from sd_accel.webui import host
from sd_accel.webui.controller import Controller, controller
from sd_accel.webui.identity import checkpoint_hash, describe, forge_loras, weights_id
from sd_accel.webui.runner import LdmEngines

log = logging.getLogger("sd_accel")

OBJECT_PATCH = "diffusion_model"


class EngineDiffusionModel(ProxyModule):
    """Forge's ``diffusion_model`` during sampling: engines where they cover, torch elsewhere.
    Forge and other extensions read attributes of the UNet (dtype, model_channels ...): proxied.

    Forge leaves the patch in place after sampling (until it unloads the model), and matches
    the next job's LoRA keys against the model's parameter names (``add_patches``:
    ``diffusion_model.input_blocks...``), then merges them by those names. So the stand-in has
    the torch UNet's submodules, parameters and buffers as its own (the same dicts), never
    under a ``torch_unet.`` prefix: with it, Forge skipped every LoRA key ("Mismatch ... 128 keys
    mismatched in 0 keys") and the UNet silently ran without the job's LoRAs."""

    _proxied = "torch_unet"

    def __init__(self, torch_unet: torch.nn.Module, engines: LdmEngines | None,
                 resolve: Callable[[], tuple[LdmEngines | None, str | None]] | None = None,
                 base: LdmEngines | None = None,
                 control: Callable[[], tuple[LdmEngines | None, str | None]] | None = None,
                 before: Callable[[str], None] | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "torch_unet", torch_unet)  # not a submodule: see the docstring
        self.__dict__["_modules"] = torch_unet._modules
        self.__dict__["_parameters"] = torch_unet._parameters
        self.__dict__["_buffers"] = torch_unet._buffers
        self.engines = engines
        # engines None: ``resolve()`` gives them at the first call (a LoRA refit, once Forge has
        # merged the LoRAs into the weights), or why not; ``base`` then counts the PyTorch calls.
        self.__dict__["_resolve"] = resolve
        self.__dict__["_base"] = base
        self.__dict__["_why"] = None
        # ``control()``: the residual-taking engines for ControlNet calls (or why none), asked at
        # the first such call and kept for the pass
        self.__dict__["_control"] = control
        self.__dict__["_control_found"] = None
        # ``before(component)``: once per pass, before the engines of ``ldm_unet`` or
        # ``ldm_unet_control`` first serve: the other kind's idle base engines leave memory
        self.__dict__["_before"] = before
        self.__dict__["_before_done"] = set()

    def __getattr__(self, name: str):
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            return getattr(self.__dict__["torch_unet"], name)

    def _first_use(self, component: str) -> None:
        done = self.__dict__["_before_done"]
        if component not in done:
            done.add(component)
            if self.__dict__["_before"] is not None:
                self.__dict__["_before"](component)

    def _engines(self) -> LdmEngines | None:
        self._first_use(COMPONENT)
        if self.engines is None and self.__dict__["_why"] is None and self.__dict__["_resolve"] is not None:
            engines, why = self.__dict__["_resolve"]()
            if engines is None:
                self.__dict__["_why"] = why or "no engine for these LoRAs"
            else:
                self.engines = engines
        return self.engines

    def _control_engines(self) -> tuple[LdmEngines | None, str | None]:
        found = self.__dict__["_control_found"]
        if found is None:
            self._first_use(CONTROL)
            resolve = self.__dict__["_control"]
            found = resolve() if resolve is not None else (None, "ControlNet residuals are not in the engine")
            self.__dict__["_control_found"] = found
        return found

    def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options=None, **kwargs):
        options = transformer_options if transformer_options is not None else {}
        reason = host.forge_call_reason(options, kwargs, "UNet")
        feed = None
        if reason is None and control is not None:
            # the residual-taking engines first: the plain UNet's (a LoRA refit of them) serve no
            # ControlNet call, so they are not resolved for one (a real Forge refitted both)
            residual_engines, why = self._control_engines()
            if residual_engines is not None:
                feed, why = control_feed(control, _control_inputs(self.torch_unet))
            reason = None if feed is not None else f"ControlNet residuals: {why}"
        if feed is not None:
            engines = residual_engines
        elif reason is None:
            engines = self._engines()
        else:
            engines = self.engines or self.__dict__["_base"]
        if engines is None:
            engines = self.__dict__["_base"]
            reason = reason or self.__dict__["_why"] or "no engine for these weights"

        def torch_part(part: slice | None) -> torch.Tensor:
            if part is None:
                return self.torch_unet(x, timesteps, context=context, y=y, control=control,
                                       transformer_options=options, **kwargs)
            return self.torch_unet(x[part], timesteps[part], context=context[part],
                                   y=None if y is None else y[part], control=sliced_control(control, part),
                                   transformer_options=options, **kwargs)

        if reason is not None:
            if engines is not None:
                engines.torch_call(reason)
            return torch_part(None)
        if feed is not None:
            return residual_engines(x, timesteps, context, y, torch_part, extra=feed)
        return engines(x, timesteps, context, y, torch_part)


def _control_inputs(unet: torch.nn.Module) -> list[str]:
    """The residual-taking engine's ``control_*`` input names for this UNet's block layout (it
    was built from the same module, so the layout is there)."""
    return control_names(ldm_layout(unet))


def _refit_refused(ctl: Controller, ckpt: str, loras, patcher) -> str | None:
    """Why this job's LoRAs cannot be carried by a refit of the checkpoint's engine (checked
    before sampling; whether Forge merged them is checked at the first call), or None."""
    from sd_accel.refit import needs_rebuild

    if not loras:
        return ""  # no LoRA, and no engine for the checkpoint's own weights: nothing to refit
    if ctl.lora_refits_kept() <= 0:
        return "refits are off in the settings"
    base, reason = ctl.engines_or_reason(weights_id(ckpt))
    if base is None:
        return reason or "the checkpoint has no engine"
    usable = [h for h in base.handles if h.broken is None]
    refused = [why for why in map(needs_rebuild, usable) if why]
    if len(refused) == len(usable):  # INT8 only (a mix: the others are refitted)
        return "; ".join(refused) or "the checkpoint's engines are set aside"
    return host.forge_lora_state(patcher, merged=False)  # Forge merges them when sampling starts


def patch_for_sampling(p, ctl: Controller | None = None) -> bool:
    """Swap engines into ``p.sd_model``'s UNet for the coming sampling pass; True when done.

    Called from ``process_before_every_sampling``. A job whose weights have no engines, or
    that uses what an engine cannot carry, is left to Forge's UNet and the console says why.
    """
    ctl = ctl or controller()
    if not ctl.forge_enabled():
        return False
    patcher = host.forge_unet_patcher(p.sd_model)
    if patcher is None:
        return False
    if ctl.job.torch_only:
        ctl.note(f"this job runs the UNet in PyTorch: {ctl.job.torch_only}")
        return False
    from sd_accel.webui import forge_transformer

    if forge_transformer.is_forge_transformer(patcher.model.diffusion_model):
        return forge_transformer.patch_for_sampling(p, ctl, patcher, _park)
    why = host.not_on_engines(patcher.model.diffusion_model)
    if why is not None:
        ctl.say_once(why)
        return False
    ckpt = checkpoint_hash(host.checkpoint_info(p.sd_model))
    if ckpt is None:
        return False
    loras = forge_loras(patcher)
    wid = weights_id(ckpt, loras)
    engines, reason = ctl.engines_or_reason(wid)
    if reason is not None:
        ctl.note(f"the UNet runs in PyTorch: {reason}")
        return False
    resolve = base = None
    unet = patcher.clone()
    torch_unet = unet.model.diffusion_model
    torch_unet = getattr(torch_unet, "torch_unet", torch_unet)  # a pass before left ours in place
    if engines is None:
        why = _refit_refused(ctl, ckpt, loras, patcher)
        if why is not None:
            if ctl.records_for_checkpoint(ckpt):  # engines exist, just not for these LoRAs
                because = f": {why}" if why else ""
                ctl.note(f"no engine for this checkpoint with {describe(loras)}{because}; the UNet runs in "
                         "PyTorch (build one in the sd-accel tab while these LoRAs are applied)")
            return False
        from sd_accel.webui.lora import forge_merge

        base, _ = ctl.engines_or_reason(weights_id(ckpt))

        def resolve():
            found, why = ctl.lora_engines(ckpt, loras, torch_unet, forge_merge(patcher))
            if found is None and why:
                ctl.note(f"no engine for this checkpoint with {describe(loras)}: {why}; the UNet runs in "
                         "PyTorch (build one in the sd-accel tab while these LoRAs are applied)")
            return found, why

    def control():
        """The residual-taking engines of these weights (refitted for the LoRAs), or why none."""
        found, why = ctl.engines_or_reason(wid, CONTROL)
        if found is None and why is None and loras:
            from sd_accel.webui.lora import forge_merge

            found, why = ctl.lora_engines(ckpt, loras, torch_unet, forge_merge(patcher), component=CONTROL)
        if found is None and why is None:
            lora_part = f" with {describe(loras)}" if loras else ""
            why = (f"no UNet engine that takes them for this checkpoint{lora_part}: build one in the sd-accel tab "
                   "with the unet_control component")
        return found, why

    unet.add_object_patch(OBJECT_PATCH, EngineDiffusionModel(torch_unet, engines, resolve, base, control,
                                                             lambda component: ctl.close_idle_bases(ckpt, component)))
    p.sd_model.forge_objects.unet = unet
    ctl.job.used.add(wid)
    _park(ctl, torch_unet)
    return True


def _park(ctl: Controller, torch_unet: torch.nn.Module) -> None:
    """Park the torch UNet's weights (:func:`sd_accel.runtime.weights.park`) while engines serve
    the job; :func:`release_parked` hands back what the job paged in at its end.

    Forge keeps its whole UNet in RAM (SD 1.5 on the CPU: 3.2 GiB of fp32, converted from the
    checkpoint at load, so anonymous memory) whatever computes the calls. In a real Forge the
    engine runs peaked above Forge's own PyTorch runs with the engines' weights beside it. Parked,
    it is written once to a memory-mapped spill file under the engine folder and costs resident
    memory only where something reads it: Forge's LoRA merge (it edits the LoRA's layers in place
    or swaps them: private copies), a refit's check against torch, a call in PyTorch."""
    from sd_accel.runtime.weights import park

    try:
        park(torch_unet, ctl.cache().root, "Forge UNet")
    except Exception as exc:  # noqa: BLE001  (never stop the image: the weights stay in RAM)
        ctl.say_once(f"the UNet's torch weights stay in RAM beside the engines: {type(exc).__name__}: {exc}")
        return
    ctl.job.parked = torch_unet


def release_parked(ctl: Controller | None = None) -> int:
    """At a job's end: hand back the pages of the parked torch UNet that the job read (a LoRA
    merge, a refit, a PyTorch call); bytes advised."""
    ctl = ctl or controller()
    unet = getattr(ctl.job, "parked", None)
    if unet is None:
        return 0
    from sd_accel.runtime.weights import release

    ctl.job.parked = None
    return release(unet)
