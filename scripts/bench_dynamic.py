#!/usr/bin/env python
"""A dynamic UNet engine's speed against PyTorch at its profile's min, opt and max (issue 46).

    python scripts/bench_dynamic.py                                       # tiny UNet: a smoke run (seconds)
    flock /work/bigmem.lock python scripts/bench_dynamic.py --real-size   # SD 1.5, dynamic-512-768, OpenVINO

Builds the UNet's engine for ``--profile`` (a preset: ``dynamic-512-768`` by default; the tiny
run scales it to 64-96 px) and, for comparison, a static engine at the profile's max shape, in
``--precision`` (bf16 where the CPU has it, else fp32), without validation (``--validate`` runs
the build's checks, the max shape's included). Then, at each point of the profile (its min,
opt and max image size and token count, ``--batch`` images, so a UNet batch of 2x that under
classifier-free guidance), times one UNet call, the median of ``--repeats`` after a warm-up, of:

- ``torch``: the UNet in PyTorch fp32 (SDPA attention), as a CPU user runs it;
- ``dynamic``: the dynamic engine;
- ``fixed``: the same engine with ``SD_ACCEL_OV_FIXED_SHAPES=1`` (its graph compiled for the
  call's shape: the first call, timed apart as ``compile_s``, compiles; OpenVINO only);
- ``static`` (max only): the static engine built for that shape.

Each engine row gives its ratio to torch (above 1: faster) and its relative L2 error against
torch on the same feed. Points with the same shape are measured once. The random weights are
the shipped SD 1.5 config's (``--real-size``) or the built-in tiny model's: speed does not
depend on the weights' values. Writes a JSON (``--out``) and prints a markdown table
(scripts/BENCHMARKS.md has the figures measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

TINY_PROFILE = {"batch": (1, 1, 2), "height": (64, 64, 96), "width": (64, 64, 96), "tokens": (77, 77, 154)}
POINTS = ("min", "opt", "max")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_pipe(real_size: bool):
    from sd_accel.models.builtin import build_tiny_pipeline
    from sd_accel.models.components import random_pipeline
    from sd_accel.models.families import FAMILIES, load_family_configs

    return random_pipeline(load_family_configs(FAMILIES["sd15"]), seed=0) if real_size else build_tiny_pipeline("sd15")


def peak_rss_gb() -> float | None:
    """This process's peak RSS (VmHWM), GB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return None


def point_profile(profile, point: str, batch: int):
    """The static profile of one point: ``batch`` images at the point's size and tokens."""
    from sd_accel.profiles import Profile

    i = POINTS.index(point)
    return Profile(batch=batch, height=profile.height[i], width=profile.width[i], tokens=profile.tokens[i],
                   cfg=profile.cfg)


def median_ms(fn, repeats: int) -> tuple[float, float, list[float]]:
    """(first call's seconds, median ms of ``repeats`` calls after it, all those ms)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return first, statistics.median(times), times


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def build(pipe, backend, cache, profile, precision: str, validate: bool):
    from sd_accel.build import EngineJob, run_jobs
    from sd_accel.components import specs_for

    spec = specs_for(pipe)["unet"]
    start = time.perf_counter()
    (record,) = run_jobs([EngineJob(spec, profile, precision)], cache, backend, progress=False, validate=validate)
    return record, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real-size", action="store_true", help="SD 1.5's UNet (random weights); default: the tiny one")
    ap.add_argument("--profile", default="dynamic-512-768", help="a dynamic preset (real size only)")
    ap.add_argument("--backend", default="openvino")
    ap.add_argument("--precision", default=None, help="default: the backend's (bf16 where the CPU has it)")
    ap.add_argument("--batch", type=int, default=1, help="images per call (the UNet runs 2x under guidance)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-static", action="store_true", help="skip the static engine at the max shape")
    ap.add_argument("--no-fixed", action="store_true", help="skip the SD_ACCEL_OV_FIXED_SHAPES=1 rows")
    ap.add_argument("--validate", action="store_true", help="validate the engines as a build does")
    ap.add_argument("--engine-dir", default=None, help="default: a fresh temporary folder")
    ap.add_argument("--out", default="bench-dynamic.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from sd_accel.backends.openvino.runner import FIXED_SHAPES_ENV
    from sd_accel.backends.registry import create
    from sd_accel.cache.store import EngineCache
    from sd_accel.components import specs_for
    from sd_accel.device import cpu_class
    from sd_accel.profiles import Profile, preset

    profile = preset(args.profile) if args.real_size else Profile.of(TINY_PROFILE)
    if profile.static:
        ap.error(f"{args.profile} is static: give a dynamic profile")
    cache = EngineCache(Path(args.engine_dir or tempfile.mkdtemp(prefix="bench-dynamic-")))
    backend = create(args.backend, cache.root)
    precision = args.precision or backend.default_precision()
    fixed_rows = not args.no_fixed and args.backend == "openvino"
    pipe = make_pipe(args.real_size)
    pipe.unet.eval()
    spec = specs_for(pipe)["unet"]
    module = spec.export_module().eval()
    names = [t.name for t in spec.inputs()]
    report: dict = {
        "cpu": cpu_name(), "cpu_class": cpu_class(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "backend": args.backend, "precision": precision, "real_size": args.real_size,
        "profile": args.profile if args.real_size else "tiny " + Profile.of(TINY_PROFILE).tag, "batch": args.batch,
        "repeats": args.repeats, "load_average_start": os.getloadavg(), "builds": {}, "points": {},
    }
    try:
        import openvino

        report["openvino"] = openvino.__version__
    except ImportError:
        report["openvino"] = None

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1))

    dyn_record, report["builds"]["dynamic_s"] = build(pipe, backend, cache, profile, precision, args.validate)
    report["builds"]["dynamic_validation"] = dyn_record.validation
    static_record = None
    if not args.no_static:
        static_record, report["builds"]["static_max_s"] = build(pipe, backend, cache,
                                                                point_profile(profile, "max", args.batch),
                                                                precision, args.validate)
    save()

    def load(record, fixed: bool):
        saved = os.environ.pop(FIXED_SHAPES_ENV, None)
        if fixed:
            os.environ[FIXED_SHAPES_ENV] = "1"
        try:
            return backend.load(cache.root / record.key.name, list(record.files), record.shapes)
        finally:
            os.environ.pop(FIXED_SHAPES_ENV, None)
            if saved is not None:
                os.environ[FIXED_SHAPES_ENV] = saved

    seen: dict[tuple, str] = {}
    for point in POINTS:
        at = point_profile(profile, point, args.batch)
        dims = {k: v[1] for k, v in spec.dim_ranges(at).items()}
        feed = spec.sample_feed(dims, seed=0)
        shape = tuple(tuple(v.shape) for v in feed.values())
        row: dict = {"height": at.height[0], "width": at.width[0], "tokens": at.tokens[0],
                     "unet_batch": int(feed[names[0]].shape[0])}
        if shape in seen:
            report["points"][point] = {**report["points"][seen[shape]], "same_as": seen[shape]}
            continue
        seen[shape] = point
        print(f"== {point}: {at.height[0]}x{at.width[0]} px, {at.tokens[0]} tokens, UNet batch {row['unet_batch']}",
              flush=True)
        out: dict = {}

        def torch_call(out=out, feed=feed):
            with torch.no_grad():
                out["torch"] = module(*[feed[n] for n in names])[0]

        _, row["torch_ms"], row["torch_times_ms"] = median_ms(torch_call, args.repeats)
        reference = out.pop("torch").clone()
        engines = [("dynamic", dyn_record, False)]
        if fixed_rows:
            engines.append(("fixed", dyn_record, True))
        if point == "max" and static_record is not None:
            engines.append(("static", static_record, False))
        for label, record, fixed in engines:
            runner = load(record, fixed)

            def call(runner=runner, feed=feed, out=out, label=label):
                out[label] = next(iter(runner.infer(feed).values()))

            try:
                first_s, ms, times = median_ms(call, args.repeats)
            finally:
                runner.close()
            row[label] = {"ms": ms, "times_ms": times, "first_call_s": round(first_s, 2),
                          "x_torch": row["torch_ms"] / ms,
                          # the fastest calls: less of the noise a shared machine adds (torch's most)
                          "x_torch_fastest": min(row["torch_times_ms"]) / min(times),
                          "rel_l2": rel_l2(out.pop(label), reference)}
            del runner
            gc.collect()
        report["points"][point] = row
        save()
    report["load_average_end"] = os.getloadavg()
    report["peak_rss_gb"] = peak_rss_gb()
    save()
    print(table(report))
    return report


def table(report: dict) -> str:
    size = "SD 1.5" if report["real_size"] else "tiny"
    lines = [f"CPU: {report['cpu']} ({report['cpu_class']}, {report['threads']} threads); torch {report['torch']}, "
             f"OpenVINO {report['openvino']}; {size} UNet, {report['backend']} {report['precision']}, profile "
             f"{report['profile']}, {report['batch']} image(s) per call; medians of {report['repeats']} calls", "",
             "x torch: by medians / by the fastest calls (above 1: the engine is faster)", "",
             "| point | size, tokens (UNet batch) | torch fp32 ms (fastest) | dynamic ms (x torch) | fixed shapes ms "
             "(x torch; first call s) | static ms (x torch) |", "|---|---|---|---|---|---|"]
    for point, r in report["points"].items():

        def cell(label: str, first: bool = False, r: dict = r) -> str:
            e = r.get(label)
            if not e:
                return "-"
            extra = f"; {e['first_call_s']:.1f} s" if first else ""
            fastest = f" / {e['x_torch_fastest']:.2f}x" if "x_torch_fastest" in e else ""
            return f"{e['ms']:.0f} ({e['x_torch']:.2f}x{fastest}{extra})"

        same = f" (= {r['same_as']})" if r.get("same_as") else ""
        lines.append(f"| {point}{same} | {r['height']}x{r['width']} px, {r['tokens']} ({r['unet_batch']}) | "
                     f"{r['torch_ms']:.0f} ({min(r['torch_times_ms']):.0f}) | {cell('dynamic')} | {cell('fixed', True)} | {cell('static')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
