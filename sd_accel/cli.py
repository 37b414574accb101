"""The ``sd-accel`` command line. Thin: it parses arguments and calls the Python API."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from sd_accel.config import ATTENTION, BACKENDS, ENGINE_PRECISIONS, OFFLOAD, PRECISION

DEFAULT_MODEL = "builtin:tiny-sd15"


def _size(text: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT`` as two ints; their values are GenerationParams' to check."""
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like 512x768, got {text!r}") from None
    return w, h


def _engines_flag(text: str) -> bool | str:
    """``--engines auto|on|off``; ``--engines`` alone means on (the engines built already)."""
    value = {"auto": "auto", "on": True, "cached": True, "true": True, "off": False, "false": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"--engines takes auto, on or off, got {text!r}")
    return value


def _generation_params(args: argparse.Namespace):
    """The request in ``args`` as a GenerationParams: InvalidValue (one line, exit 2) if a value is bad."""
    from sd_accel.generate import GenerationParams

    width, height = args.size if args.size else (None, None)
    given = {k: v for k, v in (("steps", args.steps), ("cfg", args.cfg)) if v is not None}
    return GenerationParams(prompt=args.prompt, negative_prompt=args.negative, width=width, height=height,
                            batch=args.batch, seed=args.seed, sampler=args.sampler, **given)


def _family_defaults(request, args: argparse.Namespace, pipe):
    """The request with the model family's steps and guidance where the command line gave none."""
    import dataclasses

    from sd_accel.api import generation_defaults

    wanted = {k: v for k, v in generation_defaults(pipe).items() if getattr(args, k) is None}
    return dataclasses.replace(request, **wanted) if wanted else request


def _cmd_generate(args: argparse.Namespace) -> int:
    request = _generation_params(args)  # before importing torch or loading: a bad number fails at once

    from sd_accel import AccelConfig, accelerate, load_pipeline
    from sd_accel.generate import generate, parameters_text, save_png

    config = AccelConfig(precision=args.precision, attention=args.attention, offload=args.offload,
                         sampler=args.sampler, engines=args.engines, engine_dir=args.engine_dir,
                         backend=args.backend, engine_precision=args.engine_precision,
                         vae=f"tiny:{args.tiny_vae}" if args.tiny_vae else None, step_cache=args.step_cache)
    if args.step_cache_check and args.step_cache is None:
        from sd_accel.core import InvalidValue

        raise InvalidValue("--step-cache-check needs --step-cache THRESHOLD")
    t0 = time.perf_counter()
    pipe = load_pipeline(args.model, allow_pickle=args.allow_pickle)
    request = _family_defaults(request, args, pipe)
    extra = {}
    if args.controlnet:
        pipe, extra = _with_controlnets(pipe, args)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    pipe = accelerate(pipe, config)
    t_accel = time.perf_counter() - t0
    check = None
    if args.step_cache_check and pipe.sd_accel.step_cache is not None:
        from sd_accel.generate import check_step_cache

        # the uncached and the cached picture of this request: the cached one is saved where it
        # passes the picture gate, else the uncached one (and the cache is off)
        check = check_step_cache(pipe, request, extra=extra)
        result = check.result if check.ok else check.full
    else:
        result = generate(pipe, request, extra)
    image = result.images[0]
    from sd_accel.samplers import webui_name

    sampler = pipe.sd_accel.sampler or webui_name(pipe.scheduler) or type(pipe.scheduler).__name__
    params = parameters_text(request.prompt, request.negative_prompt, request.steps, sampler, request.cfg,
                             result.seed, image.width, image.height, args.model)
    paths = []
    for i, img in enumerate(result.images):
        out = args.out if i == 0 else args.out.with_name(f"{args.out.stem}-{i}{args.out.suffix}")
        paths.append(str(save_png(img, out, params)))
    report = {
        "model": args.model,
        "family": pipe.sd_accel_model.family,
        "images": paths,
        "size": f"{image.width}x{image.height}",
        "seed": result.seed,
        "load_s": round(t_load, 3),
        "accelerate_s": round(t_accel, 3),
        "generate_s": round(result.seconds, 3),
        "it_per_s": round(result.it_per_s, 3),
        "unet_calls": result.unet_calls,
        **pipe.sd_accel.summary(),
        **({"step_cache_check": check.summary()} if check is not None else {}),
        "components": _component_use(pipe),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>13}: {value}")
        if args.model.startswith("builtin:"):
            print("note: built-in tiny models have random weights; their images are noise. "
                  "Pass --model with a real checkpoint for real pictures.")
    return 0


def _with_controlnets(pipe, args: argparse.Namespace):
    """The ControlNet pipeline of ``--controlnet`` (repeatable) and the call's arguments: each
    net's ``--control-image`` (through its ``--control-preprocess``) and ``--control-scale``."""
    from PIL import Image

    from sd_accel import with_controlnets
    from sd_accel.api import control_arguments, control_hint
    from sd_accel.core import InvalidValue

    n = len(args.controlnet)
    images = args.control_image or []
    if len(images) != n:
        raise InvalidValue(f"{n} --controlnet but {len(images)} --control-image: give one image per ControlNet")
    scales = args.control_scale or [1.0] * n
    preps = args.control_preprocess or ["none"] * n
    if len(scales) != n or len(preps) not in (1, n):
        raise InvalidValue("give one --control-scale per --controlnet (or none), and one --control-preprocess "
                           "per --controlnet (or one for all)")
    preps = preps * n if len(preps) == 1 else preps
    try:
        hints = [control_hint(Image.open(p), prep) for p, prep in zip(images, preps, strict=True)]
    except OSError as exc:
        raise InvalidValue(f"--control-image: {exc}") from exc
    pipe = with_controlnets(pipe, args.controlnet, allow_pickle=args.allow_pickle)
    modes = args.control_mode or None
    if modes and len(modes) != n:
        raise InvalidValue("--control-mode: one per --controlnet, for FLUX.1 union ControlNets")
    extra = control_arguments(hints, scales, pipe=pipe, modes=modes)
    return pipe, extra


def _component_use(pipe) -> dict[str, str]:
    """Per component, "engine", "torch" or "engine+torch", with the fallback reasons."""
    from sd_accel import stats

    use = {}
    for name, s in stats(pipe).items():
        kinds = [k for k, n in (("engine", s["engine_calls"]), ("torch", s["torch_calls"])) if n]
        use[name] = "+".join(kinds) or "unused"
        if s["fallbacks"]:
            use[name] += " (" + "; ".join(s["fallbacks"]) + ")"
        cached = s.get("step_cache")
        if cached and cached.get("calls"):  # (--step-cache: the last generation's calls that reused the residual)
            last = cached.get("last_generation") or cached
            use[name] += f", step cache: {last['cached']} of {last['calls']} calls cached"
    return use


def _cmd_samplers(args: argparse.Namespace) -> int:
    from sd_accel.samplers import list_presets, resolve

    for name in list_presets():
        preset = resolve(name)
        mark = "  (2 UNet calls/step)" if preset.second_order else ""
        print(f"{name}{mark}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="sd-accel", description="Faster, safer Stable Diffusion.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what sd-accel decides")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate an image and report timings")
    gen.add_argument("--model", default=DEFAULT_MODEL,
                     help="a .safetensors checkpoint, a diffusers folder, or builtin:tiny-sd15 / builtin:tiny-sdxl")
    gen.add_argument("--prompt", default="a photo of a cat")
    gen.add_argument("--negative", default=None)
    gen.add_argument("--sampler", default=None, help='a WebUI sampler name, e.g. "DPM++ 2M Karras"')
    gen.add_argument("--steps", type=int, default=None,
                     help="default: the model family's (20; SD3.5 and FLUX.1 dev 28, FLUX.1 schnell 4)")
    gen.add_argument("--cfg", type=float, default=None,
                     help="default: the model family's (7; SD3.5 4.5, FLUX.1 dev 3.5, FLUX.1 schnell 0)")
    gen.add_argument("--size", type=_size, default=None, help="WIDTHxHEIGHT, multiples of 8 (default: the model's)")
    gen.add_argument("--batch", type=int, default=1)
    gen.add_argument("--seed", type=int, default=0, help="-1 draws a random seed (the report shows it)")
    gen.add_argument("--attention", choices=ATTENTION, default="auto")
    gen.add_argument("--precision", choices=PRECISION, default="auto")
    gen.add_argument("--offload", choices=OFFLOAD, default="none")
    gen.add_argument("--tiny-vae", default=None, metavar="PATH",
                     help="decode with the tiny autoencoder (TAESD): a diffusers folder, taesd_decoder.safetensors, or builtin:taesd")
    gen.add_argument("--allow-pickle", action="store_true", help="allow .ckpt pickle checkpoints (they can run code)")
    gen.add_argument("--engines", nargs="?", const=True, default=False, type=_engines_flag, metavar="auto|on|off",
                     help="run on the engines built for this model (alone or 'on'); 'auto' also builds one first "
                          "for a size none covers (once, cached)")
    gen.add_argument("--engine-precision", choices=ENGINE_PRECISIONS, default=None,
                     help="when engines of several precisions fit (int8 and bf16, say), use this one first")
    _engine_args(gen, backend=True)
    gen.add_argument("--controlnet", action="append", default=None, metavar="PATH",
                     help="a ControlNet (diffusers folder or .safetensors); repeat for several")
    gen.add_argument("--control-image", action="append", default=None, metavar="IMG",
                     help="the hint image of each --controlnet, in order")
    gen.add_argument("--control-scale", action="append", type=float, default=None, metavar="S",
                     help="each --controlnet's conditioning scale (default 1.0)")
    gen.add_argument("--control-mode", action="append", type=int, default=None, metavar="N",
                     help="each --controlnet's control type, for FLUX.1 union ControlNets (their model card lists them)")
    gen.add_argument("--control-preprocess", action="append", choices=("none", "canny"), default=None,
                     help="make each hint from its image: canny (built in, no weights) or none (default)")
    gen.add_argument("--step-cache", type=float, default=None, metavar="THRESHOLD",
                     help="SD3 / FLUX.1 on engines: reuse the transformer's residual on steps where its first block "
                          "changed by less than this (0.08-0.12 usual; off by default; needs an engine built with "
                          "`sd-accel build --step-cache` or --engines auto)")
    gen.add_argument("--step-cache-check", action="store_true",
                     help="with --step-cache: also generate without it and compare (PSNR); below the picture gate "
                          "(35 dB) the uncached picture is saved and the cache is refused")
    gen.add_argument("--out", type=Path, default=Path("outputs/sd-accel.png"))
    gen.add_argument("--json", action="store_true", help="print the report as one JSON line")
    gen.set_defaults(func=_cmd_generate)

    smp = sub.add_parser("samplers", help="list the sampler presets")
    smp.set_defaults(func=_cmd_samplers)

    from sd_accel import bench, cli_engines

    bch = sub.add_parser("bench", help="a quick check: torch vs each usable backend's engines, side by side "
                         "(the full benchmark: python scripts/bench.py in a checkout)")
    bench.add_arguments(bch)
    bch.set_defaults(func=bench.run_from_args)

    cli_engines.add_commands(sub, _engine_args)

    from sd_accel.serve import cli as serve_cli

    srv = sub.add_parser("serve", help="serve txt2img over HTTP on Ray Serve, batching concurrent requests")
    serve_cli.add_arguments(srv)
    srv.set_defaults(func=serve_cli.run_from_args)
    return parser


def _engine_args(p: argparse.ArgumentParser, backend: bool = False) -> None:
    p.add_argument("--engine-dir", default=None, help="engine cache folder (default $SD_ACCEL_ENGINE_DIR or ./engines)")
    if backend:
        p.add_argument("--backend", choices=BACKENDS, default="auto")


def main(argv: list[str] | None = None) -> int:
    # transformers warns at import about optional image processors that SD never uses.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="sd-accel: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("sd-accel: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as exc:
        print(f"sd-accel: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
