"""Torch-level acceleration on a CUDA GPU, side by side with plain diffusers, in one run.

Builds the real SD 1.5 architecture (its shipped configs, random weights: the timings are real,
the images are noise) and measures, at the same seed, prompt and size:
  (a) plain diffusers, fp32, its default attention: what a user has today;
  (b) sd-accel accelerate(precision="fp16", attention="auto");
  (c) sd-accel accelerate(precision="bf16");
  plus the medvram / lowvram offload modes (peak VRAM) and the fp16 VAE NaN guard.
Writes a JSON report. Run: python scripts/gpu_torch_check.py --out report.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def build(family: str, tiny: bool):
    from sd_accel.models.builtin import build_tiny_pipeline
    from sd_accel.models.components import random_pipeline
    from sd_accel.models.families import FAMILIES, load_family_configs

    if tiny:
        return build_tiny_pipeline(family)
    return random_pipeline(load_family_configs(FAMILIES[family]), seed=0)


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def run(pipe, steps: int, size: int, repeats: int) -> dict:
    def once():
        g = torch.Generator("cpu").manual_seed(0)
        sync()
        t = time.perf_counter()
        out = pipe("a photo of a cat", num_inference_steps=steps, height=size, width=size, generator=g,
                   output_type="np").images
        sync()
        return time.perf_counter() - t, out

    once()  # warm-up: cuDNN/cuBLAS autotuning, allocator growth
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    times, out = [], None
    for _ in range(repeats):
        dt, out = once()
        times.append(dt)
    best = min(times)
    return {
        "s_per_image": round(best, 4),
        "it_per_s": round(steps / best, 2),
        "peak_vram_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if CUDA else None,
        "finite": bool(np.isfinite(out).all()),
        "image": out,
    }


def fresh(base):
    import copy

    return type(base)(**{k: copy.deepcopy(v) for k, v in base.components.items()})


def main() -> None:
    from sd_accel import accelerate
    from sd_accel.device import describe, versions

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_report.json")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny model: a quick check that the script runs")
    args = ap.parse_args()
    report: dict = {"device": describe().__dict__, "versions": versions(), "args": vars(args), "runs": {}}
    print(json.dumps(report["device"]), json.dumps(report["versions"]), flush=True)

    t = time.perf_counter()
    base = build("sd15", args.tiny)
    report["build_model_s"] = round(time.perf_counter() - t, 1)
    runs = report["runs"]

    plain = fresh(base).to(DEVICE)  # (a) plain diffusers: fp32, default attention
    runs["a_plain_fp32"] = run(plain, args.steps, args.size, args.repeats)
    ref = runs["a_plain_fp32"].pop("image")
    del plain

    for label, cfg in (("b_sdaccel_fp16", dict(precision="fp16")), ("c_sdaccel_bf16", dict(precision="bf16"))):
        pipe = accelerate(fresh(base), attention="auto", **cfg)
        r = run(pipe, args.steps, args.size, args.repeats)
        img = r.pop("image")
        r["attention"] = pipe.sd_accel.attention
        r["vae_dtype"] = pipe.sd_accel.vae_dtype
        r["speedup_vs_a"] = round(runs["a_plain_fp32"]["s_per_image"] / r["s_per_image"], 2)
        r["image_max_abs_diff_vs_a"] = round(float(np.abs(img - ref).max()), 4)
        runs[label] = r
        print(label, json.dumps(r), flush=True)
        del pipe

    for mode in ("medvram", "lowvram"):
        pipe = accelerate(fresh(base), precision="fp16", offload=mode)
        r = run(pipe, min(args.steps, 5), args.size, 1)
        r.pop("image")
        r["offload_active"] = pipe.sd_accel.offload_active
        runs[f"d_fp16_{mode}"] = r
        print(mode, json.dumps(r), flush=True)
        del pipe

    # The fp16 VAE guard on CUDA: a decode that overflows to NaN is redone in fp32.
    pipe = accelerate(fresh(base), precision="fp16" if CUDA else "bf16")
    hook = pipe.vae.decoder.conv_out.register_forward_hook(
        lambda m, i, o: o * float("nan") if o.dtype != torch.float32 else o
    )
    r = run(pipe, 2, args.size, 1)
    hook.remove()
    runs["e_nan_guard"] = {"finite": r["finite"], "redecodes": pipe.vae._sd_accel_guard.redecodes}
    print("nan guard", json.dumps(runs["e_nan_guard"]), flush=True)

    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
