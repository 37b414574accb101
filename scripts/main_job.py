"""The main job (``scripts/run.sh``): one model, one image twice, plain PyTorch then on engines,
and what the engines bought: both times, the speed-up, which components ran on engines.

``--few-step`` shows the few-step recipe instead (what FastSD CPU users run): an LCM-distilled
model (default ``builtin:tiny-sd15-lcm``), the LCM sampler, 4 steps, CFG 1 (one UNet row per image)
and the tiny autoencoder (default ``builtin:taesd``) decoding, at 512x512 for the built-in model;
the engines are the no-CFG UNet and TAESD's decoder. Arguments given override those.

Each generation is its own ``sd-accel generate`` process (the path a user takes, a fair clock).
Engines for the run's model and size are built on the first run and reused from the cache after.
Arguments are ``sd-accel generate``'s and go to both runs (and the model, size and batch to the
build), e.g. ``scripts/run.sh --model ~/models/dreamshaper_8.safetensors --size 512x512``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

# True: no build step; `sd-accel generate --engines auto` builds what the run's calls need on the
# first run and reuses it after. False (the default) keeps the build a step of its own, so its
# time and progress are reported apart from the generation's.
AUTO_ENGINES = False

BUILTIN_SIZE = "256x256"  # the built-in tiny model: see docs/install.md ("The main job") for the figures
# what txt2img runs (the VAE encoder only serves img2img): the text encoders and denoiser the model
# has (CLIP, SDXL's second, SD3's / FLUX's T5; the UNet or SD3's / FLUX's transformer)
COMPONENTS = "text,denoiser,vae_decoder"
# --few-step: the recipe's `sd-accel generate` options, each unless the command line gives it
FEW_STEP = {"--model": "builtin:tiny-sd15-lcm", "--sampler": "LCM", "--steps": "4", "--cfg": "1",
            "--tiny-vae": "builtin:taesd"}
FEW_STEP_SIZE = "512x512"  # what people run few-step SD 1.5 at; the tiny model is cheap there too


def few_step_args(argv: list[str]) -> list[str]:
    """``argv`` with the few-step recipe's options added where it does not give them.

    >>> few_step_args(["--steps", "2"])[:4]
    ['--model', 'builtin:tiny-sd15-lcm', '--sampler', 'LCM']
    """
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    out = [x for flag, value in FEW_STEP.items() if flag not in given for x in (flag, value)]
    if "--size" not in given and "--model" not in given:
        out += ["--size", FEW_STEP_SIZE]
    return out + argv


def _sd_accel(*args: str, capture: bool = True) -> subprocess.CompletedProcess:
    """``sd-accel ARGS`` in this Python; progress and warnings go to the console."""
    cmd = [sys.executable, "-m", "sd_accel.cli", *args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE if capture else None, text=True)
    if proc.returncode:
        sys.exit(proc.returncode)  # sd-accel already said what went wrong, on stderr
    return proc


def _report(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _engine_names(engine_dir: str | None) -> set[str]:
    from sd_accel.cache.store import EngineCache  # light: no torch

    return {r.name for r in EngineCache(engine_dir).list()}


def _engine_kinds(engine_dir: str | None, components: list[str], since: float) -> list[str]:
    """``backend precision`` of the engines ``components`` ran on: those used since ``since``
    (the cache records each use), or every engine of those components if none says so."""
    from sd_accel.cache.store import EngineCache

    records = [r for r in EngineCache(engine_dir).list() if r.key.component in components]
    recent = [r for r in records if r.last_used >= since] or records
    return sorted({f"{r.key.backend} {r.key.precision}" for r in recent})


def _build_args(args, engine_args: list[str]) -> list[str]:
    """``sd-accel build`` for the run: a static profile of its size and batch (the model's own
    preset when no size is given), the components txt2img runs."""
    out = ["build", "--model", args.model, "--components", COMPONENTS, "--backend", args.backend, *engine_args]
    if args.cfg is not None and args.cfg <= 1:  # CFG 1 (the few-step recipe): one UNet row per image, so a static engine of that
        out.append("--no-cfg")
    if args.tiny_vae:  # the decoder engine is the tiny autoencoder's
        out += ["--tiny-vae", args.tiny_vae]
    if args.size:
        width, height = args.size
        out += ["--static", "--height", str(height), "--width", str(width), "--batch", str(args.batch)]
    if args.allow_pickle:
        out.append("--allow-pickle")
    return out


def main(argv: list[str]) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from sd_accel.cli import DEFAULT_MODEL, build_parser

    parser = build_parser()
    few_step = "--few-step" in argv
    if few_step:
        argv = few_step_args([a for a in argv if a != "--few-step"])
    probe = parser.parse_args(["generate", *argv])  # argparse errors (exit 2) before any work
    if probe.engines:
        parser.error("scripts/run.sh runs both PyTorch and engines; leave out --engines")
    defaults = ["--size", BUILTIN_SIZE] if probe.model == DEFAULT_MODEL and probe.size is None else []
    args = parser.parse_args(["generate", *defaults, *argv])
    out = args.out
    torch_out = out.with_name(f"{out.stem}-torch{out.suffix}")
    engine_args = ["--engine-dir", args.engine_dir] if args.engine_dir else []
    common = ["generate", *defaults, *argv, "--json"]
    size = "x".join(map(str, args.size)) if args.size else "the model's default size"
    recipe = (f", few-step recipe: {args.sampler} sampler, CFG {args.cfg:g}, tiny VAE {args.tiny_vae}"
              if few_step else "")
    print(f"main job: {args.model}, {size}, {args.steps} steps, batch {args.batch}{recipe}", flush=True)

    print("[1/3] plain PyTorch", flush=True)
    plain = _report(_sd_accel(*common, "--out", str(torch_out)))

    before = _engine_names(args.engine_dir)
    build_s = None
    if AUTO_ENGINES:
        print("[2/3] engines: --engines auto builds what the run needs (first run) or reuses them", flush=True)
        engines_flag = ["--engines", "auto"]
    else:
        print("[2/3] engines: build for this model and size (cached engines are reused)", flush=True)
        start = time.perf_counter()
        _sd_accel(*_build_args(args, engine_args), capture=False)  # its progress bar and table on the console
        build_s = time.perf_counter() - start
        engines_flag = ["--engines"]
    print("[3/3] on engines", flush=True)
    since = time.time()
    fast = _report(_sd_accel(*common, *engines_flag, "--out", str(out)))
    new = _engine_names(args.engine_dir) - before
    if AUTO_ENGINES and new:  # that run built them: time the run that reuses them
        build_s = fast["generate_s"]
        fast = _report(_sd_accel(*common, *engines_flag, "--out", str(out)))

    on_engines = sorted(c for c, use in fast["components"].items() if use.startswith("engine"))
    elsewhere = {c: use for c, use in fast["components"].items() if not use.startswith("engine") and use != "unused"}
    speedup = plain["generate_s"] / fast["generate_s"] if fast["generate_s"] else float("nan")
    print()
    print(f"  PyTorch  : {plain['generate_s']:7.2f} s  ({plain['it_per_s']:.2f} it/s)  {plain['images'][0]}")
    print(f"  engines  : {fast['generate_s']:7.2f} s  ({fast['it_per_s']:.2f} it/s)  {fast['images'][0]}")
    print(f"  speed-up : {speedup:7.2f}x  (generation only; loading the model not counted)")
    kinds = _engine_kinds(args.engine_dir, on_engines, since) if on_engines else []
    print(f"  on engines: {', '.join(on_engines) or 'none'}" + (f" ({', '.join(kinds)})" if kinds else "")
          + "".join(f"; {c}: {use}" for c, use in sorted(elsewhere.items())))
    if new:
        print(f"  built {len(new)} engine(s) on this run in {build_s:.1f} s; the next run reuses them")
    else:
        print("  engines reused from the cache (built on an earlier run)")
    if args.model.startswith("builtin:"):
        print("  note: the built-in tiny models have random weights: their images are noise. "
              "Pass --model with a real checkpoint for real pictures.")
    return 0 if on_engines else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
