"""Swap engine-backed modules into a pipeline (and back), and read their stats."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from sd_accel.core import PIPELINE_ATTRIBUTES
from sd_accel.runtime.loader import engines_for
from sd_accel.runtime.modules import EngineModule, EngineTextEncoder, EngineUNet, EngineVAE
from sd_accel.runtime.selection import ComponentEngines
from sd_accel.runtime.transformer import EngineT5, EngineTransformer
from sd_accel.runtime.weights import park, parked, release

log = logging.getLogger("sd_accel")

# pipeline attribute -> the components it may serve: text_encoder, text_encoder_2 (CLIP-G or T5),
# text_encoder_3 (T5), unet, transformer, vae (both halves)
SLOTS: dict[str, tuple[str, ...]] = {
    attr: tuple(c for c, attrs in PIPELINE_ATTRIBUTES.items() if attr in attrs)
    for attr in dict.fromkeys(a for attrs in PIPELINE_ATTRIBUTES.values() for a in attrs)
}


def _set(pipe, name: str, module) -> None:
    # object.__setattr__: diffusers' __setattr__ would record the wrapper class in the pipeline
    # config, and a later save_pretrained would write that class into model_index.json.
    object.__setattr__(pipe, name, module)


def unswap(pipe) -> None:
    """Put the torch modules back (and the ControlNets' own forward)."""
    for slot in SLOTS:
        module = getattr(pipe, slot, None)
        if isinstance(module, EngineModule):
            _set(pipe, slot, module.torch_module)
    for wrapper in pipe.__dict__.pop("_sd_accel_controlnets", []):
        wrapper.uninstall()


@contextmanager
def torch_modules(pipe):
    """Within the block, the pipeline holds its torch modules (for export, fingerprints, saving)."""
    saved = {slot: getattr(pipe, slot) for slot in SLOTS if isinstance(getattr(pipe, slot, None), EngineModule)}
    nets = list(pipe.__dict__.get("_sd_accel_controlnets", []))
    unswap(pipe)
    try:
        yield pipe
    finally:
        for slot, module in saved.items():
            _set(pipe, slot, module)
        _install_controlnets(pipe, nets)


def swap_engines(pipe, cache, backend, fallback: bool = True, prefer_precision: str | None = None, *,
                 builder: Callable[[ComponentEngines, dict], Any] | None = None,
                 park_weights: bool = True, shared: dict[str, dict[str, str]] | None = None) -> dict[str, int]:
    """Replace each module that has engines in ``cache`` with its engine-backed stand-in.
    ``prefer_precision``: engines of that precision are tried first (``AccelConfig.engine_precision``).

    ``builder`` (``engines="auto"``: an :class:`sd_accel.autobuild.AutoBuilder`): every module
    engines can serve is swapped, with or without engines, and a call no engine covers asks the
    builder for an engine of its shape first. ``park_weights``: the torch weights of a module served by engines cost
    no resident memory until a fallback uses them (memory-mapped from their files or a spill
    file: :mod:`sd_accel.runtime.weights`), and hashing the modules leaves none resident.

    ``shared``: component (``unet``, ``vae_decoder``, ``clip`` ...) -> {the WebUI's or ComfyUI's
    component: its weights id} for modules that hold a checkpoint file's weights
    (:func:`sd_accel.models.source.shared_ids`): those engines serve the calls the pipeline's own
    engines do not cover, counted as that component's calls.

    Returns how many usable engines each component got. Components without engines stay torch
    (unless ``builder``); engines of another arch or backend version are never loaded, and the
    log says why.
    """
    from sd_accel.components import specs_for
    from sd_accel.components.adapter import ADAPTER_UNET
    from sd_accel.components.controlnet import CONTROL_UNET, control_specs
    from sd_accel.components.flux.controlnet import CONTROL_TRANSFORMER
    from sd_accel.onnx.fingerprint import fingerprint

    unswap(pipe)
    specs = specs_for(pipe)
    # a ControlNet pipeline's: its ControlNets and the residual-taking UNet; a T2I-Adapter pipeline's UNet
    control = control_specs(pipe)
    for unet_kind in (CONTROL_UNET, ADAPTER_UNET, CONTROL_TRANSFORMER):
        if unet_kind in control:
            specs[unet_kind] = control[unet_kind]
    if builder is not None:
        builder.on_built = lambda component: _after_build(pipe, component, cache, park_weights)
    found: dict[str, int] = {}
    # A backend whose runners read the live torch weights (torch.compile): nothing to fingerprint,
    # and the weights stay in place (parked weights would be paged in on every call).
    live = bool(getattr(backend, "reads_live_weights", False))
    park_weights = park_weights and not live
    for slot, components in SLOTS.items():
        module = getattr(pipe, slot, None)
        if module is None:
            continue
        engines: dict[str, ComponentEngines] = {}
        for component in _with_residual_kinds(slot, components):
            if component not in specs or (component in PIPELINE_ATTRIBUTES and specs[component].attribute != slot):
                continue  # (SD3's t5 is text_encoder_3, not text_encoder_2)
            torch_module = specs[component].torch_module()
            if live:  # (the compiled backend) keyed by architecture; its runners get the live module
                model = backend.model_id(torch_module)
                backend.attach(model, specs[component])
            else:  # Hashing reads every weight: hand back the pages of memory-mapped ones as it goes.
                model = fingerprint(torch_module, hand_back=park_weights)
            engines[component] = engines_for(cache, backend, model, component, fallback=fallback,
                                             prefer_precision=prefer_precision)
            engines[component].builder = builder
            found[component] = len(engines[component].handles)
        others = _shared_engines(cache, backend, engines, shared or {}, fallback, prefer_precision)
        for name, e in others.items():  # (comfy_clip serves clip and clip2: counted together)
            found[name] = found.get(name, 0) + len(e.handles)
        served = any(e.handles for e in engines.values()) or bool(others)
        if not engines or not (served or builder is not None):
            continue
        wrapper = _wrap(slot, module, engines)
        wrapper.set_shared(others)
        _set(pipe, slot, wrapper)
        if served and park_weights:
            park(module, cache.root, slot)
            wrapper.remember_weights()  # parking moves data, never values: not a change
    found.update(_swap_controlnets(pipe, control, cache, backend, fallback, prefer_precision, builder, park_weights))
    _guard_save(pipe)
    log.info("engines swapped in: %s%s", found, " (more are built on first use)" if builder is not None else "")
    return found


def _with_residual_kinds(slot: str, components: tuple[str, ...]) -> tuple[str, ...]:
    """A slot's components and the kinds of its module that take a ControlNet's or an adapter's
    residuals (their engines sit beside the plain ones in the same stand-in)."""
    if slot == "unet":
        return (*components, "unet_control", "unet_adapter")
    if slot == "transformer":
        return (*components, "transformer_control")
    return components


def _shared_engines(cache, backend, engines: dict[str, ComponentEngines], shared: dict[str, dict[str, str]],
                    fallback: bool, prefer_precision: str | None) -> dict[str, ComponentEngines]:
    """The WebUI's and ComfyUI's engines (``ldm_unet``, ``ldm_vae_*``, ``ldm_clip``, ``comfy_clip``)
    of the weights ids in ``shared`` (:func:`sd_accel.models.source.shared_ids`), for the
    components in ``engines``; each counts its calls in that component's stats."""
    out: dict[str, ComponentEngines] = {}
    for component, others in shared.items():
        if component not in engines:
            continue
        for other, model in others.items():
            found = engines_for(cache, backend, model, other, fallback=fallback, prefer_precision=prefer_precision)
            if found.handles:
                found.count_in(engines[component])
                out[other] = found
                log.info("%s: the %d %s engine(s) of %s, built by the WebUI or ComfyUI, serve it too",
                         component, len(found.handles), other, model)
    return out


def _swap_controlnets(pipe, control: dict, cache, backend, fallback: bool, prefer_precision: str | None,
                      builder, park_weights: bool) -> dict[str, int]:
    """Install an :class:`~sd_accel.runtime.control.EngineControlNet` on each ControlNet of
    ``control`` (:func:`sd_accel.components.controlnet.control_specs`) that has engines (or all,
    with ``builder``); the counts by :func:`~sd_accel.components.controlnet.control_key`."""
    from sd_accel.components.controlnet import CONTROLNET
    from sd_accel.components.flux.controlnet import is_flux_controlnet
    from sd_accel.components.sd3.controlnet import is_sd3_controlnet
    from sd_accel.onnx.fingerprint import fingerprint
    from sd_accel.runtime.control import EngineControlNet
    from sd_accel.runtime.transformer_control import EngineFluxControlNet, EngineSD3ControlNet

    found: dict[str, int] = {}
    wrappers = []
    for key, spec in control.items():
        if spec.name != CONTROLNET:
            continue
        net = spec.torch_module()
        if getattr(backend, "reads_live_weights", False):
            # (the compiled backend) its engines are keyed by architecture, and a pipeline's ControlNets
            # often share one: their runners could not tell which live module is theirs. They run torch.
            log.info("%s: the %s backend does not serve ControlNets yet; it runs in torch", key, backend.name)
            continue
        model = fingerprint(net, hand_back=park_weights)
        engines = engines_for(cache, backend, model, CONTROLNET, fallback=fallback, prefer_precision=prefer_precision)
        engines.builder = builder
        found[key] = len(engines.handles)
        if not (engines.handles or builder is not None):
            continue
        kind = (EngineFluxControlNet if is_flux_controlnet(net) else EngineSD3ControlNet if is_sd3_controlnet(net)
                else EngineControlNet)
        wrapper = kind(net, {key: engines})
        if engines.handles and park_weights:
            park(net, cache.root, key)
            wrapper.remember_weights()
        wrappers.append(wrapper)
    _install_controlnets(pipe, wrappers)
    return found


def _install_controlnets(pipe, wrappers: list) -> None:
    for wrapper in wrappers:
        wrapper.install()
    if wrappers:
        pipe.__dict__["_sd_accel_controlnets"] = list(wrappers)


def controlnet_wrappers(pipe) -> list:
    """The :class:`~sd_accel.runtime.control.EngineControlNet` of each ControlNet on engines."""
    return list(pipe.__dict__.get("_sd_accel_controlnets", []))


def _after_build(pipe, component: str, cache, park_weights: bool) -> None:
    """A new engine serves ``component``: park its module's weights, or, already parked, drop
    the pages the export and the validation read."""
    wrapper = next((w for w in (getattr(pipe, s, None) for s in SLOTS)
                    if isinstance(w, EngineModule) and component in w.engines), None)  # unet_control: the UNet's
    slot = next((s for s in SLOTS if getattr(pipe, s, None) is wrapper), "unet")
    if component == "controlnet":
        return  # (its weights stay as they are: a ControlNet is small beside the UNet)
    if not isinstance(wrapper, EngineModule):
        return
    if parked(wrapper.torch_module) is not None:
        release(wrapper.torch_module)
    elif park_weights:
        park(wrapper.torch_module, cache.root, slot)
        wrapper.remember_weights()


def set_build_progress(pipe, progress: bool | Callable[[Any], None]) -> None:
    """Where the builds of ``engines="auto"`` report: True (tqdm bars), False, or a callable
    taking :class:`sd_accel.build.BuildEvent` (a panel's progress bar)."""
    modules = [getattr(pipe, slot, None) for slot in SLOTS] + controlnet_wrappers(pipe)
    for module in modules:
        if isinstance(module, EngineModule):
            for engines in module.engines.values():
                if engines.builder is not None:
                    engines.builder.progress = progress


def _wrap(slot: str, module, engines: dict[str, ComponentEngines]) -> EngineModule:
    if slot == "unet":
        return EngineUNet(module, engines)
    if slot == "vae":
        return EngineVAE(module, engines)
    if "transformer" in engines:
        return EngineTransformer(module, engines)
    if "t5" in engines:
        return EngineT5(module, engines)
    return EngineTextEncoder(module, engines, next(iter(engines)))


# Pipeline methods that must see the torch modules, not the stand-ins: saving (diffusers would
# record the wrapper class) and diffusers' LoRA and embedding loaders, which pick what to do by the
# module's class (a stand-in is neither a ModelMixin nor a PreTrainedModel: ``unload_lora_weights``
# and ``fuse_lora`` would silently do nothing) and match its module names against the LoRA's keys.
GUARDED_METHODS = (
    "save_pretrained", "load_lora_weights", "fuse_lora", "unfuse_lora", "unload_lora_weights",
    "set_adapters", "delete_adapters", "enable_lora", "disable_lora", "set_lora_device",
    "enable_lora_hotswap", "get_active_adapters", "get_list_adapters", "load_textual_inversion",
    "unload_textual_inversion",
)


def _guard_save(pipe) -> None:
    """``save_pretrained`` saves the torch modules, never the engine wrappers; the LoRA and
    embedding loaders (:data:`GUARDED_METHODS`) work on the torch modules. What they change is
    seen by the stand-ins' next call (:mod:`sd_accel.runtime.freshness`)."""
    if getattr(pipe, "_sd_accel_save_guarded", False):
        return
    for name in GUARDED_METHODS:
        original = getattr(pipe, name, None)
        if callable(original):
            object.__setattr__(pipe, name, _with_torch_modules(pipe, original))
    object.__setattr__(pipe, "_sd_accel_save_guarded", True)


def _with_torch_modules(pipe, original):
    import functools

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        saved = {slot: getattr(pipe, slot) for slot in SLOTS if isinstance(getattr(pipe, slot, None), EngineModule)}
        try:
            with torch_modules(pipe):
                return original(*args, **kwargs)
        finally:
            for wrapper in saved.values():
                wrapper.touched()

    return guarded


def set_step_cache(pipe, threshold: float | None) -> bool:
    """Serve ``pipe``'s transformer engines through a first-block step cache of ``threshold``
    (:mod:`sd_accel.runtime.step_cache`), or, None, run every step in full. Returns whether a
    step cache is on: only an SD3 / FLUX.1 transformer on engines takes one (said otherwise)."""
    from sd_accel.runtime.step_cache import StepCache, StepCacheRule, scheduler_position

    module = getattr(pipe, "transformer", None)
    if threshold is None:
        if isinstance(module, EngineTransformer):
            module.set_step_cache(None)
        return False
    rule = StepCacheRule(float(threshold))
    if not isinstance(module, EngineTransformer):
        why = ("it has no SD3 / FLUX.1 transformer" if module is None and getattr(pipe, "unet", None) is not None
               else "its transformer is not on engines (engines=True or 'auto')")
        log.warning("step_cache=%g: not used for this pipeline: %s; every step runs in full", threshold, why)
        return False
    module.set_step_cache(StepCache(rule, scheduler_position(pipe)))
    log.info("step cache on the transformer's engines, threshold %g (the first %d steps and the last run in full)",
             threshold, rule.full_first)
    return True


def set_fallback(pipe, allowed: bool) -> None:
    """Switch the torch fallback of every engine-backed module in ``pipe`` (see
    :meth:`~sd_accel.runtime.selection.ComponentEngines.set_fallback`)."""
    for slot in SLOTS:
        module = getattr(pipe, slot, None)
        if isinstance(module, EngineModule):
            for engines in (*module.engines.values(), *module.shared.values()):
                engines.set_fallback(allowed)
    for wrapper in controlnet_wrappers(pipe):
        for engines in wrapper.engines.values():
            engines.set_fallback(allowed)


def stats(pipe) -> dict[str, dict[str, Any]]:
    """Per component: engine calls, torch calls, fallback reasons with counts, engines used.

    (Skipped in the test suite: it needs engines built for ``pipe``; docs/concepts/fallbacks.md
    builds one and runs ``stats`` on the tiny model.)

    >>> stats(pipe)["unet"]  # doctest: +SKIP
    {'engine_calls': 20, 'torch_calls': 0, 'fallbacks': {}, 'engines_used': {'unet....': 20}}
    """
    out: dict[str, dict[str, Any]] = {}
    for slot in SLOTS:
        module = getattr(pipe, slot, None)
        if isinstance(module, EngineModule):
            out.update(module.component_stats())
    for wrapper in controlnet_wrappers(pipe):
        out.update(wrapper.component_stats())
    return out
