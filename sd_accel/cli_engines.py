"""The command line's engine commands: doctor, build, list, delete, prune, ui."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from sd_accel.config import BACKENDS, ENGINE_PRECISIONS
from sd_accel.core import COMPONENT_ALIASES, BuildCancelled, InvalidValue


def _range_arg(name: str):
    """An argparse ``type`` reading ``--<name>`` in the one range grammar (:func:`parse_range`)."""
    from sd_accel.profiles import parse_range

    def read(text: str) -> tuple[int, int, int]:
        try:
            return parse_range(name, text)
        except InvalidValue as exc:  # argparse shows only an ArgumentTypeError's own message
            raise argparse.ArgumentTypeError(str(exc)) from None

    return read


def _components(text: str | None, available: list[str]) -> list[str] | None:
    if not text:
        return None
    out: list[str] = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        expanded = COMPONENT_ALIASES.get(name, (name,))
        out += [c for c in expanded if c in available or name not in COMPONENT_ALIASES]
    return out


def _profiles(args: argparse.Namespace):
    from sd_accel.profiles import Profile

    ranges = {k: getattr(args, k) for k in ("batch", "height", "width", "tokens", "text") if getattr(args, k, None)}
    if args.preset and ranges:
        raise InvalidValue("give --preset or explicit ranges (--batch/--height/--width/--tokens/--text), not both")
    if not ranges:
        return args.preset, None
    if args.static:
        bad = [k for k, (lo, _, hi) in ranges.items() if lo != hi]
        if bad:
            raise InvalidValue(f"--static needs single values, got ranges for {', '.join(bad)}")
    missing = [k for k in ("height", "width") if k not in ranges]
    if missing:
        raise InvalidValue(f"explicit ranges need --height and --width (missing: {', '.join(missing)})")
    ranges.setdefault("batch", (1, 1, 1))
    return None, [Profile(**ranges)]


_KEEP_ONNX = {"graph": "graph", "all": True, "none": False}  # --keep-onnx -> build_engines(keep_onnx=)


@contextlib.contextmanager
def _ctrl_c_cancels() -> Iterator[threading.Event]:
    """Ctrl-C during a build sets the build's cancel event instead of raising in whatever code
    runs then: the build stops at its next step and keeps nothing partial, and the command ends as
    interrupted (130). A KeyboardInterrupt raised inside a native library's call can be swallowed
    there (a CI run once saw a Ctrl-C during an OpenVINO build lost, and the build ran to the
    end); an event cannot. A second Ctrl-C stops at once."""
    cancel = threading.Event()

    def on_sigint(signum, frame) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()
        print("sd-accel: stopping the build after its current step (Ctrl-C again to stop now)",
              file=sys.stderr, flush=True)

    # signal handlers live in the main thread only; a process started with Ctrl-C ignored (a shell's
    # background job, nohup) keeps ignoring it, as POSIX tools do: the build then runs to its end
    main = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    previous = signal.signal(signal.SIGINT, on_sigint) if main else None
    try:
        yield cancel
    except BuildCancelled:
        raise KeyboardInterrupt from None
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    if cancel.is_set():  # it came after the last step: the engines are whole, the user still asked to stop
        raise KeyboardInterrupt


def _cmd_build(args: argparse.Namespace) -> int:
    from sd_accel import build_engines, load_pipeline
    from sd_accel.api import residual_component
    from sd_accel.build import engine_components

    preset, profiles = _profiles(args)
    pipe = load_pipeline(args.model, allow_pickle=args.allow_pickle)
    if args.controlnet:  # their engines and the UNet's that takes their residuals, beside the others
        from sd_accel import with_controlnets

        pipe = with_controlnets(pipe, args.controlnet, allow_pickle=args.allow_pickle)
    if args.tiny_vae:  # the decoder (and encoder) engines are the tiny autoencoder's, as generate --tiny-vae uses
        from sd_accel.api import use_vae

        use_vae(pipe, f"tiny:{args.tiny_vae}")
    if args.no_cfg:  # Turbo, LCM-LoRA at CFG 1: one UNet row per image (LCM-distilled UNets need no flag)
        from dataclasses import replace

        from sd_accel.profiles import default_preset
        from sd_accel.profiles import preset as preset_profile

        base = profiles or [preset_profile(preset or default_preset(pipe.sd_accel_model.family))]
        preset, profiles = None, [replace(p, cfg=False) for p in base]
    components = _components(args.components, engine_components(pipe) + (
        ["controlnet", residual_component(pipe)] if args.controlnet else []))
    start = time.perf_counter()
    with _ctrl_c_cancels() as cancel:
        records = build_engines(pipe, preset, profiles=profiles, backend=args.backend, precision=args.precision,
                                components=components, engine_dir=args.engine_dir, progress=not args.json,
                                keep_onnx=_KEEP_ONNX[args.keep_onnx], cancel=cancel, step_cache=args.step_cache)
    took = time.perf_counter() - start
    rows = [_row(r) for r in records]
    if args.json:
        print(json.dumps({"engines": rows, "seconds": round(took, 2)}))
    else:
        _print_table(rows)
        print(f"{len(rows)} engine(s) ready in {took:.1f} s")
    return 0


def _row(r) -> dict[str, Any]:
    from sd_accel.units import format_size

    v = r.validation or {}
    return {
        "name": r.name,
        "component": r.key.component,
        "profile": r.key.profile,
        "precision": r.key.precision,
        "backend": f"{r.key.backend} {r.key.backend_version}",
        "arch": r.key.arch,
        "size": format_size(r.size_bytes),
        "size_bytes": r.size_bytes,
        "rel_l2": v.get("rel_l2"),
        "status": r.status if r.status == "ok" else f"{r.status}: {r.bad_reason}",
        "last_used": time.strftime("%Y-%m-%d %H:%M", time.localtime(r.last_used)),
    }


def _print_table(rows: list[dict[str, Any]]) -> None:
    cols = ("component", "profile", "precision", "backend", "size", "rel_l2", "status", "last_used", "name")
    shown = [{c: ("-" if row[c] is None else f"{row[c]:.1e}" if c == "rel_l2" else str(row[c])) for c in cols}
             for row in rows]
    widths = {c: max([len(c)] + [len(r[c]) for r in shown]) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in shown:
        print("  ".join(r[c].ljust(widths[c]) for c in cols))


def _intermediate_row(item) -> dict[str, Any]:
    from sd_accel.units import format_size

    return {**item.to_dict(), "what": item.label, "size": format_size(item.size_bytes)}


def _print_intermediates(rows: list[dict[str, Any]]) -> None:
    print("intermediates (ONNX exports and int8 calibration data, kept to build more engines of the same "
          "weights; delete and prune remove those no engine needs):")
    cols = ("what", "component", "size", "status", "name")
    widths = {c: max([len(c)] + [len(str(r[c] or "-")) for r in rows]) for c in cols}
    print("  " + "  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  " + "  ".join(str(r[c] or "-").ljust(widths[c]) for c in cols))


def _refit_row(item) -> dict[str, Any]:
    from sd_accel.units import format_size

    return {**item.to_dict(), "size": format_size(item.size_bytes)}


def _print_refit_copies(rows: list[dict[str, Any]]) -> None:
    print("refit copies (engines a LoRA refit patched, under .refit; a running host's go when it closes them, "
          "those of ended processes at the next refit or prune; prune --refit-copies removes all):")
    cols = ("size", "status", "name")
    widths = {c: max([len(c)] + [len(str(r[c])) for r in rows]) for c in cols}
    print("  " + "  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  " + "  ".join(str(r[c]).ljust(widths[c]) for c in cols))


def _cmd_list(args: argparse.Namespace) -> int:
    from sd_accel import EngineCache

    cache = EngineCache(args.engine_dir)
    rows = [_row(r) for r in sorted(cache.list(), key=lambda r: r.name)]
    broken = [{"name": b.name, "reason": b.reason} for b in cache.broken()]
    usage = cache.disk_usage()
    extra = [_intermediate_row(i) for i in usage.intermediates]
    copies = [_refit_row(c) for c in usage.refit_copies]
    if args.json:
        print(json.dumps({"root": str(cache.root), "engines": rows, "broken": broken, "intermediates": extra,
                          "refit_copies": copies, "engines_bytes": usage.engines_bytes,
                          "intermediates_bytes": usage.intermediates_bytes, "refit_bytes": usage.refit_bytes,
                          "shared_weights_saved_bytes": usage.shared_bytes,
                          "orphan_weights_bytes": usage.orphan_weights_bytes, "total_bytes": usage.total_bytes}))
        return 0
    if rows:
        _print_table(rows)
    for b in broken:
        print(f"broken: {b['name']}: {b['reason']}")
    if extra:
        _print_intermediates(extra)
    if copies:
        _print_refit_copies(copies)
    print(f"{usage.describe()} in {cache.root}")
    return 0


def _print_dropped(before: dict, cache) -> None:
    """The intermediates that went with a delete or prune (no engine needs them any more)."""
    from sd_accel.units import format_size

    left = {i.name for i in cache.intermediates()}
    for name, item in sorted(before.items()):
        if name not in left:
            print(f"removed {name} ({item.label}, {format_size(item.size_bytes)})")


def _cmd_delete(args: argparse.Namespace) -> int:
    from sd_accel import EngineCache
    from sd_accel.cache.intermediates import parse_name

    cache = EngineCache(args.engine_dir)
    if parse_name(args.key) is not None:  # onnx/... or calibration/...: an intermediate
        if not cache.delete_intermediate(args.key):
            raise InvalidValue(f"no intermediate named {args.key!r} in {cache.root}; `sd-accel list` shows the names")
        print(f"deleted {args.key}")
        return 0
    before = {i.name: i for i in cache.intermediates()}
    if not cache.delete(args.key):
        raise InvalidValue(f"no engine named {args.key!r} in {cache.root}; `sd-accel list` shows the names")
    print(f"deleted {args.key}")
    _print_dropped(before, cache)
    return 0


def _cmd_prune(args: argparse.Namespace) -> int:
    from sd_accel import EngineCache
    from sd_accel.units import format_size, parse_age, parse_size

    if args.max_size is None and args.older_than is None and not args.refit_copies:
        raise InvalidValue("prune needs --max-size, --older-than and/or --refit-copies")
    cache = EngineCache(args.engine_dir)
    for c in cache.drop_refit_copies(in_use_too=args.refit_copies):  # without the flag: those of ended processes
        print(f"removed {c.name} (refit copy, {format_size(c.size_bytes)}, {c.status})")
    before = {i.name: i for i in cache.intermediates()}
    removed = cache.prune(max_bytes=parse_size(args.max_size) if args.max_size else None,
                          older_than_s=parse_age(args.older_than) if args.older_than else None)
    for r in removed:
        print(f"removed {r.name} ({format_size(r.size_bytes)})")
    _print_dropped(before, cache)
    print(f"{len(removed)} engine(s) removed; left: {cache.disk_usage().describe()}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from sd_accel.api import describe_machine

    report = describe_machine()
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"device: {report['device']} ({report['name']}), arch key {report['arch']}"
          + (f", {report['memory_gb']} GB" if report["memory_gb"] else ""))
    for name, version in report["versions"].items():
        print(f"  {name:<13} {version or 'not installed'}")
    for b in report["backends"].values():
        if b["usable"]:
            line = (f"usable ({b['version']}, {b['arch']}): builds {', '.join(b['precisions'])}, "
                    f"default {b['default_precision']}" + ("; picked by auto" if b["auto"] else ""))
        else:
            line = f"not usable: {b['why_not']} (runs on {b['runs_on']}; {b['install']})"
        print(f"backend {b['name']}: {line}")
    xf = report["xformers"]
    print("xformers: " + ("usable" if xf["usable"] else f"not usable: {xf['why_not']}"))
    return 0


def _cmd_ui(args: argparse.Namespace) -> int:
    from sd_accel.ui.app import launch

    launch(host=args.host, port=args.port, listen=args.listen, engine_dir=args.engine_dir, model=args.model)
    return 0


def add_commands(sub, engine_args) -> None:
    doc = sub.add_parser("doctor", help="the device, versions, and which backends work here")
    doc.add_argument("--json", action="store_true")
    doc.set_defaults(func=_cmd_doctor)

    b = sub.add_parser("build", help="export and build engines for a model")
    b.add_argument("--model", default="builtin:tiny-sd15")
    b.add_argument("--preset", default=None, help="static-512, dynamic-512-768, ... (default: by model family)")
    for dim in ("batch", "height", "width", "tokens"):
        b.add_argument(f"--{dim}", type=_range_arg(dim), default=None, help="N, MIN-MAX (opt = MIN) or MIN-OPT-MAX")
    b.add_argument("--text", type=_range_arg("text"), default=None,
                   help="SD3 / FLUX.1: T5's sequence length (max_sequence_length), up to 512; default: the "
                        "pipeline's (SD3 256, FLUX.1 512)")
    b.add_argument("--static", action="store_true", help="a static profile from single values")
    b.add_argument("--no-cfg", action="store_true",
                   help="UNet engines for CFG <= 1 (Turbo, LCM-LoRA): one row per image, not two")
    b.add_argument("--components", default=None, help="comma list: unet,vae,clip (default: all)")
    b.add_argument("--tiny-vae", default=None, metavar="PATH", help="build the VAE engines for this tiny autoencoder "
                   "(TAESD/TAESDXL folder or taesd_decoder.safetensors; builtin:taesd), as generate --tiny-vae runs it")
    b.add_argument("--backend", choices=BACKENDS, default="auto")
    b.add_argument("--precision", choices=("auto", *ENGINE_PRECISIONS), default="auto",
                   help="auto: the backend's default (`sd-accel doctor` lists each backend's)")
    b.add_argument("--allow-pickle", action="store_true")
    b.add_argument("--controlnet", action="append", default=None, metavar="PATH",
                   help="also build this ControlNet's engines and the UNet's that takes ControlNet residuals "
                        "(component unet_control); repeat for several")
    b.add_argument("--keep-onnx", choices=tuple(_KEEP_ONNX), default="graph",
                   help="what stays of the ONNX exports once the engines are built: graph (default: the graph "
                        "without its weights, a few MB; more profiles and refits need no new export), all, none")
    b.add_argument("--no-keep-onnx", dest="keep_onnx", action="store_const", const="none",
                   help="the same as --keep-onnx none")
    b.add_argument("--step-cache", action="store_true",
                   help="SD3 / FLUX.1: build the transformer cut for a step cache (generate --step-cache)")
    b.add_argument("--json", action="store_true")
    engine_args(b)
    b.set_defaults(func=_cmd_build)

    ls = sub.add_parser("list", help="list cached engines, the intermediates kept beside them, and disk use")
    ls.add_argument("--json", action="store_true")
    engine_args(ls)
    ls.set_defaults(func=_cmd_list)

    d = sub.add_parser("delete", help="delete one engine (and the intermediates no engine needs any more)")
    d.add_argument("key", help="the engine's name, as `sd-accel list` shows it, or an intermediate's "
                               "(onnx/... or calibration/...)")
    engine_args(d)
    d.set_defaults(func=_cmd_delete)

    pr = sub.add_parser("prune", help="remove engines by age, or engines and intermediates by total size")
    pr.add_argument("--max-size", default=None, help="e.g. 20GB: engines plus intermediates")
    pr.add_argument("--older-than", default=None, help="e.g. 30d (by last use)")
    pr.add_argument("--refit-copies", action="store_true",
                    help="remove every LoRA refit's engine copy (.refit/), those of running hosts too (they refit "
                         "again when needed); those of ended processes go with any prune")
    engine_args(pr)
    pr.set_defaults(func=_cmd_prune)

    ui = sub.add_parser("ui", help="start the standalone Gradio app")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=None)
    ui.add_argument("--listen", action="store_true", help="listen on all interfaces (0.0.0.0)")
    ui.add_argument("--model", default=None, help="the model the panel starts with (default: builtin:tiny-sd15)")
    engine_args(ui)
    ui.set_defaults(func=_cmd_ui)


__all__ = ["add_commands"]

