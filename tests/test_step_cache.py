"""The first-block step cache of the transformer families (issue 44, part 4): the cut it needs, its
rule on ONNX Runtime fp32 engines of tiny SD3 and FLUX.1 models (real architecture, random
weights) against a torch reference of the same rule, its reset between generations, and that it is
off unless asked for."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from sd_accel import accelerate, build_engines, load_pipeline, stats
from sd_accel.calibration import feed_from_call
from sd_accel.components import specs_for
from sd_accel.components.segments import FIRST_RESIDUAL, SegmentSpec, state_name, step_cache_plan
from sd_accel.config import AccelConfig
from sd_accel.core import InvalidValue
from sd_accel.profiles import Profile
from sd_accel.runtime.step_cache import StepCacheRule, relative_change

PROFILE = Profile(batch=(1, 1, 2), height=64, width=64, text=64)
STEPS = 6
CALL = dict(prompt="a cat", num_inference_steps=STEPS, height=64, width=64, max_sequence_length=64,
            output_type="np")
MODELS = ("builtin:tiny-flux", "builtin:tiny-sd3")
HUGE = 1e6  # every step the rule allows is cached


@pytest.fixture(scope="session")
def step_cache_engines(tmp_path_factory):
    """An engine dir with each tiny model's transformer cut for the step cache (ORT fp32)."""
    root = tmp_path_factory.mktemp("step-cache-engines")
    for name in MODELS:
        (record,) = build_engines(load_pipeline(name), profiles=[PROFILE], backend="onnxruntime", precision="fp32",
                                  components=["transformer"], engine_dir=root, progress=False, step_cache=True)
        assert record.key.layout.startswith("fbc3-") and record.validation["ok"], record.validation
    return root


def _pipe(name: str, engine_dir, step_cache: float | None):
    return accelerate(load_pipeline(name), AccelConfig(engines=True, engine_dir=str(engine_dir), precision="fp32",
                                                       backend="onnxruntime", step_cache=step_cache))


def _run(pipe, seed: int = 0, **more) -> np.ndarray:
    return pipe(generator=torch.Generator("cpu").manual_seed(seed), **{**CALL, **more}).images


class ReferenceStepCache:
    """The same first-block cache rule in torch, on the torch segment modules of the cut: one call
    count per stream (prompt), the first two and the last step in full, the rest cached where the
    first block's residual changed by less than ``threshold`` since the last full step."""

    def __init__(self, pipe, threshold: float, steps: int) -> None:
        self.spec = specs_for(pipe)["transformer"]
        self.parts = [SegmentSpec(self.spec, s) for s in step_cache_plan(self.spec).segments]
        self.threshold, self.steps = threshold, steps
        self.streams: dict[tuple, dict] = {}

    def _segment(self, k: int, state: dict) -> None:
        part = self.parts[k]
        out = part.torch_module()(*(state[t.name] for t in part.inputs()))
        state.update({state_name(t.name): o for t, o in zip(part.outputs(), out, strict=True)})

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        feed = {k: torch.from_numpy(v) for k, v in feed_from_call(self.spec, args, kwargs).items()}
        key = (float(feed["pooled_projections"].sum()), float(feed["encoder_hidden_states"].sum()))
        stream = self.streams.setdefault(key, {"step": 0, "cached": 0, "first": None, "rest": None})
        state = dict(feed)
        self._segment(0, state)
        hidden, first = state["hidden"], state[FIRST_RESIDUAL]
        step = stream["step"]
        if 2 <= step < self.steps - 1 and relative_change(first, stream["first"]) < self.threshold:
            state["hidden"] = hidden + stream["rest"]
            stream["cached"] += 1
        else:
            for k in range(1, len(self.parts) - 1):
                self._segment(k, state)
            stream["first"], stream["rest"] = first, state["hidden"] - hidden
        self._segment(len(self.parts) - 1, state)
        stream["step"] += 1
        sample = state["latent"]
        return Transformer2DModelOutput(sample=sample) if kwargs.get("return_dict", True) else (sample,)


def test_the_cut_for_a_step_cache():
    flux = specs_for(load_pipeline("builtin:tiny-flux"))["transformer"]
    plan = step_cache_plan(flux)
    assert plan.tag.startswith("fbc3-") and plan.kind == "fbc"
    first, middle, last = plan.segments
    assert first.blocks == (("transformer_blocks", 0),) and first.residual and first.first
    assert middle.blocks == (("single_transformer_blocks", 0), ("single_transformer_blocks", 1))
    assert last.blocks == () and last.last and not last.residual
    parts = [SegmentSpec(flux, s) for s in plan.segments]
    assert [t.name for t in parts[0].outputs()] == ["hidden_next", "context_next", "temb", FIRST_RESIDUAL]
    assert [t.name for t in parts[2].inputs()] == ["hidden", "temb"]
    sd3_specs = specs_for(load_pipeline("builtin:tiny-sd3"))
    sd3 = sd3_specs["transformer"]
    parts = [SegmentSpec(sd3, s) for s in step_cache_plan(sd3).segments]
    # SD3's last block (context_pre_only) ends the middle segment: it passes on the image tokens only
    assert [t.name for t in parts[1].outputs()] == ["hidden_next"]
    assert [t.name for t in parts[2].inputs()] == ["hidden", "temb", "hidden_states"]
    # T5 and the UNet are never cut for it
    assert step_cache_plan(sd3_specs["t5"]) is None


def test_off_by_default_and_checked():
    assert AccelConfig().step_cache is None
    for bad in (-0.1, float("nan"), "0.1", True):
        with pytest.raises(InvalidValue, match="step_cache"):
            AccelConfig(step_cache=bad)
    with pytest.raises(ValueError, match="first and the last"):
        StepCacheRule(0.1, full_first=0)


def test_off_by_default_on_engines(step_cache_engines):
    pipe = _pipe("builtin:tiny-flux", step_cache_engines, None)
    assert pipe.transformer.step_cache is None and pipe.sd_accel.step_cache is None
    _run(pipe)
    assert "step_cache" not in stats(pipe)["transformer"]


@pytest.mark.parametrize("name", MODELS)
def test_threshold_zero_caches_nothing_and_equals_the_uncached_engine(step_cache_engines, name):
    uncached = _run(_pipe(name, step_cache_engines, None))
    pipe = _pipe(name, step_cache_engines, 0.0)
    got = _run(pipe)
    s = stats(pipe)["transformer"]
    assert s["step_cache"]["calls"] == STEPS and s["step_cache"]["cached"] == 0, s
    assert s["engine_calls"] == STEPS and s["torch_calls"] == 0, s
    assert np.abs(got - uncached).max() < 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_large_threshold_caches_and_matches_the_torch_rule(step_cache_engines, name, caplog):
    pipe = _pipe(name, step_cache_engines, HUGE)
    with caplog.at_level(logging.INFO, logger="sd_accel"):
        got = _run(pipe)
    s = stats(pipe)["transformer"]["step_cache"]
    assert s == {"calls": STEPS, "cached": STEPS - 3, "last_generation": {"calls": STEPS, "cached": STEPS - 3}}
    assert f"{STEPS - 3} of {STEPS} transformer calls of this generation reused" in caplog.text
    ref_pipe = accelerate(load_pipeline(name), precision="fp32")
    reference = ReferenceStepCache(ref_pipe, HUGE, STEPS)
    ref_pipe.transformer.forward = reference
    want = _run(ref_pipe)
    assert sum(st["cached"] for st in reference.streams.values()) == STEPS - 3
    assert np.abs(got - want).max() < 2e-3
    # a cached run is not the uncached one (the rule did something)
    assert np.abs(got - _run(_pipe(name, step_cache_engines, None))).max() > 1e-4


def test_flux_true_cfg_keeps_one_cache_per_prompt(step_cache_engines):
    """FLUX.1's true CFG calls the transformer twice a step (prompt, negative prompt): two streams,
    each with its own residuals, as the torch rule keyed by prompt."""
    more = dict(negative_prompt="a dog", true_cfg_scale=2.0)
    pipe = _pipe("builtin:tiny-flux", step_cache_engines, HUGE)
    got = _run(pipe, **more)
    s = stats(pipe)["transformer"]["step_cache"]
    assert s["calls"] == 2 * STEPS and s["cached"] == 2 * (STEPS - 3), s
    assert s["last_generation"] == {"calls": 2 * STEPS, "cached": 2 * (STEPS - 3)}
    ref_pipe = accelerate(load_pipeline("builtin:tiny-flux"), precision="fp32")
    reference = ReferenceStepCache(ref_pipe, HUGE, STEPS)
    ref_pipe.transformer.forward = reference
    want = _run(ref_pipe, **more)
    assert len(reference.streams) == 2
    assert np.abs(got - want).max() < 2e-3


def test_state_resets_between_generations(step_cache_engines):
    name = "builtin:tiny-sd3"
    pipe = _pipe(name, step_cache_engines, HUGE)
    first = _run(pipe)
    again = _run(pipe)  # the same request: the second generation starts from nothing
    np.testing.assert_allclose(again, first, atol=1e-6)
    other = _run(pipe, seed=3, prompt="a red house")  # new latents, new prompt
    fresh = _run(_pipe(name, step_cache_engines, HUGE), seed=3, prompt="a red house")
    np.testing.assert_allclose(other, fresh, atol=1e-6)
    s = stats(pipe)["transformer"]["step_cache"]
    assert s["calls"] == 3 * STEPS and s["cached"] == 3 * (STEPS - 3), s


def test_an_engine_not_cut_for_it_runs_every_step(tmp_path, caplog):
    build_engines(load_pipeline("builtin:tiny-flux"), profiles=[PROFILE], backend="onnxruntime", precision="fp32",
                  components=["transformer"], engine_dir=tmp_path, progress=False)
    pipe = _pipe("builtin:tiny-flux", tmp_path, HUGE)
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        _run(pipe)
    s = stats(pipe)["transformer"]
    assert s["engine_calls"] == STEPS and s["step_cache"]["cached"] == 0, s
    assert "build_engines(pipe, step_cache=True)" in caplog.text


def test_without_engines_it_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        pipe = accelerate(load_pipeline("builtin:tiny-flux"), step_cache=0.1)
    assert pipe.sd_accel.step_cache is None and "not on engines" in caplog.text


def test_the_picture_gate_refuses_or_keeps_it(step_cache_engines, caplog):
    from sd_accel.generate import GenerationParams, check_step_cache
    from sd_accel.validate import STEP_CACHE_PSNR

    params = GenerationParams(prompt="a cat", steps=STEPS, cfg=0.0, width=64, height=64, seed=1)
    extra = {"max_sequence_length": 64}
    pipe = _pipe("builtin:tiny-flux", step_cache_engines, HUGE)
    kept = check_step_cache(pipe, params, gate=0.0, extra=extra)
    assert kept.ok and kept.cached == STEPS - 3 and kept.calls == STEPS and kept.gate == 0.0
    assert pipe.transformer.step_cache is not None and pipe.sd_accel.step_cache == HUGE
    assert kept.summary()["cached_calls"] == STEPS - 3 and kept.psnr < 60  # (the cache changed the picture)
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        refused = check_step_cache(pipe, params, gate=kept.psnr + 1, extra=extra)
    assert not refused.ok and "below the picture gate" in caplog.text
    assert pipe.transformer.step_cache is None and pipe.sd_accel.step_cache is None  # turned off
    assert check_step_cache(pipe, params, 0.0, extra=extra).psnr == float("inf")  # nothing cached: the same picture
    assert STEP_CACHE_PSNR == 35.0
    with pytest.raises(InvalidValue, match="no step cache to check"):
        check_step_cache(accelerate(load_pipeline("builtin:tiny-flux")), params)


def test_cli_flags(capsys):
    from sd_accel.cli import main

    assert main(["generate", "--step-cache", "-1", "--model", "builtin:tiny-flux"]) == 2
    assert "step_cache" in capsys.readouterr().err
    assert main(["generate", "--step-cache-check", "--model", "builtin:tiny-flux"]) == 2
    assert "--step-cache-check needs --step-cache" in capsys.readouterr().err


class _StubChain:
    """A chained runner of three links whose first gives a fixed residual: what the rule reads."""

    def __init__(self) -> None:
        from sd_accel.backends.chain import ChainLink

        self.links = [ChainLink("seg00", (), {}, ("x",), ("hidden_next", FIRST_RESIDUAL), ("hidden", FIRST_RESIDUAL)),
                      ChainLink("seg01", (), {}, ("hidden",), ("hidden_next",), ("hidden",)),
                      ChainLink("seg02", (), {}, ("hidden",), ("latent",), ("latent",))]
        self.ran: list[int] = []
        self.shapes = {}

    def run_links(self, state: dict, start: int, stop: int) -> dict:
        state = dict(state)
        for k in range(start, stop):
            self.ran.append(k)
            if k == 0:
                state.update(hidden=state["x"] + 1, first_residual=torch.ones(2))
            elif k == 1:
                state["hidden"] = state["hidden"] * 10
            else:
                state["latent"] = state["hidden"] - 1
        return state

    def infer(self, feed: dict) -> dict:
        return {"latent": self.run_links(feed, 0, 3)["latent"]}


def test_the_rule_on_a_stub_chain(caplog):
    from sd_accel.runtime.step_cache import StepCache, StepPosition

    where = {"pos": None}
    cache = StepCache(StepCacheRule(0.5), lambda: where["pos"])
    chain, feed = _StubChain(), {"x": torch.zeros(2)}
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        cache.infer(chain, feed, ("a",))
        cache.infer(chain, feed, ("a",))
    assert caplog.text.count("does not say which step") == 1 and cache.stats.calls == 0  # (said once, run whole)
    outs = []
    for i in range(5):
        where["pos"] = StepPosition(i, 5, 1)
        chain.ran.clear()
        outs.append(cache.infer(chain, feed, ("a",))["latent"])
        assert chain.ran == ([0, 2] if 2 <= i < 4 else [0, 1, 2]), (i, chain.ran)  # first 2 and the last: full
    assert all(torch.equal(o, outs[0]) for o in outs)  # (an unchanging residual: the cached result is exact)
    assert cache.stats.calls == 5 and cache.stats.cached == 2
    assert cache.stats.last_generation == {"calls": 5, "cached": 2}
    where["pos"] = StepPosition(2, 5, 2)  # a new schedule: nothing to reuse at first
    chain.ran.clear()
    cache.infer(chain, feed, ("a",))
    assert chain.ran == [0, 1, 2]


@pytest.mark.slow
def test_cli_build_and_generate_with_the_step_cache(tmp_path, capsys):
    """`sd-accel build --step-cache`, then `generate --step-cache --step-cache-check` on it."""
    import json

    from sd_accel.cli import main

    engines = str(tmp_path / "engines")
    assert main(["build", "--model", "builtin:tiny-flux", "--static", "--height", "64", "--width", "64",
                 "--text", "512", "--components", "transformer", "--backend", "onnxruntime", "--precision", "fp32",
                 "--step-cache", "--engine-dir", engines, "--json"]) == 0
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ".fbc3-" in built["engines"][0]["name"]
    out = tmp_path / "img.png"
    assert main(["generate", "--model", "builtin:tiny-flux", "--engines", "--engine-dir", engines, "--backend",
                 "onnxruntime", "--precision", "fp32", "--size", "64x64", "--steps", "6", "--step-cache", "1000",
                 "--step-cache-check", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    check = report["step_cache_check"]
    assert check["cached_calls"] == 3 and check["calls"] == 6 and check["gate_db"] == 35.0, check
    assert "step cache: 3 of 6 calls cached" in report["components"]["transformer"] or not check["ok"]
    assert report["step_cache"] == (1000 if check["ok"] else None) and out.exists()
