"""The OpenVINO backend on tiny SD 1.5: same builder/runner contract as ONNX Runtime."""

from __future__ import annotations

import builtins
import sys

import numpy as np
import pytest
import torch

from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, stats
from sd_accel.backends.openvino import OpenVinoBackend
from sd_accel.backends.openvino.builder import has_bf16

STATIC = dict(batch=1, height=64, width=64)
DYNAMIC = dict(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96))


def test_info_says_why_when_openvino_is_missing(monkeypatch):
    real_import = builtins.__import__

    def no_openvino(name, *args, **kwargs):
        if name == "openvino" or name.startswith("openvino."):
            raise ImportError("No module named 'openvino'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "openvino", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_openvino)
    info = OpenVinoBackend().info()
    assert not info.usable and "pip install openvino" in info.why_not


pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    engine_dir = tmp_path_factory.mktemp("ov-engines")
    pipe = load_pipeline("builtin:tiny-sd15")
    precisions = ["fp32", "bf16"] if has_bf16() else ["fp32"]
    records = []
    for precision in precisions:
        records += build_engines(pipe, profiles=[STATIC], backend="openvino", precision=precision,
                                 components=["unet", "vae_decoder"], engine_dir=engine_dir, progress=False)
    records += build_engines(pipe, profiles=[DYNAMIC], backend="openvino", precision="fp32",
                             components=["unet"], engine_dir=engine_dir, progress=False)
    return engine_dir, records


def test_engines_are_built_validated_and_keyed_by_cpu_class(built):
    from sd_accel.device import cpu_class

    _, records = built
    assert all(r.status == "ok" and r.key.backend == "openvino" and r.key.arch == cpu_class() for r in records)
    for r in records:
        assert r.validation["rel_l2"] <= {"fp32": 1e-3, "bf16": 5e-2}[r.key.precision]


def test_generation_on_openvino_engines_matches_torch(built):
    engine_dir, _ = built

    def run(**config):
        pipe = accelerate(load_pipeline("builtin:tiny-sd15"), AccelConfig(precision="fp32", sampler="Euler", **config))
        g = torch.Generator("cpu").manual_seed(0)
        img = pipe("a cat", num_inference_steps=3, height=64, width=64, generator=g, output_type="np").images
        return pipe, img

    _, ref = run()
    pipe, got = run(engines=True, engine_dir=str(engine_dir), backend="openvino")
    assert stats(pipe)["unet"]["engine_calls"] >= 3
    assert np.abs(got - ref).max() < 0.05


def test_dynamic_engine_serves_a_size_between_min_and_max(built):
    engine_dir, records = built
    dyn = next(r for r in records if not r.key.profile.startswith("static"))
    from sd_accel import EngineCache

    runner = OpenVinoBackend().load(EngineCache(engine_dir).engine_dir(dyn.key), dyn.files, dyn.shapes)
    feed = {"sample": torch.randn(1, 4, 10, 11), "timestep": torch.tensor([10.0]),
            "encoder_hidden_states": torch.randn(1, 77, runner.shapes["encoder_hidden_states"][0][2])}
    out = runner.infer(feed)["latent"]
    assert out.shape == (1, 4, 10, 11) and torch.isfinite(out).all()
