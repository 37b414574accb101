"""Sampler presets: WebUI names -> diffusers schedulers, checked on tiny random-weight pipelines."""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch

from sd_accel import samplers
from sd_accel.samplers import (
    SamplerPreset,
    apply_sampler,
    list_presets,
    list_samplers,
    list_schedules,
    make_scheduler,
    resolve,
)

STEPS = 3
SIZE = 64
SIGMA_FLAGS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")

# The exact constructor arguments of the main presets. "DPM++ 2M" and "DPM++ 2M SDE" alone get the
# WebUI's own default schedule (Karras, Exponential); sigma schedules pin linspace spacing.
_DPMPP_2M = {"algorithm_type": "dpmsolver++", "solver_order": 2}
_DPMPP_2M_SDE = {"algorithm_type": "sde-dpmsolver++", "solver_order": 2}
_KARRAS = {"use_karras_sigmas": True, "timestep_spacing": "linspace"}
_EXPONENTIAL = {"use_exponential_sigmas": True, "timestep_spacing": "linspace"}
EXPECTED: dict[str, tuple[str, dict]] = {
    "DPM++ 2M": ("DPMSolverMultistepScheduler", {**_DPMPP_2M, **_KARRAS}),
    "DPM++ 2M Karras": ("DPMSolverMultistepScheduler", {**_DPMPP_2M, **_KARRAS}),
    "DPM++ 2M Uniform": ("DPMSolverMultistepScheduler", {**_DPMPP_2M, "timestep_spacing": "linspace"}),
    "DPM++ 2M Exponential": ("DPMSolverMultistepScheduler", {**_DPMPP_2M, **_EXPONENTIAL}),
    "DPM++ 2M SGM Uniform": ("DPMSolverMultistepScheduler", {**_DPMPP_2M, "timestep_spacing": "trailing"}),
    "DPM++ 2M SDE": ("DPMSolverMultistepScheduler", {**_DPMPP_2M_SDE, **_EXPONENTIAL}),
    "DPM++ 2M SDE Karras": ("DPMSolverMultistepScheduler", {**_DPMPP_2M_SDE, **_KARRAS}),
    "DPM++ 2M SDE Heun": (
        "DPMSolverMultistepScheduler",
        {**_DPMPP_2M_SDE, "solver_type": "heun", **_EXPONENTIAL},
    ),
    "DPM++ SDE": ("DPMSolverSDEScheduler", _KARRAS),
    "DPM++ SDE Karras": ("DPMSolverSDEScheduler", _KARRAS),
    "Euler a": ("EulerAncestralDiscreteScheduler", {}),
    "Euler a SGM Uniform": ("EulerAncestralDiscreteScheduler", {"timestep_spacing": "trailing"}),
    "Euler": ("EulerDiscreteScheduler", {}),
    "Euler Karras": ("EulerDiscreteScheduler", _KARRAS),
    "Euler Beta": ("EulerDiscreteScheduler", {"use_beta_sigmas": True, "timestep_spacing": "linspace"}),
    "LMS": ("LMSDiscreteScheduler", {}),
    "LMS Karras": ("LMSDiscreteScheduler", _KARRAS),
    "Heun": ("HeunDiscreteScheduler", {}),
    "DPM2": ("KDPM2DiscreteScheduler", {}),
    "DPM2 Karras": ("KDPM2DiscreteScheduler", _KARRAS),
    "DPM2 a": ("KDPM2AncestralDiscreteScheduler", {}),
    "DPM2 a Karras": ("KDPM2AncestralDiscreteScheduler", _KARRAS),
    "DDIM": ("DDIMScheduler", {}),
    "DDIM Simple": ("DDIMScheduler", {"timestep_spacing": "trailing"}),
    "PLMS": ("PNDMScheduler", {"skip_prk_steps": True}),
    "UniPC": ("UniPCMultistepScheduler", {"solver_type": "bh2", "solver_order": 2, "predict_x0": True}),
    "UniPC Karras": (
        "UniPCMultistepScheduler",
        {"solver_type": "bh2", "solver_order": 2, "predict_x0": True, **_KARRAS},
    ),
    "LCM": ("LCMScheduler", {}),
    "TCD": ("TCDScheduler", {}),
    "DEIS": ("DEISMultistepScheduler", {"algorithm_type": "deis", "solver_order": 2}),
    "DEIS Exponential": (
        "DEISMultistepScheduler",
        {"algorithm_type": "deis", "solver_order": 2, **_EXPONENTIAL},
    ),
}

SECOND_ORDER = {"Heun", "DPM2", "DPM2 a", "DPM++ SDE"}
# TCD only with eta > 0 (diffusers' pipelines pass 0): tested below.
STOCHASTIC = {"Euler a", "DPM2 a", "DPM++ SDE", "DPM++ 2M SDE", "DPM++ 2M SDE Heun", "LCM"}


def _copy(pipe):
    """A pipeline sharing the fixture's modules, whose scheduler can be replaced freely."""
    copy = type(pipe)(**pipe.components)
    copy.set_progress_bar_config(disable=True)
    return copy


@pytest.fixture(scope="module")
def sd15(tiny_sd15):
    return _copy(tiny_sd15)


@pytest.fixture(scope="module")
def sdxl(tiny_sdxl):
    return _copy(tiny_sdxl)


@pytest.fixture(scope="module")
def sd2v(tiny_factory):
    pipe = tiny_factory("sd2-v")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _latents(pipe, seed: int = 0) -> torch.Tensor:
    channels = pipe.unet.config.in_channels
    return torch.randn((1, channels, SIZE // 8, SIZE // 8), generator=torch.Generator().manual_seed(seed))


def _generate(pipe, noise_seed: int = 0, **call) -> np.ndarray:
    """STEPS steps from fixed initial latents; ``noise_seed`` only feeds the sampler's own noise."""
    return pipe(
        "a red apple",
        **call,
        num_inference_steps=STEPS,
        height=SIZE,
        width=SIZE,
        latents=_latents(pipe),
        generator=torch.Generator().manual_seed(noise_seed),
        output_type="np",
    ).images


def _count_unet_calls(pipe, run) -> int:
    calls = []
    # The UNet is shared with the session fixture, so the hook must not outlive this run.
    handle = pipe.unet.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        run()
    finally:
        handle.remove()
    return len(calls)


def _assert_image(images: np.ndarray) -> None:
    assert images.shape == (1, SIZE, SIZE, 3)
    assert np.isfinite(images).all()


# --- names and tables -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_expected_mapping(name):
    cls_name, kwargs = EXPECTED[name]
    preset = resolve(name)
    assert preset.scheduler_class == cls_name
    assert preset.kwargs == kwargs
    assert hasattr(diffusers, cls_name)


def test_list_presets_has_every_combination_in_webui_order():
    presets = list_presets()
    assert len(presets) == len(set(presets))
    for name in ("DPM++ 2M Karras", "DPM++ SDE Karras", "Euler a", "DPM++ 2M SDE Exponential", "DDIM"):
        assert name in presets
    # Sampler-major, each sampler first alone ("Automatic"), then with its schedules.
    first = presets.index("DPM++ 2M")
    assert presets[first : first + 3] == ["DPM++ 2M", "DPM++ 2M Uniform", "DPM++ 2M Karras"]
    assert presets.index("DPM++ 2M Beta") < presets.index("DPM++ SDE") < presets.index("Euler a")
    expected_count = sum(len(list_schedules(s)) for s in list_samplers())
    assert len(presets) == expected_count


@pytest.mark.parametrize("name", list_presets())
def test_every_listed_name_resolves_to_itself(name):
    preset = resolve(name)
    assert isinstance(preset, SamplerPreset)
    assert preset.name == name
    assert preset.sampler in list_samplers()
    assert preset.schedule in list_schedules(preset.sampler)


def test_list_samplers_and_schedules():
    assert list_samplers()[:4] == ["DPM++ 2M", "DPM++ SDE", "DPM++ 2M SDE", "DPM++ 2M SDE Heun"]
    for name in ("Euler a", "Euler", "Heun", "LMS", "DPM2", "DPM2 a", "DDIM", "PLMS", "UniPC", "LCM", "DEIS"):
        assert name in list_samplers()
    assert list_schedules()[:3] == ["Automatic", "Uniform", "Karras"]
    assert {"Exponential", "SGM Uniform", "Simple", "Normal", "Beta"} <= set(list_schedules())
    assert "Karras" not in list_schedules("Euler a")
    assert "SGM Uniform" in list_schedules("euler a")
    assert list_schedules("LCM") == ["Automatic"]


@pytest.mark.parametrize(
    ("name", "schedule", "expected"),
    [
        ("dpm++ 2m karras", None, "DPM++ 2M Karras"),
        ("  DPM++2M   KARRAS ", None, "DPM++ 2M Karras"),
        ("DPM++ 2M", "Karras", "DPM++ 2M Karras"),
        ("DPM++ 2M", "karras", "DPM++ 2M Karras"),
        ("dpmpp 2m", None, None),
        ("DPM++ 2M SDE", "sgm_uniform", "DPM++ 2M SDE SGM Uniform"),
        ("DPM++ 2M SDE Exponential", None, "DPM++ 2M SDE Exponential"),
        ("euler A", None, "Euler a"),
        ("Euler a", "SGMUniform", "Euler a SGM Uniform"),
        ("k_euler_a", None, "Euler a"),
        ("DPM++ SDE Karras", "Automatic", "DPM++ SDE Karras"),
        ("DPM++ SDE Karras", "Karras", "DPM++ SDE Karras"),
        ("DDIM", None, "DDIM"),
        ("Euler DDIM", None, "Euler DDIM"),
        ("dpm2_a_karras", None, "DPM2 a Karras"),
    ],
)
def test_matching_is_tolerant_but_exact(name, schedule, expected):
    if expected is None:  # "dpmpp" is not a spelling of "DPM++": no guessing
        with pytest.raises(ValueError, match="unknown sampler"):
            resolve(name, schedule)
    else:
        assert resolve(name, schedule).name == expected


def test_split_and_combined_forms_agree():
    assert resolve("DPM++ 2M", "Karras") == resolve("DPM++ 2M Karras")
    assert resolve("DPM2 a", "Exponential") == resolve("DPM2 a Exponential")


def test_automatic_uses_the_webui_default_schedule():
    assert resolve("DPM++ 2M").schedule == "Karras"
    assert resolve("DPM++ 2M", "Automatic").kwargs == resolve("DPM++ 2M Karras").kwargs
    assert resolve("DPM++ 2M SDE").schedule == "Exponential"
    assert resolve("DPM++ SDE").schedule == "Karras"
    # Samplers without a WebUI default keep the model's own settings.
    assert resolve("Euler").schedule == "Automatic"
    assert resolve("Euler").kwargs == {}


def test_unknown_name_lists_close_matches():
    with pytest.raises(ValueError, match="unknown sampler") as err:
        resolve("DPM++ 2M Karas")
    assert "DPM++ 2M Karras" in str(err.value)
    with pytest.raises(ValueError, match="Euler a"):
        resolve("Eulr a")
    with pytest.raises(ValueError, match="unknown schedule type 'Karas'.*Karras"):
        resolve("Euler", "Karas")


def test_unknown_name_without_close_match_lists_samplers():
    with pytest.raises(ValueError, match="valid names: DPM\\+\\+ 2M, ") as err:
        resolve("zzzz")
    assert all(s in str(err.value) for s in list_samplers())


@pytest.mark.parametrize(
    ("name", "schedule", "sampler"),
    [
        ("Euler a", "Karras", "Euler a"),
        ("Euler a Exponential", None, "Euler a"),
        ("DDIM", "Beta", "DDIM"),
        ("PLMS Karras", None, "PLMS"),
        ("LCM", "SGM Uniform", "LCM"),
    ],
)
def test_unsupported_combination_names_supported_schedules(name, schedule, sampler):
    with pytest.raises(ValueError, match="it supports: ") as err:
        resolve(name, schedule)
    message = str(err.value)
    assert message.startswith(f"{sampler} cannot use the")
    for supported in list_schedules(sampler):
        assert supported in message.split("it supports: ")[1]


def test_conflicting_schedules_raise():
    with pytest.raises(ValueError, match="already names the Karras schedule"):
        resolve("DPM++ 2M Karras", "Exponential")


@pytest.mark.parametrize(
    ("name", "schedule", "reason"),
    [
        ("DPM++ 2S a", None, "no ancestral single-step"),
        ("DPM++ 2S a Karras", None, "no ancestral single-step"),
        ("DPM++ 3M SDE", None, "third-order SDE"),
        ("DPM++ 3M SDE Exponential", None, "third-order SDE"),
        ("DPM fast", None, "no equivalent"),
        ("DPM adaptive", None, "adaptive"),
        ("Restart", None, "Restart"),
        ("DPM++ 2M Align Your Steps", None, "fixed sigma table"),
        ("Euler", "KL Optimal", "KL-optimal"),
        ("Euler", "Polyexponential", "polyexponential"),
    ],
)
def test_webui_names_diffusers_cannot_express_explain_why(name, schedule, reason):
    with pytest.raises(ValueError, match="not available") as err:
        resolve(name, schedule)
    assert reason in str(err.value)
    assert " ".join(filter(None, (name, schedule))) not in list_presets()


def test_second_order_flags():
    for sampler in list_samplers():
        assert resolve(sampler).second_order == (sampler in SECOND_ORDER), sampler
        assert resolve(sampler).stochastic == (sampler in STOCHASTIC), sampler
    for name in list_presets():
        preset = resolve(name)
        assert preset.second_order == (preset.sampler in SECOND_ORDER)
        if not preset.missing:
            # diffusers marks schedulers that call the model twice per step with order 2.
            assert getattr(diffusers, preset.scheduler_class).order == (2 if preset.second_order else 1)


def test_presets_are_immutable_and_hashable():
    preset = resolve("DPM++ 2M Karras")
    preset.kwargs["use_karras_sigmas"] = False
    assert resolve("DPM++ 2M Karras").kwargs["use_karras_sigmas"] is True
    assert preset.kwargs["use_karras_sigmas"] is True
    with pytest.raises(AttributeError):
        preset.name = "x"
    assert len({preset, resolve("DPM++ 2M", "Karras")}) == 1


# --- optional packages ------------------------------------------------------------------------


def test_missing_package_raises_import_error(tiny_sd15, monkeypatch):
    monkeypatch.setattr(samplers, "_is_installed", lambda package: package not in {"torchsde", "scipy"})
    assert resolve("DPM++ SDE Karras").missing == ("torchsde",)
    assert resolve("Euler Beta").missing == ("scipy",)
    assert resolve("Euler Karras").missing == ()
    with pytest.raises(ImportError, match="pip install torchsde"):
        make_scheduler("DPM++ SDE Karras", tiny_sd15.scheduler.config)
    with pytest.raises(ImportError, match="pip install scipy"):
        make_scheduler("LMS", tiny_sd15.scheduler.config)
    with pytest.raises(ImportError, match="scipy"):
        make_scheduler("DPM++ 2M", tiny_sd15.scheduler.config, schedule="Beta")
    available = list_presets(available_only=True)
    assert "DPM++ 2M Karras" in available
    assert not {"DPM++ SDE", "LMS", "LMS Karras", "Euler Beta", "DPM++ 2M Beta"} & set(available)


def test_available_only_when_everything_is_installed(monkeypatch):
    monkeypatch.setattr(samplers, "_is_installed", lambda package: True)
    assert list_presets(available_only=True) == list_presets()


# --- building schedulers ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_builds_its_scheduler_keeping_model_settings(tiny_sd15, name):
    preset = resolve(name)
    base = tiny_sd15.scheduler.config
    if preset.missing:
        with pytest.raises(ImportError, match=preset.missing[0]):
            make_scheduler(name, base)
        return
    scheduler = make_scheduler(name, base)
    config = scheduler.config
    assert type(scheduler).__name__ == preset.scheduler_class
    for key, value in preset.kwargs.items():
        assert config[key] == value, key
    for key in ("beta_start", "beta_end", "beta_schedule", "num_train_timesteps", "prediction_type"):
        assert config[key] == base[key], key
    if "steps_offset" in config:
        assert config["steps_offset"] == base["steps_offset"] == 1
    if "timestep_spacing" in config:
        assert config["timestep_spacing"] == preset.kwargs.get("timestep_spacing", base["timestep_spacing"])
    for flag in SIGMA_FLAGS:
        assert config.get(flag, False) == preset.kwargs.get(flag, False), flag


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_expected_table_on_built_schedulers(tiny_sdxl, name):
    preset = resolve(name)
    if preset.missing:
        pytest.skip(f"needs {', '.join(preset.missing)}")
    cls_name, kwargs = EXPECTED[name]
    scheduler = make_scheduler(name, tiny_sdxl.scheduler)
    assert type(scheduler).__name__ == cls_name
    assert {k: scheduler.config[k] for k in kwargs} == kwargs
    # The SDXL config's "leading" spacing survives unless the preset sets one.
    assert scheduler.config.get("timestep_spacing", "leading") == kwargs.get("timestep_spacing", "leading")


def test_make_scheduler_accepts_scheduler_config_or_dict(tiny_sd15):
    from_scheduler = make_scheduler("Euler Karras", tiny_sd15.scheduler)
    from_config = make_scheduler("Euler", tiny_sd15.scheduler.config, schedule="Karras")
    from_dict = make_scheduler("euler karras", dict(tiny_sd15.scheduler.config))
    for scheduler in (from_scheduler, from_config, from_dict):
        assert isinstance(scheduler, diffusers.EulerDiscreteScheduler)
        assert scheduler.config.use_karras_sigmas is True
    with pytest.raises(TypeError, match="scheduler, its config or a dict"):
        make_scheduler("Euler", 42)


def test_karras_uses_the_models_full_sigma_range(tiny_sd15):
    model_sigma_max = float(make_scheduler("Euler Uniform", tiny_sd15.scheduler).sigmas.max())
    karras = make_scheduler("Euler Karras", tiny_sd15.scheduler)
    uniform = make_scheduler("Euler Uniform", tiny_sd15.scheduler)
    leading = make_scheduler("Euler", tiny_sd15.scheduler)  # the model's own "leading" spacing
    for scheduler in (karras, uniform, leading):
        scheduler.set_timesteps(10)
    assert karras.sigmas[0] == pytest.approx(model_sigma_max, rel=1e-4)
    assert not torch.allclose(karras.sigmas, uniform.sigmas)
    assert leading.sigmas[0] < 0.95 * model_sigma_max


def test_switching_presets_does_not_leak_settings(tiny_sd15):
    pipe = _copy(tiny_sd15)
    apply_sampler(pipe, "Euler Karras")
    assert pipe.scheduler.config.timestep_spacing == "linspace"
    apply_sampler(pipe, "Euler a")
    assert pipe.scheduler.config.timestep_spacing == "leading"  # the model's, not the last preset's
    apply_sampler(pipe, "DPM++ 2M SDE Karras")
    apply_sampler(pipe, "DPM++ 2M", "Exponential")
    config = pipe.scheduler.config
    assert (config.algorithm_type, config.use_karras_sigmas, config.use_exponential_sigmas) == (
        "dpmsolver++",
        False,
        True,
    )
    # A model shipping solver choices in its scheduler_config.json (as some community checkpoints
    # do) gets the preset's choices, not a mix.
    shipped = {
        **{k: v for k, v in tiny_sd15.scheduler.config.items() if not k.startswith("_")},
        "_class_name": "DPMSolverMultistepScheduler",
        "algorithm_type": "sde-dpmsolver++",
        "solver_order": 3,
        "use_karras_sigmas": True,
    }
    dpm = make_scheduler("DPM++ 2M Uniform", shipped).config
    assert (dpm.algorithm_type, dpm.solver_order, dpm.use_karras_sigmas) == ("dpmsolver++", 2, False)
    deis = make_scheduler("DEIS", shipped).config
    assert (deis.solver_order, deis.use_karras_sigmas, deis.timestep_spacing) == (2, False, "leading")


def test_apply_sampler_leaves_the_fixture_alone(tiny_sd15):
    original = tiny_sd15.scheduler
    pipe = _copy(tiny_sd15)
    preset = apply_sampler(pipe, "DPM++ 2M Karras")
    assert preset == resolve("DPM++ 2M Karras")
    assert isinstance(pipe.scheduler, diffusers.DPMSolverMultistepScheduler)
    assert tiny_sd15.scheduler is original
    assert type(tiny_sd15.scheduler).__name__ == "PNDMScheduler"


# --- generating -------------------------------------------------------------------------------


def _one_schedule_each() -> list[tuple[str, str]]:
    """Each sampler alone, plus once with a sigma schedule (or a spacing one if it has none)."""
    cases = []
    for sampler in list_samplers():
        cases.append((sampler, "Automatic"))
        schedules = list_schedules(sampler)
        other = next((s for s in ("Exponential", "Karras", "SGM Uniform") if s in schedules), None)
        if other and other != resolve(sampler).schedule:
            cases.append((sampler, other))
    return cases


def _quick_unless(cases: list, quick: set) -> list:
    """The cases, those not in ``quick`` marked slow: every sampler generates in ~2 s, dozens of
    them take over a minute; the quick run keeps one of each kind."""
    out = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        out.append(case if case in quick else pytest.param(*values, marks=pytest.mark.slow))
    return out


# A first-order, a multistep, a second-order and a stochastic sampler.
QUICK_SD15 = {("Euler", "Automatic"), ("DPM++ 2M", "Automatic"), ("Heun", "Automatic"), ("Euler a", "Automatic")}


@pytest.mark.parametrize(("sampler", "schedule"), _quick_unless(_one_schedule_each(), QUICK_SD15))
def test_generation_sd15(sd15, sampler, schedule):
    preset = resolve(sampler, schedule)
    if preset.missing:
        pytest.skip(f"needs {', '.join(preset.missing)}")
    assert apply_sampler(sd15, sampler, schedule) == preset
    images = []
    calls = _count_unet_calls(sd15, lambda: images.append(_generate(sd15, noise_seed=0)))
    _assert_image(images[0])
    # CFG batches both halves into one call: one call per model evaluation. PLMS repeats one
    # timestep to start its multistep history.
    expected_calls = 2 * STEPS - 1 if preset.second_order else STEPS + (preset.sampler == "PLMS")
    assert calls == expected_calls
    # Same starting latents, different noise seed: only stochastic samplers notice.
    again = _generate(sd15, noise_seed=1)
    assert np.array_equal(images[0], again) != preset.stochastic


@pytest.mark.parametrize("sampler", _quick_unless(list_samplers(), {"Euler"}))
def test_generation_sdxl(sdxl, sampler):
    preset = resolve(sampler)
    if preset.missing:
        pytest.skip(f"needs {', '.join(preset.missing)}")
    apply_sampler(sdxl, sampler)
    _assert_image(_generate(sdxl))


@pytest.mark.slow
def test_v_prediction_is_kept(sd2v):
    assert sd2v.scheduler.config.prediction_type == "v_prediction"
    for name in list_presets(available_only=True):
        assert make_scheduler(name, sd2v.scheduler).config.prediction_type == "v_prediction", name
    for name in ("DPM++ 2M Karras", "Euler a", "DPM2 a", "DDIM", "UniPC"):
        pipe = _copy(sd2v)
        apply_sampler(pipe, name)
        assert pipe.scheduler.config.prediction_type == "v_prediction"
        _assert_image(_generate(pipe))


def test_webui_name_of_every_scheduler_made_here_names_the_same_scheduler(tiny_sd15):
    """The name an answer reports for a scheduler builds that scheduler again (a model's own
    scheduler included: SD 1.5's PNDM config is the WebUI's PLMS, not 'PNDMScheduler')."""
    import diffusers

    from sd_accel.core import MissingDependency
    from sd_accel.samplers import webui_name

    assert type(tiny_sd15.scheduler).__name__ == "PNDMScheduler"
    assert webui_name(tiny_sd15.scheduler) == "PLMS"
    assert webui_name(diffusers.PNDMScheduler(skip_prk_steps=False)) is None  # no WebUI sampler does PRK

    def plain(config):
        return {k: v for k, v in dict(config).items() if not k.startswith("_")}

    checked = 0
    for name in list_presets(available_only=True):
        try:
            made = make_scheduler(name, tiny_sd15.scheduler)
        except MissingDependency:
            continue
        again = make_scheduler(webui_name(made), tiny_sd15.scheduler)
        assert type(again) is type(made) and plain(again.config) == plain(made.config), (name, webui_name(made))
        checked += 1
    assert checked > 50


def test_unknown_sampler_points_to_the_command_that_lists_every_name():
    with pytest.raises(ValueError, match=r"`sd-accel samplers` lists all \d+ names"):
        resolve("zzzz")
    with pytest.raises(ValueError, match=r"closest matches: Euler.*`sd-accel samplers` lists all"):
        resolve("Eular")


def test_tcd_takes_the_noise_seed_only_with_eta(sd15):
    """TCD's gamma is the call's ``eta``: at the pipelines' default 0 it is deterministic, at 0.3
    (its paper's value) the sampler's own noise changes the image."""
    apply_sampler(sd15, "TCD")
    assert np.array_equal(_generate(sd15, noise_seed=0), _generate(sd15, noise_seed=1))
    assert not np.allclose(_generate(sd15, 0, eta=0.3), _generate(sd15, 1, eta=0.3), atol=1e-4)
