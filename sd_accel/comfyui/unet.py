"""ComfyUI's UNet calls on engines: two wrappers on a ModelPatcher clone.

ComfyUI's extension points (``ModelPatcher.add_wrapper_with_key``, ``comfy.patcher_extension``):

- ``outer_sample`` wraps one sampling run (``CFGGuider.outer_sample``; ``executor.class_obj`` is the
  guider, whose ``model_patcher`` is the MODEL the sampler got, LoRA patches and all). Here the
  run's weights are worked out once: the checkpoint's id plus the patch set, its engines, or
  why the UNet runs in PyTorch. At its end the run's report is logged.
- ``diffusion_model`` wraps each UNet call (``UNetModel.forward``, after ComfyUI's input scaling
  and sigma -> timestep): ``(executor, x, timesteps, context, y, control, transformer_options,
  **kwargs)``. The call goes to the engines (per-call choice and batch chunks:
  :class:`~sd_accel.webui.runner.LdmEngines`), or to ``executor(...)``, ComfyUI's own UNet.

Wrappers, not ``set_model_unet_function_wrapper``: that slot holds one function per model, and
other packs use it; wrappers chain. A ``model_function_wrapper`` of another pack (it wraps
``apply_model`` from outside) still reaches these; what changes the UNet from inside (FreeU's
block patches, attention patches and replacements, other ``diffusion_model`` wrappers, object
patches of ``diffusion_model``, T2I-Adapter residuals) sends the call to PyTorch, with its names
in the message, said once per reason and counted. ControlNet residuals (``control``: what
ComfyUI's ControlNet apply nodes make, strengths and chained nets summed) go to the checkpoint's
residual-taking UNet engine (``ldm_unet_control``, :mod:`sd_accel.components.ldm_control_unet`)
when one is built, to PyTorch otherwise (said once: build it with the Build Engines node).

LoRA: ComfyUI writes the patches into the weights when it loads the model for sampling
(``ModelPatcher.load``, before the first UNet call) and records ``current_weight_patches_uuid``
on the model. At the first call of a run whose patch set has no engine of its own, the
checkpoint's engine is refitted to those weights (:func:`sd_accel.webui.lora.refit_for`, the
WebUI's), each profile at its own first call (a profile no call reaches is never patched); a
strength change is another patch set, so another refit, never a rebuild: the previous set's
refits leave memory first (:data:`KEPT_REFITS`); and the unpatched engine never serves patched
weights. A refit that would not fit in the memory available says so before it starts and the
run goes on in PyTorch.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from sd_accel.comfyui import host
from sd_accel.comfyui.identity import describe, patch_set, unet_weights_id
from sd_accel.comfyui.patches import callable_name as _name
from sd_accel.comfyui.patches import patch_names as _patch_names
from sd_accel.comfyui.state import State, state
from sd_accel.components.ldm_control_unet import COMPONENT as CONTROL
from sd_accel.components.ldm_control_unet import control_feed, control_names, ldm_layout, sliced_control
from sd_accel.components.ldm_unet import COMPONENT
from sd_accel.webui.identity import LoraSet

log = logging.getLogger("sd_accel")

KEY = "sd_accel"  # the wrappers' key on the ModelPatcher
KEPT_REFITS = 1  # patch sets kept refitted per checkpoint (each a patched copy of the engines in memory)


def call_reason(options: dict | None, kwargs: dict) -> str | None:
    """Why this UNet call must run in PyTorch (patches, other wrappers, arguments), with the
    names of what asks for it; None: engines. ControlNet residuals are judged apart."""
    options = options or {}
    patches = _patch_names(options, "patches") + _patch_names(options, "patches_replace")
    if patches:
        return f"UNet patches ({'; '.join(patches)}) are not in the engine"
    others = {k: v for k, v in ((options.get("wrappers") or {}).get(host.wrappers().DIFFUSION_MODEL) or {}).items()
              if k != KEY and v}
    if others:
        names = sorted({_name(f) for fns in others.values() for f in fns})
        return f"other UNet wrappers ({', '.join(names)}) are not in the engine"
    extra = sorted(k for k, v in kwargs.items() if v is not None)
    if extra:
        return f"arguments the engine was not built for: {', '.join(extra)}"
    return None


def _controlnets(guider) -> list[str]:
    """Class names of the ControlNets (and T2I adapters, Control-LoRAs) in the guider's conds."""
    names: list[str] = []
    for conds in (getattr(guider, "original_conds", None) or getattr(guider, "conds", None) or {}).values():
        for c in conds or []:
            control = c.get("control") if isinstance(c, dict) else None
            while control is not None:
                names.append(type(control).__name__)
                control = getattr(control, "previous_controlnet", None)
    return sorted(set(names))


@dataclass
class Run:
    """One sampling run of a MODEL with engines applied."""

    patcher: Any
    loras: LoraSet = ()
    engines: Any = None  # LdmEngines serving the run
    counter: Any = None  # LdmEngines whose stats count the run's PyTorch calls (engines or the base)
    reason: str | None = None  # the whole run runs in PyTorch, and why
    refit: bool = False  # the engines come from a refit at the first call
    controlnets: list[str] = field(default_factory=list)
    control: Any = None  # LdmEngines taking ControlNet residuals (the checkpoint's, or refitted)
    control_base: Any = None  # the checkpoint's residual-taking engines (what a refit starts from)
    control_why: str | None = None  # why ControlNet calls cannot use them
    torch_calls: dict[str, int] = field(default_factory=dict)  # where no engines count them
    line: Any = None  # () -> what a refit did, for the report


class EngineUNet:
    """Engines for one checkpoint's UNet, reached through the two wrappers."""

    def __init__(self, ckpt_id: str, st: State | None = None) -> None:
        self.ckpt_id = ckpt_id
        self._state = st
        self.run: Run | None = None
        self.last_report: str | None = None
        self._names: list[str] | None = None  # the residual engine's control inputs

    @property
    def state(self) -> State:
        return self._state or state()

    # ---- the run

    def prepare(self, patcher) -> Run:
        """The run's engines (or why none) for ``patcher``'s weights."""
        run = Run(patcher)
        if patcher is None:
            run.reason = "the sampler gave no ModelPatcher: its patches are not known"
            return run
        if getattr(patcher, "hook_patches", None) or getattr(patcher, "current_hooks", None):
            run.reason = "hook LoRAs / weight hooks (they change weights per step or per cond) are not in the engine"
            return run
        objects = sorted(k for k in getattr(patcher, "object_patches", {}) if str(k).startswith("diffusion_model"))
        if objects:
            run.reason = f"object patches of the UNet ({', '.join(objects)}) replace what the engine was built from"
            return run
        run.loras = patch_set(getattr(patcher, "patches", {}) or {})
        st = self.state
        base, why = st.engines_or_reason(unet_weights_id(self.ckpt_id), COMPONENT)
        control, _ = st.engines_or_reason(unet_weights_id(self.ckpt_id), CONTROL)
        run.counter = base
        if control is not None:
            control.reset_stats()
        run.control = run.control_base = control
        if control is None:
            run.control_why = (f"no residual-taking UNet engine (ldm_unet_control) for {self.ckpt_id}: build one "
                               "with the sd-accel Build Engines node (components with unet_control)")
        if not run.loras:
            run.engines = base
            if base is None:
                run.reason = why or (f"no engine for {self.ckpt_id} here (build one with the sd-accel Build "
                                     "Engines node)")
            return run
        own, _ = st.engines_or_reason(unet_weights_id(self.ckpt_id, run.loras), COMPONENT)
        own_control, _ = st.engines_or_reason(unet_weights_id(self.ckpt_id, run.loras), CONTROL)
        run.control = own_control  # the checkpoint's residual engine is refitted with the UNet's, or not used
        if own_control is None and control is not None:
            run.control_why = None  # decided at the refit
        if own is not None:  # an engine built with these patches applied
            run.engines = run.counter = own
            if own_control is None:
                run.control_why = (f"no residual-taking UNet engine built for {describe(run.loras)}: ControlNet "
                                   "calls run in PyTorch")
            return run
        if base is None:
            run.reason = f"no engine for {self.ckpt_id} to refit for {describe(run.loras)}"
            run.control, run.control_why = None, run.reason
            return run
        from sd_accel.refit import needs_rebuild

        usable = [h for h in base.handles if h.broken is None]
        refused = [w for w in map(needs_rebuild, usable) if w]
        if len(refused) == len(usable):
            run.reason = "; ".join(refused) or "the checkpoint's engines are set aside"
            return run
        run.refit = True
        return run

    def outer_sample(self, executor, *args, **kwargs):
        """``outer_sample`` wrapper: prepare the run, sample, report."""
        guider = getattr(executor, "class_obj", None)
        run = self.prepare(getattr(guider, "model_patcher", None))
        run.controlnets = _controlnets(guider)
        if run.counter is not None:
            run.counter.reset_stats()
        self.run = run
        unet = self._park(run)
        try:
            return executor(*args, **kwargs)
        finally:
            self.last_report = self.report(run)
            log.info("%s", self.last_report)
            self.run = None
            if unet is not None:
                from sd_accel.runtime.weights import release

                release(unet)  # what the LoRA patching, a refit or a PyTorch call paged in

    def _park(self, run: Run) -> torch.nn.Module | None:
        """ComfyUI's torch UNet with its weights parked (:func:`sd_accel.runtime.weights.park`:
        written once to a memory-mapped file, resident only while used) for a run the engines
        serve. ComfyUI keeps the whole fp32 UNet in RAM whatever serves the calls: beside the
        engine (and the refit's copy) it put a real ComfyUI's engine runs above its own PyTorch
        runs (issue 46). ComfyUI still patches and restores LoRA weights in it as usual (those
        become private copies), a PyTorch call or a refit pages in what it reads, and the run's
        end hands those pages back. None (nothing parked) for a run in PyTorch."""
        if run.reason is not None or (run.engines is None and not run.refit):
            return None
        unet = getattr(getattr(run.patcher, "model", None), "diffusion_model", None)
        if not isinstance(unet, torch.nn.Module):
            return None
        from sd_accel.runtime.weights import park

        try:
            park(unet, self.state.engine_dir(), "ComfyUI UNet")
        except Exception as exc:  # noqa: BLE001  (never stop the image: the weights stay in RAM)
            self.state.say_once(f"the UNet's torch weights stay in RAM beside the engines: {type(exc).__name__}: {exc}")
            return None
        return unet

    def _refit(self, run: Run, unet: torch.nn.Module) -> None:
        """The checkpoint's engine refitted to the patched weights now in ``unet`` (once per set)."""
        run.refit = False
        patcher = run.patcher
        model = getattr(patcher, "model", None)
        if getattr(model, "model_lowvram", False):
            run.reason = ("ComfyUI loaded the UNet partially (low VRAM): its LoRA patches are computed on the fly, "
                          "not in the weights")
            return
        if getattr(model, "current_weight_patches_uuid", None) != getattr(patcher, "patches_uuid", None):
            run.reason = "the UNet's weights do not carry this MODEL's patches now"
            return
        from sd_accel.webui.lora import lora_text, refit_for

        st = self.state
        base = run.counter
        where = (self.ckpt_id, st.backend_name(), str(st.cache().root), st.generation)
        refit = st.refits.get(where, run.loras)
        made_now = refit is None
        if refit is None:
            failed = st.refits.failed(where, run.loras)
            if failed:
                run.reason = failed
                return
            log.warning("sd-accel: refitting the engine of %s for %s at its first call (patches on the engine "
                        "without a rebuild)", self.ckpt_id, describe(run.loras))
            st.refits.make_room(where, KEPT_REFITS)  # the set that gives way leaves memory first
            try:
                refit = refit_for(base, run.loras, self.ckpt_id.removeprefix("ckpt-"), unet, context=_trace(unet))
            except Exception as exc:  # noqa: BLE001  (never stop the image: PyTorch, said once)
                why = f"the refit for {lora_text(run.loras)} failed: {type(exc).__name__}: {exc}"
                st.refits.fail(where, run.loras, why)
                log.warning("sd-accel: %s", why)
                run.reason = why
                return
            st.refits.add(where, refit, KEPT_REFITS)
        else:
            refit.bind(unet, context=_trace(unet))  # a profile first called in this run refits from this UNet
        run.line = lambda: refit.line(made_now)
        run.engines = run.counter = refit.engines
        run.counter.reset_stats()
        if run.controlnets and run.control is None and run.control_base is not None:
            self._refit_control(run, unet, (*where, CONTROL))

    def _refit_control(self, run: Run, unet: torch.nn.Module, where: tuple) -> None:
        """The checkpoint's residual-taking engine refitted to the same patched weights."""
        from sd_accel.components.ldm_control_unet import LdmControlUNetSpec
        from sd_accel.webui.lora import lora_text, refit_for

        st = self.state
        refit = st.refits.get(where, run.loras)
        if refit is None:
            failed = st.refits.failed(where, run.loras)
            if failed:
                run.control_why = failed
                return
            st.refits.make_room(where, KEPT_REFITS)
            try:
                refit = refit_for(run.control_base, run.loras, self.ckpt_id.removeprefix("ckpt-"), unet,
                                  LdmControlUNetSpec(unet), context=_trace(unet))
            except Exception as exc:  # noqa: BLE001  (never stop the image: PyTorch, said once)
                why = f"the residual-taking engine's refit for {lora_text(run.loras)} failed: {type(exc).__name__}: {exc}"
                st.refits.fail(where, run.loras, why)
                log.warning("sd-accel: %s", why)
                run.control_why = why
                return
            st.refits.add(where, refit, KEPT_REFITS)
        else:
            refit.bind(unet, LdmControlUNetSpec(unet), context=_trace(unet))
        run.control = refit.engines
        run.control.reset_stats()

    def diffusion_model(self, executor, x, timesteps=None, context=None, y=None, control=None,
                        transformer_options=None, **kwargs):
        """``diffusion_model`` wrapper: one UNet call, on engines where they cover it."""
        options = transformer_options if transformer_options is not None else {}
        run = self.run
        if run is None:  # a call outside a sampling run (another pack calling the UNet directly)
            run = Run(None, reason="a UNet call outside a sampling run: the patches on the weights are not known")

        def torch_part(part: slice | None = None) -> torch.Tensor:
            if part is None:
                return executor(x, timesteps, context, y, control, transformer_options, **kwargs)
            return executor(x[part], timesteps[part], context[part], None if y is None else y[part],
                            sliced_control(control, part), transformer_options, **kwargs)

        reason = call_reason(options, kwargs)
        if reason is None and run.reason is None and run.refit:
            self._refit(run, getattr(executor, "class_obj", None))
        reason = reason or run.reason
        if reason is None and run.engines is None:
            reason = f"no engine for {self.ckpt_id}"
        if reason is not None:
            self._count_torch(run, reason)
            return torch_part()
        if control is None:
            return run.engines(x, timesteps, context, y, torch_part)
        if run.control is None:
            names = ", ".join(run.controlnets) or "a ControlNet"
            self._count_torch(run, f"ControlNet residuals ({names}): {run.control_why or 'no residual-taking engine'}")
            return torch_part()
        unet = getattr(executor, "class_obj", None)
        feed, why = control_feed(control, self._control_names(unet))
        if feed is None:
            self._count_torch(run, why)
            return torch_part()
        return run.control(x, timesteps, context, y, torch_part, extra=feed)

    def _control_names(self, unet) -> list[str]:
        if self._names is None:
            self._names = control_names(ldm_layout(unet))
        return self._names

    def _count_torch(self, run: Run, reason: str) -> None:
        if run.counter is not None:
            run.counter.torch_call(reason)  # counted, and said once per reason
            return
        if reason not in run.torch_calls:
            self.state.say_once(f"the UNet runs in PyTorch: {reason}")
        run.torch_calls[reason] = run.torch_calls.get(reason, 0) + 1

    def report(self, run: Run) -> str:
        """``sd-accel: UNet calls this run: N on engines, M in PyTorch (k x why; ...)``."""
        on = off = 0
        reasons: dict[str, int] = {}
        counted = {id(e): e for e in (run.counter, run.control) if e is not None}
        for engines in counted.values():
            stats = engines.stats
            on += stats.engine_calls
            off += stats.torch_calls
            for why, n in stats.fallbacks.items():
                reasons[why] = reasons.get(why, 0) + n
        for why, n in run.torch_calls.items():
            reasons[why] = reasons.get(why, 0) + n
        off += sum(run.torch_calls.values())
        line = f"sd-accel: UNet calls this run: {on} on engines, {off} in PyTorch"
        if run.control is not None and run.control.stats.engine_calls:
            line += f" ({run.control.stats.engine_calls} with ControlNet residuals)"
        if reasons:
            line += " (" + "; ".join(f"{n}x {why}" for why, n in reasons.items()) + ")"
        if run.line:
            line += f"\nsd-accel: {run.line() if callable(run.line) else run.line}"
        return line


def _trace(unet: torch.nn.Module):
    """What a refit of ``unet``'s engine needs around it inside a sampling run: autograd mode
    back (ComfyUI samples in inference mode) and ComfyUI's run-time choices undone."""

    @contextlib.contextmanager
    def context():
        from sd_accel.comfyui.tracing import comfy_export_context

        with torch.inference_mode(False), comfy_export_context(unet):
            yield

    return context


def apply_engines(patcher, st: State | None = None, cache_dir=None):
    """A clone of ``patcher`` (a MODEL) whose UNet calls go to engines where they cover them."""
    from sd_accel.comfyui import transformer
    from sd_accel.comfyui.identity import checkpoint_id

    if transformer.is_transformer(patcher):  # FLUX.1, SD3 / SD3.5: their own wrappers
        return transformer.apply_engines(patcher, st, cache_dir)
    st = st or state()
    model = patcher.model
    unet = model.diffusion_model
    if host.source_of(model) is None and getattr(patcher, "backup", None):
        from sd_accel.core import InvalidValue

        raise InvalidValue("this MODEL was not loaded from a checkpoint file and its weights carry patches right "
                           "now, so its base weights cannot be identified: apply sd-accel engines before the LoRA "
                           "loaders, or load the model with a checkpoint loader")
    ckpt = checkpoint_id(model, cache_dir or st.engine_dir(), fingerprint_of=unet)
    clone = patcher.clone()
    wrappers = host.wrappers()
    for kind in (wrappers.OUTER_SAMPLE, wrappers.DIFFUSION_MODEL):
        clone.remove_wrappers_with_key(kind, KEY)
    binding = EngineUNet(ckpt, st)
    clone.add_wrapper_with_key(wrappers.OUTER_SAMPLE, KEY, binding.outer_sample)
    clone.add_wrapper_with_key(wrappers.DIFFUSION_MODEL, KEY, binding.diffusion_model)
    engines, why = st.engines_or_reason(unet_weights_id(ckpt), COMPONENT)
    if engines is None:
        st.say_once(f"no UNet engine for {ckpt} yet ({why or 'none built'}): its calls run in PyTorch until one is "
                    "built with the sd-accel Build Engines node")
    return clone, binding
