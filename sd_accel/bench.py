"""``sd-accel bench``: a quick side-by-side check that works wherever sd-accel is installed.

One generation in torch, then the same generation (same model, prompt, seed and size) on the
engines of every backend in the table that is usable here, each at its default precision (or
``--backend`` / ``--precision``): seconds per image, the speed-up over torch, and the final
latent's relative L2 against torch. Engines are built for the request's shape (static profile,
validated, cached under ``--engine-dir``). The default model is ``builtin:tiny-sd15`` (shipped
configs, nothing downloaded), so the check takes seconds; ``--model`` takes whatever
``load_pipeline`` does.

The research harness (optimum-intel and INT8 rows, peak RAM, rows in subprocesses, the
Markdown report in scripts/BENCHMARKS.md) is ``python scripts/bench.py`` in a checkout: it needs
the repository (an optimum-intel venv beside it), so it is not part of the package.

(Skipped in the test suite: it builds engines on every usable backend, about a minute;
tests/test_bench_check.py runs it.)

>>> rows = check("builtin:tiny-sd15", size=64, steps=2)          # doctest: +SKIP
>>> [(r["row"], r["skipped"] or round(r["speedup"], 1)) for r in rows]  # doctest: +SKIP
[('torch', 1.0), ('tensorrt', 'TensorRT needs an NVIDIA GPU ...'), ('openvino', 2.1), ('onnxruntime', 1.3)]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import sd_accel.backends.registry as registry
from sd_accel.core import SdAccelError

PROMPT = "a photograph of an astronaut riding a horse on mars, highly detailed"
DEFAULT_MODEL = "builtin:tiny-sd15"


def _run(pipe, prompt: str, size: int, steps: int, seed: int):
    """(final latent, seconds) of one generation; a first, untimed one warms the modules up."""
    import torch

    def once():
        g = torch.Generator("cpu").manual_seed(seed)
        return pipe(prompt, height=size, width=size, num_inference_steps=steps, generator=g,
                    output_type="latent").images

    once()
    start = time.perf_counter()
    latent = once()
    return latent.float().cpu(), time.perf_counter() - start


def _rel_l2(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def check(model: str = DEFAULT_MODEL, size: int = 64, steps: int = 3, backends: Sequence[str] | None = None,
          precision: str | None = None, engine_dir: str | Path | None = None, seed: int = 0,
          prompt: str = PROMPT, log: Callable[[str], None] = lambda m: None) -> list[dict[str, Any]]:
    """The rows of the check: ``torch`` first, then one per backend (``backends``: default every
    backend in the table). A backend that cannot run here, or cannot build ``precision``, is a
    row with ``skipped`` saying why."""
    from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, stats
    from sd_accel.paths import cache_dir
    from sd_accel.profiles import Profile

    engine_dir = Path(engine_dir) if engine_dir else cache_dir() / "bench" / "engines-check"
    pipe = load_pipeline(model)
    device = str(getattr(pipe, "device", "cpu")).split(":")[0]
    log(f"[bench] torch ({model}, {size} px, {steps} steps)")
    ref, ref_s = _run(pipe, prompt, size, steps, seed)
    rows: list[dict[str, Any]] = [{"row": "torch", "version": "", "precision": str(pipe.unet.dtype).split(".")[-1],
                                   "s_per_image": ref_s, "speedup": 1.0, "rel_l2": 0.0, "skipped": ""}]
    for name in backends or registry.names():
        entry = registry.entry(name)
        row = {"row": name, "version": "", "precision": precision or "", "s_per_image": None,
               "speedup": None, "rel_l2": None, "skipped": ""}
        rows.append(row)
        backend = registry.create(name)
        info = backend.info()
        if not info.usable:
            row["skipped"] = info.why_not
            continue
        if entry.torch_device != device:
            row["skipped"] = f"its engines take {entry.torch_device} tensors; this pipeline runs on {device}"
            continue
        row["version"] = info.version
        row["precision"] = wanted = precision or backend.default_precision()
        log(f"[bench] {name} {info.version} {wanted}: building engines (cached), then running")
        try:
            build_engines(pipe, profiles=[Profile(batch=1, height=size, width=size)], backend=name,
                          precision=wanted, engine_dir=engine_dir, progress=False)
            accelerate(pipe, AccelConfig(engines=True, backend=name, engine_dir=str(engine_dir)))
            latent, seconds = _run(pipe, prompt, size, steps, seed)
            calls = stats(pipe)
        except SdAccelError as exc:  # a precision it cannot build here, a failed validation
            row["skipped"] = str(exc)
            continue
        finally:
            accelerate(pipe, AccelConfig())  # the torch modules back for the next row
        row.update(s_per_image=seconds, speedup=ref_s / seconds, rel_l2=_rel_l2(latent, ref),
                   torch_calls=sum(s["torch_calls"] for s in calls.values()))
    return rows


def text_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned plain-text table."""
    head = ["row", "version", "precision", "s/image", "speed-up", "latent rel L2", "note"]
    body = []
    for r in rows:
        if r["skipped"]:
            body.append([r["row"], r["version"], r["precision"], "-", "-", "-", f"skipped: {r['skipped']}"])
            continue
        note = f"{r['torch_calls']} call(s) ran torch" if r.get("torch_calls") else ""
        body.append([r["row"], r["version"], r["precision"], f"{r['s_per_image']:.3f}", f"{r['speedup']:.2f}x",
                     f"{r['rel_l2']:.2e}", note])
    widths = [max(len(str(line[i])) for line in [head, *body]) for i in range(len(head) - 1)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=False)) + "  " + line[-1]
                     for line in [head, *body]).rstrip()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``sd-accel bench`` options."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"a checkpoint, diffusers folder or builtin:NAME "
                   f"(default {DEFAULT_MODEL})")
    p.add_argument("--size", type=int, default=64, help="image side in px (default 64)")
    p.add_argument("--steps", type=int, default=3, help="denoising steps (default 3)")
    p.add_argument("--backend", action="append", choices=registry.names(), default=None,
                   help="only this backend (repeat for several; default: every backend in the table)")
    p.add_argument("--precision", choices=registry.engine_precisions(), default=None,
                   help="engine precision (default: each backend's own default here)")
    p.add_argument("--engine-dir", default=None, help="where the engines are built (default: <cache>/bench/engines-check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


def run_from_args(args: argparse.Namespace) -> int:
    """The ``sd-accel bench`` subcommand (``set_defaults(func=run_from_args)``)."""
    rows = check(args.model, size=args.size, steps=args.steps, backends=args.backend, precision=args.precision,
                 engine_dir=args.engine_dir, seed=args.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(rows))
    else:
        print(text_table(rows))
        print("\nThe full benchmark (INT8 and optimum-intel rows, peak RAM, a Markdown report) is "
              "`python scripts/bench.py` in a checkout of sd-accel.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sd-accel bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
