#!/usr/bin/env python
"""What this CPU computes per second in OpenVINO, against what one FLUX.1 segment engine does: the
roofline behind a transformer's time per call (scripts/BENCHMARKS-full-size.md, "Why FLUX.1-schnell
at 512 px is not under 2 minutes").

    python scripts/bench_cpu_rate.py                          # matrix products only
    python scripts/bench_cpu_rate.py --engine ENGINE_FOLDER   # and its segments seg05 / seg30

The matrix product is one FLUX.1 single block's first layer at 512 px (1,280 tokens x 3,072 ->
21,504): int8 weights (dynamic quantization of activations at OpenVINO's default, then off) and
float weights run in bf16 (f32 where the CPU has no bf16). A segment of a built FLUX.1 engine
(``--engine``: its folder, ``seg05`` a double block, ``seg30`` a single block) runs at the same
512 px shapes; its operations are counted from FLUX.1's widths. Prints one JSON object; the
fastest of 3 runs each.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

TOKENS, TEXT, WIDTH, MLP = 1280, 256, 3072, 12288
# one double or single block at 512 px: every linear layer's multiply-adds, plus attention's two products
STREAM = 3 * WIDTH * WIDTH + WIDTH * WIDTH + 2 * WIDTH * MLP  # qkv, out, MLP of one stream
SINGLE = WIDTH * (3 * WIDTH + MLP) + (WIDTH + MLP) * WIDTH
ATTENTION = 4 * TOKENS * TOKENS * WIDTH
FLOPS = {"seg05": 2 * (TOKENS - TEXT) * STREAM + 2 * TEXT * STREAM + ATTENTION,
         "seg30": 2 * TOKENS * SINGLE + ATTENTION}


def fastest(compiled, feed: dict, runs: int = 3) -> float:
    req = compiled.create_infer_request()
    req.infer(feed)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        req.infer(feed)
        times.append(time.perf_counter() - start)
    return min(times)


def config(hint: str, dq: int | None) -> dict[str, str]:
    cfg = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": hint}
    if dq is not None:
        cfg["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = str(dq)
    return cfg


def matmul_rate(ov, ops, hint: str, int8: bool, dq: int | None, k: int = WIDTH, n: int = 3 * WIDTH + MLP) -> float:
    rng = np.random.default_rng(0)
    x = ops.parameter([1, TOKENS, k], np.float32, name="x")
    if int8:  # the decompression pattern the CPU plugin takes as compressed weights
        w = ops.convert(ops.constant(rng.integers(-127, 127, (n, k), dtype=np.int8)), np.float16)
        w = ops.convert(ops.multiply(w, ops.constant((rng.random((n, 1)) * 0.01).astype(np.float16))), np.float32)
    else:
        w = ops.constant((rng.standard_normal((n, k)) * 0.02).astype(np.float32))
    model = ov.Model([ops.matmul(x, w, False, True)], [x])
    compiled = ov.Core().compile_model(model, "CPU", config(hint, dq))
    seconds = fastest(compiled, {"x": rng.standard_normal((1, TOKENS, k)).astype(np.float32)})
    return 2 * TOKENS * k * n / seconds / 1e9


def segment_rate(ov, folder: Path, hint: str, dq: int | None) -> dict[str, float]:
    model = ov.Core().read_model(str(folder / "engine.xml"), str(folder / "engine.bin"))
    feed = {}
    for port in model.inputs:
        dims = [d.get_length() if d.is_static else (1024 if i == 1 or port.get_any_name() == "img_ids" else 1)
                for i, d in enumerate(port.get_partial_shape())]
        feed[port.get_any_name()] = (np.random.default_rng(1).standard_normal(dims) * 0.5).astype(np.float32)
    seconds = fastest(ov.Core().compile_model(model, "CPU", config(hint, dq)), feed)
    return {"s": round(seconds, 3), "gflops": round(FLOPS[folder.name] / seconds / 1e9, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, help="a FLUX.1 transformer engine folder (seg05, seg30 inside)")
    args = ap.parse_args()
    import openvino as ov
    from openvino import opset13 as ops

    from sd_accel.backends.openvino.builder import has_bf16

    hint = "bf16" if has_bf16() else "f32"
    out: dict[str, object] = {"inference_precision": hint, "gflops": {
        "matmul int8 weights, dynamic quantization default": round(matmul_rate(ov, ops, hint, True, None), 1),
        "matmul int8 weights, dynamic quantization off": round(matmul_rate(ov, ops, hint, True, 0), 1),
        f"matmul float weights in {hint}": round(matmul_rate(ov, ops, hint, False, None), 1)}}
    if args.engine:
        out["segments"] = {f"{seg} dynamic quantization {'off' if dq == 0 else 'default'}":
                           segment_rate(ov, args.engine / seg, hint, dq)
                           for seg in ("seg05", "seg30") if (args.engine / seg).is_dir() for dq in (None, 0)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
