"""On a CPU: Inductor (the compile backend) against OpenVINO on the same UNet, in one run.

Builds the SD 1.5 UNet (its shipped config, random weights; ``--tiny`` for the test-size one),
and times one UNet call (batch 2: classifier-free guidance) at ``--size`` px for each row:

- ``eager-fp32`` / ``eager-bf16``: plain torch (SDPA), the UNet as loaded / cast to bf16;
- ``compile-fp32`` / ``compile-bf16``: sd-accel's compile backend (torch.compile, Inductor, static
  profile), built through the same ``run_jobs`` as every engine; its build time is the compile;
- ``openvino-fp32`` / ``openvino-bf16``: sd-accel's OpenVINO engines of the same UNet.

Each row: median ms per call of ``--repeats`` calls after one warm-up, the min-max, the build
seconds, the relative L2 error against eager fp32 on the same feed, and the ratio to eager fp32.
Writes a JSON (``--out``) and prints a markdown table. ``auto``'s CPU order follows what it says
(sd_accel/backends/registry.py AUTO_ORDER; scripts/BENCHMARKS-compile.md).

Run: python scripts/bench_compile_cpu.py --size 256 --out /tmp/bench-compile-cpu.json
Self-check (tiny UNet, seconds plus the compiles): python scripts/bench_compile_cpu.py --tiny --size 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROWS = ("eager-fp32", "eager-bf16", "compile-fp32", "compile-bf16", "openvino-fp32", "openvino-bf16")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_pipe(tiny: bool):
    from sd_accel.models.builtin import build_tiny_pipeline
    from sd_accel.models.components import random_pipeline
    from sd_accel.models.families import FAMILIES, load_family_configs

    return build_tiny_pipeline("sd15") if tiny else random_pipeline(load_family_configs(FAMILIES["sd15"]), seed=0)


def time_calls(fn, repeats: int) -> list[float]:
    fn()  # warm-up (and, for compiled rows, any compile left)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return times


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def run_engine_row(pipe, backend_name: str, precision: str, profile, feed, cache_root: Path, repeats: int):
    """Build (or reuse) the UNet engine of ``backend_name`` in ``precision``; time its runner."""
    from sd_accel.backends.registry import create
    from sd_accel.build import EngineJob, run_jobs
    from sd_accel.cache.store import EngineCache
    from sd_accel.components import specs_for

    cache = EngineCache(cache_root)
    be = create(backend_name, cache.root)
    spec = specs_for(pipe)["unet"]
    start = time.perf_counter()
    (record,) = run_jobs([EngineJob(spec, profile, precision)], cache, be, progress=False, validate=False)
    build_s = time.perf_counter() - start
    runner = be.load(cache.root / record.key.name, list(record.files), spec.shape_ranges(profile))
    out: dict = {}

    def call():
        out["latent"] = runner.infer(feed)["latent"]

    try:
        times = time_calls(call, repeats)
    finally:
        runner.close()
    return times, build_s, out["latent"].clone()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="the test-size UNet (a self-check of the script)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--engine-dir", default=None, help="default: a fresh temporary folder")
    ap.add_argument("--out", default="bench-compile-cpu.json")
    args = ap.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = set(rows) - set(ROWS)
    if unknown:
        ap.error(f"unknown rows {sorted(unknown)}; choose from {', '.join(ROWS)}")

    from sd_accel.backends.compile.builder import _feed_at
    from sd_accel.components import specs_for
    from sd_accel.device import cpu_class
    from sd_accel.profiles import Profile

    engine_dir = Path(args.engine_dir or tempfile.mkdtemp(prefix="bench-compile-cpu-"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(engine_dir / "inductor"))  # a cold compile each run
    profile = Profile.of({"batch": 1, "height": args.size, "width": args.size})
    pipe = make_pipe(args.tiny)
    spec = specs_for(pipe)["unet"]
    feed = _feed_at(spec, spec.shape_ranges(profile), "opt", "cpu")
    report = {
        "cpu": cpu_name(), "cpu_class": cpu_class(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "size": args.size, "tiny": args.tiny, "unet_batch": int(feed["sample"].shape[0]),
        "repeats": args.repeats, "load_average_start": os.getloadavg(), "rows": {},
    }
    try:
        import openvino

        report["openvino"] = openvino.__version__
    except ImportError:
        report["openvino"] = None
    export = spec.export_module().eval()
    names = [t.name for t in spec.inputs()]
    # the bf16 rows cast the UNet; casting back would leave bf16-rounded weights for the rows after
    fp32_weights = {k: v.detach().clone() for k, v in pipe.unet.state_dict().items()}

    def restore() -> None:
        pipe.unet.to(torch.float32)
        pipe.unet.load_state_dict(fp32_weights)
    with torch.no_grad():
        reference = export(*[feed[n] for n in names])[0].clone()

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1))

    for row in rows:
        kind, precision = row.split("-")
        print(f"== {row}", flush=True)
        try:
            if kind == "eager":
                module = export if precision == "fp32" else spec.export_module().eval()
                if precision == "bf16":
                    pipe.unet.to(torch.bfloat16)
                args_ = [feed[n].to(torch.bfloat16) if feed[n].is_floating_point() and precision == "bf16" else feed[n]
                         for n in names]
                out: dict = {}

                def call(module=module, args_=args_, out=out):
                    with torch.no_grad():
                        out["latent"] = module(*args_)[0]

                times, build_s = time_calls(call, args.repeats), None
                latent = out["latent"]
            else:
                pipe.unet.to(torch.bfloat16 if (kind == "compile" and precision == "bf16") else torch.float32)
                times, build_s, latent = run_engine_row(pipe, "compile" if kind == "compile" else "openvino",
                                                        precision, profile, feed, engine_dir, args.repeats)
            restore()
            report["rows"][row] = {"ms": statistics.median(times), "min": min(times), "max": max(times),
                                   "times_ms": times, "build_s": build_s, "rel_l2": rel_l2(latent, reference)}
        except Exception as exc:  # one row failing must not lose the others
            restore()
            report["rows"][row] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(report["rows"][row]["traceback"], flush=True)
        gc.collect()
        save()
    base = report["rows"].get("eager-fp32", {}).get("ms")
    for r in report["rows"].values():
        if "ms" in r and base:
            r["x_eager_fp32"] = base / r["ms"]
    pairs = [("compile-fp32", "openvino-fp32"), ("compile-bf16", "openvino-bf16")]
    report["compile_vs_openvino"] = {
        f"{a} / {b}": report["rows"][b]["ms"] / report["rows"][a]["ms"]
        for a, b in pairs if "ms" in report["rows"].get(a, {}) and "ms" in report["rows"].get(b, {})
    }  # > 1: compile faster
    report["compile_vs_openvino_min"] = {  # the fastest calls: less of the noise a shared machine adds
        f"{a} / {b}": report["rows"][b]["min"] / report["rows"][a]["min"]
        for a, b in pairs if "ms" in report["rows"].get(a, {}) and "ms" in report["rows"].get(b, {})
    }
    report["load_average_end"] = os.getloadavg()
    save()
    print(table(report))
    return report


def table(report: dict) -> str:
    lines = [f"CPU: {report['cpu']} ({report['cpu_class']}, {report['threads']} threads); torch {report['torch']}, "
             f"OpenVINO {report['openvino']}; UNet {'tiny' if report['tiny'] else 'SD 1.5'} at {report['size']} px, "
             f"batch {report['unet_batch']}", "",
             "| row | ms/call (median) | min-max | x eager fp32 | build s | rel L2 vs eager fp32 |",
             "|---|---|---|---|---|---|"]
    for name, r in report["rows"].items():
        if "ms" not in r:
            lines.append(f"| {name} | failed: {r['error'][:80]} | | | | |")
            continue
        build = "-" if r["build_s"] is None else f"{r['build_s']:.0f}"
        lines.append(f"| {name} | {r['ms']:.0f} | {r['min']:.0f}-{r['max']:.0f} | {r.get('x_eager_fp32', 0):.2f} | "
                     f"{build} | {r['rel_l2']:.2e} |")
    for k, v in report.get("compile_vs_openvino", {}).items():
        fastest = report.get("compile_vs_openvino_min", {}).get(k)
        lines.append(f"\n{k}: {v:.2f} by medians, {fastest:.2f} by the fastest calls (above 1: compile is faster)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
