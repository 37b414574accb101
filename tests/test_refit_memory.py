"""A LoRA strength change must not grow memory with engines x strengths (issue 46: a real ComfyUI
was killed by the kernel on one): one refitted set kept per checkpoint by default, the previous
set released before the next is refitted, each profile refitted only when it is called, a
pre-flight that refuses a refit that would not fit (and the host goes on), and the refit copies
on disk named by their process: listed, counted, pruned, removed after a crash.

WebUI (A1111 stand-in) and ComfyUI (stand-in) hosts, ONNX Runtime fp32 engines of the tiny
checkpoint; the diffusers path (``refit_engines(auto=True)``) keeps one set too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

STUB = Path(__file__).resolve().parent / "webui_stub"
sys.path.insert(0, str(STUB))
import harness  # noqa: E402
from harness import webui_lean  # noqa: E402, F401  (autouse: see its docstring)

from sd_accel.cache import refits as refit_store  # noqa: E402
from sd_accel.profiles import Profile  # noqa: E402

EXACT = {"sd_accel_backend": "onnxruntime"}
TOL = dict(atol=2e-3, rtol=2e-3)
SMALL = Profile(batch=1, height=64, width=64)
LARGE = Profile(batch=1, height=96, width=96)


def _copies(engine_dir: Path) -> list[str]:
    root = engine_dir / ".refit"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def _counts():
    from sd_accel.webui.controller import controller

    engines = controller().loaded("ldm_unet")
    return sum(e.stats.engine_calls for e in engines), sum(e.stats.torch_calls for e in engines)


def _spy_refits(monkeypatch, engine_dir: Path) -> list[tuple[str, int]]:
    """(engine refitted, refit copies on disk as it starts), for every refit made."""
    from sd_accel import refit

    events: list[tuple[str, int]] = []
    real = refit.refit_engine

    def spy(handle, *args, **kwargs):
        events.append((handle.name, len(_copies(engine_dir))))
        return real(handle, *args, **kwargs)

    monkeypatch.setattr(refit, "refit_engine", spy)
    return events


@pytest.mark.slow
def test_webui_keeps_one_set_releases_it_first_and_refits_only_the_profile_called(tmp_path, monkeypatch):
    webui = harness.start(tmp_path, options=EXACT, loras={"lora-a": 1})
    from sd_accel.webui.controller import controller  # (the modules start() imported)
    from sd_accel.webui.jobs import build_for_checkpoint
    from sd_accel.webui.lora import DEFAULT_KEPT

    assert DEFAULT_KEPT == 1
    small = build_for_checkpoint(profile=SMALL, components=("unet",))[0].key.name
    large = build_for_checkpoint(profile=LARGE, components=("unet",))[0].key.name
    engine_dir = tmp_path / "engines"
    prompts = {0.8: "a cat <lora:lora-a:1:0.8>", 0.5: "a cat <lora:lora-a:1:0.5>"}
    webui.shared.opts.sd_unet = "None"
    reference = {s: webui.txt2img(prompt=p, steps=2).samples for s, p in prompts.items()}
    webui.shared.opts.sd_unet = "Automatic"
    events = _spy_refits(monkeypatch, engine_dir)
    webui.txt2img(prompt="a cat", steps=2)  # the base 64 px engine loaded (no LoRA)

    def base_loaded() -> dict[str, bool]:
        (base,) = [e for e in controller().loaded("ldm_unet") if "+lora" not in e.weights_id]
        return {h.name: h.runner is not None for h in base.handles}

    assert base_loaded() == {small: True, large: False}
    # 64 px: only the 64 px engine is refitted (the 96 px one is never patched for it); the base
    # engine's copy leaves memory as its refit starts.
    out = webui.txt2img(prompt=prompts[0.8], steps=2)
    assert _counts() == (2, 0)
    torch.testing.assert_close(out.samples, reference[0.8], **TOL)
    assert events == [(small, 0)] and len(_copies(engine_dir)) == 1
    assert base_loaded() == {small: False, large: False}
    # 96 px with the same set: now its engine, at its first call.
    webui.txt2img(prompt=prompts[0.8], steps=2, width=96, height=96)
    assert events[-1] == (large, 1) and len(events) == 2 and len(_copies(engine_dir)) == 2
    # Another strength: the previous set's copies are released before its refit starts, and only
    # one set stays (no second patched copy in memory or on disk).
    out = webui.txt2img(prompt=prompts[0.5], steps=2)
    torch.testing.assert_close(out.samples, reference[0.5], **TOL)
    assert events[-1] == (small, 0) and len(events) == 3
    assert len(_copies(engine_dir)) == 1
    refits = controller().refits.engines("ldm_unet")
    assert len(refits) == 1 and sum(p.done for h in refits[0].handles for p in [h.refit]) == 1
    # The copy is this process's, listed and counted; it goes with the engines.
    assert _copies(engine_dir)[0].startswith(f"p{os.getpid()}-")
    usage = controller().cache().disk_usage()
    assert len(usage.refit_copies) == 1 and usage.refit_bytes > 0 and "refit copies" in usage.describe()
    # Without LoRA: the base engine, loaded again from the cache.
    webui.txt2img(prompt="a cat", steps=2)
    assert _counts() == (2, 0) and base_loaded()[small]
    controller().engines_changed()
    assert _copies(engine_dir) == []


@pytest.mark.slow
def test_preflight_refuses_a_refit_that_would_not_fit_and_the_job_goes_on(tmp_path, monkeypatch, capsys, caplog):
    webui = harness.start(tmp_path, options=EXACT, loras={"lora-a": 1})
    from sd_accel import refit
    from sd_accel.webui.jobs import build_for_checkpoint

    name = build_for_checkpoint(profile=SMALL, components=("unet",))[0].key.name
    prompt = "a cat <lora:lora-a:1:0.8>"
    webui.shared.opts.sd_unet = "None"
    reference = webui.txt2img(prompt=prompt, steps=2).samples
    webui.shared.opts.sd_unet = "Automatic"
    events = _spy_refits(monkeypatch, tmp_path / "engines")
    monkeypatch.setattr(refit, "available_memory", lambda: 4096)  # 4 KiB free
    capsys.readouterr()

    out = webui.txt2img(prompt=prompt, steps=2)
    text = capsys.readouterr().out + caplog.text
    torch.testing.assert_close(out.samples, reference, **TOL)  # the job is done, in PyTorch
    assert _counts() == (0, 2), text
    assert f"not enough memory to refit {name}: needs ~" in text and "available; close other engines" in text
    assert len(events) == 1 and _copies(tmp_path / "engines") == []  # refused before anything was written
    # Not tried again for that set; a job without LoRA runs on the base engine as before.
    webui.txt2img(prompt=prompt, steps=2)
    assert len(events) == 1 and _counts() == (0, 2)
    webui.txt2img(prompt="a cat", steps=2)
    assert _counts() == (2, 0)


def test_preflight_estimate_and_message(monkeypatch):
    from types import SimpleNamespace

    from sd_accel import refit
    from sd_accel.core import EngineError

    key = SimpleNamespace(precision="fp32", name="unet.x")
    handle = SimpleNamespace(record=SimpleNamespace(key=key, size_bytes=3 << 30), name="unet.x")
    weights = {"w": torch.zeros(2, 2**28)}  # 2 GiB at fp32
    assert refit.refit_needs(handle, weights) == 5 << 30
    key.precision = "bf16"
    assert refit.refit_needs(handle, weights) == 4 << 30
    monkeypatch.setattr(refit, "available_memory", lambda: 3 << 30)
    with pytest.raises(EngineError, match=r"not enough memory to refit unet.x: needs ~4.0 GiB, 3.0 GiB available; "
                                          r"close other engines"):
        refit.preflight(handle, weights)
    monkeypatch.setattr(refit, "available_memory", lambda: 5 << 30)
    refit.preflight(handle, weights)  # fits: nothing said


@pytest.mark.slow
def test_comfyui_keeps_one_strength_and_releases_it_before_the_next(tmp_path, monkeypatch, caplog):
    import logging

    sys.path.insert(0, str(Path(__file__).resolve().parent / "comfyui_stub"))
    import comfy_harness

    from sd_accel.comfyui import unet as comfy_unet

    assert comfy_unet.KEPT_REFITS == 1
    monkeypatch.setenv("SD_ACCEL_ORT_THREADS", "1")
    logger = logging.getLogger("sd_accel")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="sd_accel")
    try:
        engine_dir = tmp_path / "engines"
        comfy = comfy_harness.start(tmp_path, engine_dir)
        model, clip, vae = comfy.load()
        build = dict(preset="custom (ranges below)", backend="onnxruntime", precision="fp32", batch="1",
                     tokens="77", components="unet", vae=vae, clip=clip)
        comfy.node("SdAccelBuildEngines").build(model, height="64", width="64", **build)
        comfy.node("SdAccelBuildEngines").build(model, height="96", width="96", **build)
        events = _spy_refits(monkeypatch, engine_dir)
        lora = comfy.sd.lora_for(model, seed=3)
        engines = comfy.node("SdAccelApplyEngines").apply(model)[0]
        for n, strength in enumerate((1.0, 0.5)):
            torch_lora, _ = comfy.sd.load_lora_for_models(model, clip, lora, strength, strength)
            reference = comfy.sample(torch_lora, clip)
            engine_lora, _ = comfy.sd.load_lora_for_models(engines, clip, lora, strength, strength)
            torch.testing.assert_close(comfy.sample(engine_lora, clip), reference, **TOL)
            # one engine (the 64 px profile's) refitted per strength, none held from before
            assert len(events) == n + 1 and events[-1][1] == 0, events
            assert "64" in events[-1][0].split(".h")[1][:3]
            assert len(_copies(engine_dir)) == 1
        # A strength whose refit would not fit: said before it starts; the image is made in PyTorch.
        from sd_accel import refit

        monkeypatch.setattr(refit, "available_memory", lambda: 4096)
        caplog.clear()
        torch_lora, _ = comfy.sd.load_lora_for_models(model, clip, lora, 0.75, 0.75)
        reference = comfy.sample(torch_lora, clip)
        engine_lora, _ = comfy.sd.load_lora_for_models(engines, clip, lora, 0.75, 0.75)
        torch.testing.assert_close(comfy.sample(engine_lora, clip), reference, **TOL)
        assert "not enough memory to refit" in caplog.text and "0 on engines, 2 in PyTorch" in caplog.text
        assert _copies(engine_dir) == []  # the previous strength's copy went first; nothing new written
    finally:
        logger.removeHandler(caplog.handler)
        comfy_harness.purge()
        while str(Path(__file__).resolve().parent / "comfyui_stub") in sys.path:
            sys.path.remove(str(Path(__file__).resolve().parent / "comfyui_stub"))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_copies_go_at_the_first_refit_and_live_ones_stay(tmp_path):
    root = tmp_path / "engines"
    folder = root / ".refit"
    dead = folder / f"p{_dead_pid()}-unet.x.s2-abc123"
    live = folder / f"p{os.getpid()}-unet.y.s2-def456"
    legacy = folder / "unet.z.s2-ghi789"  # an older sd-accel's layout: no owner to ask
    for path in (dead, live, legacy):
        path.mkdir(parents=True)
        (path / "engine.bin").write_bytes(b"x" * 1000)
    listed = {c.name: c for c in refit_store.refit_copies(root)}
    assert listed[f".refit/{dead.name}"].stale and not listed[f".refit/{live.name}"].stale
    assert listed[f".refit/{legacy.name}"].stale and listed[f".refit/{live.name}"].size_bytes == 1000
    new = refit_store.new_copy(root, "unet.w.s2")  # a process's first refit cleans up
    assert new.name.startswith(f"p{os.getpid()}-unet.w.s2-")
    assert sorted(p.name for p in folder.iterdir()) == sorted([live.name, new.name])


def _cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "sd_accel.cli", *args], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    return out.stdout


@pytest.mark.slow
def test_list_shows_refit_copies_and_prune_removes_them(tmp_path):
    from sd_accel import EngineCache

    root = tmp_path / "engines"
    dead = root / ".refit" / f"p{_dead_pid()}-unet.x.s2-abc123"
    live = root / ".refit" / f"p{os.getpid()}-unet.y.s2-def456"
    for path in (dead, live):
        path.mkdir(parents=True)
        (path / "engine.bin").write_bytes(b"x" * 2048)
    usage = EngineCache(root).disk_usage()
    assert usage.refit_bytes == 4096 and usage.total_bytes == 4096
    assert "refit copies 4.1 KB (LoRA refits; 2.0 KB left by ended processes" in usage.describe(), usage.describe()

    text = _cli("list", "--engine-dir", str(root))
    assert "refit copies" in text and dead.name in text and live.name in text and "is gone" in text, text
    listed = json.loads(_cli("list", "--json", "--engine-dir", str(root)))
    assert {c["name"] for c in listed["refit_copies"]} == {f".refit/{dead.name}", f".refit/{live.name}"}
    assert listed["refit_bytes"] == 4096 and listed["total_bytes"] == 4096

    # prune (by age here): the copies of ended processes go; the running one's stays
    text = _cli("prune", "--older-than", "30d", "--engine-dir", str(root))
    assert f"removed .refit/{dead.name}" in text and not dead.exists() and live.exists(), text
    # --refit-copies: all of them
    text = _cli("prune", "--refit-copies", "--engine-dir", str(root))
    assert f"removed .refit/{live.name}" in text and not live.exists(), text
    assert EngineCache(root).disk_usage().refit_copies == ()


def test_diffusers_auto_refit_keeps_one_set():
    from sd_accel import refit

    assert refit.KEEP_REFITS == 1


# --------------------------------------------------------------------------- diffusers: refit_engines(auto=True)

DIFFUSERS_SCRIPT = r'''
import resource, sys, torch
from sd_accel import AccelConfig, accelerate, load_pipeline, refit_engines
mode, engine_dir, lora_dir = sys.argv[1:4]
pipe = accelerate(load_pipeline("builtin:tiny-sd15"), AccelConfig(engines=True, engine_dir=engine_dir,
                  backend="onnxruntime", precision="fp32", sampler="Euler"))
def run():
    pipe("a cat", num_inference_steps=2, height=64, width=64, generator=torch.Generator().manual_seed(0),
         output_type="np")
if mode == "lora":
    pipe.load_lora_weights(lora_dir, adapter_name="style")
    refit_engines(pipe, progress=False, auto=True)
for scale in (1.0, 0.5, 0.25, 0.75, 0.5, 1.0):
    if mode == "lora":
        pipe.set_adapters(["style"], [scale])
    run()
# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so both runs would show pytest's size
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
print("peak", int(hwm[0].split()[1]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
'''


@pytest.fixture(scope="module")
def diffusers_setup(tmp_path_factory):
    """UNet engine of the tiny SD 1.5 (ONNX Runtime fp32, 64 px) and a LoRA on its attention."""
    pytest.importorskip("peft", reason="peft is not installed (it is in sd-accel[dev])")
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from sd_accel import build_engines, load_pipeline

    engine_dir = tmp_path_factory.mktemp("refit-memory-engines")
    build_engines(load_pipeline("builtin:tiny-sd15"), profiles=[dict(batch=1, height=64, width=64)],
                  components=["unet"], backend="onnxruntime", engine_dir=engine_dir, progress=False)
    lora_dir = tmp_path_factory.mktemp("refit-memory-lora")
    src = load_pipeline("builtin:tiny-sd15")
    torch.manual_seed(0)
    src.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                    init_lora_weights=False))
    StableDiffusionPipeline.save_lora_weights(lora_dir, unet_lora_layers=get_peft_model_state_dict(src.unet))
    return engine_dir, lora_dir


def _live_refits() -> int:
    import gc

    from sd_accel.refit import RefittedRunner

    return sum(1 for o in gc.get_objects() if isinstance(o, RefittedRunner) and o._cleanup.alive)


@pytest.mark.slow
def test_diffusers_auto_refit_keeps_one_set_and_releases_the_serving_one_first(diffusers_setup, monkeypatch):
    from sd_accel import AccelConfig, accelerate, load_pipeline, refit, refit_engines, stats

    engine_dir, lora_dir = diffusers_setup
    assert refit.KEEP_REFITS == 1
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), AccelConfig(
        engines=True, engine_dir=str(engine_dir), backend="onnxruntime", precision="fp32", sampler="Euler"))
    before = _live_refits()
    seen: list[tuple[int, int]] = []  # (refits alive, UNet runners loaded) as each refit starts
    real = refit.refit_engine
    wrapper = pipe.unet  # (a refit runs with the torch modules in the pipeline's slots)

    def spy(handle, *args, **kwargs):
        loaded = sum(h.runner is not None for e in wrapper.engines.values() for h in e.handles)
        seen.append((_live_refits() - before, loaded))
        return real(handle, *args, **kwargs)

    monkeypatch.setattr(refit, "refit_engine", spy)
    pipe("a cat", num_inference_steps=1, height=64, width=64, output_type="np")  # the base engine loaded
    pipe.load_lora_weights(lora_dir, adapter_name="style")
    refit_engines(pipe, progress=False, auto=True)
    for scale in (0.5, 0.25, 1.0):
        pipe.set_adapters(["style"], [scale])
        pipe("a cat", num_inference_steps=1, height=64, width=64, output_type="np")
    assert len(seen) == 4 and stats(pipe)["unet"]["torch_calls"] == 0
    # Every refit started with nothing patched held and the serving engine released.
    assert seen == [(0, 0)] * 4, seen
    assert _live_refits() - before == 1
    assert len(_copies(Path(engine_dir))) == 1


@pytest.mark.slow
def test_diffusers_peak_rss_with_lora_strength_changes_stays_near_a_plain_run(diffusers_setup, tmp_path):
    """Peak RSS of a process making images at six LoRA strengths (each a refit) against the same
    images without LoRA: tiny models, so the bound is loose; it catches a refit that holds every
    strength's copy, or the weights several times over."""
    engine_dir, lora_dir = diffusers_setup
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "SD_ACCEL_ORT_THREADS": "1"}
    peaks = {}
    for mode in ("plain", "lora"):
        out = subprocess.run([sys.executable, "-c", DIFFUSERS_SCRIPT, mode, str(engine_dir), str(lora_dir)],
                             capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        peaks[mode] = int(out.stdout.split("peak")[-1].split()[0]) * 1024  # KiB on Linux
    assert peaks["lora"] <= peaks["plain"] * 1.25 + (64 << 20), peaks
