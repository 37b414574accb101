"""The OpenVINO backend on tiny SD 1.5: same builder/runner contract as ONNX Runtime."""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import shutil
import sys
from pathlib import Path

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


@pytest.mark.slow
def test_engines_are_built_validated_and_keyed_by_cpu_class(built):
    from sd_accel.device import cpu_class

    _, records = built
    assert all(r.status == "ok" and r.key.backend == "openvino" and r.key.arch == cpu_class() for r in records)
    for r in records:
        assert r.validation["rel_l2"] <= {"fp32": 1e-3, "bf16": 5e-2}[r.key.precision]


@pytest.mark.slow
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


@pytest.mark.slow
def test_dynamic_engine_serves_a_size_between_min_and_max(built):
    engine_dir, records = built
    dyn = next(r for r in records if not r.key.profile.startswith("static"))
    from sd_accel import EngineCache

    runner = OpenVinoBackend().load(EngineCache(engine_dir).engine_dir(dyn.key), dyn.files, dyn.shapes)
    feed = {"sample": torch.randn(1, 4, 10, 11), "timestep": torch.tensor([10.0]),
            "encoder_hidden_states": torch.randn(1, 77, runner.shapes["encoder_hidden_states"][0][2])}
    out = runner.infer(feed)["latent"]
    assert out.shape == (1, 4, 10, 11) and torch.isfinite(out).all()


@pytest.fixture(scope="module")
def dynamic_fp32(tmp_path_factory):
    """A dynamic fp32 UNet engine of tiny SD 1.5 (its own folder)."""
    engine_dir = tmp_path_factory.mktemp("ov-dynamic")
    (record,) = build_engines(load_pipeline("builtin:tiny-sd15"), profiles=[DYNAMIC], backend="openvino",
                              precision="fp32", components=["unet"], engine_dir=engine_dir, progress=False)
    from sd_accel import EngineCache

    return EngineCache(engine_dir).engine_dir(record.key), record


def test_fixed_shapes_compile_per_call_shape_match_the_dynamic_engine_and_are_kept_bounded(dynamic_fp32,
                                                                                        monkeypatch):
    from sd_accel.backends.openvino import runner as runner_mod

    folder, record = dynamic_fp32
    assert "engine.xml" in record.files  # a dynamic engine keeps its graph for fixed-shape compiles
    width = record.shapes["encoder_hidden_states"][0][2]

    def feed(batch: int, h: int, w: int, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {"sample": torch.randn(batch, 4, h, w, generator=g), "timestep": torch.full((batch,), 10.0),
                "encoder_hidden_states": torch.randn(batch, 77, width, generator=g)}

    feeds = [feed(2, 8, 8, 0), feed(1, 12, 12, 1), feed(2, 8, 8, 2), feed(1, 10, 11, 3)]
    monkeypatch.delenv(runner_mod.FIXED_SHAPES_ENV, raising=False)
    dynamic = OpenVinoBackend().load(folder, record.files, record.shapes)
    assert dynamic.graph is None
    want = [dynamic.infer(f)["latent"] for f in feeds]
    assert not dynamic.fixed and dynamic.fixed_compiles == 0
    weights = (folder / "engine.bin").stat().st_size
    assert dynamic.once_bytes == 0 and dynamic.per_shape_bytes == 0  # (it has run: its weights are loaded)
    assert OpenVinoBackend().load(folder, record.files, record.shapes).once_bytes == weights  # not yet
    monkeypatch.setenv(runner_mod.FIXED_SHAPES_ENV, "1")
    fixed = OpenVinoBackend().load(folder, record.files, record.shapes)
    assert fixed.once_bytes == fixed.per_shape_bytes == weights  # each shape compiled holds a copy
    got = []
    for f in feeds:
        got.append(fixed.infer(f)["latent"])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    # three shapes: the third call's shape was compiled before (kept), the fourth drops the oldest
    assert fixed.fixed_compiles == 3
    assert len(fixed.fixed) == runner_mod.FIXED_SHAPES_KEPT == 2
    kept = [dict(k)["sample"] for k in fixed.fixed]
    assert kept == [(2, 4, 8, 8), (1, 4, 10, 11)]
    # a static engine has nothing to reshape: the option leaves it as it is
    static = OpenVinoBackend().load(folder, record.files, {k: (v[0], v[0], v[0]) for k, v in record.shapes.items()})
    assert static.graph is None


needs_nncf = pytest.mark.skipif(not OpenVinoBackend().precisions().count("int8"),
                                reason="OpenVINO int8 needs NNCF, which is not installed")


@pytest.fixture(scope="module")
def int8_built(tmp_path_factory):
    """A float and an int8 UNet engine for the same profile, in one engine folder."""
    engine_dir = tmp_path_factory.mktemp("ov-int8")
    pipe = load_pipeline("builtin:tiny-sd15")
    records = {}
    for precision in ("int8", "fp32"):
        (records[precision],) = build_engines(pipe, profiles=[STATIC], backend="openvino", precision=precision,
                                              components=["unet"], engine_dir=engine_dir, progress=False)
    return engine_dir, records


@needs_nncf
@pytest.mark.parametrize(("flags", "fix"), [({"avx2", "fma"}, "ENABLE"), ({"avx2", "avx_vnni"}, "FIRST_LAYER"),
                                            ({"avx512f", "avx512_vnni"}, "FIRST_LAYER"),
                                            ({"avx512f", "amx_int8", "amx_bf16"}, "FIRST_LAYER")])
def test_int8_weights_keep_to_7_bits_on_cpus_without_vnni(monkeypatch, flags, fix):
    """AVX2-only CPUs (an AMD EPYC Zen 3, say) sum u8 x s8 pairs in int16, which saturates with
    8-bit weights: there every layer gets NNCF's overflow fix; VNNI/AMX CPUs keep NNCF's default."""
    from nncf.quantization.advanced_parameters import OverflowFix

    import sd_accel.backends.openvino.quantize as quantize
    import sd_accel.device as device

    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))
    assert quantize._advanced_parameters().overflow_fix == OverflowFix[fix]


@pytest.mark.slow
def test_int8_keeps_the_latent_input_and_full_resolution_decoder_convolutions_in_float(tmp_path):
    import openvino as ov

    from sd_accel.backends.openvino.quantize import float_convolutions
    from sd_accel.components import specs_for
    from sd_accel.onnx.export import onnx_artifact

    spec = specs_for(load_pipeline("builtin:tiny-sd15"))["unet"]
    names = float_convolutions(ov.convert_model(str(onnx_artifact(spec, tmp_path))))
    assert any("conv_in" in n for n in names) and any("conv_out" in n for n in names)
    # the last decoder level (up_blocks.1 of the two-level tiny UNet) stays float, the encoder does not
    assert any("up_blocks.1/resnets.1/conv2" in n for n in names)
    assert not any("down_blocks" in n or "mid_block" in n for n in names)
    # the wide scope quantizes the last decoder level too: only conv_in and conv_out stay float
    wide = float_convolutions(ov.convert_model(str(onnx_artifact(spec, tmp_path))), "wide")
    assert len(wide) == 2 and "conv_in" in wide[0] and "conv_out" in wide[1]


@pytest.mark.slow
@needs_nncf
def test_int8_engine_is_quantized_validated_and_recorded(int8_built):

    engine_dir, records = int8_built
    rec = records["int8"]
    assert rec.status == "ok" and rec.key.precision == "int8" and "int8" in rec.key.name
    assert 0 < rec.validation["rel_l2"] <= 0.1  # measured on held-out captured steps, kept in the index
    assert list((engine_dir / "calibration").glob("*-unet-*.npz"))
    from sd_accel import EngineCache

    runner = OpenVinoBackend().load(EngineCache(engine_dir).engine_dir(rec.key), rec.files, rec.shapes)
    ran = {(op.get_rt_info()["layerType"].astype(str), op.get_rt_info()["runtimePrecision"].astype(str))
           for op in runner.compiled.get_runtime_model().get_ops()}
    # convolutions and linear layers run int8 kernels; the kept convolutions run in float
    assert ("Convolution", "u8") in ran and ("FullyConnected", "u8") in ran
    assert ("Convolution", "bf16" if has_bf16() else "f32") in ran
    # the record says which int8 scope passed the gate, and the engine is that one (the tiny UNet's
    # wide engine is over the gate: 10-13% error per call, so its build took the safe one)
    last_level = [op.get_friendly_name() for op in runner.compiled.get_runtime_model().get_ops()
                  if op.get_rt_info()["layerType"].astype(str) == "Convolution"
                  and op.get_rt_info()["runtimePrecision"].astype(str) != "u8"
                  and "up_blocks.1/resnets" in op.get_friendly_name()]
    assert bool(last_level) == (rec.extra["int8_scope"] == "safe"), (rec.extra, last_level)


@pytest.mark.slow
@needs_nncf
@pytest.mark.parametrize("wide_passes", [True, False], ids=["wide-passes", "wide-fails"])
def test_int8_build_takes_the_wide_scope_only_when_it_passes_its_check(tmp_path, monkeypatch, caplog, wide_passes):
    import dataclasses
    import logging

    import sd_accel.validate

    real = sd_accel.validate.validate
    verdicts = []

    def judged(*args, **kwargs):
        result = real(*args, **kwargs)
        if not verdicts:  # the wide scope's engine, judged as the test says
            result = dataclasses.replace(result, ok=wide_passes, why="" if wide_passes else "forced by the test")
        verdicts.append(result.ok)
        return result

    monkeypatch.setattr(sd_accel.validate, "validate", judged)
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        (rec,) = build_engines(load_pipeline("builtin:tiny-sd15"), profiles=[STATIC], backend="openvino",
                               precision="int8", components=["unet"], engine_dir=tmp_path, progress=False)
    assert rec.status == "ok"
    if wide_passes:
        assert verdicts == [True] and rec.extra["int8_scope"] == "wide" and "quantizing again" not in caplog.text
    else:
        assert verdicts == [False, True] and rec.extra["int8_scope"] == "safe"
        assert "quantizing again with the safe scope" in caplog.text
    # without validation nothing could turn the wide scope down: the safe one is built directly
    from sd_accel.build import int8_scopes

    assert int8_scopes(OpenVinoBackend(), "int8", validate_it=False) == ("safe",)
    assert int8_scopes(OpenVinoBackend(), "bf16", validate_it=True) == (None,)


@pytest.mark.slow
@needs_nncf
def test_engine_precision_picks_int8_or_float_when_both_cover_the_call(int8_built):
    engine_dir, records = int8_built

    def used(**config):
        pipe = accelerate(load_pipeline("builtin:tiny-sd15"),
                          AccelConfig(precision="fp32", sampler="Euler", engines=True, engine_dir=str(engine_dir),
                                      backend="openvino", **config))
        pipe("a cat", num_inference_steps=2, height=64, width=64, output_type="np")
        return set(stats(pipe)["unet"]["engines_used"])

    assert used(engine_precision="fp32") == {records["fp32"].key.name}
    assert used(engine_precision="int8") == {records["int8"].key.name}
    assert used() == {records["int8"].key.name}  # no preference: the faster precision among equals
    with pytest.raises(ValueError, match="engine_precision"):
        AccelConfig(engine_precision="int2")


@pytest.mark.slow
@needs_nncf
def test_cancelling_an_int8_build_during_quantization_keeps_nothing(tmp_path):
    import threading

    from sd_accel import EngineCache
    from sd_accel.build import BuildCancelled

    cancel = threading.Event()
    stages = []

    def progress(ev):
        stages.append(ev.stage)
        if "calibration sample" in ev.stage:
            cancel.set()  # the next per-sample tick inside NNCF stops the build

    with pytest.raises(BuildCancelled):
        build_engines(load_pipeline("builtin:tiny-sd15"), profiles=[STATIC], backend="openvino", precision="int8",
                      components=["unet"], engine_dir=tmp_path, progress=progress, cancel=cancel)
    assert any("calibration sample" in s for s in stages)
    assert not EngineCache(tmp_path).find(component="unet")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("unet.", ".tmp-"))]


@pytest.mark.slow
@needs_nncf
def test_int8_dynamic_profile_serves_sizes_between_min_and_max(tmp_path):
    (rec,) = build_engines(load_pipeline("builtin:tiny-sd15"), profiles=[DYNAMIC], backend="openvino",
                           precision="int8", components=["unet"], engine_dir=tmp_path, progress=False)
    assert rec.key.precision == "int8" and rec.validation["rel_l2"] <= 0.1
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"),
                      AccelConfig(precision="fp32", sampler="Euler", engines=True, engine_dir=str(tmp_path),
                                  backend="openvino", engine_fallback=False))
    image = pipe("a cat", num_inference_steps=2, height=80, width=96, output_type="np").images
    assert image.shape == (1, 80, 96, 3) and np.isfinite(image).all()
    assert stats(pipe)["unet"]["engine_calls"] == 2


@pytest.mark.slow
@needs_nncf
def test_int8_sdxl_unet_with_its_extra_conditioning_inputs(tmp_path):
    (rec,) = build_engines(load_pipeline("builtin:tiny-sdxl"), profiles=[STATIC], backend="openvino",
                           precision="int8", components=["unet"], engine_dir=tmp_path, progress=False)
    assert rec.key.precision == "int8" and 0 < rec.validation["rel_l2"] <= 0.1
    assert {"text_embeds", "time_ids"} <= set(rec.shapes)  # calibrated on every UNet input


@pytest.mark.slow
@needs_nncf
def test_int8_vae_decoder_is_quantized_validated_and_decodes_like_torch(int8_built, tmp_path, monkeypatch):
    """The VAE decoder in int8: calibrated on the latents the pipeline's prompt runs decode, its
    convolutions run int8 kernels, it passes the int8 gate, and a generation decodes on it to an
    image close to torch's. The gate's image PSNR is lowered to 35 dB here: the tiny random decoder
    makes 41-42 dB in int8, under the 45 dB that real decoders are held to (the next test)."""
    import sd_accel.validate as validate

    monkeypatch.setitem(validate.IMAGE_PSNR, "int8", 35.0)
    # the UNet's build captured every component's calibration data at once: reuse it, as one
    # engine folder would (a capture runs the whole pipeline several times)
    shutil.copytree(int8_built[0] / "calibration", tmp_path / "calibration")
    pipe = load_pipeline("builtin:tiny-sd15")
    (rec,) = build_engines(pipe, profiles=[STATIC], backend="openvino", precision="int8",
                           components=["vae_decoder"], engine_dir=tmp_path, progress=False)
    assert rec.status == "ok" and rec.key.component == "vae_decoder" and rec.key.precision == "int8"
    assert 0 < rec.validation["rel_l2"] <= 0.1 and rec.extra["int8_scope"] in ("wide", "safe")
    assert 35.0 <= rec.validation["image_psnr"] < 200  # judged by the picture too, and recorded
    assert list((tmp_path / "calibration").glob("*-vae_decoder-*.npz"))
    from sd_accel import EngineCache

    runner = OpenVinoBackend().load(EngineCache(tmp_path).engine_dir(rec.key), rec.files, rec.shapes)
    ran = {(op.get_rt_info()["layerType"].astype(str), op.get_rt_info()["runtimePrecision"].astype(str))
           for op in runner.compiled.get_runtime_model().get_ops()}
    runner.close()
    assert ("Convolution", "u8") in ran

    def image(p):
        g = torch.Generator("cpu").manual_seed(0)
        return p("a cat", num_inference_steps=2, height=64, width=64, generator=g, output_type="np").images

    want = image(accelerate(load_pipeline("builtin:tiny-sd15"), AccelConfig(precision="fp32", sampler="Euler")))
    fast = accelerate(load_pipeline("builtin:tiny-sd15"),
                      AccelConfig(precision="fp32", sampler="Euler", engines=True, engine_dir=str(tmp_path),
                                  backend="openvino", engine_fallback=False))
    got = image(fast)
    assert stats(fast)["vae_decoder"]["engine_calls"] == 1 and stats(fast)["vae_decoder"]["torch_calls"] == 0
    psnr = 10 * np.log10(1 / np.mean((got - want) ** 2))
    assert 25 < psnr < 80, psnr  # close to torch, and not torch itself


@pytest.mark.slow
@needs_nncf
def test_int8_vae_decoder_below_the_image_psnr_gate_is_refused_in_every_scope(int8_built, tmp_path, monkeypatch,
                                                                               caplog):
    """An int8 decoder is refused by the picture it makes (issue 31: one at 3.7% relative error
    passed and cost the image 4.9 dB): with the gate above what int8 reaches, the wide scope fails,
    the safe one is tried, and the error names the image PSNR; nothing is kept."""
    import sd_accel.validate as validate
    from sd_accel import EngineCache
    from sd_accel.core import ValidationFailed

    shutil.copytree(int8_built[0] / "calibration", tmp_path / "calibration")
    monkeypatch.setitem(validate.IMAGE_PSNR, "int8", 150.0)
    pipe = load_pipeline("builtin:tiny-sd15")
    with caplog.at_level(logging.WARNING, logger="sd_accel"), \
            pytest.raises(ValidationFailed, match=r"image PSNR [\d.]+ dB at holdout\d+ is below 150 dB for int8") as err:
        build_engines(pipe, profiles=[STATIC], backend="openvino", precision="int8", components=["vae_decoder"],
                      engine_dir=tmp_path, progress=False)
    assert "int8 with the wide scope failed validation (image PSNR" in caplog.text
    assert "int8 missed it in every scope tried (wide, safe) on this machine: build vae_decoder in" in str(err.value)
    assert not [r for r in EngineCache(tmp_path).list() if r.key.component == "vae_decoder"]


@pytest.mark.slow
@needs_nncf
def test_int8_unet_is_judged_by_its_picture_in_every_scope_and_torch_runs_once(int8_built, tmp_path, monkeypatch,
                                                                             caplog):
    """Issue 31, part 2: the int8 UNet's scope is chosen by the picture too. The fixture's engine
    recorded its picture's PSNR; with the gate above what int8 reaches, the wide scope is refused
    by its picture, the safe one is tried and refused the same way, torch's picture is made once
    for both, and the error says to build the float precision."""
    import sd_accel.calibration as calibration
    import sd_accel.validate as validate
    from sd_accel import EngineCache
    from sd_accel.core import ValidationFailed

    assert 35.0 <= int8_built[1]["int8"].validation["image_psnr"] < 200
    shutil.copytree(int8_built[0] / "calibration", tmp_path / "calibration")
    monkeypatch.setitem(validate.TOLERANCE, "int8", 1.0)  # the tiny UNet's wide scope misses 10% per call
    monkeypatch.setitem(validate.UNET_IMAGE_PSNR, "int8", 150.0)
    runs = []
    real = calibration.replay
    monkeypatch.setattr(calibration, "replay", lambda *a, **k: runs.append(1) or real(*a, **k))
    with caplog.at_level(logging.WARNING, logger="sd_accel"), pytest.raises(ValidationFailed) as err:
        build_engines(load_pipeline("builtin:tiny-sd15"), profiles=[STATIC], backend="openvino", precision="int8",
                      components=["unet"], engine_dir=tmp_path, progress=False)
    assert "int8 with the wide scope failed validation (the picture its pipeline makes on it is" in caplog.text
    assert "int8 missed it in every scope tried (wide, safe) on this machine: build unet in" in str(err.value)
    assert len(runs) == 3  # torch once, then the engine of each scope
    assert not [r for r in EngineCache(tmp_path).list() if r.key.component == "unet"]


def _resident_bytes_of(folder) -> int:
    """Resident bytes of this process's mappings of the files under ``folder`` (/proc/self/smaps)."""

    root, total, inside = os.path.realpath(folder) + os.sep, 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = len(head) >= 6 and head[5].startswith(root)
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps (not Linux)")
def test_first_call_hands_back_the_mapped_weights_the_plugin_copied(built, monkeypatch):
    """The CPU plugin copies a weightless blob's weights out of the mapped engine.bin on the first
    call; the runner hands those pages back (they counted in RSS for nothing), and the engine
    still computes the same."""

    from sd_accel import EngineCache
    from sd_accel.backends.openvino import runner as runner_mod

    engine_dir, records = built
    rec = next(r for r in records if r.key.component == "unet" and r.key.profile.startswith("static")
               and r.key.precision == "fp32")
    folder = EngineCache(engine_dir).engine_dir(rec.key)
    feed = {"sample": torch.randn(2, 4, 8, 8), "timestep": torch.tensor([10.0, 10.0]),
            "encoder_hidden_states": torch.randn(2, 77, rec.shapes["encoder_hidden_states"][0][2])}
    size = (folder / "engine.bin").stat().st_size

    def first_call(kept: bool) -> tuple[int, torch.Tensor]:
        copy = engine_dir.parent / f"ov-mapped-{kept}"  # a folder of its own: pages no other runner maps
        shutil.copytree(folder, copy)
        os.sync()  # freshly written pages are dirty: a page-out skips them
        if not kept:
            monkeypatch.setattr(runner_mod, "kept_released", lambda *a, **k: contextlib.nullcontext())
        runner = OpenVinoBackend().load(copy, rec.files, rec.shapes)
        out = runner.infer(feed)["latent"]
        resident = _resident_bytes_of(copy)
        runner.close()
        monkeypatch.undo()
        return resident, out

    left, before = first_call(kept=False)
    handed, after = first_call(kept=True)
    assert left > 0.5 * size, (left, size)  # without the hand-back the plugin leaves them resident
    assert handed < 0.1 * size, (handed, size)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.slow
def test_unpinned_accelerate_uses_engines_of_another_backend_and_a_pinned_one_says_so(tmp_path, caplog):
    """Built with backend="onnxruntime", then accelerate() with no backend pinned (auto: OpenVINO
    first on this CPU): the ONNX Runtime engines run, and the log says which. Pinned to OpenVINO,
    the log says the engines are of another backend instead of only "no engine"."""
    import logging

    pipe = load_pipeline("builtin:tiny-sd15")
    build_engines(pipe, profiles=[STATIC], backend="onnxruntime", components=["unet"], engine_dir=tmp_path,
                  progress=False)
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        pipe = accelerate(pipe, AccelConfig(engines=True, engine_dir=str(tmp_path)))
    assert pipe.unet.engines["unet"].handles, stats(pipe)
    assert {h.record.key.backend for h in pipe.unet.engines["unet"].handles} == {"onnxruntime"}
    assert "has no engine for this model on openvino" in caplog.text and "using its onnxruntime engines" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        pipe = accelerate(pipe, AccelConfig(engines=True, backend="openvino", engine_dir=str(tmp_path)))
    assert "are of another backend: onnxruntime (1)" in caplog.text
    assert "AccelConfig(backend='onnxruntime')" in caplog.text
