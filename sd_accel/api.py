"""The Python entry: ``load_pipeline`` and ``accelerate``.

What the faces (CLI, panel and app, serve, bench, the WebUI adapter) may use, checked by
``tests/test_layers.py`` (:data:`FACE_MODULES` there):

- the package root (``sd_accel``: this module, ``build_engines``, ``EngineCache``, ``stats``,
  ``refit_engines``) and the modules a request is written in: ``config``, ``core``,
  ``profiles``, ``generate``, ``preview`` (live previews), ``samplers``, ``units``, the backend table
  (``backends.registry``), the builder (``build``) and the cache's folder names
  (``cache.intermediates``);
- the WebUI adapter besides: it builds from the WebUI's own LDM modules, not a diffusers
  pipeline, so it uses their specs (``components.ldm_*``; Forge's FLUX.1 and SD3.5: ``components.flux``
  and ``components.sd3``, whose ``bfl_module`` / ``sai_module`` convert Black Forest Labs' and
  Stability's modules as the host holds them), the runtime's public entry
  (``runtime``, ``runtime.modules.ProxyModule``), the parking of the host's torch UNet while
  engines serve (``runtime.weights``: Forge keeps it in RAM), the refit (``refit``, ``onnx.weights``) and
  the ONNX helpers its weights ids and exports need (``onnx.fingerprint``, ``onnx.export``);
- ``sd-accel bench`` (the quick check) besides: ``paths`` (its engine folder).

``SHARED_COMPONENTS`` names the WebUI's and ComfyUI's engine components that serve a pipeline
loaded from the same checkpoint file (:mod:`sd_accel.models.source`): a face counts their calls
under the pipeline's own components.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from sd_accel.config import AccelConfig
from sd_accel.core import DeviceError, InvalidType
from sd_accel.models.controlnet import call_arguments as control_arguments
from sd_accel.models.controlnet import (
    controlnet_pipeline,
    load_controlnet,
    residual_component,
    with_controlnets,
)
from sd_accel.models.hints import canny as control_canny
from sd_accel.models.hints import preprocess as control_hint
from sd_accel.models.load import ModelInfo, load_pipeline
from sd_accel.models.source import SHARED_COMPONENTS
from sd_accel.models.taesd import load_tiny_vae
from sd_accel.optimize.attention import apply_attention, resolve_attention
from sd_accel.optimize.memory_format import apply_memory_format
from sd_accel.optimize.offload import apply_offload, apply_vae_memory
from sd_accel.optimize.precision import install_vae_guard, resolve_precision, vae_dtype_for
from sd_accel.optimize.vae_choice import use_vae
from sd_accel.refit import refit_engines

log = logging.getLogger("sd_accel")

__all__ = ["SHARED_COMPONENTS", "AccelState", "control_arguments", "accelerate", "control_canny", "control_hint", "controlnet_pipeline", "describe_machine", "generation_defaults", "load_controlnet", "model_family",
           "load_pipeline", "load_tiny_vae", "ModelInfo", "refit_engines", "residual_component", "resolve_device", "use_vae", "with_controlnets"]


@dataclass
class AccelState:
    """What ``accelerate`` actually applied; kept on the pipeline as ``pipe.sd_accel``."""

    config: AccelConfig
    device: str
    dtype: str
    vae_dtype: str
    attention: str
    sampler: str | None
    second_order: bool
    offload_active: bool
    engines: dict[str, int] = field(default_factory=dict)
    memory_format: str = "contiguous"  # "channels_last": convolutions in NHWC (CUDA, half precision)
    step_cache: float | None = None  # the step cache's threshold where one is on (AccelConfig.step_cache)

    def summary(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "vae_dtype": self.vae_dtype,
            "attention": self.attention,
            "sampler": self.sampler,
            "offload": self.config.offload if self.offload_active else "none",
            "memory_format": self.memory_format,
            "engines": self.engines,
            "step_cache": self.step_cache,
        }


def generation_defaults(pipe) -> dict[str, Any]:
    """The steps and guidance (``steps``, ``cfg``) a face generates with when the user gives none:
    the model makers' recommendation for the pipeline's family (SD 1.x/2.x/SDXL 20 / 7, SD3.5
    Medium 28 / 4.5, FLUX.1 dev 28 / 3.5, FLUX.1 schnell 4 / 0). ``pipe`` may be a family name
    (:func:`model_family`).

    >>> generation_defaults(load_pipeline("builtin:tiny-flux"))
    {'steps': 4, 'cfg': 0.0}
    """
    from sd_accel.models.families import FAMILIES

    name = pipe if isinstance(pipe, str) else getattr(getattr(pipe, "sd_accel_model", None), "family", "")
    family = FAMILIES.get(name) or FAMILIES["sd15"]
    return {"steps": family.steps, "cfg": family.cfg}


def model_family(source) -> str | None:
    """The family of a model source (``sd15``, ``sdxl``, ``sd3``, ``flux-dev`` ...) without loading
    it; None when it cannot tell. With :func:`generation_defaults` and
    :func:`sd_accel.profiles.default_preset`, what a face shows before the first run.

    >>> model_family("builtin:tiny-sd3")
    'sd3'
    """
    from sd_accel.models.load import family_of

    return family_of(source)


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"device={requested!r} but torch sees no CUDA device (torch {torch.__version__})")
    if requested == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("device='mps' but this torch has no MPS support")
    return torch.device(requested)


def describe_machine() -> dict[str, Any]:
    """The device and its arch key, library versions, every backend of the table with what it
    builds here (or why it cannot run), and xFormers: what ``sd-accel doctor`` prints.

    >>> describe_machine()["backends"]["onnxruntime"]["usable"]
    True
    """
    from dataclasses import asdict

    from sd_accel.backends.registry import describe
    from sd_accel.device import describe as describe_device
    from sd_accel.device import versions
    from sd_accel.optimize.attention import xformers_status

    xf_ok, xf_why = xformers_status()
    return {
        **asdict(describe_device()),
        "versions": versions(),
        "backends": {row["name"]: row for row in describe()},
        "xformers": {"usable": xf_ok, "why_not": xf_why or None},
    }


def _swap_engines(pipe, config: AccelConfig) -> dict[str, int]:
    from sd_accel.backends.registry import get_backend
    from sd_accel.cache.store import EngineCache
    from sd_accel.runtime.swap import swap_engines

    cache = EngineCache(config.engine_dir)
    # auto picks by where the pipeline runs: a CPU pipeline on a GPU machine takes the CPU's backend
    backend = get_backend(config.backend, cache_root=cache.root, device=str(getattr(pipe, "device", "cpu")))
    auto = config.engines == "auto"
    builder = None
    if auto:
        from sd_accel.autobuild import AutoBuilder

        # the backend's default precision may give way to fp32 where it misses its check; one asked for may not
        builder = AutoBuilder(pipe, cache, backend, _build_precision(backend, config.engine_precision),
                              fallback_precision="fp32" if config.engine_precision is None else None)
        builder.step_cache = config.step_cache is not None  # (the transformer built cut for it)
    from sd_accel.models.source import shared_ids

    shared = shared_ids(pipe, cache)  # a single-file checkpoint: the WebUI's and ComfyUI's engines of it serve too
    found = swap_engines(pipe, cache, backend, fallback=config.engine_fallback,
                         prefer_precision=config.engine_precision, builder=builder, shared=shared)
    if auto:
        log.info("engines='auto': %s engines found in %s; a call none covers builds one first",
                 sum(found.values()), cache.root)
        return found
    if any(found.values()):
        return found
    device = str(getattr(pipe, "device", "cpu"))
    others = engines_of_other_backends(pipe, cache, backend.name)
    if config.backend == "auto":
        # No backend pinned: the engines already built for another backend that runs here are
        # worth more than torch (a build with backend="onnxruntime", an accelerate() with auto).
        from sd_accel.backends.registry import auto_order

        for name in auto_order(device):
            if name not in others:
                continue
            try:
                other = get_backend(name, cache_root=cache.root)
            except Exception:  # DeviceError: cannot run here; the next one may
                continue
            found = swap_engines(pipe, cache, other, fallback=config.engine_fallback,
                                 prefer_precision=config.engine_precision, shared=shared)
            if any(found.values()):
                log.warning("engines=True, backend='auto': %s has no engine for this model on %s (auto's first "
                            "choice here); using its %s engines", cache.root, backend.name, name)
                return found
    if others:
        listed = ", ".join(f"{n} ({k})" for n, k in others.items())
        log.warning(
            "engines=True with backend=%r, but the engines %s holds for this model are of another backend: %s; "
            "use AccelConfig(backend=%r) (or 'auto') to run them, or build_engines(pipe, backend=%r). Running torch.",
            backend.name, cache.root, listed, next(iter(others)), backend.name,
        )
        return found
    log.warning(
        "engines=True but %s holds no engine for this model on %s; run build_engines(pipe) or "
        "`sd-accel build` first, or use engines='auto'. Running torch.", cache.root, backend.name,
    )
    return found


def engines_of_other_backends(pipe, cache, backend_name: str) -> dict[str, int]:
    """Backend -> how many engines ``cache`` holds for ``pipe``'s components on backends other
    than ``backend_name``, whether or not they run here. The fingerprints are the ones the swap
    just cached on the modules: no weights are read again."""
    from sd_accel.components import specs_for
    from sd_accel.onnx.fingerprint import fingerprint
    # Nothing was swapped in (no engine found): the pipeline's modules are its own.
    wanted = {(component, fingerprint(spec.torch_module())) for component, spec in specs_for(pipe).items()}
    counts: dict[str, int] = {}
    for record in cache.list():
        if record.key.backend != backend_name and (record.key.component, record.key.model) in wanted:
            counts[record.key.backend] = counts.get(record.key.backend, 0) + 1
    return counts


# Precisions a build on first use cannot make: static INT8 needs calibration data captured from
# whole prompt runs beforehand (build_engines(pipe, precision="int8") does that).
_NOT_ON_FIRST_USE = ("int8",)


def _build_precision(backend, wanted: str | None) -> str:
    """The precision ``engines="auto"`` builds in: ``engine_precision`` when the backend builds it
    on first use, else the backend's default (said once)."""
    default = backend.default_precision()
    if wanted is None or wanted == default:
        return default
    if wanted in _NOT_ON_FIRST_USE or wanted not in backend.precisions():
        why = ("needs calibration data: build it beforehand with build_engines(pipe, precision='int8')"
               if wanted in _NOT_ON_FIRST_USE else f"is not one {backend.name} builds ({', '.join(backend.precisions())})")
        log.warning("engines='auto' builds %s engines: engine_precision=%r %s", default, wanted, why)
        return default
    return wanted


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def accelerate(pipe, config: AccelConfig | None = None, **overrides: Any):
    """Apply ``config`` to a diffusers pipeline in place and return it.

    Works on any device and without engines. Keyword overrides build the config for you.

    >>> pipe = accelerate(load_pipeline("builtin:tiny-sd15"), precision="bf16", sampler="Euler a")
    >>> pipe.sd_accel.attention
    'sdpa'
    >>> pipe = accelerate(load_pipeline("builtin:tiny-sd15"), engines="auto")  # engines built on first use
    """
    if config is None:
        config = AccelConfig(**overrides)
    elif overrides:
        config = AccelConfig(**{**config.to_dict(), **overrides})
    if not isinstance(config, AccelConfig):
        raise InvalidType(f"config must be an AccelConfig, got {type(config).__name__}")
    device = resolve_device(config.device)
    dtype = resolve_precision(config.precision, device)
    attention = resolve_attention(config.attention, device)

    from sd_accel.runtime.swap import unswap

    unswap(pipe)  # torch options apply to the torch modules; engines are swapped in last
    if config.vae is not None or "_sd_accel_own_vae" in pipe.__dict__:
        from sd_accel.optimize.vae_choice import use_vae

        use_vae(pipe, config.vae)
    vae = getattr(pipe, "vae", None)
    vae_dtype = vae_dtype_for(vae, dtype, config.vae_precision) if vae is not None else dtype
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            target = vae_dtype if module is vae else dtype
            if getattr(module, "dtype", None) != target:  # diffusers warns on every .to(dtype)
                module.to(dtype=target)
    offload_active = apply_offload(pipe, config.offload, device)
    if not offload_active:
        pipe.to(device)
    apply_attention(pipe, attention)
    memory_format = apply_memory_format(pipe, device, dtype)
    apply_vae_memory(pipe, config.vae_slicing, config.vae_tiling)
    if vae is not None:
        install_vae_guard(vae, config.nan_check)

    engines_found: dict[str, int] = {}
    if config.engines:  # True or "auto"
        engines_found = _swap_engines(pipe, config)
    if device.type == "cpu":  # T5-XXL (9.5 GB) runs once per prompt: not resident between prompts
        from sd_accel.cache.store import EngineCache
        from sd_accel.runtime.paged_encoders import page_big_encoders

        page_big_encoders(pipe, EngineCache(config.engine_dir).root)
    step_cache = False
    if config.step_cache is not None:
        from sd_accel.runtime.swap import set_step_cache

        step_cache = set_step_cache(pipe, config.step_cache)
    preset = None
    if config.sampler is not None:
        from sd_accel.samplers import apply_sampler

        preset = apply_sampler(pipe, config.sampler)
    state = AccelState(
        config=config,
        device=str(device),
        dtype=_dtype_name(dtype),
        vae_dtype=_dtype_name(vae_dtype),
        attention=attention,
        sampler=preset.name if preset else None,
        second_order=bool(preset and preset.second_order),
        offload_active=offload_active,
        engines=engines_found,
        memory_format=memory_format,
        step_cache=config.step_cache if step_cache else None,
    )
    pipe.sd_accel = state
    log.info("accelerated: %s", state.summary())
    return pipe
