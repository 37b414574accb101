"""ComfyUI's FLUX.1 and SD3 / SD3.5 transformers on engines: one wrapper per sampling run, one per call.

The engine is diffusers' transformer (:mod:`sd_accel.components.flux`, :mod:`sd_accel.components.sd3`:
component ``transformer``) built from ComfyUI's weights (:mod:`.flux`, :mod:`.mmdit` convert them),
keyed by the checkpoint file as the UNet's are (``ckpt-<10 hex>``).

The call is caught at ``apply_model`` (an APPLY_MODEL wrapper), not at the diffusion model:
ComfyUI 0.8's MMDiT (``OpenAISignatureMMDITWrapper.forward``) runs no DIFFUSION_MODEL wrappers,
and one hook for both families keeps one path. The wrapper does what ``BaseModel._apply_model``
does around the diffusion model, with the model's own functions (``model_sampling.calculate_input``,
``timestep``, ``process_timestep``, ``calculate_denoised``), and feeds the engine in between;
anything it does not cover goes to ``executor(...)``, ComfyUI's own path, counted with the reason:
ControlNet residuals without a residual-taking engine (FLUX.1's and SD3's go to
``transformer_control``: :func:`.flux.control_feed`, :func:`.mmdit.control_feed`; with a LoRA,
refitted as the transformer's is), transformer patches and block replacements, other packs' DIFFUSION_MODEL /
APPLY_MODEL wrappers, arguments the engine lacks (Kontext's reference latents, attention masks),
a shape no profile covers, LoRA patches that cannot be put on the engine.

LoRA (a LoraLoader / LoraLoaderModelOnly after the apply node, any strengths, several at once):
as for the UNet (:mod:`.unet`), ComfyUI writes its patches into the weights when it loads the
model for sampling and records ``current_weight_patches_uuid``; at the run's first call the
checkpoint's transformer engine is refitted to those weights (each profile at its own first
call: :class:`~sd_accel.refit.PendingRefit`). The weights are ComfyUI's own patched ones, put in
the engine's names by the same conversion the engine was built from (:func:`.flux.to_diffusers`:
BFL names -> diffusers', fused q/k/v and single-block ``linear1`` rows split; :func:`.mmdit.to_diffusers`:
diffusers' SD3 single-file converter), validated against diffusers' transformer holding them.
A strength change or another LoRA is another patch set (:func:`.identity.patch_set`): another
refit, the previous one released first (:data:`KEPT_REFITS`); a MODEL without LoRA uses the base
engine. ``transformer_control`` is refitted the same way, separately, at the first
ControlNet call of a run with LoRA patches (a run without ControlNet never refits it; the plain
engine only at a call without residuals, so a run whose calls all carry them refits one engine); the engine never serves weights other than the ones the run's MODEL computes with (the
patch set's uuid must be the one in the weights). Patches of weights the conversion does not
carry, a partially loaded model (low VRAM: patches computed on the fly), hook LoRAs, INT8
engines, and a refit that fails or would not fit in memory: the run in PyTorch, with the reason.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from sd_accel.comfyui import host
from sd_accel.comfyui.identity import describe, patch_set
from sd_accel.comfyui.patches import callable_name, patch_names
from sd_accel.comfyui.state import State, state
from sd_accel.webui.lora import Refit

log = logging.getLogger("sd_accel")

KEY = "sd_accel"
COMPONENT = "transformer"
CONTROL = "transformer_control"  # FLUX.1's transformer taking ControlNet residuals (ComfyUI's ControlNet nodes)
KEPT_REFITS = 1  # patch sets kept refitted per checkpoint (each a patched copy of the engines in memory)
# the extra conds each family's engine takes (any other, not None, sends the call to PyTorch)
_TAKEN = {"flux": ("y", "guidance"), "sd3": ("y",)}


def family_module(diffusion_model: Any):
    """:mod:`.flux` or :mod:`.mmdit` for ComfyUI's transformer, None for any other model."""
    from sd_accel.comfyui import flux, mmdit

    if flux.is_flux(diffusion_model):
        return flux
    if mmdit.is_mmdit(diffusion_model):
        return mmdit
    return None


def is_transformer(model: Any) -> bool:
    """A ComfyUI BaseModel (or its ModelPatcher) whose diffusion model is a FLUX.1 or MMDiT."""
    base = getattr(model, "model", model)
    return family_module(getattr(base, "diffusion_model", None)) is not None


@dataclass
class Run:
    patcher: Any
    engines: Any = None
    reason: str | None = None  # the whole run in PyTorch, and why
    torch_calls: dict[str, int] = field(default_factory=dict)
    loras: tuple = ()  # the MODEL's patch set (:func:`.identity.patch_set`)
    base: Any = None  # the checkpoint's engines (what a refit starts from)
    control: Any = None  # the residual-taking engines (FLUX.1 ControlNet calls), or None
    control_why: str | None = None  # why there are none
    control_base: Any = None  # the checkpoint's residual-taking engines, to refit with a LoRA
    refit: bool = False  # the engines come from a refit at the first call
    control_refit: bool = False  # the residual-taking engines too, at the first ControlNet call
    lines: list = field(default_factory=list)  # () -> what a refit did, for the report


class EngineTransformer:
    """Engines for one checkpoint's transformer, reached through the two wrappers."""

    def __init__(self, ckpt_id: str, family: str, st: State | None = None) -> None:
        self.ckpt_id = ckpt_id
        self.family = family
        self._state = st
        self.run: Run | None = None
        self.last_report: str | None = None

    @property
    def state(self) -> State:
        return self._state or state()

    def prepare(self, patcher) -> Run:
        run = Run(patcher)
        if patcher is None:
            run.reason = "the sampler gave no ModelPatcher: its patches are not known"
            return run
        if getattr(patcher, "hook_patches", None) or getattr(patcher, "current_hooks", None):
            run.reason = "hook LoRAs / weight hooks are not in the engine"
            return run
        objects = sorted(k for k in getattr(patcher, "object_patches", {}) if str(k).startswith("diffusion_model"))
        if objects:
            run.reason = f"object patches of the diffusion model ({', '.join(objects)}) are not in the engine"
            return run
        dm = getattr(getattr(patcher, "model", None), "diffusion_model", None)
        fam = family_module(dm)
        odd = fam.unsupported(dm) if fam is not None else "the MODEL's diffusion model is no longer a FLUX.1 / MMDiT"
        if odd is not None:
            run.reason = odd
            return run
        engines, why = self.state.engines_or_reason(self.ckpt_id, COMPONENT)
        if engines is None:
            run.reason = why or f"no transformer engine for {self.ckpt_id} here (build one with the sd-accel Build Engines node)"
            return run
        engines.reset_stats()
        run.engines = run.base = engines
        run.control, run.control_why = self.state.engines_or_reason(self.ckpt_id, CONTROL)
        if run.control is not None:
            run.control.reset_stats()
        patches = getattr(patcher, "patches", {}) or {}
        run.loras = patch_set(patches)
        if not run.loras:
            return run
        run.engines = None  # never the base weights: the refit's engines, or PyTorch
        if run.control is not None:  # (refitted at the run's first ControlNet call, if it makes one)
            run.control_base, run.control, run.control_refit = run.control, None, True
            run.control_why = f"no residual-taking transformer engine for {self.ckpt_id} with {describe(run.loras)}"
        bad = fam.unmapped(dm, [_key(k) for k in patches if _key(k).startswith("diffusion_model.")])
        if bad:
            run.reason = (f"LoRA patches of weights the {self.family} engine does not take ({', '.join(bad[:3])}"
                          f"{', ...' if len(bad) > 3 else ''})")
            return run
        from sd_accel.refit import needs_rebuild

        usable = [h for h in engines.handles if h.broken is None]
        refused = [w for w in map(needs_rebuild, usable) if w]
        if len(refused) == len(usable):
            run.reason = "; ".join(refused) or "the checkpoint's engines are set aside"
            return run
        run.refit = True
        return run

    def _refit(self, run: Run, dm: torch.nn.Module) -> None:
        """The checkpoint's engines refitted to the patched weights now in ``dm`` (once per set)."""
        run.refit = False
        run.engines, why = self._refitted(run, dm, COMPONENT, run.base)
        if why:
            run.reason = why

    def _refitted(self, run: Run, dm: torch.nn.Module, component: str, base) -> tuple[Any, str | None]:
        """``base`` (the checkpoint's ``component`` engines) refitted to the patched weights now
        in ``dm`` (once per patch set and component, then reused): (engines, None) or (None, why)."""
        patcher = run.patcher
        model = getattr(patcher, "model", None)
        if getattr(model, "model_lowvram", False):
            return None, ("ComfyUI loaded the transformer partially (low VRAM): its LoRA patches are computed on "
                          "the fly, not in the weights")
        if not _carries(patcher):
            return None, "the transformer's weights do not carry this MODEL's patches now"
        from sd_accel.webui.lora import lora_text

        st = self.state
        where = (self.ckpt_id, st.backend_name(), str(st.cache().root), st.generation, component)
        refit = st.refits.get(where, run.loras)
        made_now = refit is None
        if refit is None:
            failed = st.refits.failed(where, run.loras)
            if failed:
                return None, failed
            log.warning("sd-accel: refitting the %s %s engine of %s for %s at its first call (ComfyUI's patched "
                        "weights on the engine without a rebuild)", self.family, component, self.ckpt_id,
                        describe(run.loras))
            st.refits.make_room(where, KEPT_REFITS)  # the set that gives way leaves memory first
            try:
                refit = refit_for(base, run.loras, dm, patcher)
            except Exception as exc:  # noqa: BLE001  (never stop the image: PyTorch, said once)
                why = f"the {component} refit for {lora_text(run.loras)} failed: {type(exc).__name__}: {exc}"
                st.refits.fail(where, run.loras, why)
                log.warning("sd-accel: %s", why)
                return None, why
            st.refits.add(where, refit, KEPT_REFITS)
        else:
            refit.bind(dm, None, _check(patcher), _context)  # a profile first called now refits from this run's weights
        what = f"{self.family} transformer" + (" (ControlNet residuals)" if component == CONTROL else "")
        run.lines.append(lambda: refit.line(made_now).replace("UNet ", f"{what} ", 1))
        refit.engines.reset_stats()
        return refit.engines, None

    def outer_sample(self, executor, *args, **kwargs):
        """``outer_sample`` wrapper: the run's engines (or why none), sample, report."""
        guider = getattr(executor, "class_obj", None)
        run = self.prepare(getattr(guider, "model_patcher", None))
        self.run = run
        try:
            return executor(*args, **kwargs)
        finally:
            self.last_report = self.report(run)
            log.info("%s", self.last_report)
            self.run = None

    def _control_reason(self, run: Run, dm: torch.nn.Module) -> str | None:
        """Why a ControlNet call cannot run on the residual-taking engine, or None (with a LoRA:
        that engine refitted to ``dm``'s patched weights first, once per run)."""
        if run.control_refit:
            run.control_refit = False
            run.control, why = self._refitted(run, dm, CONTROL, run.control_base)
            run.control_why = why or run.control_why
        if run.control is None:
            return run.control_why or (f"no residual-taking transformer engine for {self.ckpt_id}: build one with the "
                                       "sd-accel Build Engines node (components with unet_control)")
        return None

    def _reason(self, base, c_concat, control, options: dict, kwargs: dict) -> str | None:
        patches = patch_names(options, "patches") + patch_names(options, "patches_replace")
        if patches:
            return f"transformer patches ({'; '.join(patches)}) are not in the engine"
        wrappers = options.get("wrappers") or {}
        kinds = host.wrappers()
        others = sorted({callable_name(f) for kind in (kinds.DIFFUSION_MODEL, kinds.APPLY_MODEL)
                         for k, fns in (wrappers.get(kind) or {}).items() if k != KEY for f in fns or []})
        if others:
            return f"other model wrappers ({', '.join(others)}) are not in the engine"
        extra = sorted(k for k, v in kwargs.items() if v is not None and k not in _TAKEN[self.family])
        if extra:
            return f"arguments the engine was not built for: {', '.join(extra)}"
        fam = family_module(base.diffusion_model)
        if self.family == "flux":
            return fam.call_reason(base.diffusion_model, kwargs.get("guidance"), kwargs, options)
        return fam.call_reason(base.diffusion_model, kwargs.get("y"), kwargs, options)

    def apply_model(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None,
                    **kwargs):
        """APPLY_MODEL wrapper: ``BaseModel._apply_model`` with the diffusion model on the engine."""
        options = transformer_options if transformer_options is not None else {}
        base = executor.class_obj
        run = self.run or Run(None, reason="a model call outside a sampling run: the patches on the weights are not known")

        def in_torch() -> torch.Tensor:
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)

        reason = run.reason or self._reason(base, c_concat, control, options, kwargs)
        if reason is None and control is not None:
            reason = self._control_reason(run, base.diffusion_model)
        if reason is None and run.refit and control is None:  # (a ControlNet call never needs the plain engine)
            self._refit(run, base.diffusion_model)
            reason = run.reason
        if reason is None and control is None and run.engines is None:
            reason = f"no transformer engine for {self.ckpt_id} with {describe(run.loras)}"
        if reason is not None:
            self._count_torch(run, reason)
            return in_torch()
        sampling = base.model_sampling
        sigma = t
        xc = sampling.calculate_input(sigma, x)
        if c_concat is not None:  # (Flux Fill / depth / canny: extra latent channels, as ComfyUI adds them)
            xc = torch.cat([xc, c_concat.to(xc)], dim=1)
        timestep = base.process_timestep(sampling.timestep(t).float(), x=x, **kwargs)
        dm = base.diffusion_model
        fam = family_module(dm)
        if self.family == "flux":
            feed, shape = fam.feed(dm, xc, timestep, c_crossattn, kwargs.get("y"), kwargs.get("guidance"))
        else:
            feed, shape = fam.feed(dm, xc, timestep, c_crossattn, kwargs.get("y"))
        engines = run.engines
        if control is not None:  # FLUX.1 with ComfyUI's ControlNet residuals: the residual-taking engine
            try:
                if self.family == "flux":
                    feed.update(fam.control_feed(dm, control, feed["hidden_states"].shape[1], x.shape[0]))
                else:
                    takes = {n for h in run.control.handles for n in getattr(h, "shapes", {})} or None
                    feed.update(fam.control_feed(dm, control, feed["hidden_states"], x.shape[0], takes))
            except ValueError as exc:
                self._count_torch(run, str(exc))
                return in_torch()
            engines = run.control
        out = engines.run(feed, need=("latent",))
        if out is None:  # counted, with the reason, by the engines
            return in_torch()
        # copy: the engine reuses its output buffer on the next call
        model_output = fam.output(out["latent"], shape).to(device=x.device, dtype=torch.float32, copy=True)
        return sampling.calculate_denoised(sigma, model_output, x)

    def _count_torch(self, run: Run, reason: str) -> None:
        counter = run.engines if run.engines is not None else run.base
        if counter is not None:
            counter.torch_call(reason)
            return
        if reason not in run.torch_calls:
            self.state.say_once(f"the {self.family} transformer runs in PyTorch: {reason}")
        run.torch_calls[reason] = run.torch_calls.get(reason, 0) + 1

    def report(self, run: Run) -> str:
        """``sd-accel: transformer calls this run: N on engines, M in PyTorch (k x why; ...)``."""
        on = off = 0
        reasons: dict[str, int] = {}
        for engines in {id(e): e for e in (run.base, run.engines, run.control, run.control_base)
                        if e is not None}.values():
            stats = engines.stats
            on, off = on + stats.engine_calls, off + stats.torch_calls
            for why, n in stats.fallbacks.items():
                reasons[why] = reasons.get(why, 0) + n
        for why, n in run.torch_calls.items():
            reasons[why] = reasons.get(why, 0) + n
            off += n
        line = f"sd-accel: {self.family} transformer calls this run: {on} on engines, {off} in PyTorch"
        if reasons:
            line += " (" + "; ".join(f"{n}x {why}" for why, n in reasons.items()) + ")"
        for made in run.lines:
            line += f"\nsd-accel: {made()}"
        return line


def _key(k) -> str:
    return str(k if isinstance(k, str) else k[0])


def _carries(patcher) -> bool:
    model = getattr(patcher, "model", None)
    return getattr(model, "current_weight_patches_uuid", None) == getattr(patcher, "patches_uuid", None)


def _check(patcher):
    """A refit's ``merge``: ComfyUI wrote this MODEL's patches into the weights (None), or why not."""
    return lambda: None if _carries(patcher) else "the transformer's weights do not carry this MODEL's patches now"


@contextlib.contextmanager
def _context():
    """A refit inside a sampling run: autograd mode back (ComfyUI samples in inference mode)."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def spec_for(transformer: torch.nn.Module, control: bool = False):
    """The engine spec of diffusers' transformer made from ComfyUI's (:func:`.flux.to_diffusers`,
    :func:`.mmdit.to_diffusers`); ``control``: the one taking ControlNet residuals."""
    if type(transformer).__name__.startswith("Flux"):
        from sd_accel.components.flux import FluxTransformerSpec
        from sd_accel.components.flux.controlnet import FluxControlTransformerSpec

        return (FluxControlTransformerSpec if control else FluxTransformerSpec)(FluxFromComfy(transformer))
    from sd_accel.components.sd3 import SD3TransformerSpec
    from sd_accel.components.sd3.controlnet import SD3ControlTransformerSpec

    return (SD3ControlTransformerSpec if control else SD3TransformerSpec)(StableDiffusion3FromComfy(transformer))


class TransformerRefit(Refit):
    """One patch set's refitted transformer engines; each refitted at its first call from the
    ComfyUI transformer bound last (its patched weights, converted as the engine was built)."""

    def make(self, handle):
        from sd_accel.core import EngineError
        from sd_accel.onnx.weights import effective_weights
        from sd_accel.refit import conversion_preflight, refit_engine
        from sd_accel.webui.lora import lora_text

        dm, _, check, context = self.source
        with context():
            why = check() if check is not None else None
            if why:
                raise EngineError(why)
            conversion_preflight(handle, dm.state_dict().values(), "patched transformer")  # (all copied)
            transformer = family_module(dm).to_diffusers(dm)
            log.info("sd-accel: refitting %s for %s", handle.name, lora_text(self.loras))
            spec = spec_for(transformer, control=handle.record.key.component == CONTROL)
            return refit_engine(handle, effective_weights(transformer), spec, lambda f, m: None)


def refit_for(base, loras, dm: torch.nn.Module, patcher) -> TransformerRefit:
    """The engines ``base`` (the checkpoint's transformer engines; INT8 ones left out) to be
    refitted to ``dm``'s weights (ComfyUI's, carrying ``loras``), each at its first call."""
    return TransformerRefit.pending_for(base, loras, dm, None, _check(patcher), _context)


def lora_patched(patcher) -> bool:
    """The MODEL carries patches of the diffusion model's weights (a LoRA loader's)."""
    return any(str(k if isinstance(k, str) else k[0]).startswith("diffusion_model.")
               for k in (getattr(patcher, "patches", {}) or {}))


def apply_engines(patcher, st: State | None = None, cache_dir=None):
    """A clone of ``patcher`` (a FLUX.1 or SD3 MODEL) whose transformer calls go to engines where
    they cover them; returns (clone, binding)."""
    from sd_accel.comfyui.identity import checkpoint_id

    st = st or state()
    model = patcher.model
    dm = model.diffusion_model
    fam = family_module(dm)
    if host.source_of(model) is None and getattr(patcher, "backup", None):
        from sd_accel.core import InvalidValue

        raise InvalidValue("this MODEL was not loaded from a model file and its weights carry patches right now, so "
                           "its base weights cannot be identified: apply sd-accel engines before the LoRA loaders")
    ckpt = checkpoint_id(model, cache_dir or st.engine_dir(), fingerprint_of=dm)
    clone = patcher.clone()
    kinds = host.wrappers()
    for kind in (kinds.OUTER_SAMPLE, kinds.DIFFUSION_MODEL, kinds.APPLY_MODEL):
        clone.remove_wrappers_with_key(kind, KEY)
    binding = EngineTransformer(ckpt, fam.FAMILY, st)
    clone.add_wrapper_with_key(kinds.OUTER_SAMPLE, KEY, binding.outer_sample)
    clone.add_wrapper_with_key(kinds.APPLY_MODEL, KEY, binding.apply_model)
    why = fam.unsupported(dm)
    if why is not None:
        st.say_once(f"{ckpt}: {why}: its calls run in PyTorch")
        return clone, binding
    engines, why = st.engines_or_reason(ckpt, COMPONENT)
    if engines is None:
        st.say_once(f"no transformer engine for {ckpt} yet ({why or 'none built'}): its calls run in PyTorch until "
                    "one is built with the sd-accel Build Engines node")
    return clone, binding


class _Pipe:
    """What the library's transformer specs read of a pipeline: the module, the VAE's scale."""

    vae = None
    vae_scale_factor = 8

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer


class FluxFromComfy(_Pipe):
    """(named for the specs' family lookups: ``Flux…``)"""


class StableDiffusion3FromComfy(_Pipe):
    """(named for the specs' family lookups: ``StableDiffusion3…``)"""


# ComfyUI's T5 lengths when the profile does not say: Flux pads T5 to 256 tokens (longer prompts
# grow), SD3 to 77, after CLIP's 77 columns.
DEFAULT_TEXT = {"flux": 256, "sd3": 77}


def profile_for(profile, part) -> Any:
    """A transformer part's profile: ComfyUI's T5 length for its family where ``profile`` names
    none; any other part's: ``profile``."""
    from dataclasses import replace

    if part.component not in (COMPONENT, CONTROL) or profile.text is not None:
        return profile
    n = DEFAULT_TEXT["flux" if str(part.facts.get("family", "")).startswith("flux") else "sd3"]
    return replace(profile, text=(n, n, n))
