"""Serving benchmark: throughput (images/minute) and p50/p95 latency of ``sd-accel serve`` at
several client concurrencies, with dynamic batching and without (max_batch_size=1).

Starts a local Ray, builds engines of ``--backend`` (ONNX Runtime or OpenVINO, at ``--precision``)
for the model at the size (batch 1 to the batch limit) in an engine folder, deploys the app once per mode, and drives it over HTTP with N
concurrent clients, each sending its next request when the last one answers.

    python scripts/bench_serve.py                     # tiny SD 1.5, 128x128, 10 steps
    python scripts/bench_serve.py --size 64 --steps 4 --requests 16 --json out.json
    python scripts/bench_serve.py --backend openvino --size 256 --concurrency 1,4

Run it under the heavy lock on shared machines. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    pos = (len(values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


async def _drive(url: str, concurrency: int, total: int, body: dict) -> dict:
    import httpx

    latencies: list[float] = []
    failures: list[int] = []
    counter = iter(range(total))

    async def client(c: httpx.AsyncClient) -> None:
        for i in counter:
            start = time.perf_counter()
            r = await c.post(url + "/sdapi/v1/txt2img", json={**body, "seed": 1000 + i})
            if r.status_code == 200:
                latencies.append(time.perf_counter() - start)
            else:
                failures.append(r.status_code)

    async with httpx.AsyncClient(timeout=600) as c:
        start = time.perf_counter()
        await asyncio.gather(*(client(c) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": total,
        "ok": len(latencies),
        "failures": failures,
        "wall_s": round(wall, 2),
        "images_per_min": round(len(latencies) / wall * 60, 1),
        "p50_s": round(_percentile(latencies, 0.5), 3) if latencies else None,
        "p95_s": round(_percentile(latencies, 0.95), 3) if latencies else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny-sd15")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--requests", type=int, default=24, help="requests per concurrency level (after one warm-up)")
    p.add_argument("--max-batch", type=int, default=8, help="max_batch_size with batching on")
    p.add_argument("--batch-wait-ms", type=float, default=50)
    p.add_argument("--num-cpus", type=int, default=2, help="Ray CPUs (the one replica takes them all)")
    p.add_argument("--backend", default="onnxruntime", help="engine backend (onnxruntime, openvino)")
    p.add_argument("--precision", default="auto", help="engine precision (auto: the backend's default on this CPU)")
    p.add_argument("--engine-dir", default=None, help="default: a temporary folder")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    import ray
    from ray import serve as rserve

    from sd_accel.serve import ServeConfig, serve

    levels = [int(x) for x in args.concurrency.split(",")]
    engine_dir = args.engine_dir or tempfile.mkdtemp(prefix="sd-accel-bench-serve-")
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=False)
    port = _free_port()
    body = {"prompt": "a lighthouse at dusk", "steps": args.steps, "width": args.size, "height": args.size,
            "cfg_scale": 7}
    rows = []
    try:
        for mode, max_batch in (("batching", args.max_batch), ("no batching", 1)):
            config = ServeConfig(
                model=args.model, engine_dir=engine_dir, accel={"backend": args.backend}, port=port,
                num_replicas=1, num_cpus=args.num_cpus, max_batch_size=max_batch, batch_wait_ms=args.batch_wait_ms,
                max_ongoing_requests=max(max(levels), max_batch), max_queued_requests=max(levels),
                build_missing=mode == "batching", build_precision=args.precision,
                build_profiles=[{"batch": [1, min(4, args.max_batch), args.max_batch], "height": args.size,
                                 "width": args.size}],
            )
            t0 = time.perf_counter()
            server = serve(config, blocking=False)
            print(f"# {mode}: deployed in {time.perf_counter() - t0:.0f} s", flush=True)
            asyncio.run(_drive(server.url, 1, 2, body))  # warm-up: sessions load on first use
            for level in levels:
                before = server.stats()["images_per_call"]
                row = asyncio.run(_drive(server.url, level, args.requests, body))
                row["mode"] = mode
                after = server.stats()["images_per_call"]
                row["calls_by_size"] = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            server.shutdown()
    finally:
        rserve.shutdown()
        ray.shutdown()

    print()
    print(f"{args.model}, {args.size}x{args.size}, {args.steps} steps, CFG 7, {args.backend} {args.precision} engines, "
          f"1 replica on {args.num_cpus} CPUs, {args.requests} requests per row")
    print()
    print("| mode | concurrency | images/min | p50 latency (s) | p95 latency (s) | calls by images per call | failed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        calls = ", ".join(f"{k}: {v}" for k, v in sorted(r["calls_by_size"].items(), key=lambda kv: int(kv[0])))
        print(f"| {r['mode']} | {r['concurrency']} | {r['images_per_min']} | {r['p50_s']} | {r['p95_s']} | "
              f"{calls} | {len(r['failures'])} |")
    if args.json:
        args.json.write_text(json.dumps({"backend": args.backend, "precision": args.precision, "size": args.size,
                                         "steps": args.steps, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
