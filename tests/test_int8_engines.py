"""INT8 engines on tiny SD 1.5: static quantization calibrated on real prompt runs, the accuracy
gate (error stored in the index; an over-threshold engine refused), dynamic quantization."""

from __future__ import annotations

import pytest
import torch

from sd_accel import EngineCache, build_engines, load_pipeline
from sd_accel.calibration import calibration_for, capture_calibration
from sd_accel.components import specs_for
from sd_accel.core import CalibrationSet, EngineError
from sd_accel.profiles import Profile

STATIC = dict(batch=1, height=64, width=64)


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("builtin:tiny-sd15")


def test_capture_records_unet_vae_and_clip_inputs(pipe):
    specs = {n: s for n, s in specs_for(pipe).items() if n in ("unet", "vae_decoder", "clip")}
    sets = capture_calibration(pipe, specs, height=64, width=64, prompts=["a cat", "a dog"], steps=3)
    assert len(sets["unet"]) >= 6  # 2 prompts x 3 steps (PNDM adds a warm-up call)
    feed = sets["unet"].feeds[0]
    assert feed["sample"].shape == (2, 4, 8, 8)  # guidance doubles the batch
    assert feed["timestep"].shape == (2,)
    assert feed["encoder_hidden_states"].shape[:2] == (2, 77)
    assert len(sets["vae_decoder"]) == 2 and sets["vae_decoder"].feeds[0]["latent"].shape == (1, 4, 8, 8)
    assert len(sets["clip"]) >= 2


def test_calibration_is_cached_on_disk(pipe, tmp_path):
    spec = specs_for(pipe)["unet"]
    first = calibration_for(spec, Profile.of(STATIC), tmp_path, prompts=["a cat"], steps=2)
    assert list((tmp_path / "calibration").glob("*-unet-*.npz"))
    again = calibration_for(spec, Profile.of(STATIC), tmp_path, prompts=["a cat"], steps=2)
    assert isinstance(again, CalibrationSet) and len(again) == len(first) >= 2
    assert (again.feeds[1]["sample"] == first.feeds[1]["sample"]).all()


def _build(pipe, engine_dir, precision):
    return build_engines(pipe, profiles=[STATIC], components=["unet"], backend="onnxruntime",
                         precision=precision, engine_dir=engine_dir, progress=False)


@pytest.mark.slow
def test_static_int8_engine_is_built_validated_and_recorded(pipe, tmp_path):
    (rec,) = _build(pipe, tmp_path, "int8")
    assert rec.status == "ok" and rec.key.precision == "int8"
    assert 0 < rec.validation["rel_l2"] <= 0.1  # the error is stored in the index
    stored = [r for r in EngineCache(tmp_path).find(component="unet") if r.key.precision == "int8"]
    assert stored and stored[0].validation["rel_l2"] == rec.validation["rel_l2"]
    assert list((tmp_path / "calibration").glob("*.npz"))  # captured from prompt runs, kept


@pytest.mark.slow
def test_engine_over_the_int8_threshold_is_refused(pipe, tmp_path, monkeypatch):
    import sd_accel.validate as validate

    monkeypatch.setitem(validate.TOLERANCE, "int8", 1e-9)
    with pytest.raises(EngineError, match="failed validation"):
        _build(pipe, tmp_path, "int8")
    assert not [r for r in EngineCache(tmp_path).find(component="unet") if r.key.precision == "int8"]


@pytest.mark.slow
def test_dynamic_int8_needs_no_calibration(pipe, tmp_path):
    (rec,) = _build(pipe, tmp_path, "int8-dynamic")
    assert rec.status == "ok" and rec.validation["rel_l2"] <= 0.1
    assert not (tmp_path / "calibration").exists()


def test_static_int8_without_calibration_teaches(tmp_path, pipe):
    from sd_accel.backends.onnxruntime.quantize import quantize_onnx
    from sd_accel.onnx.export import onnx_artifact

    spec = specs_for(pipe)["unet"]
    path = onnx_artifact(spec, tmp_path)
    with pytest.raises(EngineError, match="int8-dynamic"):
        quantize_onnx(path, tmp_path / "q.onnx", "int8", spec.shape_ranges(Profile.of(STATIC)))
    torch.manual_seed(0)
