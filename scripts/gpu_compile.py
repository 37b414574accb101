"""The compiled PyTorch backend on an NVIDIA GPU, beside what a user has without it, in one run.

Issue 47's measurement. Models are built from their shipped configs with random weights (no hub
here: timings are real, images are noise). Per section, at the same seed, prompt and size:

- ``eager``: plain diffusers in fp16 with SDPA (its default attention) on CUDA;
- ``torch_compile``: the same plus the one line a user tries first,
  ``pipe.unet = torch.compile(pipe.unet)`` (``pipe.transformer`` for the slice);
- ``sdaccel``: ``build_engines(..., backend="compile")`` then ``accelerate(backend="compile",
  engines=True)``: every component compiled by Inductor, CUDA graphs per fixed shape.

Sections: ``sd15`` (512 px, batch 1, 20 steps), ``lcm`` (the 4-step LCM + TAESD recipe at 512 px),
``sdxl`` (1024 px, 20 steps), ``flux`` (a FLUX-width transformer slice: 3072 wide, 2 double and 4
single blocks, 1,024 image and 512 text tokens; ms per forward, no pipeline).

Each row: s/image (best of ``--repeats`` after one warm-up), it/s (steps / s per image), peak VRAM,
the first image's time (for the compiled rows: the compile), the image's max abs difference to the
eager row. ``sdaccel`` rows also: build (compile) seconds, the runtime's stats (engine calls,
fallbacks), CUDA-graph captures and replays, and a second process's warm start (this script run
again on the same engine folder: seconds to its first image and Inductor's cache hits and misses).
A section that would end past ``--budget-s`` (by ``ESTIMATE_S``) is skipped (and said). Writes the JSON after each section, then a
markdown table (``--table``).

Run (GPU, < 8 minutes on an H100):
    python scripts/gpu_compile.py --out gpu_compile.json --table gpu_compile.md
Dry run (tiny models on the CPU, Dynamo without code generation: the plumbing in seconds):
    python scripts/gpu_compile.py --dry-run --out /tmp/dry.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

SECTIONS = ("sd15", "lcm", "sdxl", "flux")
# Guessed seconds per section on an H100 (compiles included; not yet measured): a section starts
# only when it should end within --budget-s. Replace with measured ones after the first run.
ESTIMATE_S = {"sd15": 150, "lcm": 100, "sdxl": 200, "flux": 60}
PROMPT = "a photo of a cat"
LCM_UNET = {"time_cond_proj_dim": 256}  # as scripts/gpu_torch_check.py (the few-step recipe)
LCM_SCHEDULER = {"timestep_spacing": "leading", "original_inference_steps": 50}
LCM_GUIDANCE = 8.0
TAESD = "builtin:taesd"
ROOT = Path(__file__).resolve().parents[1]


class Ctx:
    """What the run is: device, dtype, sizes; the dry run shrinks everything."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.dry = args.dry_run
        self.cuda = torch.cuda.is_available() and not self.dry
        self.device = "cuda" if self.cuda else "cpu"
        self.dtype = torch.float16 if self.cuda else torch.float32
        self.precision = "fp16" if self.cuda else "fp32"
        self.repeats = 1 if self.dry else args.repeats
        self.steps = 2 if self.dry else args.steps
        self.lcm_steps = 2 if self.dry else args.lcm_steps
        self.engine_root = Path(args.engine_dir or tempfile.mkdtemp(prefix="gpu-compile-"))
        # the one-line torch.compile row: Inductor on a GPU; Dynamo alone in the dry run
        self.plain_compile = {"backend": "eager"} if self.dry else {}

    def size(self, section: str) -> int:
        return 64 if self.dry else (1024 if section == "sdxl" else 512)


def sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


def free(ctx: Ctx) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def peak_gb(ctx: Ctx) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if ctx.cuda else None


# ---- models ------------------------------------------------------------------------------------


def own(config) -> dict:
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}


def base_pipeline(family: str, ctx: Ctx):
    from sd_accel.models.builtin import build_tiny_pipeline
    from sd_accel.models.components import random_pipeline
    from sd_accel.models.families import FAMILIES, load_family_configs

    pipe = build_tiny_pipeline(family) if ctx.dry else random_pipeline(load_family_configs(FAMILIES[family]), seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def lcm_pipeline(base):
    """The few-step recipe: an LCM-distilled UNet config, the LCM scheduler, TAESD decoding."""
    from diffusers import LatentConsistencyModelPipeline, LCMScheduler, UNet2DConditionModel

    from sd_accel.models.taesd import load_tiny_vae

    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config({**own(base.unet.config), **LCM_UNET}).eval()
    pipe = LatentConsistencyModelPipeline(
        vae=load_tiny_vae(TAESD), text_encoder=base.text_encoder, tokenizer=base.tokenizer, unet=unet,
        scheduler=LCMScheduler.from_config({**own(base.scheduler.config), **LCM_SCHEDULER}),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def section_pipe(section: str, ctx: Ctx):
    if section == "lcm":
        return lcm_pipeline(base_pipeline("sd15", ctx))
    return base_pipeline("sdxl" if section == "sdxl" else "sd15", ctx)


def fresh(base):
    return type(base)(**{k: copy.deepcopy(v) for k, v in base.components.items()})


# ---- timing ------------------------------------------------------------------------------------


def call_kwargs(section: str, ctx: Ctx) -> dict:
    size = ctx.size(section)
    kw = {"num_inference_steps": ctx.lcm_steps if section == "lcm" else ctx.steps, "height": size, "width": size}
    if section == "lcm":
        kw["guidance_scale"] = LCM_GUIDANCE
    return kw


def timed(pipe, section: str, ctx: Ctx) -> dict:
    kw = call_kwargs(section, ctx)

    def once():
        g = torch.Generator("cpu").manual_seed(0)
        sync(ctx)
        t = time.perf_counter()
        out = pipe(PROMPT, generator=g, output_type="np", **kw).images
        sync(ctx)
        return time.perf_counter() - t, out

    first, _ = once()  # the first image: compiles (compiled rows), autotunes, grows the allocator
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    times, out = [], None
    for _ in range(ctx.repeats):
        dt, out = once()
        times.append(dt)
    best = min(times)
    return {"steps": kw["num_inference_steps"], "size": kw["height"], "s_per_image": round(best, 4),
            "it_per_s": round(kw["num_inference_steps"] / best, 2), "first_image_s": round(first, 2),
            "peak_vram_gb": peak_gb(ctx), "finite": bool(np.isfinite(out).all()), "image": out}


def compiled_components(pipe) -> list[str]:
    from sd_accel.build import engine_components

    return [c for c in engine_components(pipe) if c != "vae_encoder"]  # txt2img never encodes


def accelerated(base, section: str, ctx: Ctx, engine_dir: Path) -> tuple:
    """The sd-accel row's pipeline: torch options, the compiled engines built (timed), swapped in."""
    from sd_accel import accelerate, build_engines

    accel = {"precision": ctx.precision, "device": ctx.device}
    if section == "lcm":
        accel["vae"] = f"tiny:{TAESD}"
    pipe = accelerate(fresh(base), **accel)
    size = ctx.size(section)
    t = time.perf_counter()
    build_engines(pipe, profiles=[{"batch": 1, "height": size, "width": size}], backend="compile",
                  precision=ctx.precision, components=compiled_components(pipe), engine_dir=str(engine_dir),
                  progress=False, validate=False)
    build_s = time.perf_counter() - t
    pipe = accelerate(pipe, backend="compile", engines=True, engine_dir=str(engine_dir), **accel)
    pipe.set_progress_bar_config(disable=True)
    return pipe, build_s


def runner_stats(pipe) -> dict:
    out = {}
    for slot in ("text_encoder", "text_encoder_2", "unet", "vae"):
        module = getattr(pipe, slot, None)
        for component, engines in (getattr(module, "engines", None) or {}).items():
            for h in engines.handles:
                if h.runner is not None and hasattr(h.runner, "stats"):
                    out[component] = h.runner.stats()
    return out


def run_section(section: str, ctx: Ctx, args, report: dict) -> None:
    from sd_accel import stats

    runs = report["runs"]
    base = section_pipe(section, ctx)
    # eager fp16 SDPA: what diffusers gives on a GPU
    pipe = fresh(base).to(ctx.device, ctx.dtype)
    r = timed(pipe, section, ctx)
    ref = r.pop("image")
    runs[f"{section}.eager"] = r
    print(section, "eager", json.dumps(r), flush=True)
    del pipe
    free(ctx)
    # plus the one-line torch.compile of the UNet
    pipe = fresh(base).to(ctx.device, ctx.dtype)
    pipe.unet = torch.compile(pipe.unet, **ctx.plain_compile)
    r = timed(pipe, section, ctx)
    img = r.pop("image")
    r["image_max_abs_diff_vs_eager"] = round(float(np.abs(img - ref).max()), 4)
    runs[f"{section}.torch_compile"] = r
    print(section, "torch_compile", json.dumps(r), flush=True)
    del pipe
    torch._dynamo.reset()
    free(ctx)
    # sd-accel compiled
    engine_dir = ctx.engine_root / section
    pipe, build_s = accelerated(base, section, ctx, engine_dir)
    r = timed(pipe, section, ctx)
    img = r.pop("image")
    r.update({"build_s": round(build_s, 1), "image_max_abs_diff_vs_eager": round(float(np.abs(img - ref).max()), 4),
              "stats": stats(pipe), "runners": runner_stats(pipe)})
    eager = runs[f"{section}.eager"]["s_per_image"]
    r["x_eager"] = round(eager / r["s_per_image"], 2)
    r["x_torch_compile"] = round(runs[f"{section}.torch_compile"]["s_per_image"] / r["s_per_image"], 2)
    runs[f"{section}.sdaccel"] = r
    print(section, "sdaccel", json.dumps({k: v for k, v in r.items() if k not in ("stats", "runners")}), flush=True)
    del pipe
    torch._dynamo.reset()
    free(ctx)
    if section in args.warm_sections.split(","):
        runs[f"{section}.sdaccel"]["warm_start"] = warm_start(section, engine_dir, args)


def warm_start(section: str, engine_dir: Path, args) -> dict:
    """This script again in a new process on the same engine folder: its first image's time and
    Inductor's cache hits (the second process must find the compiled kernels)."""
    out = engine_dir / "warm-child.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--warm-child", section, "--engine-dir", str(engine_dir),
           "--out", str(out)] + (["--dry-run"] if args.dry_run else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the engine folder's own Inductor caches
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    result = {"process_s": round(time.perf_counter() - t, 1), "returncode": proc.returncode}
    if proc.returncode != 0 or not out.is_file():
        result["error"] = proc.stderr[-2000:]
        return result
    result.update(json.loads(out.read_text()))
    return result


def warm_child(section: str, args) -> None:
    """The second process: load, swap the compiled engines in, time the first image."""
    from torch._dynamo.utils import counters

    from sd_accel import accelerate, stats

    start = time.perf_counter()
    ctx = Ctx(args)
    base = section_pipe(section, ctx)
    accel = {"precision": ctx.precision, "device": ctx.device}
    if section == "lcm":
        accel["vae"] = f"tiny:{TAESD}"
    pipe = accelerate(base, backend="compile", engines=True, engine_dir=args.engine_dir, **accel)
    pipe.set_progress_bar_config(disable=True)
    loaded = time.perf_counter() - start
    g = torch.Generator("cpu").manual_seed(0)
    sync(ctx)
    t = time.perf_counter()
    pipe(PROMPT, generator=g, output_type="np", **call_kwargs(section, ctx))
    sync(ctx)
    first = time.perf_counter() - t
    unet = stats(pipe).get("unet", {})
    Path(args.out).write_text(json.dumps({
        "load_s": round(loaded, 2), "first_image_s": round(first, 2),
        "fxgraph_cache_hit": counters["inductor"].get("fxgraph_cache_hit", 0),
        "fxgraph_cache_miss": counters["inductor"].get("fxgraph_cache_miss", 0),
        "unet_engine_calls": unet.get("engine_calls", 0), "unet_torch_calls": unet.get("torch_calls", 0)}))


# ---- the FLUX-width transformer slice ------------------------------------------------------------


class _FluxCall(torch.nn.Module):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, hidden, text, pooled, timestep, img_ids, txt_ids, guidance):
        return (self.model(hidden_states=hidden, encoder_hidden_states=text, pooled_projections=pooled,
                           timestep=timestep, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                           return_dict=False)[0],)


class _FluxSpec:
    """What the compiled backend reads of a component spec, for the slice (no pipeline around it)."""

    name = "transformer"

    def __init__(self, call: _FluxCall, feed: dict[str, torch.Tensor]) -> None:
        self.call, self.feed = call, feed

    def torch_module(self):
        return self.call.model

    def export_module(self):
        return self.call

    def inputs(self):
        from sd_accel.components.spec import TensorSpec

        return tuple(TensorSpec(n, tuple(t.shape), t.dtype) for n, t in self.feed.items())

    def outputs(self):
        from sd_accel.components.spec import TensorSpec

        return (TensorSpec("out", tuple(self.feed["hidden"].shape), self.feed["hidden"].dtype),)


def section_flux(ctx: Ctx, args, report: dict) -> None:
    from diffusers import FluxTransformer2DModel

    from sd_accel.backends.compile.builder import CompileBackend
    from sd_accel.backends.compile.runner import CompiledRunner

    runs = report["runs"]
    heads, dim = (2, 32) if ctx.dry else (24, 128)
    tokens, text = (16, 8) if ctx.dry else (1024, 512)
    joint = 32 if ctx.dry else 4096
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4,
                                   attention_head_dim=dim, num_attention_heads=heads, joint_attention_dim=joint,
                                   pooled_projection_dim=768, guidance_embeds=True,
                                   axes_dims_rope=(dim // 8, 7 * dim // 16, 7 * dim // 16))
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    model = model.to(ctx.device, dtype).eval()
    g = torch.Generator("cpu").manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(ctx.device, dtype)

    feed = {"hidden": rand(1, tokens, 64), "text": rand(1, text, joint), "pooled": rand(1, 768),
            "timestep": torch.full((1,), 0.5, device=ctx.device, dtype=dtype),
            "img_ids": torch.zeros(tokens, 3, device=ctx.device, dtype=dtype),
            "txt_ids": torch.zeros(text, 3, device=ctx.device, dtype=dtype),
            "guidance": torch.full((1,), 3.5, device=ctx.device, dtype=dtype)}
    call = _FluxCall(model)

    def bench(fn) -> dict:
        sync(ctx)
        t = time.perf_counter()
        with torch.no_grad():
            out = fn()
        sync(ctx)
        first = time.perf_counter() - t
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(max(3, ctx.repeats * 3)):
            sync(ctx)
            t = time.perf_counter()
            with torch.no_grad():
                out = fn()
            sync(ctx)
            times.append(time.perf_counter() - t)
        return {"ms_per_forward": round(1000 * min(times), 2), "first_call_s": round(first, 2),
                "peak_vram_gb": peak_gb(ctx), "out": out.float().cpu()}

    args_ = list(feed.values())
    r = bench(lambda: call(*args_)[0])
    ref = r.pop("out")
    runs["flux_slice.eager"] = r
    plain = torch.compile(call, **ctx.plain_compile)
    r = bench(lambda: plain(*args_)[0])
    r["max_abs_diff_vs_eager"] = round(float((r.pop("out") - ref).abs().max()), 4)
    runs["flux_slice.torch_compile"] = r
    torch._dynamo.reset()
    be = CompileBackend(ctx.device)
    spec = _FluxSpec(call, feed)
    be.attach("slice", spec)
    shapes = {n: (tuple(t.shape),) * 3 for n, t in feed.items()}
    runner = CompiledRunner(be, {"component": "transformer", "model": "slice",
                                 "precision": "bf16" if ctx.cuda else "fp32", "static": True}, shapes)
    r = bench(lambda: runner.infer(feed)["out"])
    r["max_abs_diff_vs_eager"] = round(float((r.pop("out") - ref).abs().max()), 4)
    r["runner"] = runner.stats()
    r["x_eager"] = round(runs["flux_slice.eager"]["ms_per_forward"] / r["ms_per_forward"], 2)
    runs["flux_slice.sdaccel"] = r
    print("flux", json.dumps({k: v for k, v in runs.items() if k.startswith("flux")}), flush=True)
    runner.close()
    torch._dynamo.reset()


# ---- report --------------------------------------------------------------------------------------


def table(report: dict) -> str:
    dev = report.get("device", {})
    lines = [f"Card: {dev.get('name') or dev.get('arch') or 'cpu'}; torch {report['versions'].get('torch')}"
             f"{' (dry run: tiny models on the CPU, Dynamo without code generation)' if report['dry_run'] else ''}",
             "", "| row | steps | size | s/image | it/s | x eager | first image s | build s | peak VRAM GB | "
             "warm 2nd process: first image s (cache hit/miss) | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        if "s_per_image" in r:
            warm = r.get("warm_start") or {}
            warm_s = (f"{warm.get('first_image_s')} ({warm.get('fxgraph_cache_hit')}/{warm.get('fxgraph_cache_miss')})"
                      if "first_image_s" in warm else ("failed" if warm else ""))
            lines.append(f"| {name} | {r['steps']} | {r['size']} | {r['s_per_image']} | {r['it_per_s']} | "
                         f"{r.get('x_eager', '')} | {r['first_image_s']} | {r.get('build_s', '')} | "
                         f"{r['peak_vram_gb']} | {warm_s} | {r.get('image_max_abs_diff_vs_eager', '')} |")
        elif "ms_per_forward" in r:
            lines.append(f"| {name} | 1 forward | - | {r['ms_per_forward']} ms | - | {r.get('x_eager', '')} | "
                         f"{r['first_call_s']} | | {r['peak_vram_gb']} | | {r.get('max_abs_diff_vs_eager', '')} |")
    for name, why in report.get("skipped", {}).items():
        lines.append(f"\n{name}: skipped ({why})")
    goals = report.get("goals")
    if goals:
        lines.append("\nGoals: " + "; ".join(f"{k}: {v}" for k, v in goals.items()))
    return "\n".join(lines)


def goals(report: dict) -> dict:
    runs, out = report["runs"], {}
    if "sd15.sdaccel" in runs:
        r = runs["sd15.sdaccel"]
        out["sd15 >= 2x eager fp16"] = f"{r['x_eager']}x ({'met' if r['x_eager'] >= 2 else 'not met'})"
        out["sd15 >= plain torch.compile"] = f"{r['x_torch_compile']}x ({'met' if r['x_torch_compile'] >= 1 else 'not met'})"
    if "lcm.sdaccel" in runs:
        r = runs["lcm.sdaccel"]
        out["lcm >= 1.5x eager fp16"] = f"{r['x_eager']}x ({'met' if r['x_eager'] >= 1.5 else 'not met'})"
    return out


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_compile.json")
    ap.add_argument("--table", default=None, help="also write the markdown table here")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--warm-sections", default="sd15,lcm", help="sections whose engines a second process loads")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lcm-steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=450,
                    help="a section starts only if it should end within this many seconds (ESTIMATE_S)")
    ap.add_argument("--engine-dir", default=None, help="default: a fresh temporary folder")
    ap.add_argument("--dry-run", action="store_true", help="tiny models on the CPU, Dynamo only: the plumbing")
    ap.add_argument("--warm-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
        # no code generation: Dynamo traces, the backend's contract runs (set before any backend exists)
        os.environ["SD_ACCEL_COMPILE_BACKEND"] = "eager"
    if args.warm_child:
        warm_child(args.warm_child, args)
        return None
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"--sections: unknown {sorted(unknown)}; use {', '.join(SECTIONS)}")
    from sd_accel.device import describe, versions

    ctx = Ctx(args)
    start = time.perf_counter()
    report: dict = {"device": describe(ctx.device).__dict__, "versions": versions(), "dry_run": ctx.dry,
                    "args": vars(args), "runs": {}, "section_s": {}, "errors": {}, "skipped": {}}

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))

    for section in sections:
        elapsed = time.perf_counter() - start
        estimate = 0 if ctx.dry else ESTIMATE_S[section]
        if elapsed + estimate > args.budget_s:
            report["skipped"][section] = (f"{elapsed:.0f} s spent + about {estimate} s for it would pass "
                                          f"--budget-s {args.budget_s:.0f}")
            continue
        t = time.perf_counter()
        try:
            section_flux(ctx, args, report) if section == "flux" else run_section(section, ctx, args, report)
        except Exception:  # one section failing must not lose the others
            report["errors"][section] = traceback.format_exc()
            print(f"section {section} FAILED:\n{report['errors'][section]}", flush=True)
        free(ctx)
        report["section_s"][section] = round(time.perf_counter() - t, 1)
        save()
    report["total_s"] = round(time.perf_counter() - start, 1)
    report["goals"] = goals(report)
    report["table"] = table(report)
    save()
    if args.table:
        Path(args.table).write_text(report["table"] + "\n")
    print(report["table"])
    return report


if __name__ == "__main__":
    main()
