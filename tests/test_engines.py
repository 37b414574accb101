"""Engines end to end on the ONNX Runtime backend: build, cache, swap, per-call matching,
fallback, validation and the failure cases users hit. Tiny SD 1.x and SDXL models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from sd_accel import AccelConfig, EngineCache, accelerate, build_engines, load_pipeline, stats
from sd_accel.build import BuildCancelled
from sd_accel.prompts import encode_long_prompt
from sd_accel.runtime.modules import EngineUNet
from sd_accel.runtime.swap import unswap

STATIC = dict(batch=1, height=64, width=64)
DYNAMIC = dict(batch=(1, 1, 2), height=(64, 64, 136), width=(64, 64, 136), tokens=(77, 77, 154))
LONG_PROMPT = " ".join(["a red cat sitting on a blue chair in a sunny garden"] * 10)  # ~110 tokens


def generate(pipe, size: int = 64, steps: int = 3, **kwargs) -> np.ndarray:
    g = torch.Generator("cpu").manual_seed(0)
    if "prompt_embeds" not in kwargs:
        kwargs["prompt"] = "a photo of a cat"
    return pipe(num_inference_steps=steps, height=size, width=size, generator=g, output_type="np", **kwargs).images


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Engines for every component of tiny SD 1.5, for a static and a dynamic profile."""
    engine_dir = tmp_path_factory.mktemp("engines")
    pipe = load_pipeline("builtin:tiny-sd15")
    events = []
    records = build_engines(pipe, profiles=[STATIC, DYNAMIC], backend="onnxruntime", engine_dir=engine_dir,
                            progress=events.append)
    return engine_dir, records, events


def engine_pipe(engine_dir: Path, **config):
    pipe = load_pipeline("builtin:tiny-sd15")
    # Euler: one UNet call per step, so call counts are exact (PLMS makes one extra).
    # the engines here are ONNX Runtime's; auto on a CPU would look for OpenVINO ones
    return accelerate(pipe, AccelConfig(engines=True, engine_dir=str(engine_dir), precision="fp32",
                                        sampler="Euler", **{"backend": "onnxruntime", **config}))


@pytest.mark.slow
def test_builds_every_component_for_static_and_dynamic(built):
    engine_dir, records, events = built
    got = {(r.key.component, r.key.profile.startswith("static")) for r in records}
    comps = {"clip", "unet", "vae_decoder", "vae_encoder"}
    assert got == {(c, s) for c in comps for s in (True, False)}
    for r in records:
        assert r.validation["ok"] and r.validation["rel_l2"] < 1e-3, r.key.name
        assert (engine_dir / r.key.name / r.files[0]).exists()
        assert r.key.backend == "onnxruntime" and r.key.arch.startswith("cpu-")
    # progress was reported for each engine, ending at 1.0
    assert {e.index for e in events} == set(range(len(records)))
    assert all(any(e.index == i and e.fraction == 1.0 for e in events) for i in range(len(records)))


@pytest.mark.slow
def test_generation_on_engines_matches_torch(built):
    engine_dir, _, _ = built
    ref = generate(accelerate(load_pipeline("builtin:tiny-sd15"), precision="fp32", sampler="Euler"))
    pipe = engine_pipe(engine_dir)
    assert isinstance(pipe.unet, EngineUNet)
    out = generate(pipe)
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert s["unet"]["engine_calls"] == 3 and s["unet"]["torch_calls"] == 0
    assert s["clip"]["engine_calls"] == 2  # prompt and negative prompt
    assert s["vae_decoder"]["engine_calls"] == 1
    # the static 64x64 engine is preferred over the dynamic one that also covers the call
    (used,) = s["unet"]["engines_used"]
    assert ".static." in used
    # the wrapper keeps the torch module's interface
    assert pipe.unet.config.in_channels == 4 and pipe.unet.dtype == torch.float32


@pytest.mark.slow
def test_size_outside_every_profile_falls_back_and_is_counted(built, caplog):
    engine_dir, _, _ = built
    pipe = engine_pipe(engine_dir)
    with caplog.at_level("WARNING", logger="sd_accel"):
        image = generate(pipe, size=160)
    assert image.shape == (1, 160, 160, 3) and np.isfinite(image).all()
    s = stats(pipe)
    assert s["unet"]["engine_calls"] == 0 and s["unet"]["torch_calls"] == 3
    (reason,) = s["unet"]["fallbacks"]
    assert "no engine covers" in reason and "(2, 4, 20, 20)" in reason
    # told in pixels and images (CFG's two rows are one image), with the sizes the engines cover
    # and what to build (issue 46)
    assert reason.startswith("no engine covers 160x160 px, batch 1 (sample=(2, 4, 20, 20), "), reason
    assert "the engines cover " in reason and "; 64x64 px, batch 1" in reason
    assert "64-136 x 64-136 px, batch 1-2, 77-154 tokens" in reason
    assert "sd-accel build --model MODEL --height 160 --width 160 --batch 1" in reason
    assert "engines='auto'" in reason
    # warned once, not once per step
    assert sum("unet: running torch" in r.message for r in caplog.records) == 1


@pytest.mark.slow
def test_dynamic_engine_serves_sizes_that_are_not_multiples_of_64(built):
    engine_dir, _, _ = built
    ref = generate(accelerate(load_pipeline("builtin:tiny-sd15"), precision="fp32", sampler="Euler"), size=136)
    pipe = engine_pipe(engine_dir)
    out = generate(pipe, size=136)
    assert stats(pipe)["unet"]["engine_calls"] == 3
    assert np.abs(out - ref).max() < 2e-3


@pytest.mark.slow
def test_long_prompt_uses_154_token_profile(built, tmp_path):
    engine_dir, _, _ = built
    pipe = engine_pipe(engine_dir)
    embeds = encode_long_prompt(pipe, LONG_PROMPT, "blurry")
    assert embeds["prompt_embeds"].shape[1] == 154
    generate(pipe, **embeds)
    assert stats(pipe)["unet"]["engine_calls"] == 3
    assert any(".static." not in n for n in stats(pipe)["unet"]["engines_used"])

    # only the static (77-token) engines: the same call falls back, counted
    static_dir = tmp_path / "static-only"
    static_dir.mkdir()
    for name in os.listdir(engine_dir):
        if name.startswith("unet.") and ".static." in name:
            shutil.copytree(engine_dir / name, static_dir / name)
    pipe = engine_pipe(static_dir)
    generate(pipe, **encode_long_prompt(pipe, LONG_PROMPT, "blurry"))
    s = stats(pipe)["unet"]
    assert s["engine_calls"] == 0 and s["torch_calls"] == 3
    assert "77, 154" not in next(iter(s["fallbacks"]))  # the reason names the real shape
    assert "154" in next(iter(s["fallbacks"]))


@pytest.mark.slow
def test_second_process_reuses_cache_without_export(built):
    engine_dir, records, _ = built
    onnx_dir = engine_dir / "onnx"
    before = {p: p.stat().st_mtime_ns for p in onnx_dir.rglob("*") if p.is_file()}
    script = textwrap.dedent(f"""
        import json, torch
        import sd_accel.onnx.export as ex
        from sd_accel import load_pipeline, build_engines, accelerate, AccelConfig, stats
        calls = []
        real = ex.export_onnx
        ex.export_onnx = lambda *a, **k: calls.append(1) or real(*a, **k)
        pipe = load_pipeline("builtin:tiny-sd15")
        events = []
        recs = build_engines(pipe, profiles=[{STATIC!r}, {DYNAMIC!r}], backend="onnxruntime",
                             engine_dir={str(engine_dir)!r}, progress=events.append)
        pipe = accelerate(pipe, AccelConfig(engines=True, engine_dir={str(engine_dir)!r}, sampler="Euler",
                                            backend="onnxruntime"))
        pipe("a cat", num_inference_steps=2, height=64, width=64)
        print(json.dumps({{"exports": len(calls), "stages": sorted({{e.stage for e in events}}),
                          "n": len(recs), "unet": stats(pipe)["unet"]["engine_calls"]}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"exports": 0, "stages": ["cached"], "n": len(records), "unet": 2}
    after = {p: p.stat().st_mtime_ns for p in onnx_dir.rglob("*") if p.is_file()}
    assert after == before


@pytest.mark.slow
def test_corrupt_engine_file_falls_back_and_is_marked_bad(built, tmp_path):
    engine_dir, _, _ = built
    copy = tmp_path / "engines"
    shutil.copytree(engine_dir, copy)
    (victim,) = [d for d in copy.iterdir() if d.name.startswith("unet.") and ".static." in d.name]
    engine_file = victim / "engine.onnx"
    data = bytearray(engine_file.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\x00" * 64
    engine_file.write_bytes(bytes(data))
    pipe = engine_pipe(copy)
    image = generate(pipe)
    assert np.isfinite(image).all()
    s = stats(pipe)["unet"]
    # the dynamic engine covers the call once the static one is refused: no crash, no torch needed
    assert s["engine_calls"] == 3
    assert all(".static." not in n for n in s["engines_used"])
    record = next(r for r in EngineCache(copy).list() if r.key.name == victim.name)
    assert record.status == "bad" and "checksum" in record.bad_reason


@pytest.mark.slow
def test_foreign_arch_engine_is_never_loaded(built, tmp_path, caplog):
    engine_dir, _, _ = built
    copy = tmp_path / "engines"
    copy.mkdir()
    for d in engine_dir.iterdir():
        if d.name.startswith("unet.") and ".static." in d.name:
            meta = json.loads((d / "meta.json").read_text())
            meta["key"]["arch"] = "sm86"
            from sd_accel.cache.key import EngineKey

            new = EngineKey.from_dict(meta["key"])
            shutil.copytree(d, copy / new.name)
            (copy / new.name / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level("WARNING", logger="sd_accel"):
        pipe = engine_pipe(copy)
    assert not isinstance(pipe.unet, EngineUNet)
    assert any("sm86" in r.message and "rebuild" in r.message for r in caplog.records)


@pytest.mark.slow
def test_index_deleted_is_rebuilt_from_files(built, tmp_path):
    engine_dir, records, _ = built
    copy = tmp_path / "engines"
    shutil.copytree(engine_dir, copy)
    (copy / "index.json").unlink()
    pipe = engine_pipe(copy)
    generate(pipe)
    assert stats(pipe)["unet"]["engine_calls"] == 3
    assert len(EngineCache(copy).list()) == len(records)


@pytest.mark.slow
def test_cancelled_build_leaves_nothing(tmp_path):
    pipe = load_pipeline("builtin:tiny-sd15")
    cancel = threading.Event()

    def on_event(ev):
        if ev.stage.startswith("exporting"):
            cancel.set()

    with pytest.raises(BuildCancelled):
        build_engines(pipe, profiles=[STATIC], components=["vae_decoder"], backend="onnxruntime",
                      engine_dir=tmp_path, progress=on_event, cancel=cancel)
    assert EngineCache(tmp_path).list() == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    # no stale lock: the same build runs straight away
    (rec,) = build_engines(pipe, profiles=[STATIC], components=["vae_decoder"], backend="onnxruntime",
                           engine_dir=tmp_path, progress=False)
    assert rec.status == "ok"


@pytest.mark.slow
def test_save_pretrained_with_engines_saves_torch_modules(built, tmp_path):
    engine_dir, _, _ = built
    pipe = engine_pipe(engine_dir)
    pipe.save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"]
    assert isinstance(pipe.unet, EngineUNet)  # still swapped after saving
    again = load_pipeline(tmp_path / "saved")
    assert type(again.unet).__name__ == "UNet2DConditionModel"


@pytest.mark.slow
def test_img2img_uses_vae_encoder_engine(built):
    from diffusers import StableDiffusionImg2ImgPipeline

    engine_dir, _, _ = built
    pipe = engine_pipe(engine_dir)
    unswapped = {k: v for k, v in pipe.components.items()}
    img2img = StableDiffusionImg2ImgPipeline(**unswapped)
    init = torch.rand(1, 3, 64, 64)
    g = torch.Generator("cpu").manual_seed(0)
    out = img2img("a cat", image=init, strength=0.6, num_inference_steps=4, generator=g, output_type="np").images
    assert np.isfinite(out).all()
    assert stats(img2img)["vae_encoder"]["engine_calls"] == 1


def test_accelerate_without_engines_built_warns_and_runs_torch(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="sd_accel"):
        pipe = engine_pipe(tmp_path / "empty")
    assert not isinstance(pipe.unet, EngineUNet)
    assert any("build_engines" in r.message for r in caplog.records)
    assert np.isfinite(generate(pipe)).all()


@pytest.mark.slow
def test_fallback_off_raises_instead(built):
    engine_dir, _, _ = built
    pipe = engine_pipe(engine_dir, engine_fallback=False)
    with pytest.raises(Exception, match="fallback is off"):
        generate(pipe, size=160)


@pytest.mark.slow
def test_sdxl_engines_match_torch(tmp_path):
    pipe = load_pipeline("builtin:tiny-sdxl")
    records = build_engines(pipe, profiles=[STATIC], backend="onnxruntime", engine_dir=tmp_path, progress=False)
    assert {r.key.component for r in records} == {"clip", "clip2", "unet", "vae_decoder", "vae_encoder"}
    ref = generate(accelerate(load_pipeline("builtin:tiny-sdxl"), precision="fp32", sampler="Euler"))
    pipe = accelerate(load_pipeline("builtin:tiny-sdxl"),
                      AccelConfig(engines=True, engine_dir=str(tmp_path), precision="fp32", sampler="Euler",
                                  backend="onnxruntime"))
    out = generate(pipe)
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert s["unet"]["engine_calls"] == 3 and s["clip2"]["engine_calls"] >= 1
    unswap(pipe)
    assert type(pipe.unet).__name__ == "UNet2DConditionModel"
