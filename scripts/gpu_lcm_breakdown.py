"""Where the time of the few-step (LCM + TAESD) recipe goes, plain diffusers against sd-accel, on a GPU.

``scripts/gpu_torch_check.py --sections lcm`` measured on an H200 that sd-accel's torch-level path
(``accelerate(precision="fp16"|"bf16", attention="auto", vae="tiny:builtin:taesd")``) makes this
recipe slower than plain diffusers fp32. This script builds the same real-size random LCM model once
(SD 1.5 configs, ``time_cond_proj_dim`` 256, LCMScheduler, 4 steps, guidance 8 embedded, no CFG,
TAESD decoding) and, per row, measures s/image (best of ``--repeats`` after ``--warmup`` calls,
synchronized) and a per-component breakdown from separate hooked calls: CUDA-event time (and host
time) of ``text_encoder``, ``unet``, ``vae.decode`` (the whole call: sd-accel's NaN guard included)
and ``vae.decoder`` (the decoder module alone); ``rest`` = wall total minus text encoder, UNet and
``vae.decode`` (scheduler, latents, postprocess, Python). UNet calls are counted.

Rows: 1 plain fp32; 2 plain fp16 (``pipe.to("cuda", torch.float16)``, the fair baseline for 3);
3 sd-accel fp16; 4 sd-accel bf16; 5 sd-accel bf16 with TAESD cast back to fp16; 6 sd-accel fp16 with
``cudnn.benchmark``; extras: 7 plain fp16 + cudnn.benchmark, 8 sd-accel bf16 + cudnn.benchmark,
9 sd-accel fp16 with ``nan_check=False`` (no VAE guard check), 10 sd-accel fp16 with the UNet and TAESD
in channels_last. For rows 2, 3 and 4 a torch.profiler table (top CUDA kernels; top CPU ops for 2, 3)
is printed. Writes a JSON report.

Run: python scripts/gpu_lcm_breakdown.py --out lcm_breakdown.json
CPU self-check (tiny models, 64 px, 2 steps): python scripts/gpu_lcm_breakdown.py --tiny
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_torch_check import CUDA, DEVICE, free, sync  # noqa: E402

PROMPT = "a photo of a cat"


def torch_flags() -> dict:
    return {
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


# ---- per-component timing ------------------------------------------------------------------


class Breakdown:
    """Forward pre/post hooks (and a wrapper of ``vae.decode``) that record CUDA events and host
    times per component; read after a synchronize."""

    COMPONENTS = ("text_encoder", "unet", "vae_decode", "vae_decoder")

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        self.handles: list = []
        self.open: dict[str, list] = {c: [] for c in self.COMPONENTS}
        self.pairs: dict[str, list] = {c: [] for c in self.COMPONENTS}
        self.unet_calls = 0
        for name, module in (("text_encoder", pipe.text_encoder), ("unet", pipe.unet),
                             ("vae_decoder", getattr(pipe.vae, "decoder", None))):
            if module is None:
                continue
            self.handles.append(module.register_forward_pre_hook(self._pre(name)))
            self.handles.append(module.register_forward_hook(self._post(name)))
        vae = pipe.vae
        self.had_decode = "decode" in vae.__dict__
        self.orig_decode = vae.decode  # sd-accel: VaeGuard.decode; plain: the class's bound method

        def timed_decode(*args, **kwargs):
            self._start("vae_decode")
            out = self.orig_decode(*args, **kwargs)
            self._stop("vae_decode")
            return out

        vae.decode = timed_decode

    def _start(self, name: str) -> None:
        ev = None
        if CUDA:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.open[name].append((ev, time.perf_counter()))
        if name == "unet":
            self.unet_calls += 1

    def _stop(self, name: str) -> None:
        ev = None
        if CUDA:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        start = self.open[name].pop()
        self.pairs[name].append((start, (ev, time.perf_counter())))

    def _pre(self, name):
        return lambda module, args: self._start(name)

    def _post(self, name):
        return lambda module, args, out: self._stop(name)

    def reset(self) -> None:
        self.pairs = {c: [] for c in self.COMPONENTS}
        self.unet_calls = 0

    def read(self) -> dict:
        """ms per component: ``gpu_ms`` (CUDA events; host time on CPU) and ``host_ms``."""
        out = {}
        for name, pairs in self.pairs.items():
            gpu = host = 0.0
            for (e0, t0), (e1, t1) in pairs:
                host += (t1 - t0) * 1e3
                gpu += e0.elapsed_time(e1) if CUDA else (t1 - t0) * 1e3
            out[name] = {"gpu_ms": round(gpu, 2), "host_ms": round(host, 2), "calls": len(pairs)}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        if self.had_decode:
            self.pipe.vae.decode = self.orig_decode
        else:
            del self.pipe.vae.__dict__["decode"]


# ---- one row -------------------------------------------------------------------------------


def call(pipe, steps: int, size: int):
    g = torch.Generator("cpu").manual_seed(0)
    sync()
    t = time.perf_counter()
    out = pipe(PROMPT, num_inference_steps=steps, height=size, width=size, generator=g, output_type="np",
               guidance_scale=8.0).images
    sync()
    return time.perf_counter() - t, out


def hooks_present(pipe) -> dict:
    """Forward hooks / accelerate hooks / wrapped methods on the pipeline's modules (before ours)."""
    found = {}
    for name in ("text_encoder", "unet", "vae"):
        m = getattr(pipe, name, None)
        if m is None:
            continue
        fwd = sum(len(x._forward_hooks) for x in m.modules())
        pre = sum(len(x._forward_pre_hooks) for x in m.modules())
        hf = sum(1 for x in m.modules() if hasattr(x, "_hf_hook"))
        found[name] = {"class": type(m).__name__, "dtype": str(getattr(m, "dtype", "?")).replace("torch.", ""),
                       "device": str(getattr(m, "device", "?")), "forward_hooks": fwd, "forward_pre_hooks": pre,
                       "accelerate_hf_hooks": hf,
                       "instance_overrides": sorted(k for k in ("forward", "decode", "encode") if k in m.__dict__)}
    procs = getattr(pipe.unet, "attn_processors", {})
    found["unet_attn_processors"] = sorted({type(p).__name__ for p in procs.values()})
    found["scheduler"] = type(pipe.scheduler).__name__
    found["pipeline"] = type(pipe).__name__
    guard = getattr(pipe.vae, "_sd_accel_guard", None)
    if guard is not None:
        found["vae_guard"] = {"nan_check": guard.nan_check, "redecodes": guard.redecodes}
    found["memory_format_unet_conv_in"] = (
        "channels_last" if pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
        and not pipe.unet.conv_in.weight.is_contiguous() else "contiguous")
    return found


def profile(pipe, steps: int, size: int, label: str, cpu_table: bool) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with tprofile(activities=acts) as prof:
        wall, _ = call(pipe, steps, size)
    avg = prof.key_averages()
    key = "self_cuda_time_total" if CUDA else "self_cpu_time_total"
    print(f"\n== profile {label}: wall {wall * 1e3:.1f} ms; top 15 by {key}", flush=True)
    print(avg.table(sort_by=key, row_limit=15, max_name_column_width=60), flush=True)
    if cpu_table:
        print(f"== profile {label}: top 12 CPU ops by cpu_time_total", flush=True)
        print(avg.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60), flush=True)
    gpu_busy = kernels = 0
    if CUDA:
        for evt in prof.events():
            if "CUDA" in str(getattr(evt, "device_type", "")):
                kernels += 1
                gpu_busy += evt.device_time_total
    # host syncs (.item(), bool(tensor)), launches and copies, by op name
    counts = {e.key: e.count for e in avg if e.key in (
        "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "cudaStreamSynchronize",
        "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
        "cuLaunchKernelEx", "aten::copy_", "aten::to", "aten::isnan", "aten::isinf", "aten::any")}
    return {"wall_ms": round(wall * 1e3, 1), "gpu_kernel_ms": round(gpu_busy / 1e3, 1), "gpu_events": kernels,
            "gpu_busy_fraction": round(gpu_busy / 1e3 / (wall * 1e3), 3) if CUDA else None, "op_counts": counts}


def measure(pipe, args, ref, label: str, prof: str | None = None) -> dict:
    pipe.set_progress_bar_config(disable=True)
    for _ in range(args.warmup):
        call(pipe, args.steps, args.size)
    times, img = [], None
    for _ in range(args.repeats):
        dt, img = call(pipe, args.steps, args.size)
        times.append(dt)
    r = {"s_per_image": round(min(times), 4), "s_all": [round(t, 4) for t in times],
         "finite": bool(np.isfinite(img).all())}
    if ref is not None:
        r["image_max_abs_diff_vs_1"] = round(float(np.abs(img - ref).max()), 4)
    # the breakdown: separate hooked calls, the fastest kept
    bd = Breakdown(pipe)
    best = None
    try:
        for _ in range(args.hooked):
            bd.reset()
            dt, _ = call(pipe, args.steps, args.size)
            if best is None or dt < best[0]:
                best = (dt, bd.read(), bd.unet_calls)
    finally:
        bd.remove()
    dt, comps, unet_calls = best
    total = dt * 1e3
    counted = sum(comps[c]["gpu_ms"] for c in ("text_encoder", "unet", "vae_decode"))
    r["breakdown_ms"] = {
        "total_hooked": round(total, 2),
        "text_encoder": comps["text_encoder"]["gpu_ms"],
        "unet": comps["unet"]["gpu_ms"],
        "unet_per_call": round(comps["unet"]["gpu_ms"] / max(unet_calls, 1), 2),
        "vae_decode": comps["vae_decode"]["gpu_ms"],
        "vae_decoder_module": comps["vae_decoder"]["gpu_ms"],
        "vae_decode_outside_decoder": round(comps["vae_decode"]["gpu_ms"] - comps["vae_decoder"]["gpu_ms"], 2),
        "rest": round(total - counted, 2),
    }
    r["host_ms"] = {c: comps[c]["host_ms"] for c in Breakdown.COMPONENTS}
    r["unet_calls"] = unet_calls
    r["steps"] = args.steps
    if prof is not None:
        try:
            r["profile"] = profile(pipe, args.steps, args.size, label, cpu_table=prof == "cpu")
        except Exception:  # the row's timings stand without it
            r["profile_error"] = traceback.format_exc()
            print(f"profile {label} FAILED:\n{r['profile_error']}", flush=True)
    print(label, json.dumps(r), flush=True)
    return r, img


# ---- the rows ------------------------------------------------------------------------------


def make_rows(args):
    """(label, factory, post, setup, teardown, profile) per row: factory builds a fresh pipeline, post
    changes it, setup/teardown set and reset a global flag, profile: None, "cpu" (CPU table too) or "gpu"."""
    from diffusers import LatentConsistencyModelPipeline, LCMScheduler, UNet2DConditionModel
    from gpu_torch_check import LCM_SCHEDULER, LCM_UNET, TAESD, build, own

    from sd_accel import accelerate
    from sd_accel.models.taesd import load_tiny_vae

    t = time.perf_counter()
    base = build("sd15", args.tiny)
    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config({**own(base.unet.config), **LCM_UNET}).eval()
    scheduler_config = {**own(base.scheduler.config), **LCM_SCHEDULER}
    taesd = load_tiny_vae(TAESD)
    build_s = round(time.perf_counter() - t, 1)

    def pipeline(vae):
        return LatentConsistencyModelPipeline(
            vae=copy.deepcopy(vae), text_encoder=copy.deepcopy(base.text_encoder), tokenizer=base.tokenizer,
            unet=copy.deepcopy(unet), scheduler=LCMScheduler.from_config(scheduler_config), safety_checker=None,
            feature_extractor=None, requires_safety_checker=False)

    def plain(dtype):
        return lambda: pipeline(taesd).to(DEVICE, dtype)

    def sdaccel(precision, **extra):
        # as gpu_torch_check: the model's own VAE in the pipeline, TAESD swapped in by accelerate
        return lambda: accelerate(pipeline(base.vae), vae=f"tiny:{TAESD}", precision=precision, attention="auto",
                                  **extra)

    def bench_on():
        torch.backends.cudnn.benchmark = True

    def bench_off():
        torch.backends.cudnn.benchmark = False

    def taesd_fp16(pipe):
        pipe.vae.to(torch.float16)
        return pipe

    def channels_last(pipe):
        pipe.unet.to(memory_format=torch.channels_last)
        pipe.vae.to(memory_format=torch.channels_last)
        return pipe

    half = torch.float16
    rows = [
        ("1_plain_fp32", plain(torch.float32), None, None, None, None),
        ("2_plain_fp16", plain(half), None, None, None, "cpu"),
        ("3_sdaccel_fp16", sdaccel("fp16"), None, None, None, "cpu"),
        ("4_sdaccel_bf16", sdaccel("bf16"), None, None, None, "gpu"),
        ("5_sdaccel_bf16_taesd_fp16", sdaccel("bf16"), taesd_fp16, None, None, None),
        ("6_sdaccel_fp16_cudnn_benchmark", sdaccel("fp16"), None, bench_on, bench_off, None),
        ("7x_plain_fp16_cudnn_benchmark", plain(half), None, bench_on, bench_off, None),
        ("8x_sdaccel_bf16_cudnn_benchmark", sdaccel("bf16"), None, bench_on, bench_off, None),
        ("9x_sdaccel_fp16_no_nan_check", sdaccel("fp16", nan_check=False), None, None, None, None),
        ("10x_sdaccel_fp16_channels_last", sdaccel("fp16"), channels_last, None, None, None),
    ]
    return rows, build_s


def table(runs: dict) -> str:
    lines = ["| row | s/image | x vs 1 | x vs 2 | text enc ms | UNet ms (per call) | vae.decode ms (decoder) | rest ms "
             "| UNet calls | finite |", "|---|---|---|---|---|---|---|---|---|---|"]
    a = runs.get("1_plain_fp32", {}).get("s_per_image")
    b = runs.get("2_plain_fp16", {}).get("s_per_image")
    for name, r in runs.items():
        if "s_per_image" not in r:
            continue
        bd = r["breakdown_ms"]
        lines.append("| {} | {} | {} | {} | {} | {} ({}) | {} ({}) | {} | {} | {} |".format(
            name, r["s_per_image"], round(a / r["s_per_image"], 2) if a else "",
            round(b / r["s_per_image"], 2) if b else "", bd["text_encoder"], bd["unet"], bd["unet_per_call"],
            bd["vae_decode"], bd["vae_decoder_module"], bd["rest"], r["unet_calls"], r["finite"]))
    return "\n".join(lines)


def main() -> None:
    from sd_accel.device import describe, versions

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="lcm_breakdown.json")
    ap.add_argument("--tiny", action="store_true", help="tiny models, 64 px, 2 steps: a CPU check that it runs")
    ap.add_argument("--steps", type=int, default=None, help="default 4 (2 with --tiny)")
    ap.add_argument("--size", type=int, default=None, help="default 512 (64 with --tiny)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls, best kept; default 5 (1 with --tiny)")
    ap.add_argument("--warmup", type=int, default=None, help="default 2 (1 with --tiny)")
    ap.add_argument("--hooked", type=int, default=None, help="hooked calls for the breakdown; default 3 (1 --tiny)")
    ap.add_argument("--rows", default="", help="comma-separated row-label prefixes to run (default: all)")
    args = ap.parse_args()
    for name, full, tiny in (("steps", 4, 2), ("size", 512, 64), ("repeats", 5, 1), ("warmup", 2, 1),
                             ("hooked", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)

    report: dict = {"device": describe().__dict__, "versions": versions(), "args": vars(args),
                    "torch_flags_at_start": torch_flags(), "runs": {}, "wrappers": {}, "errors": {}}
    print(json.dumps(report["device"]), json.dumps(report["versions"]), json.dumps(report["torch_flags_at_start"]),
          flush=True)

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    t0 = time.perf_counter()
    rows, report["build_s"] = make_rows(args)
    print("built in", report["build_s"], "s", flush=True)
    wanted = [w.strip() for w in args.rows.split(",") if w.strip()]
    ref = None
    for label, factory, post, setup, teardown, prof in rows:
        if wanted and not any(label.startswith(w) for w in wanted):
            continue
        t = time.perf_counter()
        pipe = None
        try:
            if setup:
                setup()
            pipe = factory()
            if post:
                pipe = post(pipe)
            if label.startswith(("3_", "4_", "5_")):
                info = hooks_present(pipe)
                info["sd_accel_summary"] = pipe.sd_accel.summary()
                info["torch_flags"] = torch_flags()
                report["wrappers"][label] = info
                print("wrappers", label, json.dumps(info), flush=True)
            r, img = measure(pipe, args, ref, label, prof)
            if label.startswith("1_"):
                ref = img
            if hasattr(pipe.vae, "_sd_accel_guard"):
                r["vae_guard_redecodes"] = pipe.vae._sd_accel_guard.redecodes
            r["row_s"] = round(time.perf_counter() - t, 1)
            report["runs"][label] = r
        except Exception:
            report["errors"][label] = traceback.format_exc()
            print(f"row {label} FAILED:\n{report['errors'][label]}", flush=True)
        finally:
            if teardown:
                teardown()
            del pipe
            free()
        save()

    report["total_s"] = round(time.perf_counter() - t0, 1)
    report["table"] = table(report["runs"])
    save()
    print(report["table"])
    print("total", report["total_s"], "s", flush=True)
    if report["errors"]:
        raise SystemExit(f"failed rows: {', '.join(report['errors'])}")


if __name__ == "__main__":
    main()
