"""A LoRA on a FLUX.1 transformer engine at FLUX.1's real width: refit (``refit_engines``) against a
rebuild (issue 45, LoRA: "refit time measured against a rebuild at real width").

The model is ``bench_segments.py``'s real-width slice (FLUX.1-dev's hidden size 3072, 24 heads,
rotary axes and guidance embedding; ``--double`` / ``--single`` blocks; random weights, stored in
bf16 and memory-mapped as a user's checkpoint is). The LoRA is random, rank ``--rank`` on every
attention's ``to_q``, ``to_k``, ``to_v`` and ``to_out.0`` (the single blocks' ``to_q/k/v``), in
diffusers' key layout, loaded with ``load_lora_weights``.

    python scripts/bench_refit_transformer.py WORK [--double 1] [--single 1] [--backend openvino]
        [--precision bf16] [--size 512] [--text 512]

Each step runs in a fresh process (its own peak, VmHWM): ``build`` (the base engine: export,
compile, validate), ``refit`` (the pipeline on that engine, the LoRA loaded, ``refit_engines``
validated against torch), ``rebuild`` (what a user without refit does: the LoRA fused,
``build_engines`` into a fresh folder). Prints one ``RESULT {json}`` per step and a markdown table
(seconds, / rebuild, peak RSS GiB).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_segments import _peak_bytes, prepare  # noqa: E402

TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def lora_state(transformer, rank: int, seed: int = 0, strength: float = 0.1) -> dict:
    """A random LoRA in diffusers' FLUX layout (``transformer.<module>.lora_A/B.weight``), B scaled
    so that each layer's delta is about ``strength`` of its weight's size."""
    import torch

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in transformer.named_modules():
        if not name.endswith(TARGETS) or not isinstance(module, torch.nn.Linear):
            continue
        w = module.weight
        a = torch.randn(rank, w.shape[1], generator=g) / w.shape[1] ** 0.5
        b = torch.randn(w.shape[0], rank, generator=g) / rank ** 0.5 * float(w.float().std()) * strength
        state[f"transformer.{name}.lora_A.weight"] = a
        state[f"transformer.{name}.lora_B.weight"] = b
    return state


def _profile(args):
    from sd_accel.profiles import Profile

    return Profile(batch=1, height=args.size, width=args.size, text=args.text)


def _pipeline(args):
    import torch

    from sd_accel import load_pipeline

    return load_pipeline(str(Path(args.work) / "model"), torch_dtype=torch.bfloat16)


def _build(pipe, args, engines: Path) -> dict:
    from sd_accel import build_engines

    start = time.perf_counter()
    (record,) = build_engines(pipe, profiles=[_profile(args)], backend=args.backend, precision=args.precision,
                              components=["transformer"], engine_dir=str(engines), progress=False)
    return {"seconds": round(time.perf_counter() - start, 1), "validation": record.validation,
            "size_bytes": record.size_bytes}


def step_build(args) -> dict:
    return _build(_pipeline(args), args, Path(args.work) / "engines")


def step_refit(args) -> dict:
    from sd_accel import AccelConfig, accelerate, refit_engines

    pipe = accelerate(_pipeline(args), AccelConfig(engines=True, engine_dir=str(Path(args.work) / "engines"),
                                                   backend=args.backend))
    module = getattr(pipe.transformer, "torch_module", pipe.transformer)
    pipe.load_lora_weights(lora_state(module, args.rank), adapter_name="a")
    start = time.perf_counter()
    done = refit_engines(pipe, progress=False)  # validated against torch, as a new engine is
    return {"seconds": round(time.perf_counter() - start, 1), "refitted": done}


def step_rebuild(args) -> dict:
    pipe = _pipeline(args)
    pipe.load_lora_weights(lora_state(pipe.transformer, args.rank), adapter_name="a")
    start = time.perf_counter()
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    fused = time.perf_counter() - start
    out = _build(pipe, args, Path(args.work) / "engines-rebuilt")
    out["seconds"] = round(out["seconds"] + fused, 1)
    return out


STEPS = {"build": step_build, "refit": step_refit, "rebuild": step_rebuild}


def table(results: dict) -> str:
    rebuild = results["rebuild"]["seconds"]
    rows = ["| step | seconds | / rebuild | peak RSS GiB |", "|---|---|---|---|"]
    for step in ("build", "refit", "rebuild"):
        r = results[step]
        rows.append(f"| {step} | {r['seconds']} | {r['seconds'] / rebuild:.2f} | {r['peak'] / 2**30:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work", help="a work folder (the model, the engines)")
    p.add_argument("--step", choices=sorted(STEPS), help="(internal) run one step in this process")
    p.add_argument("--double", type=int, default=1)
    p.add_argument("--single", type=int, default=1)
    p.add_argument("--backend", default="openvino")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--text", type=int, default=512)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args(argv)
    if args.step:
        out = STEPS[args.step](args)
        out["peak"] = _peak_bytes()
        print("RESULT " + json.dumps(out, default=str), flush=True)
        return 0
    work = Path(args.work)
    if not (work / "model").is_dir():
        prepare(work / "model", args.double, args.single)
    results = {}
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != args.work]
    for step in ("build", "refit", "rebuild"):
        done = work / f"step-{step}.json"  # (a step that finished before is not run again)
        if done.is_file():
            results[step] = json.loads(done.read_text())
            continue
        proc = subprocess.run([sys.executable, __file__, args.work, "--step", step, *passed], capture_output=True,
                              text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return 1
        results[step] = json.loads(lines[-1][7:])
        done.write_text(json.dumps(results[step]))
        print(step, json.dumps(results[step]), flush=True)
    print(table(results))
    (work / "report.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
