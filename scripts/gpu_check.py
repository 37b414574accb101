#!/usr/bin/env python3
"""Build TensorRT engines for every component of the tiny built-in models on this GPU, run them,
and compare them with torch: one PASS/FAIL line per engine and a summary; exit status 0 on PASS.

    python scripts/gpu_check.py                       # tiny-sd15 and tiny-sdxl, fp16 and fp32
    python scripts/gpu_check.py --models tiny-sd15 --precisions fp16 --json report.json

Each engine is built from the component's ONNX export with one dynamic profile (batch 1-2,
64-96 px), loaded, and checked at its opt and max shapes against the fp32 torch module
(``sd_accel.validate``: the check ``build_engines`` makes before it keeps an engine). Then a
short end-to-end generation runs on the engines. ``scripts/gpu_check.sh`` sets up and runs this.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

PROFILE = dict(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96))


def environment() -> dict:
    import torch

    from sd_accel.backends.tensorrt.builder import trt_status
    from sd_accel.device import versions

    ok, version, why = trt_status()
    env = {**versions(), "tensorrt": version, "tensorrt_usable": ok, "why_not": why}
    env["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{props.name} (sm{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
    return env


def check_engine(backend, spec, precision: str, cache_root: Path, work: Path) -> dict:
    from sd_accel.onnx.export import onnx_artifact
    from sd_accel.profiles import Profile
    from sd_accel.validate import validate

    profile = Profile(**PROFILE)
    shapes = spec.shape_ranges(profile)
    out_dir = work / f"{spec.name}.{precision}"
    start = time.perf_counter()
    onnx_path = onnx_artifact(spec, cache_root)
    files = backend.build(onnx_path, shapes, precision, out_dir, lambda f, m: None)
    build_s = time.perf_counter() - start
    runner = backend.load(out_dir, files, shapes)
    try:
        result = validate(spec, runner, profile, precision, device="cuda")
    finally:
        runner.close()
    size_mb = sum((out_dir / f).stat().st_size for f in files) / 2**20
    return {"max_abs": result.max_abs, "rel_l2": result.rel_l2, "ok": result.ok, "why": result.why,
            "points": result.points, "build_s": round(build_s, 1), "engine_mb": round(size_mb, 1)}


def end_to_end(model: str, engine_dir: Path) -> dict:
    """A 2-step generation on the engines next to the same generation in torch."""
    import numpy as np
    import torch

    from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, stats

    size = 64
    ref_pipe = accelerate(load_pipeline(f"builtin:{model}"))  # torch on CUDA, same precision as the engines
    kwargs = dict(num_inference_steps=2, height=size, width=size, output_type="np")
    ref = ref_pipe("a cat", generator=torch.Generator().manual_seed(0), **kwargs).images
    del ref_pipe
    pipe = load_pipeline(f"builtin:{model}")
    build_engines(pipe, profiles=[dict(batch=1, height=size, width=size)], backend="tensorrt",
                  engine_dir=engine_dir, progress=False)
    pipe = accelerate(pipe, AccelConfig(engines=True, engine_dir=str(engine_dir), backend="tensorrt"))
    got = pipe("a cat", generator=torch.Generator().manual_seed(0), **kwargs).images
    calls = {k: v.get("engine_calls", 0) for k, v in stats(pipe).items() if isinstance(v, dict)}
    diff = float(np.abs(np.asarray(got, dtype=np.float32) - np.asarray(ref, dtype=np.float32)).max())
    return {"max_abs_pixels": diff, "engine_calls": calls, "ok": bool(np.isfinite(got).all()) and sum(calls.values()) > 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-sd15", "tiny-sdxl"])
    ap.add_argument("--precisions", nargs="+", default=["fp16", "fp32"])
    ap.add_argument("--json", type=Path, help="write the full report here")
    ap.add_argument("--no-e2e", action="store_true", help="skip the end-to-end generation")
    args = ap.parse_args(argv)

    env = environment()
    print("gpu_check: " + ", ".join(f"{k}={v}" for k, v in env.items() if v not in (None, "")))
    report: dict = {"environment": env, "engines": [], "end_to_end": []}
    if not env["tensorrt_usable"]:
        print(f"gpu_check: FAIL: TensorRT is not usable here: {env['why_not']}")
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        return 2

    from sd_accel.backends.tensorrt import TensorRTBackend
    from sd_accel.components import specs_for
    from sd_accel.models.builtin import BUILTINS, build_tiny_pipeline
    from sd_accel.runtime.swap import torch_modules
    from sd_accel.validate import TOLERANCE

    with tempfile.TemporaryDirectory(prefix="sd-accel-gpu-check-") as tmp:
        tmp = Path(tmp)
        backend = TensorRTBackend(cache_root=tmp / "cache")
        header = f"{'model':<10} {'component':<12} {'precision':<9} {'max abs err':>12} {'rel L2':>9} {'tol':>6}  build  result"
        print(header)
        for model in args.models:
            pipe = build_tiny_pipeline(BUILTINS[model])
            with torch_modules(pipe):
                specs = specs_for(pipe)
                for precision in args.precisions:
                    for name, spec in specs.items():
                        row = {"model": model, "component": name, "precision": precision}
                        try:
                            row.update(check_engine(backend, spec, precision, tmp / "cache", tmp / model))
                        except Exception as exc:  # one broken engine must not hide the others
                            row.update(ok=False, why=f"{type(exc).__name__}: {exc}", max_abs=math.nan,
                                       rel_l2=math.nan, build_s=math.nan, trace=traceback.format_exc())
                        report["engines"].append(row)
                        print(f"{model:<10} {name:<12} {precision:<9} {row['max_abs']:>12.3e} {row['rel_l2']:>9.2e} "
                              f"{TOLERANCE[precision]:>6.0e} {row['build_s']:>5}s  {'PASS' if row['ok'] else 'FAIL'}"
                              + ("" if row["ok"] else f"  ({row['why']})"), flush=True)
        if not args.no_e2e:
            for model in args.models:
                try:
                    result = end_to_end(model, tmp / f"e2e-{model}")
                except Exception as exc:
                    result = {"ok": False, "why": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
                report["end_to_end"].append({"model": model, **result})
                print(f"gpu_check: end to end {model}: {'PASS' if result['ok'] else 'FAIL'} "
                      + json.dumps({k: v for k, v in result.items() if k not in ("ok", "trace")}), flush=True)

    rows = report["engines"] + report["end_to_end"]
    passed = sum(bool(r["ok"]) for r in rows)
    ok = passed == len(rows)
    worst = {}
    for r in report["engines"]:
        key = f"{r['component']}/{r['precision']}"
        worst[key] = max(worst.get(key, 0.0), r["max_abs"]) if not math.isnan(r["max_abs"]) else math.nan
    report["summary"] = {"ok": ok, "passed": passed, "total": len(rows), "max_abs_by_component": worst}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    print("gpu_check: max abs error vs torch: " + ", ".join(f"{k}={v:.3e}" for k, v in worst.items()))
    print(f"gpu_check: {'PASS' if ok else 'FAIL'} ({passed}/{len(rows)} checks) with TensorRT {env['tensorrt']} "
          f"on {env.get('gpu', '?')}")
    for r in rows:
        if not r["ok"] and r.get("trace"):
            print(f"--- {r.get('component', 'end to end')} {r.get('precision', '')} {r['model']}:\n{r['trace']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
