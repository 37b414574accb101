"""Sampler presets under the names AUTOMATIC1111 WebUI users know.

A WebUI sampler ("DPM++ 2M", "Euler a", ...) plus a schedule type ("Karras", "SGM Uniform", ...)
becomes a diffusers scheduler class and the constructor arguments that reproduce it. Names come
either split (``resolve("DPM++ 2M", "Karras")``) or combined WebUI style
(``resolve("DPM++ 2M Karras")``); matching ignores case, spaces, ``_`` and ``-`` but never guesses.

>>> preset = resolve("DPM++ 2M SDE Karras")
>>> preset.scheduler_class, preset.kwargs["algorithm_type"], preset.kwargs["use_karras_sigmas"]
('DPMSolverMultistepScheduler', 'sde-dpmsolver++', True)
>>> from sd_accel import load_pipeline
>>> apply_sampler(load_pipeline("builtin:tiny-sd15"), "Euler a").name
'Euler a'

"Automatic" means what it means in WebUI 1.9 and later: the sampler's own default schedule
(Karras for DPM++ 2M and DPM++ SDE, Exponential for DPM++ 2M SDE), otherwise the model's own
scheduler settings untouched.

Only what diffusers really implements is offered. WebUI samplers and schedules without a diffusers
equivalent are still recognised, so asking for one explains why it is missing instead of
suggesting a look-alike.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sd_accel.core import InvalidType, InvalidValue, MissingDependency

AUTOMATIC = "Automatic"

# Schedule types, in the WebUI's dropdown order. Sigma-based ones also pin timestep_spacing to
# "linspace": the Euler/Heun/LMS/DPM2 schedulers take sigma_max from the first *spaced* timestep,
# and with SD's "leading" spacing that would cut the Karras/Exponential/Beta range short of the
# model's real sigma_max, which is what the WebUI uses.
_SCHEDULE_KWARGS: dict[str, dict[str, Any]] = {
    AUTOMATIC: {},
    # WebUI "Uniform" and "Normal" both sample t evenly from T-1 down to 0: diffusers' linspace.
    "Uniform": {"timestep_spacing": "linspace"},
    "Karras": {"use_karras_sigmas": True, "timestep_spacing": "linspace"},
    "Exponential": {"use_exponential_sigmas": True, "timestep_spacing": "linspace"},
    # Both step evenly down from t = T-1 and never land on t = 0: diffusers' trailing.
    "SGM Uniform": {"timestep_spacing": "trailing"},
    "Simple": {"timestep_spacing": "trailing"},
    "Normal": {"timestep_spacing": "linspace"},
    # The WebUI's "DDIM" schedule is the original DDIM discretisation (t = k * T/n + offset).
    "DDIM": {"timestep_spacing": "leading"},
    "Beta": {"use_beta_sigmas": True, "timestep_spacing": "linspace"},
}
_SCHEDULE_REQUIRES: dict[str, tuple[str, ...]] = {"Beta": ("scipy",)}
_SCHEDULE_ALIASES: dict[str, str] = {"SGMUniform": "SGM Uniform"}

_SPACING_ONLY = (AUTOMATIC, "Uniform", "SGM Uniform", "Simple", "Normal", "DDIM")
_ALL_SCHEDULES = tuple(_SCHEDULE_KWARGS)

_UNSUPPORTED_SCHEDULES: dict[str, str] = {
    "Polyexponential": "diffusers schedulers have no polyexponential sigma option",
    "KL Optimal": "diffusers schedulers have no KL-optimal sigma option",
    "Align Your Steps": "Align Your Steps is a fixed sigma table, not a diffusers scheduler option",
}


@dataclass(frozen=True)
class _Sampler:
    name: str
    scheduler_class: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    schedules: tuple[str, ...] = _ALL_SCHEDULES
    default_schedule: str = AUTOMATIC
    second_order: bool = False
    stochastic: bool = False
    requires: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()


# WebUI order. Aliases are the WebUI's own (its API accepts them).
_SAMPLERS: tuple[_Sampler, ...] = (
    _Sampler(
        "DPM++ 2M",
        "DPMSolverMultistepScheduler",
        (("algorithm_type", "dpmsolver++"), ("solver_order", 2)),
        default_schedule="Karras",
        aliases=("k_dpmpp_2m",),
    ),
    # DPMSolverSDEScheduler is the port of k-diffusion's sample_dpmpp_sde (midpoint step,
    # Brownian-tree noise); DPMSolverSinglestepScheduler, which some tables list, is deterministic.
    _Sampler(
        "DPM++ SDE",
        "DPMSolverSDEScheduler",
        default_schedule="Karras",
        second_order=True,
        stochastic=True,
        requires=("torchsde",),
        aliases=("k_dpmpp_sde",),
    ),
    _Sampler(
        "DPM++ 2M SDE",
        "DPMSolverMultistepScheduler",
        (("algorithm_type", "sde-dpmsolver++"), ("solver_order", 2)),
        default_schedule="Exponential",
        stochastic=True,
        aliases=("k_dpmpp_2m_sde",),
    ),
    _Sampler(
        "DPM++ 2M SDE Heun",
        "DPMSolverMultistepScheduler",
        (("algorithm_type", "sde-dpmsolver++"), ("solver_order", 2), ("solver_type", "heun")),
        default_schedule="Exponential",
        stochastic=True,
        aliases=("k_dpmpp_2m_sde_heun",),
    ),
    # diffusers' Euler ancestral scheduler has no sigma-schedule options, only timestep spacing.
    _Sampler(
        "Euler a",
        "EulerAncestralDiscreteScheduler",
        schedules=_SPACING_ONLY,
        stochastic=True,
        aliases=("k_euler_a", "k_euler_ancestral"),
    ),
    _Sampler("Euler", "EulerDiscreteScheduler", aliases=("k_euler",)),
    _Sampler("LMS", "LMSDiscreteScheduler", requires=("scipy",), aliases=("k_lms",)),
    _Sampler("Heun", "HeunDiscreteScheduler", second_order=True, aliases=("k_heun",)),
    _Sampler("DPM2", "KDPM2DiscreteScheduler", second_order=True, aliases=("k_dpm_2",)),
    _Sampler(
        "DPM2 a",
        "KDPM2AncestralDiscreteScheduler",
        second_order=True,
        stochastic=True,
        aliases=("k_dpm_2_a",),
    ),
    # Deterministic with the pipelines' default eta=0, as in the WebUI.
    _Sampler("DDIM", "DDIMScheduler", schedules=_SPACING_ONLY),
    # PLMS is PNDM without its Runge-Kutta warm-up steps.
    _Sampler("PLMS", "PNDMScheduler", (("skip_prk_steps", True),), schedules=_SPACING_ONLY),
    # diffusers' recommended guided-sampling setting (bh2, order 2), not the WebUI's bh1/order 3:
    # diffusers' bh1 update yields NaN on the final step to sigma 0 (final_sigmas_type "zero").
    _Sampler(
        "UniPC",
        "UniPCMultistepScheduler",
        (("solver_type", "bh2"), ("solver_order", 2), ("predict_x0", True)),
    ),
    # LCMScheduler ignores timestep_spacing: it always walks its own distilled timestep grid.
    _Sampler("LCM", "LCMScheduler", schedules=(AUTOMATIC,), stochastic=True),
    # Trajectory Consistency Distillation (TCD-LoRA / TCD models): its stochasticity is the call's
    # ``eta`` (the paper's gamma, 0.3 in its examples): GenerationParams(eta=...). diffusers' SD
    # pipelines pass eta=0 unless told, and at 0 TCD is deterministic: the noise seed changes nothing.
    _Sampler("TCD", "TCDScheduler", schedules=(AUTOMATIC,), stochastic=False),
    # Not in the WebUI (ComfyUI and Forge call it "deis"); offered because diffusers has it.
    _Sampler("DEIS", "DEISMultistepScheduler", (("algorithm_type", "deis"), ("solver_order", 2))),
)

_UNSUPPORTED_SAMPLERS: dict[str, str] = {
    "DPM++ 2S a": "diffusers has no ancestral single-step DPM-Solver++(2S) scheduler",
    # Compared with k-diffusion on a quadratic x0(lambda): diffusers 0.42's third-order
    # "sde-dpmsolver++" step flips the sign of the 0.5 in its D2 coefficient (about 10x the error).
    "DPM++ 3M SDE": (
        "diffusers documents its SDE DPM-Solver++ for first and second order only, and its "
        "third-order SDE update does not match k-diffusion's DPM++ 3M SDE; use DPM++ 2M SDE"
    ),
    "DPM fast": "diffusers has no equivalent of k-diffusion's DPM-Solver fast",
    "DPM adaptive": "diffusers has no adaptive-step DPM-Solver scheduler",
    "Restart": "diffusers has no Restart sampler",
    "DDIM CFG++": "CFG++ changes the guidance formula, which a scheduler cannot express",
}

# Solver choices belong to the preset, not the model: whatever a previous preset or the model's own
# scheduler_config.json set for them is dropped, so "DPM++ 2M Uniform" never inherits Karras sigmas
# or a third solver order.
_SOLVER_KEYS = frozenset(
    {
        "use_karras_sigmas",
        "use_exponential_sigmas",
        "use_beta_sigmas",
        "use_lu_lambdas",
        "algorithm_type",
        "solver_order",
        "solver_type",
        "lower_order_final",
        "euler_at_final",
        "final_sigmas_type",
        "predict_x0",
        "disable_corrector",
        "solver_p",
        "skip_prk_steps",
        "noise_sampler_seed",
    }
)
# Attribute on schedulers made here holding the model's own config, so a later preset starts from
# the model's settings (e.g. its "leading" spacing), not from the previous preset's.
_MODEL_CONFIG_ATTR = "_sd_accel_model_config"


@dataclass(frozen=True)
class SamplerPreset:
    """A resolved sampler: which diffusers scheduler to build, with which arguments.

    ``schedule`` is the schedule actually used: "Automatic" already replaced by the sampler's
    WebUI default where it has one. ``kwargs`` is a fresh dict on every access.

    >>> p = resolve("Heun", "Karras")
    >>> p.name, p.scheduler_class, p.second_order
    ('Heun Karras', 'HeunDiscreteScheduler', True)
    """

    name: str
    sampler: str
    schedule: str
    scheduler_class: str
    options: tuple[tuple[str, Any], ...]
    second_order: bool
    stochastic: bool
    requires: tuple[str, ...] = ()

    @property
    def kwargs(self) -> dict[str, Any]:
        """Constructor arguments for ``scheduler_class.from_config(config, **kwargs)``."""
        return dict(self.options)

    @property
    def missing(self) -> tuple[str, ...]:
        """Packages this preset needs that are not installed (empty when it can be built)."""
        return tuple(pkg for pkg in self.requires if not _is_installed(pkg))


def _is_installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _norm(text: str) -> str:
    return re.sub(r"[\s_\-]+", "", text).casefold()


_SAMPLER_INDEX: dict[str, _Sampler] = {_norm(key): s for s in _SAMPLERS for key in (s.name, *s.aliases)}
_SCHEDULE_INDEX: dict[str, str] = {
    **{_norm(label): label for label in _SCHEDULE_KWARGS},
    **{_norm(alias): label for alias, label in _SCHEDULE_ALIASES.items()},
}
_UNSUPPORTED_SAMPLER_INDEX = {_norm(k): k for k in _UNSUPPORTED_SAMPLERS}
_UNSUPPORTED_SCHEDULE_INDEX = {_norm(k): k for k in _UNSUPPORTED_SCHEDULES}


def list_samplers() -> list[str]:
    """Sampler names diffusers can run, in the WebUI's order.

    >>> list_samplers()[:3]
    ['DPM++ 2M', 'DPM++ SDE', 'DPM++ 2M SDE']
    """
    return [s.name for s in _SAMPLERS]


def list_schedules(sampler: str | None = None) -> list[str]:
    """Schedule types, in the WebUI's order: all of them, or those ``sampler`` supports.

    >>> list_schedules("Euler a")
    ['Automatic', 'Uniform', 'SGM Uniform', 'Simple', 'Normal', 'DDIM']
    """
    if sampler is None:
        return list(_ALL_SCHEDULES)
    return list(_find_sampler(sampler).schedules)


def list_presets(available_only: bool = False) -> list[str]:
    """Every valid full name: each sampler alone ("Automatic"), then with each of its schedules.

    ``available_only`` leaves out presets whose optional packages (scipy, torchsde) are missing.

    >>> "DPM++ 2M Karras" in list_presets()
    True
    """
    names = []
    for s in _SAMPLERS:
        for schedule in s.schedules:
            name = s.name if schedule == AUTOMATIC else f"{s.name} {schedule}"
            if not available_only or not _build_preset(s, schedule, name).missing:
                names.append(name)
    return names


def resolve(name: str, schedule: str | None = None) -> SamplerPreset:
    """The preset for a WebUI sampler name, combined ("DPM++ 2M Karras") or split.

    Raises ``ValueError`` for unknown names (listing the closest matches), for samplers and
    schedules diffusers cannot express, and for a schedule the sampler cannot use.

    >>> resolve("dpm++ 2m", "karras").name
    'DPM++ 2M Karras'
    """
    # Names come from request bodies too (a JSON 5 or list): say so rather than fail in re.sub.
    if not isinstance(name, str):
        raise InvalidValue(f"sampler name {name!r} is not valid; allowed: a string such as 'Euler a' "
                           "(`sd-accel samplers` lists them)")
    if schedule is not None and not isinstance(schedule, str):
        raise InvalidValue(f"schedule type {schedule!r} is not valid; allowed: a string such as 'Karras'")
    sampler, suffix = _split(name)
    wanted = _find_schedule(schedule) if schedule is not None else AUTOMATIC
    if suffix not in (None, AUTOMATIC) and wanted not in (AUTOMATIC, suffix):
        raise InvalidValue(f"{name!r} already names the {suffix} schedule, but schedule={schedule!r} was given")
    if suffix not in (None, AUTOMATIC):
        wanted = suffix
    if wanted not in sampler.schedules:
        raise InvalidValue(
            f"{sampler.name} cannot use the {wanted} schedule in diffusers; "
            f"it supports: {', '.join(sampler.schedules)}"
        )
    full_name = sampler.name if wanted == AUTOMATIC else f"{sampler.name} {wanted}"
    return _build_preset(sampler, wanted, full_name)


# Schedule flags a scheduler's config can carry, and the WebUI schedule type each means.
_SIGMA_FLAGS = (("use_karras_sigmas", "Karras"), ("use_exponential_sigmas", "Exponential"),
                ("use_beta_sigmas", "Beta"))
_SPACING_SCHEDULES = {"linspace": "Uniform", "trailing": "SGM Uniform", "leading": "DDIM"}


def webui_name(scheduler: Any) -> str | None:
    """The WebUI sampler name of a diffusers scheduler (or its config), or None when the WebUI
    has no such sampler (e.g. PNDM with its Runge-Kutta warm-up).

    A model's own scheduler is named by what it does, so an answer never reports a class name
    such as ``PNDMScheduler``, which no WebUI client knows.

    >>> import diffusers
    >>> webui_name(diffusers.PNDMScheduler(skip_prk_steps=True))
    'PLMS'
    >>> webui_name(make_scheduler("DPM++ 2M Karras", {}))
    'DPM++ 2M Karras'
    """
    config = getattr(scheduler, "config", scheduler)
    cls = type(scheduler).__name__ if hasattr(scheduler, "config") else config.get("_class_name")
    config = dict(config) if isinstance(config, Mapping) else {}
    # The most specific match wins: "DPM++ 2M SDE Heun" pins solver_type, "DPM++ 2M SDE" does not.
    matches = [s for s in _SAMPLERS if s.scheduler_class == cls
               and all(config.get(k, v) == v for k, v in s.kwargs)]
    if not matches:
        return None
    sampler = max(matches, key=lambda s: len(s.kwargs))
    schedule = next((label for flag, label in _SIGMA_FLAGS if config.get(flag)), None)
    spacing = config.get("timestep_spacing", "linspace")
    model_spacing = dict(getattr(scheduler, _MODEL_CONFIG_ATTR, None) or config).get("timestep_spacing", "linspace")
    # The plain name means the sampler's default schedule (Karras for DPM++ 2M) or, where that is
    # Automatic, the model's own spacing: name the spacing whenever it is not what the plain name means.
    if schedule is None and (sampler.default_schedule != AUTOMATIC or spacing != model_spacing):
        schedule = _SPACING_SCHEDULES.get(spacing)
    if schedule is None or schedule not in sampler.schedules:
        return sampler.name
    return f"{sampler.name} {schedule}"


# The flow-matching models (SD3 / SD3.5, FLUX.1) train a velocity, not a noise prediction: only the
# samplers with a flow-matching form in diffusers apply, keeping the model's shift settings. Euler
# alone: FlowMatchHeun takes no custom sigmas, which the FLUX.1 pipelines always pass.
FLOW_SAMPLERS: dict[str, str] = {"Euler": "FlowMatchEulerDiscreteScheduler"}
# The schedules FlowMatchEuler takes (its sigma options).
_FLOW_SCHEDULES: dict[str, tuple[str, ...]] = {"Euler": (AUTOMATIC, "Simple", "Karras", "Exponential", "Beta")}


def is_flow(base_config: Any) -> bool:
    """Whether a scheduler (or its config) is a flow-matching one: the model predicts velocity."""
    if type(base_config).__name__.startswith("FlowMatch"):
        return True
    config = getattr(base_config, "config", base_config)
    return isinstance(config, Mapping) and str(config.get("_class_name", "")).startswith("FlowMatch")


def flow_preset(name: str, schedule: str | None = None) -> SamplerPreset:
    """The flow-matching preset for a WebUI name: ``Euler`` (schedules Automatic, Simple, Karras,
    Exponential, Beta). Any other sampler is refused, naming these.

    >>> flow_preset("Euler Karras").scheduler_class, flow_preset("Euler Karras").kwargs
    ('FlowMatchEulerDiscreteScheduler', {'use_karras_sigmas': True})
    >>> flow_preset("DPM++ 2M SDE")
    Traceback (most recent call last):
    ...
    sd_accel.core.InvalidValue: 'DPM++ 2M SDE' has no flow-matching form in diffusers; SD3 / SD3.5 and FLUX.1 take: Euler (Automatic, Simple, Karras, Exponential, Beta)
    """
    preset = resolve(name, schedule)
    choices = ", ".join(f"{k} ({', '.join(v)})" for k, v in _FLOW_SCHEDULES.items())
    if preset.sampler not in FLOW_SAMPLERS:
        raise InvalidValue(f"{name!r} has no flow-matching form in diffusers; SD3 / SD3.5 and FLUX.1 take: {choices}")
    if preset.schedule not in _FLOW_SCHEDULES[preset.sampler]:
        raise InvalidValue(f"{preset.name!r}: the flow-matching {preset.sampler} cannot use the {preset.schedule} "
                           f"schedule; SD3 / SD3.5 and FLUX.1 take: {choices}")
    sigma = {k: v for k, v in _SCHEDULE_KWARGS[preset.schedule].items() if k.endswith("_sigmas")}
    return SamplerPreset(name=preset.name, sampler=preset.sampler, schedule=preset.schedule,
                         scheduler_class=FLOW_SAMPLERS[preset.sampler], options=tuple(sigma.items()),
                         second_order=preset.second_order, stochastic=False, requires=preset.requires)


def make_scheduler(name: str, base_config: Any, schedule: str | None = None):
    """A new diffusers scheduler for ``name``, keeping the model's settings from ``base_config``.

    ``base_config`` is a scheduler, its ``.config`` or a plain dict. Betas, prediction_type
    (v_prediction included), steps_offset and timestep_spacing (unless the schedule sets it)
    come from it; raises ``ImportError`` when the preset needs a package that is missing.

    >>> sched = make_scheduler("DPM++ 2M Karras", {"beta_schedule": "scaled_linear"})  # or pipe.scheduler
    >>> type(sched).__name__, sched.config.use_karras_sigmas
    ('DPMSolverMultistepScheduler', True)
    """
    preset = flow_preset(name, schedule) if is_flow(base_config) else resolve(name, schedule)
    return _build_scheduler(preset, base_config)


def apply_sampler(pipe: Any, name: str, schedule: str | None = None) -> SamplerPreset:
    """Replace ``pipe.scheduler`` with the scheduler for ``name``; returns the preset used.

    >>> from sd_accel import load_pipeline
    >>> pipe = load_pipeline("builtin:tiny-sd15")
    >>> apply_sampler(pipe, "DPM++ 2M", "Karras").scheduler_class
    'DPMSolverMultistepScheduler'
    """
    preset = flow_preset(name, schedule) if is_flow(pipe.scheduler) else resolve(name, schedule)
    pipe.scheduler = _build_scheduler(preset, pipe.scheduler)
    return preset


def _build_preset(sampler: _Sampler, schedule: str, name: str) -> SamplerPreset:
    effective = sampler.default_schedule if schedule == AUTOMATIC else schedule
    options = {**dict(sampler.kwargs), **_SCHEDULE_KWARGS[effective]}
    requires = tuple(dict.fromkeys(sampler.requires + _SCHEDULE_REQUIRES.get(effective, ())))
    return SamplerPreset(
        name=name,
        sampler=sampler.name,
        schedule=effective,
        scheduler_class=sampler.scheduler_class,
        options=tuple(options.items()),
        second_order=sampler.second_order,
        stochastic=sampler.stochastic,
        requires=requires,
    )


def _build_scheduler(preset: SamplerPreset, base_config: Any):
    if preset.missing:
        packages = " ".join(preset.missing)
        raise MissingDependency(
            f"The {preset.name!r} sampler needs {', '.join(preset.missing)}, which is not installed "
            f"(pip install {packages})"
        )
    import diffusers

    model_config = _model_config(base_config)
    config = {k: v for k, v in model_config.items() if k not in _SOLVER_KEYS}
    scheduler = getattr(diffusers, preset.scheduler_class).from_config(config, **preset.kwargs)
    setattr(scheduler, _MODEL_CONFIG_ATTR, model_config)
    return scheduler


def _model_config(base_config: Any) -> dict[str, Any]:
    remembered = getattr(base_config, _MODEL_CONFIG_ATTR, None)
    if remembered is not None:
        return dict(remembered)
    config = getattr(base_config, "config", base_config)
    if not isinstance(config, Mapping):
        raise InvalidType(f"expected a scheduler, its config or a dict, got {type(base_config).__name__}")
    return dict(config)


def _split(name: str) -> tuple[_Sampler, str | None]:
    """(sampler, schedule named in the suffix or None); raises ValueError when it can't tell."""
    key = _norm(name)
    if key in _SAMPLER_INDEX:
        return _SAMPLER_INDEX[key], None
    _raise_if_unsupported_sampler(key, name)
    for sched_key, label in _SCHEDULE_INDEX.items():
        prefix = key[: -len(sched_key)]
        if key.endswith(sched_key) and prefix in _SAMPLER_INDEX:
            return _SAMPLER_INDEX[prefix], label
    for sched_key, label in _UNSUPPORTED_SCHEDULE_INDEX.items():
        prefix = key[: -len(sched_key)]
        if key.endswith(sched_key) and prefix in _SAMPLER_INDEX:
            raise InvalidValue(
                f"{name!r}: the {label} schedule is not available: {_UNSUPPORTED_SCHEDULES[label]}"
            )
    for sched_key in _SCHEDULE_INDEX:
        prefix = key[: -len(sched_key)]
        if key.endswith(sched_key) and prefix:
            _raise_if_unsupported_sampler(prefix, name)
    raise InvalidValue(f"unknown sampler {name!r}{_suggest(name, list_presets(), list_samplers())}{_see_all()}")


def _see_all() -> str:
    # Samplers times schedules is too many to print in an error; the command lists them.
    return f"; `sd-accel samplers` lists all {len(list_presets())} names (sampler and schedule)"


def _raise_if_unsupported_sampler(key: str, name: str) -> None:
    if key in _UNSUPPORTED_SAMPLER_INDEX:
        label = _UNSUPPORTED_SAMPLER_INDEX[key]
        raise InvalidValue(
            f"{name!r}: the {label} sampler is not available: {_UNSUPPORTED_SAMPLERS[label]}. "
            f"Available samplers: {', '.join(list_samplers())}"
        )


def _find_sampler(name: str) -> _Sampler:
    key = _norm(name)
    if key in _SAMPLER_INDEX:
        return _SAMPLER_INDEX[key]
    _raise_if_unsupported_sampler(key, name)
    raise InvalidValue(f"unknown sampler {name!r}{_suggest(name, list_samplers(), list_samplers())}{_see_all()}")


def _find_schedule(name: str) -> str:
    key = _norm(name)
    if key in _SCHEDULE_INDEX:
        return _SCHEDULE_INDEX[key]
    if key in _UNSUPPORTED_SCHEDULE_INDEX:
        label = _UNSUPPORTED_SCHEDULE_INDEX[key]
        raise InvalidValue(f"the {label} schedule is not available: {_UNSUPPORTED_SCHEDULES[label]}")
    raise InvalidValue(
        f"unknown schedule type {name!r}{_suggest(name, list(_ALL_SCHEDULES), list(_ALL_SCHEDULES))}"
    )


def _suggest(name: str, candidates: list[str], valid: list[str]) -> str:
    """Close matches among ``candidates``, or the ``valid`` names when nothing is close."""
    # Compare normalised forms so spacing and case don't hide an obvious match.
    by_key = {_norm(c): c for c in candidates}
    close = difflib.get_close_matches(_norm(name), list(by_key), n=5, cutoff=0.6)
    if not close:
        return f"; valid names: {', '.join(valid)}"
    return f"; closest matches: {', '.join(by_key[k] for k in close)}"
