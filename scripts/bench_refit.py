#!/usr/bin/env python
"""Time applying a LoRA to engines (``refit_engines``) against rebuilding the same engines (issue 14).

    flock /tmp/sd-accel-heavy.lock python scripts/bench_refit.py              # SD 1.5, 512 px, OpenVINO
    python scripts/bench_refit.py --backend onnxruntime --steps 2
    python scripts/bench_refit.py --tiny                                      # builtin:tiny-sd15, 64 px: a smoke run

One run, each step in its own process (so each peak RSS, /proc/self/status VmHWM, is the step's own):

1. ``build``: engines for the UNet and the text encoder (static, batch 1, ``--size``) into a fresh
   engine folder: export + optimize + compile + validate, timed per component from the progress.
2. ``loras``: two LoRAs (rank ``--rank`` on the UNet's ``to_q, to_k, to_v, to_out.0``) made with
   peft on the model's UNet, B scaled so that each layer's delta is ``--strength`` of its weight's
   norm, saved as diffusers LoRA folders.
3. ``reference``: torch fp32 final latents without a LoRA, with A, with B (``--steps`` steps).
4. ``refit``: the pipeline accelerated on those engines, ``load_lora_weights(A)``, timed
   ``refit_engines(pipe)`` (validation included), latents on the refitted engine; then the usual
   switch (``unload_lora_weights``, ``load_lora_weights(B)``, ``refit_engines``) timed the same
   way, then back to A with ``refit_engines(pipe, validate=False)`` (no check against torch: what
   the weights cost on their own). Each refit's phases come from its progress messages; the peak RSS of each refit is its own
   (VmHWM reset through /proc/self/clear_refs before it).
5. ``rebuild``: what a user without refit does: A fused into the UNet (``fuse_lora``,
   ``unload_lora_weights``), ``build_engines`` again into the same folder (the text encoder's
   engine is a cache hit, the UNet's is exported and built again).

Prints a markdown table (step, seconds, refit/rebuild, peak RSS) and the phase splits; writes
``report.json`` into ``--out`` (default: the work folder's parent). The engine folders are
deleted at the end unless ``--keep``. Needs about 12 GB of free disk at SD 1.5 size.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

PROMPT = "a photograph of an astronaut riding a horse on mars, highly detailed"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
COMPONENTS = ["unet", "clip"]
STEPS = ("build", "loras", "reference", "refit", "rebuild")


# --------------------------------------------------------------------------- helpers


def peak_rss_gb() -> float:
    """This process's peak RSS since start (or since the last :func:`reset_peak`)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 2**20, 2)
    return float("nan")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def rss_split() -> dict[str, float]:
    """This process's resident memory now, GB: anonymous (heap, tensors, engines' own buffers) and
    file-backed (memory-mapped weights the kernel can drop again)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            fields[name] = round(int(value.split()[0]) / 2**20, 2)
    return fields


class RssWatch:
    """Samples :func:`rss_split` on a thread: the split at the highest VmRSS seen and the progress
    message current then (what the peak holds and where it came)."""

    def __init__(self, phases: Phases, every: float = 0.2) -> None:
        import threading

        self.phases, self.every = phases, every
        self.at_peak: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            now = rss_split()
            if now.get("VmRSS", 0.0) > self.at_peak.get("VmRSS", -1.0):
                phase = self.phases.marks[-1][1] if self.phases.marks else "computing the effective weights"
                self.at_peak = {**now, "phase": phase}

    def __enter__(self) -> RssWatch:
        self.at_peak = {**rss_split(), "phase": "before"}
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Phases:
    """Wall time between successive progress messages: (message, seconds) in order."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, str]] = []

    def __call__(self, label: str, message: str) -> None:
        text = message if not label or message.startswith(f"{label}:") else f"{label}: {message}"
        if not self.marks or self.marks[-1][1] != text:
            self.marks.append((time.perf_counter(), text))

    def split(self, end: float) -> list[tuple[str, float]]:
        ends = [t for t, _ in self.marks[1:]] + [end]
        return [(m, round(e - t, 1)) for (t, m), e in zip(self.marks, ends, strict=True)]


def _pipeline(args):
    from sd_accel import load_pipeline

    pipe = load_pipeline(args.model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _latents(pipe, args) -> np.ndarray:
    import torch

    g = torch.Generator("cpu").manual_seed(0)
    with torch.inference_mode():
        out = pipe(PROMPT, height=args.size, width=args.size, num_inference_steps=args.steps, generator=g,
                   output_type="latent")
    return out.images.float().cpu().numpy()


def _build(pipe, args, engine_dir: str) -> dict[str, Any]:
    from sd_accel import build_engines

    phases = Phases()
    start = time.perf_counter()
    records = build_engines(pipe, profiles=[dict(batch=1, height=args.size, width=args.size)], backend=args.backend,
                            precision=args.precision, components=COMPONENTS, engine_dir=engine_dir,
                            progress=lambda ev: phases(ev.component, ev.stage))
    end = time.perf_counter()
    return {"seconds": round(end - start, 1), "phases": phases.split(end),
            "per_component": {r.key.component: round(float(r.build_seconds or 0.0), 1) for r in records},
            "precision": records[0].key.precision,
            "validation": {r.key.component: (r.validation or {}).get("rel_l2") for r in records},
            "item_rel": {r.key.component: (r.validation or {}).get("item_rel") for r in records}}


# --------------------------------------------------------------------------- steps (each in its own process)


def step_build(args) -> dict[str, Any]:
    pipe = _pipeline(args)
    out = _build(pipe, args, args.engine_dir)
    return out


def step_loras(args) -> dict[str, Any]:
    """Two LoRAs on the UNet's attention projections, saved as diffusers does."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import get_peft_model_state_dict

    start = time.perf_counter()
    pipe = _pipeline(args)
    unet: UNet2DConditionModel = pipe.unet
    del pipe
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        torch.manual_seed(seed)
        unet.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS,
                                    init_lora_weights=False), adapter_name=name)
        ratios = []
        with torch.no_grad():
            for layer in unet.modules():
                if isinstance(layer, BaseTunerLayer) and name in layer.lora_B:
                    base = layer.get_base_layer().weight
                    delta = layer.get_delta_weight(name)
                    layer.lora_B[name].weight.mul_(args.strength * base.norm() / delta.norm())
                    ratios.append((layer.get_delta_weight(name).norm() / base.norm()).item())
        folder = Path(args.work) / f"lora-{name}"
        StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=get_peft_model_state_dict(
            unet, adapter_name=name))
        unet.delete_adapters(name)
        out[name] = {"folder": str(folder), "layers": len(ratios), "delta_over_weight": round(float(np.mean(ratios)), 3),
                     "mb": round(sum(f.stat().st_size for f in folder.iterdir()) / 2**20, 1)}
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def step_reference(args) -> dict[str, Any]:
    """Torch fp32 latents: no LoRA, A, B."""
    pipe = _pipeline(args)
    work = Path(args.work)
    start = time.perf_counter()
    np.save(work / "torch-base.npy", _latents(pipe, args))
    pipe.load_lora_weights(work / "lora-a", adapter_name="a")
    np.save(work / "torch-a.npy", _latents(pipe, args))
    pipe.unload_lora_weights()
    pipe.load_lora_weights(work / "lora-b", adapter_name="b")
    np.save(work / "torch-b.npy", _latents(pipe, args))
    return {"seconds": round(time.perf_counter() - start, 1)}


class _Said(logging.Handler):
    """The library's log lines during a refit (how many weights the written-weights path wrote)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _timed_refit(pipe, validate: bool = True) -> dict[str, Any]:
    from sd_accel import refit_engines

    phases = Phases()
    said = _Said()
    logger = logging.getLogger("sd_accel")
    level = logger.level
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    reset_peak()
    before = rss_split()
    start = time.perf_counter()
    try:
        with RssWatch(phases) as watch:
            done = refit_engines(pipe, validate=validate, progress=lambda ev: phases("", ev[2]))
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    end = time.perf_counter()
    split = phases.split(end)
    first = phases.marks[0][0] if phases.marks else end
    # before the first message: the module's effective weights (base + LoRA deltas) are computed
    split.insert(0, ("computing the effective weights", round(first - start, 1)))
    written = [line.split(": ", 1)[1] if "weights differ" in line else line for line in said.lines
               if "weights differ from the engine's" in line or "batch item" in line]
    return {"seconds": round(end - start, 1), "phases": split, "refitted": done, "peak_rss_gb": peak_rss_gb(),
            "written": written, "rss_before": before, "rss_at_peak": watch.at_peak}


def step_refit(args) -> dict[str, Any]:
    from sd_accel import AccelConfig, accelerate, stats

    work = Path(args.work)
    start = time.perf_counter()
    pipe = accelerate(_pipeline(args), AccelConfig(engines=True, engine_dir=args.engine_dir, backend=args.backend,
                                                   precision="fp32"))
    out: dict[str, Any] = {"load_s": round(time.perf_counter() - start, 1), "load_peak_rss_gb": peak_rss_gb()}
    base = _latents(pipe, args)
    out["rss_after_base"] = rss_split()  # serving on engines, before any LoRA: what the torch modules still hold
    np.save(work / "engine-base.npy", base)
    t = time.perf_counter()
    pipe.load_lora_weights(work / "lora-a", adapter_name="a")
    out["load_lora_a_s"] = round(time.perf_counter() - t, 1)
    out["a"] = _timed_refit(pipe)
    np.save(work / "engine-a.npy", _latents(pipe, args))
    t = time.perf_counter()
    pipe.unload_lora_weights()
    pipe.load_lora_weights(work / "lora-b", adapter_name="b")
    out["load_lora_b_s"] = round(time.perf_counter() - t, 1)
    out["b"] = _timed_refit(pipe)
    np.save(work / "engine-b.npy", _latents(pipe, args))
    # The refit without its check: what the weights cost on their own. The engine's first inference
    # (weights repacked on first use), which the check pays above, moves into the next generation.
    pipe.unload_lora_weights()
    pipe.load_lora_weights(work / "lora-a", adapter_name="a")
    out["a_unchecked"] = _timed_refit(pipe, validate=False)
    np.save(work / "engine-a-unchecked.npy", _latents(pipe, args))
    s = stats(pipe)
    out["unet_calls"] = {k: s["unet"].get(k) for k in ("engine_calls", "torch_calls")}
    out["unet_fallbacks"] = s["unet"].get("fallbacks")
    return out


def step_rebuild(args) -> dict[str, Any]:
    pipe = _pipeline(args)
    start = time.perf_counter()
    pipe.load_lora_weights(Path(args.work) / "lora-a", adapter_name="a")
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    fuse_s = time.perf_counter() - start
    out = _build(pipe, args, args.engine_dir)
    out["fuse_s"] = round(fuse_s, 1)
    return out


# --------------------------------------------------------------------------- the run


def _run_step(step: str, args, argv: list[str]) -> dict[str, Any]:
    result = Path(args.work) / f"{step}.json"
    cmd = [sys.executable, __file__, *argv, "--worker", step, "--work", args.work, "--engine-dir", args.engine_dir]
    print(f"== {step}", flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    out = json.loads(result.read_text())
    out["wall_s"] = round(time.perf_counter() - start, 1)
    return out


def _free_gb(path: str) -> float:
    return round(shutil.disk_usage(path).free / 2**30, 1)


def _du_gb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**30, 2)


def accuracy(work: Path) -> dict[str, float]:
    """Relative L2 of the final latents: engine vs torch with the same LoRA, and how far the
    LoRA moves torch (so that a small error means the LoRA is in the engine)."""
    load = {n: np.load(work / f"{n}.npy") for n in ("torch-base", "torch-a", "torch-b", "engine-base", "engine-a",
                                                    "engine-b", "engine-a-unchecked")}
    return {
        "engine_base_vs_torch_base": rel_l2(load["engine-base"], load["torch-base"]),
        "engine_a_vs_torch_a": rel_l2(load["engine-a"], load["torch-a"]),
        "engine_b_vs_torch_b": rel_l2(load["engine-b"], load["torch-b"]),
        "torch_a_vs_torch_base": rel_l2(load["torch-a"], load["torch-base"]),
        "torch_b_vs_torch_a": rel_l2(load["torch-b"], load["torch-a"]),
        "engine_a_vs_torch_base": rel_l2(load["engine-a"], load["torch-base"]),
        # A after B without the check: A's engine again (the refit writes full weights, never deltas)
        "engine_a_unchecked_vs_torch_a": rel_l2(load["engine-a-unchecked"], load["torch-a"]),
        "engine_a_unchecked_vs_engine_a": rel_l2(load["engine-a-unchecked"], load["engine-a"]),
    }


def table(r: dict[str, Any]) -> str:
    build, refit, rebuild = r["build"], r["refit"], r.get("rebuild")
    unet_rebuild = rebuild["per_component"]["unet"] if rebuild else build["per_component"]["unet"]
    how = "measured" if rebuild else "from step 1 (identical work)"

    def ratio(s: float) -> str:
        return f"{s / unet_rebuild:.2f}"

    rows = [
        ("build UNet + text encoder (export, optimize, compile, validate)", build["seconds"], "-",
         build["peak_rss_gb"]),
        ("  of which UNet", build["per_component"]["unet"], "-", "-"),
        ("  of which text encoder", build["per_component"].get("clip", "-"), "-", "-"),
        ("load_lora_weights(A)", refit["load_lora_a_s"], "-", "-"),
        ("**refit_engines(pipe), LoRA A** (UNet, validated)", refit["a"]["seconds"], ratio(refit["a"]["seconds"]),
         refit["a"]["peak_rss_gb"]),
        ("unload + load_lora_weights(B)", refit["load_lora_b_s"], "-", "-"),
        ("**refit_engines(pipe), switch to B**", refit["b"]["seconds"], ratio(refit["b"]["seconds"]),
         refit["b"]["peak_rss_gb"]),
    ]
    if "a_unchecked" in refit:
        rows.append(("refit_engines(pipe, validate=False), back to A (no check)", refit["a_unchecked"]["seconds"],
                     ratio(refit["a_unchecked"]["seconds"]), refit["a_unchecked"]["peak_rss_gb"]))
    if rebuild:
        rows.append(("rebuild with A fused (fuse, build_engines; text encoder cached)", rebuild["seconds"],
                     f"{rebuild['seconds'] / unet_rebuild:.2f}", rebuild["peak_rss_gb"]))
    rows.append((f"  of which UNet export + build + validate ({how})", unet_rebuild, "1.00", "-"))
    lines = ["| step | seconds | / UNet rebuild | peak RSS GB |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], prog="python scripts/bench_refit.py")
    p.add_argument("--model", help="model folder or builtin: (default: the bench's SD 1.5 random-weights model)")
    p.add_argument("--tiny", action="store_true", help="builtin:tiny-sd15 at 64 px: a smoke run")
    p.add_argument("--backend", default="openvino", choices=["openvino", "onnxruntime"])
    p.add_argument("--precision", default="auto", help="engine precision (auto: the backend's default)")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="denoising steps of the accuracy check")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--strength", type=float, default=0.1, help="each LoRA layer's |delta| / |weight|")
    p.add_argument("--no-rebuild", action="store_true", help="take the UNet rebuild time from step 1 (same work)")
    p.add_argument("--work", help="work folder (default: a new folder under the system temp dir)")
    p.add_argument("--out", help="where report.json goes (default: next to the work folder)")
    p.add_argument("--keep", action="store_true", help="keep the engines and LoRAs")
    p.add_argument("--engine-dir", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=STEPS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.size = args.model or "builtin:tiny-sd15", 64
    if not args.model:
        from bench import default_model  # scripts/bench.py, beside this script

        args.model = default_model()

    if args.worker:
        out = globals()[f"step_{args.worker}"](args)
        out.setdefault("peak_rss_gb", peak_rss_gb())
        Path(args.work, f"{args.worker}.json").write_text(json.dumps(out, indent=1, default=str))
        return 0

    argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    argv += ["--model", args.model] if "--model" not in argv else []
    work = Path(args.work or tempfile.mkdtemp(prefix="sd-accel-refit-"))
    work.mkdir(parents=True, exist_ok=True)
    args.work, args.engine_dir = str(work), str(work / "engines")
    print(f"work folder {work}; {_free_gb(args.work)} GB free", flush=True)
    report: dict[str, Any] = {"model": args.model, "backend": args.backend, "size": args.size, "steps": args.steps,
                              "rank": args.rank, "strength": args.strength, "free_gb_start": _free_gb(args.work)}
    start = time.perf_counter()
    try:
        for step in STEPS:
            if step == "rebuild" and args.no_rebuild:
                continue
            report[step] = _run_step(step, args, argv)
            report[f"disk_gb_after_{step}"] = _du_gb(work / "engines")
            report[f"free_gb_after_{step}"] = _free_gb(args.work)
        report["accuracy"] = accuracy(work)
    finally:
        report["total_s"] = round(time.perf_counter() - start, 1)
        out = Path(args.out or work.parent) / f"refit-report-{args.backend}-{args.size}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nreport: {out}\n")
    print(f"{args.model}, {args.backend} {report['build']['precision']}, static {args.size}x{args.size} batch 1; "
          f"LoRA rank {args.rank} on {','.join(TARGETS)} (|delta|/|W| = {args.strength}); total {report['total_s']} s\n")
    print(table(report))
    print()
    for name in ("a", "b", "a_unchecked"):
        print(f"refit {name.upper()} phases: " + "; ".join(f"{m} {s}" for m, s in report["refit"][name]["phases"]))
        for line in report["refit"][name].get("written", []):
            print(f"  {line}")
    print("build phases: " + "; ".join(f"{m} {s}" for m, s in report["build"]["phases"]))
    print(f"build validation (relative L2, per batch item): {report['build'].get('item_rel')}")
    if "rebuild" in report:
        print("rebuild phases: " + "; ".join(f"{m} {s}" for m, s in report["rebuild"]["phases"]))
    print("accuracy (final latents, relative L2): " + ", ".join(f"{k} {v:.4f}" for k, v in report["accuracy"].items()))
    print(f"UNet calls in the refit step: {report['refit']['unet_calls']}, fallbacks {report['refit']['unet_fallbacks']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
