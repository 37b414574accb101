"""GenerationParams, the one place every face checks a generation request, and generate() itself."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest

from sd_accel.core import InvalidType, InvalidValue
from sd_accel.generate import MAX_SEED, GenerationParams, generate


def test_defaults_and_edges_are_valid():
    GenerationParams()
    for fields in (dict(steps=1), dict(steps=150), dict(cfg=0), dict(cfg=100.0), dict(cfg=7), dict(batch=64),
                   dict(width=8, height=4096), dict(width=None, height=None), dict(seed=-1), dict(seed=MAX_SEED),
                   dict(sampler="DPM++ 2M Karras"), dict(sampler="euler a"), dict(prompt="", negative_prompt="x")):
        assert GenerationParams(**fields)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("steps", 0), ("steps", -3), ("steps", 151), ("steps", 2.5), ("steps", True), ("steps", "20"),
        ("cfg", math.nan), ("cfg", math.inf), ("cfg", -1.0), ("cfg", 100.5), ("cfg", "7"), ("cfg", False),
        ("batch", 0), ("batch", 65), ("batch", 1.0),
        ("width", 65), ("width", 0), ("width", -64), ("width", 4104), ("width", True), ("height", 60),
        ("seed", -2), ("seed", MAX_SEED + 1), ("seed", 1.5),
        ("prompt", None), ("prompt", 3), ("negative_prompt", 5),
    ],
)
def test_every_bad_value_names_its_field(field, value):
    with pytest.raises(InvalidValue, match=rf"^GenerationParams\.{field}=.* is not valid; allowed: "):
        GenerationParams(**{field: value})


def test_an_unknown_sampler_is_refused_with_the_closest_names():
    with pytest.raises(InvalidValue, match="unknown sampler 'Eular'.*Euler"):
        GenerationParams(sampler="Eular")


def test_params_are_frozen_and_round_trip_as_a_dict():
    params = GenerationParams(prompt="a cat", steps=4, width=64, height=64, seed=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.steps = 0  # type: ignore[misc]
    assert GenerationParams(**params.to_dict()) == params


def test_seed_minus_one_draws_a_seed_in_range():
    assert GenerationParams(seed=42).resolved_seed() == 42
    drawn = {GenerationParams(seed=-1).resolved_seed() for _ in range(5)}
    assert all(0 <= s <= MAX_SEED for s in drawn) and len(drawn) > 1


def test_checking_a_request_imports_neither_torch_nor_diffusers():
    code = ("import sys; from sd_accel.generate import GenerationParams; GenerationParams(sampler='Euler a'); "
            "print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_generate_takes_only_generation_params():
    with pytest.raises(InvalidType, match="GenerationParams"):
        generate(None, {"prompt": "a cat", "steps": 0})


def test_generate_reports_the_seed_it_drew_and_that_seed_reproduces_the_image(tiny_sd15):
    pipe = tiny_sd15
    drawn = generate(pipe, GenerationParams(prompt="a cat", steps=2, width=64, height=64, seed=-1))
    assert 0 <= drawn.seed <= MAX_SEED and drawn.steps == 2 and drawn.unet_calls >= 2
    again = generate(pipe, GenerationParams(prompt="a cat", steps=2, width=64, height=64, seed=drawn.seed))
    assert again.seed == drawn.seed
    assert np.array_equal(np.asarray(drawn.images[0]), np.asarray(again.images[0]))
    assert drawn.images[0].size == (64, 64)
