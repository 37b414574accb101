"""Peak memory of a transformer build, whole against in segments (issue 44), on a real-width FLUX.1
slice with random weights: its real hidden size, heads, rotary axes and guidance embedding, cut to
a few blocks of each kind, stored in bf16 as the real checkpoints are and loaded from its
safetensors (memory-mapped) as a user's pipeline is.

    python scripts/bench_segments.py prepare DIR [--double 2] [--single 2] [--heads 24]
    python scripts/bench_segments.py build DIR ENGINES --mode whole|segments [--backend openvino]
        [--size 512] [--text 512] [--precision fp32] [--budget-mib 1024]

``build`` prints one ``RESULT {json}`` line: peak RSS (VmHWM of this process), build seconds,
the validation record, the engine key's layout. Run each build in a fresh process (the peak
only grows); ``prepare`` runs apart so that making the random weights is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prepare(folder: Path, double: int, single: int, heads: int | None = None) -> None:
    import torch

    from sd_accel.models.builtin import tiny_configs
    from sd_accel.models.components import random_pipeline
    from sd_accel.models.families import FAMILIES, load_family_configs

    configs = tiny_configs("flux-dev")  # tiny CLIP, T5 and VAE: only the transformer is built
    real = load_family_configs(FAMILIES["flux-dev"])["transformer/config.json"]
    configs["transformer/config.json"] = dict(real, num_layers=double, num_single_layers=single,
                                              num_attention_heads=heads or real["num_attention_heads"])
    pipe = random_pipeline(configs, seed=0)
    pipe.transformer.to(torch.bfloat16)
    pipe.save_pretrained(folder, safe_serialization=True)
    params = sum(p.numel() for p in pipe.transformer.parameters())
    print("RESULT " + json.dumps({"params": params, "folder": str(folder)}))


def _peak_bytes() -> int:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a
    build started by a big parent (a pytest worker) would report the parent's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build(folder: Path, engines: Path, mode: str, backend: str, size: int, text: int, precision: str,
          budget_mib: float) -> None:
    os.environ["SD_ACCEL_SEGMENTS"] = "off" if mode == "whole" else str(budget_mib)
    import torch

    from sd_accel import build_engines, load_pipeline
    from sd_accel.profiles import Profile

    pipe = load_pipeline(str(folder), torch_dtype=torch.bfloat16)
    loaded = _peak_bytes()
    start = time.perf_counter()

    def stage(ev) -> None:  # where the memory goes: each stage with RSS now and the peak so far
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        print(f"STAGE {time.perf_counter() - start:7.1f}s rss {int(status['VmRSS'].split()[0]) / 2**20:5.2f} GiB "
              f"peak {int(status['VmHWM'].split()[0]) / 2**20:5.2f} GiB  {ev.stage}", flush=True)

    (record,) = build_engines(pipe, profiles=[Profile(batch=1, height=size, width=size, text=text)],
                              backend=backend, precision=precision, components=["transformer"],
                              engine_dir=str(engines), progress=stage)
    seconds = time.perf_counter() - start
    peak = _peak_bytes()
    params = sum(p.numel() for p in pipe.transformer.parameters())
    print("RESULT " + json.dumps({"mode": mode, "peak": peak, "loaded": loaded, "seconds": round(seconds, 1),
                                  "params": params, "layout": record.key.layout, "validation": record.validation,
                                  "profile": record.key.profile, "size_bytes": record.size_bytes}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("folder", type=Path)
    p.add_argument("--double", type=int, default=2)
    p.add_argument("--single", type=int, default=2)
    p.add_argument("--heads", type=int, default=None, help="fewer heads than the real 24: a narrower model")
    b = sub.add_parser("build")
    b.add_argument("folder", type=Path)
    b.add_argument("engines", type=Path)
    b.add_argument("--mode", choices=("whole", "segments"), required=True)
    b.add_argument("--backend", default="openvino")
    b.add_argument("--size", type=int, default=512)
    b.add_argument("--text", type=int, default=512)
    b.add_argument("--precision", default="fp32")
    b.add_argument("--budget-mib", type=float, default=1024)
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.folder, args.double, args.single, args.heads)
    else:
        build(args.folder, args.engines, args.mode, args.backend, args.size, args.text, args.precision,
              args.budget_mib)


if __name__ == "__main__":
    main()
