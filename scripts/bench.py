#!/usr/bin/env python
"""The benchmark harness: plain diffusers against sd-accel (torch level, engines, INT8) and
optimum-intel, one run, side by side, same model, seed, prompt and shapes.

    python scripts/bench.py                  # SD 1.5 architecture, 256 px on CPU / 512 px on CUDA
    python scripts/bench.py --tiny           # builtin:tiny-sd15, a smoke run in seconds
    python scripts/bench.py --arch sdxl --steps 2 --repeats 1   # SDXL architecture at 1024 px (minutes per UNet call on CPU)
    python scripts/bench.py --model path/to/model.safetensors --steps 20 --size 512 --profile

A research tool that lives beside the package, not in it (it runs scripts/bench_optimum.py with
the python of a ``.venv-optimum`` next to the checkout): ``sd-accel bench`` is the quick check
that works from an installed wheel (:mod:`sd_accel.bench`). Prints the table, writes the JSON
report, and (unless ``--markdown`` says otherwise) regenerates ``scripts/BENCHMARKS.md`` next to
this file (not for --tiny or --quick smoke runs).

Rows (variants), each measured the same way:

- ``diffusers``: plain diffusers with its default attention (fp32 on CPU, fp16 on CUDA): what a
  user has today, and the reference for accuracy and speed-up ratios.
- ``sd-accel-torch``: sd-accel's torch-level best for the device (bf16 weights on a CPU with
  AVX512-BF16/AMX, else fp32; fp16 + xFormers/SDPA on CUDA).
- ``ort-fp32``, ``openvino-fp32``, ``openvino-bf16``, ``tensorrt-fp16``: engines.
- ``ort-int8`` (static, calibrated on prompt runs), ``ort-int8-dynamic``, ``openvino-int8``: INT8
  engines for the UNet (:data:`INT8_DEFAULT`), float ones for the rest.
- ``optimum-intel-default``, ``optimum-intel-hybrid-int8``: what CPU users run today, optimum-intel's
  OVStableDiffusionPipeline (its default, and its hybrid int8 quantization), measured by
  ``scripts/bench_optimum.py`` with the python of its own venv (its pins clash with sd-accel's).

Per row: CLIP ms, UNet ms per call, VAE-decode ms, it/s, seconds per image, peak RAM (and VRAM
on CUDA), disk kept, cold export+build seconds, warm load seconds, and the accuracy against ``diffusers``:
final-latent relative L2 and image PSNR. Each row runs in its own process (so peak RAM is the
row's own and thread pools of different runtimes never compete), engines are built in a
separate process first; ``--inprocess`` (the default with ``--tiny``) runs everything here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sd_accel.backends.registry import TABLE
from sd_accel.core import DEFAULT_COMPONENTS, BenchError, ValidationFailed

# optimum-intel rows: variant -> scripts/bench_optimum.py --mode. They run in their own venv.
# optimum-intel-int8 / -int4: weight-only compression of every part (its default export does int8 to
# models above 1e9 parameters: pass int8 to get that on a scaled-down folder too).
OPTIMUM = {"optimum-intel-default": "default", "optimum-intel-hybrid-int8": "hybrid-int8",
           "optimum-intel-int8": "int8", "optimum-intel-int4": "int4"}
PROMPT = "a photograph of an astronaut riding a horse on mars, highly detailed"
CPU_VARIANTS = ("diffusers", "sd-accel-torch", "ort-fp32", "openvino-fp32", "openvino-bf16", "openvino-int8",
                "ort-int8", "ort-int8-dynamic", *OPTIMUM)
CUDA_VARIANTS = ("diffusers", "sd-accel-torch", "tensorrt-fp16")
ENGINE_COMPONENTS = DEFAULT_COMPONENTS  # those the pipeline has (clip2: SDXL)
# variant -> (backend, precision) for engine rows: every precision of every backend in the table
# (ort-fp32, ..., openvino-int8, tensorrt-fp16, tensorrt-fp32), named <short backend>-<precision>.
_SHORT = {"onnxruntime": "ort"}
ENGINES = {f"{_SHORT.get(e.name, e.name)}-{p}": (e.name, p) for e in TABLE for p in e.builds}
# What INT8 rows quantize: the UNet. The other components run as float engines of the same backend
# (ONNX Runtime fp32; OpenVINO bf16 where the CPU has it, else fp32). OpenVINO's int8 VAE decoder
# is 1.4-1.8x faster than bf16, but at 20 steps it took the image from 40.7 to 35.8 dB PSNR
# against torch fp32 (issue 31, BENCHMARKS.md): its per-decode gate passed it, the image did not.
INT8_COMPONENTS: dict[str, tuple[str, ...]] = {}
INT8_DEFAULT = ("unet", "transformer")  # the denoiser, UNet or transformer (SD3 / SD3.5, FLUX.1); int4 rows alike
SHARED_ONNX = "onnx-shared"
SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[1]
OPTIMUM_SCRIPT = REPO / "scripts" / "bench_optimum.py"
OPTIMUM_VENV = REPO / ".venv-optimum"
OPTIMUM_SETUP = ('python -m venv .venv-optimum && .venv-optimum/bin/pip install "torch==2.13.0" '
                 '"optimum-intel[openvino,nncf,diffusers]==2.2.0" "diffusers==0.39.0" '
                 "&& .venv-optimum/bin/pip uninstall -y torchvision")
TE_PREFIX = "text_model."
# --arch: the family whose shipped configs (sd_accel/models/configs/<family>) the default model has
ARCHS = ("sd15", "sdxl")


@dataclass(frozen=True)
class Recipe:
    """How one image is made: the default model's architecture (shipped configs, random weights,
    ``overrides`` per config file), steps, guidance, size, and whether the tiny autoencoder decodes.
    ``None`` fields defer to the command line's defaults (the 20-step recipe)."""

    name: str
    arch: str | None = None
    steps: int | None = None
    guidance_scale: float = 7.5
    size: int | None = None
    tiny_vae: bool = False
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    about: str = ""
    controlnet: bool = False  # one ControlNet of the architecture (random weights) and a fixed hint


_LCM_SCHEDULER = {"_class_name": "LCMScheduler", "timestep_spacing": "leading", "original_inference_steps": 50}
RECIPES = {
    "default": Recipe("default", about="the model's own scheduler (PNDM), 20 steps, CFG 7.5, the full VAE"),
    # what FastSD CPU runs by default: an LCM-distilled SD 1.5 (LCM Dreamshaper v7: its UNet embeds
    # the guidance scale, time_cond_proj_dim 256, and runs one row per image), 4 steps, TAESD
    "lcm": Recipe("lcm", arch="sd15", steps=4, guidance_scale=8.0, size=512, tiny_vae=True, overrides={
        "unet/config.json": {"time_cond_proj_dim": 256},
        "scheduler/scheduler_config.json": _LCM_SCHEDULER,
        "model_index.json": {"_class_name": "LatentConsistencyModelPipeline", "scheduler": ["diffusers", "LCMScheduler"]},
    }, about="LCM-distilled SD 1.5 UNet (time_cond_proj_dim 256), LCM scheduler, 4 steps, guidance 8 "
             "embedded (no CFG), TAESD"),
    # SD-Turbo: the SD 2.1-base architecture, one step, CFG 0, Euler with trailing spacing, TAESD
    "turbo": Recipe("turbo", arch="sd2-base", steps=1, guidance_scale=0.0, size=512, tiny_vae=True, overrides={
        "scheduler/scheduler_config.json": {"_class_name": "EulerDiscreteScheduler", "timestep_spacing": "trailing"},
        "model_index.json": {"scheduler": ["diffusers", "EulerDiscreteScheduler"]},
    }, about="SD-Turbo's shape (SD 2.1-base UNet and OpenCLIP-H text encoder), Euler trailing, 1 step, "
             "CFG 0, TAESD"),
    # issue 28's row: a ControlNet beside the default recipe; its engines are the ControlNet and the
    # residual-taking UNet (every UNet call carries residuals), float only (no int8 ControlNet yet)
    "controlnet": Recipe("controlnet", arch="sd15", controlnet=True, about="SD 1.5 + one ControlNet (the SD 1.5 "
                         "ControlNet architecture, random weights, non-zero residuals; a fixed edge-map hint), PNDM "
                         "20 steps, CFG 7.5, the full VAE"),
}
CONTROL_VARIANTS = ("diffusers", "openvino-bf16", "openvino-fp32", "ort-fp32")  # what the controlnet recipe runs by default
CONTROL_EXTRA = ("openvino-int8",)  # and on request (int8 calibrates on ControlNet runs first: long at 512 px)


@dataclass
class BenchConfig:
    """What one bench run measures; every row uses the same model, seed, prompt and shapes."""

    model: str
    device: str
    height: int
    width: int
    steps: int = 20
    repeats: int = 3
    rounds: int = 1  # passes over the rows (round-robin after the builds); each row's median round is reported
    seed: int = 0
    prompt: str = PROMPT
    engine_dir: str = ""
    profile: bool = False
    out_dir: str = "."
    optimum_python: str = ""  # the optimum-intel venv's python (empty: <repo>/.venv-optimum)
    optimum_samples: int | None = None  # hybrid int8's calibration UNet calls (None: bench_optimum's 200)
    recipe: str = "default"  # a key of RECIPES
    guidance_scale: float = 7.5
    tiny_vae: str = ""  # a TAESD folder that decodes instead of the model's VAE (every row)
    controlnet: str = ""  # a ControlNet folder every row runs (the controlnet recipe)
    # The transformer families (SD3 / SD3.5, FLUX.1) at their real size (scripts/BENCHMARKS-full-size.md):
    text_length: int = 0  # T5 tokens (``max_sequence_length``) of every row and engine; 0: the pipeline's default
    max_size: int = 0  # engines built for sizes from the run's up to this (one engine for 512-1024 px); 0: the run's
    components: str = ""  # comma list of the components engine rows build (empty: every one the pipeline has)
    validate: bool = True  # False: engines are not checked against torch (FLUX.1 in fp32 does not fit in 24 GB)
    warmup_steps: int = 2  # the untimed generation before the timed ones (first-call compiles, buffers)

    @property
    def cfg_rows(self) -> bool:
        """Whether the UNet runs two rows per image (CFG): not for guidance <= 1 nor a
        guidance-embedded (LCM-distilled) UNet."""
        return self.guidance_scale > 1 and self.recipe != "lcm"


@dataclass
class RowResult:
    """One variant's measurements (times in ms unless named ``_s``); ``skipped`` says why not run."""

    variant: str
    skipped: str = ""
    clip_ms: float | None = None
    unet_ms: float | None = None
    unet_ms_spread: tuple[float, float] | None = None
    vae_ms: float | None = None
    controlnet_ms: float | None = None  # the controlnet recipe: per ControlNet call
    it_s: float | None = None
    s_per_image: float | None = None
    s_per_image_spread: tuple[float, float] | None = None
    s_per_image_20: float | None = None
    peak_ram_gb: float | None = None
    peak_vram_gb: float | None = None
    build_s: float | None = None
    build_peak_ram_gb: float | None = None
    disk_gb: float | None = None
    load_s: float | None = None
    latent_rel_l2: float | None = None
    psnr_db: float | None = None
    unet_speedup: float | None = None
    e2e_speedup: float | None = None
    engine_rel_l2: dict[str, float] = field(default_factory=dict)
    notes: str = ""
    details: dict[str, Any] = field(default_factory=dict)  # how the row ran: UNet rows per call, precisions, calls


# ---- measuring one generation ---------------------------------------------------------------


class _Timer:
    """Accumulates wall time per component through forward hooks and a ``vae.decode`` wrapper."""

    def __init__(self, pipe, cuda: bool) -> None:
        self.cuda = cuda
        self.times: dict[str, list[float]] = {"clip": [], "unet": [], "vae": [], "controlnet": []}
        self._handles: list[Any] = []
        self._starts: dict[str, float] = {}
        self._pipe = pipe
        self._decode = None
        self.last_latent = None

    def _now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def __enter__(self) -> _Timer:
        self.unet_rows: set[int] = set()
        self._handles.append(denoiser(self._pipe).register_forward_pre_hook(
            lambda _m, args, kwargs: self.unet_rows.add(int((args[0] if args else kwargs.get(
                "sample", kwargs.get("hidden_states"))).shape[0])),
            with_kwargs=True))
        for name, module in _timed_modules(self._pipe):
            self._handles.append(module.register_forward_pre_hook(lambda *_a, _n=name: self._start(_n)))
            self._handles.append(module.register_forward_hook(lambda *_a, _n=name: self._stop(_n)))
        vae = self._pipe.vae
        self._decode = vae.__dict__.get("decode")
        inner = vae.decode

        def decode(z, *args, **kwargs):
            self.last_latent = z.detach().float().cpu().numpy().copy()
            self._start("vae")
            try:
                return inner(z, *args, **kwargs)
            finally:
                self._stop("vae")

        vae.decode = decode
        return self

    def _start(self, name: str) -> None:
        self._starts[name] = self._now()

    def _stop(self, name: str) -> None:
        self.times[name].append(self._now() - self._starts.pop(name))

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        vae = self._pipe.vae
        if self._decode is None:
            vae.__dict__.pop("decode", None)
        else:
            vae.decode = self._decode

    def reset(self) -> None:
        for v in self.times.values():
            v.clear()


def denoiser(pipe):
    """The module every step calls: the UNet, or the transformer of SD3 / SD3.5 and FLUX.1 (timed
    under the ``unet`` keys, headed by its name in the table)."""
    return pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer


def _timed_modules(pipe) -> list[tuple[str, Any]]:
    """(timer name, module): every text encoder counts as CLIP (SDXL's two, SD3's CLIPs and T5, FLUX.1's
    CLIP and T5: they run one after the other, once per prompt)."""
    encoders = [m for m in (getattr(pipe, f"text_encoder{n}", None) for n in ("", "_2", "_3")) if m is not None]
    net = getattr(pipe, "controlnet", None)
    return [*(("clip", m) for m in encoders), ("unet", denoiser(pipe)),
            *([("controlnet", net)] if net is not None else [])]


def control_hint(size: tuple[int, int]):
    """The controlnet recipe's hint: white edges of a few circles and lines on black, as a canny map looks."""
    from sd_accel.models.hints import synthetic_edges

    return synthetic_edges(size)


def _generate(pipe, cfg: BenchConfig, steps: int):
    import torch

    g = torch.Generator("cpu").manual_seed(cfg.seed)
    extra = {"image": control_hint((cfg.width, cfg.height))} if cfg.controlnet else {}
    if cfg.text_length:
        extra["max_sequence_length"] = cfg.text_length
    return pipe(cfg.prompt, height=cfg.height, width=cfg.width, num_inference_steps=steps, generator=g,
                guidance_scale=cfg.guidance_scale, output_type="np", **extra).images[0]


def _peak_ram_gb() -> float:
    """This process's peak resident memory. VmHWM where Linux has it: ``ru_maxrss`` survives
    ``exec``, so a worker started by a big parent would report the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kb / 2**20, 2)


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


# ---- building a row's pipeline ----------------------------------------------------------------


def _cpu_bf16() -> bool:
    from sd_accel.device import cpu_flags

    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _torch_best(device: str) -> dict[str, Any]:
    """sd-accel's torch-level choice for this device."""
    if device.startswith("cuda"):
        return {"precision": "fp16", "attention": "auto"}
    return {"precision": "bf16" if _cpu_bf16() else "fp32", "attention": "sdpa", "vae_precision": "same"}


def _availability(variant: str, device: str) -> str:
    """Empty when the variant can run here, else why not."""
    if variant not in ENGINES:
        return ""
    backend, precision = ENGINES[variant]
    from sd_accel.backends.registry import entry, get_backend

    try:
        where = entry(backend).torch_device
    except ValueError as exc:
        return str(exc)
    if where != ("cuda" if device.startswith("cuda") else "cpu"):
        return f"{backend} rows are measured on {where} runs"
    try:
        be = get_backend(backend)
    except Exception as exc:  # not installed, not usable here
        return str(exc)
    if precision not in be.precisions():
        return f"{backend} does not build {precision} here (it builds {', '.join(be.precisions())})"
    return ""


def optimum_python(cfg: BenchConfig) -> Path:
    """The optimum-intel venv's python: ``cfg.optimum_python``, else ``SD_ACCEL_OPTIMUM_PYTHON``,
    else ``<repo>/.venv-optimum/bin/python``."""
    return Path(cfg.optimum_python or os.environ.get("SD_ACCEL_OPTIMUM_PYTHON") or OPTIMUM_VENV / "bin" / "python")


def _optimum_availability(cfg: BenchConfig) -> str:
    """Empty when the optimum-intel rows can run here, else what is missing and how to get it."""
    if cfg.device != "cpu":
        return "optimum-intel rows are measured on cpu runs"
    if not OPTIMUM_SCRIPT.exists():
        return f"{OPTIMUM_SCRIPT} is missing (it ships in the sd-accel checkout, not the wheel)"
    python = optimum_python(cfg)
    setup = f"create it with `cd {REPO} && {OPTIMUM_SETUP}` or point --optimum-python / SD_ACCEL_OPTIMUM_PYTHON at one"
    if not python.exists():
        return f"no optimum-intel venv ({python} is missing): {setup}"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('optimum.intel') is None)"
    if subprocess.run([str(python), "-c", probe], capture_output=True).returncode != 0:
        return f"{python} has no optimum-intel: {setup}"
    return ""


def _optimum_model_dir(cfg: BenchConfig) -> str:
    """A diffusers folder of ``cfg.model`` for optimum-intel: the folder itself, or (a builtin:NAME
    or single-file checkpoint) a copy saved once under the engine folder."""
    if (Path(cfg.model) / "model_index.json").exists():
        return str(Path(cfg.model).resolve())
    import hashlib

    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(cfg.model).name)
    dest = Path(cfg.engine_dir) / "optimum-models" / f"{name}-{hashlib.sha1(cfg.model.encode()).hexdigest()[:8]}"
    if not (dest / "model_index.json").exists():
        _save_model(load_model(cfg), dest)
    return str(dest)


def _optimum_cmd(cfg: BenchConfig, variant: str, mode: str, work: Path) -> list[str]:
    model_dir = _optimum_model_dir(cfg)
    # the export is size-independent; a TAESD decoder in it makes it another folder
    name = Path(model_dir).name + (f"+{Path(cfg.tiny_vae).name}" if cfg.tiny_vae else "")
    export_dir = Path(cfg.engine_dir) / variant / name
    return [str(optimum_python(cfg)), str(OPTIMUM_SCRIPT), "--phase", mode, "--result", str(work / f"{variant}.{mode}.json"),
            "--mode", OPTIMUM[variant], "--model-dir", model_dir, "--export-dir", str(export_dir),
            "--out-dir", str(work), "--height", str(cfg.height), "--width", str(cfg.width), "--steps", str(cfg.steps),
            "--repeats", str(cfg.repeats), "--seed", str(cfg.seed), "--prompt", cfg.prompt,
            "--guidance-scale", str(cfg.guidance_scale), *(["--tiny-vae", cfg.tiny_vae] if cfg.tiny_vae else []),
            *(["--text", str(cfg.text_length)] if cfg.text_length else []),
            *(["--num-samples", str(cfg.optimum_samples)] if cfg.optimum_samples and OPTIMUM[variant] != "default" else [])]


def _du_gb(*paths: Path) -> float:
    """Bytes of the files under ``paths`` (links not followed), in GB."""
    files = (f for p in paths if p.exists() for f in p.rglob("*") if f.is_file() and not f.is_symlink())
    return round(sum(f.stat().st_size for f in files) / 2**30, 3)


def _engine_jobs(variant: str, available: Sequence[str] = ENGINE_COMPONENTS,
                 control: bool = False) -> list[tuple[str, str, list[str]]]:
    """(backend, precision, components) builds a row needs, of the ``available`` components (the
    pipeline's: SD 1.x has no ``clip2``); ``control``: a ControlNet pipeline, whose UNet calls all
    carry residuals: the ControlNet and the residual-taking UNet instead of the plain UNet."""
    backend, precision = ENGINES[variant]
    if control:  # (the ControlNet last and alone: build_row may take it in fp32, see there)
        others = [c for c in ENGINE_COMPONENTS if c in available and c != "unet"]
        if precision.startswith("int8"):  # int8: the UNet and the ControlNet, the rest float as in plain rows
            from sd_accel.backends.registry import create

            return [(backend, create(backend).default_precision(), others), (backend, precision, ["unet_control"]),
                    (backend, precision, ["controlnet"])]
        return [(backend, precision, [*others, "unet_control"]), (backend, precision, ["controlnet"])]
    if precision.startswith(("int8", "int4")):
        # the float components of an INT8 (INT4) row: the same backend at its default float precision
        from sd_accel.backends.registry import create

        floats = create(backend).default_precision()
        quantized = INT8_COMPONENTS.get(backend, INT8_DEFAULT)
        return [(backend, precision, [c for c in ENGINE_COMPONENTS if c in available and c in quantized]),
                (backend, floats, [c for c in ENGINE_COMPONENTS if c in available and c not in quantized])]
    return [(backend, precision, [c for c in ENGINE_COMPONENTS if c in available])]


def row_engine_dir(cfg: BenchConfig, variant: str) -> str:
    """Each row keeps its engines in its own folder (the runtime picks engines by backend, not by
    precision); the exported ONNX files are shared by all rows through a link."""
    root = Path(cfg.engine_dir)
    shared = root / SHARED_ONNX
    shared.mkdir(parents=True, exist_ok=True)
    folder = root / variant
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "onnx"
    if not link.exists():
        link.symlink_to(shared.resolve(), target_is_directory=True)
    return str(folder)


def load_model(cfg: BenchConfig):
    """The model, with the recipe's tiny autoencoder in place of its VAE (every row decodes with it:
    plain diffusers too, as a diffusers user sets ``pipe.vae = AutoencoderTiny...``)."""
    from sd_accel import load_pipeline
    from sd_accel.api import use_vae

    pipe = load_pipeline(cfg.model)
    if cfg.controlnet:
        from sd_accel import with_controlnets

        pipe = with_controlnets(pipe, [cfg.controlnet])
    pipe.set_progress_bar_config(disable=True)
    if cfg.tiny_vae:
        use_vae(pipe, _vae_choice(cfg))
    return pipe


def _vae_choice(cfg: BenchConfig) -> str | None:
    return f"tiny:{cfg.tiny_vae}" if cfg.tiny_vae else None


def build_row(cfg: BenchConfig, variant: str) -> dict[str, Any]:
    """Build (or find in the cache) the engines of one row; returns seconds, peak RAM, errors."""
    from sd_accel import build_engines
    from sd_accel.build import engine_components

    pipe = load_model(cfg)
    top = max(cfg.max_size, cfg.height, cfg.width)
    # FLUX.1 runs one row per call whatever the guidance (embedded, or none): its profile never
    # says .nocfg, so the engines scripts/bench_full_size.py built are the ones found here
    one_row = not cfg.cfg_rows and "Flux" not in type(pipe).__name__
    profile = dict(batch=1, height=(cfg.height, top, top) if cfg.max_size else cfg.height,
                   width=(cfg.width, top, top) if cfg.max_size else cfg.width,
                   **({"cfg": False} if one_row else {}), **({"text": cfg.text_length} if cfg.text_length else {}))
    available = engine_components(pipe)
    if cfg.components:
        wanted = cfg.components.split(",")
        unknown = [c for c in wanted if c not in available]
        if unknown:
            raise BenchError(f"--components {cfg.components}: the pipeline has no {', '.join(unknown)} (it has "
                             f"{', '.join(available)})")
        available = wanted
    start = time.perf_counter()
    built_s, errors, fell_back, records_all = 0.0, {}, {}, []
    for backend, precision, components in _engine_jobs(variant, available, bool(cfg.controlnet)):
        if not components:
            continue

        def build(p: str, backend: str = backend, components: list[str] = components) -> list:
            return build_engines(pipe, profiles=[profile], backend=backend, precision=p, components=components,
                                 engine_dir=row_engine_dir(cfg, variant), progress=False, validate=cfg.validate)

        try:
            records = build(precision)
        except ValidationFailed as exc:
            # A ControlNet that misses the reduced precision's check (its residuals, then the UNet
            # they feed: sd_accel.validate.consumer_error) is built in fp32, as engines="auto" does
            # with any component; the row says so
            if components != ["controlnet"] or precision == "fp32":
                raise
            from sd_accel.backends.registry import create

            instead = create(backend).default_precision() if precision.startswith("int8") else "fp32"
            fell_back["controlnet"] = f"{instead} ({precision} missed its check: {str(exc).split(': ', 1)[-1][:160]})"
            records = build(instead)
        records_all += records
        for r in records:
            built_s += float(getattr(r, "build_seconds", 0.0) or 0.0)
            if r.validation:
                errors[f"{r.key.component}.{r.key.precision}"] = r.validation.get("rel_l2")
    folder = Path(row_engine_dir(cfg, variant))
    # the row's own engines (a folder linked in may hold other precisions' too) and the ONNX
    # exports they come from, shared by the engine rows
    disk = _du_gb(*(folder / r.key.name for r in records_all), Path(cfg.engine_dir) / SHARED_ONNX)
    return {"build_wall_s": time.perf_counter() - start, "build_s": built_s, "build_peak_ram_gb": _peak_ram_gb(),
            "engine_rel_l2": errors, "disk_gb": disk, **({"precision_fallbacks": fell_back} if fell_back else {})}


def _accelerated(cfg: BenchConfig, variant: str):
    """The row's pipeline, ready to run, and the seconds it took to get there (load + swap)."""
    import torch

    from sd_accel import AccelConfig, accelerate

    start = time.perf_counter()
    pipe = load_model(cfg)
    cuda = cfg.device.startswith("cuda")
    stored = denoiser(pipe).dtype  # a transformer family's 16-bit / fp8 file loads in bf16 (load_pipeline)
    if variant == "diffusers":
        if getattr(pipe, "transformer", None) is None or cuda:
            pipe.to(cfg.device, torch.float16 if cuda else torch.float32)
        else:  # SD3 / FLUX.1: in the dtype it loads in (bf16 from a 16-bit file: fp32 FLUX.1 is 48 GB)
            _hand_back_if_big(pipe)
    elif variant == "sd-accel-torch":
        accelerate(pipe, AccelConfig(device=cfg.device, vae=_vae_choice(cfg), **_torch_best(cfg.device)))
    else:
        backend, precision = ENGINES[variant]
        from sd_accel.backends.registry import entry

        torch_precision = "fp16" if entry(backend).torch_device == "cuda" else "bf16" if stored == torch.bfloat16 \
            else "fp32"  # what stays in torch (T5, CLIP, VAE) as loaded: bf16 FLUX.1's T5 in fp32 would be 19 GB
        accelerate(pipe, AccelConfig(device=cfg.device, precision=torch_precision, engines=True, vae=_vae_choice(cfg),
                                     engine_dir=row_engine_dir(cfg, variant), backend=backend,
                                     engine_precision=_engine_precision(variant)))
    return pipe, time.perf_counter() - start


def _engine_precision(variant: str) -> str | None:
    """The denoiser's engine precision a row runs on, where engines of several precisions share a
    folder (a full-size transformer's int4 and int8 engines, built once, linked into each row's)."""
    precision = ENGINES[variant][1]
    return precision if precision.startswith(("int8", "int4")) else None


def _hand_back_if_big(pipe) -> None:
    """A transformer on its file's mapping (``models.mapped_file``) bigger than half the memory
    available (FLUX.1: 24 GB of bf16 on a 24 GB machine) hands each layer's pages back after its
    forward, or the plain diffusers row could not run at all: the row's notes say so."""
    from sd_accel.device import available_memory
    from sd_accel.pages import PageDropper
    from sd_accel.runtime.weights import hand_back_hooks

    net = denoiser(pipe)
    size = sum(t.numel() * t.element_size() for t in net.parameters())
    free = available_memory()
    if free is not None and size > free / 2:
        hand_back_hooks(net, PageDropper())
        pipe._bench_hand_back = True  # (read by run_row for the row's details)


def run_row(cfg: BenchConfig, variant: str, work: Path) -> dict[str, Any]:
    """Load, warm up, time ``repeats`` generations, save the last latents and image in ``work``."""
    import torch

    cuda = cfg.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    pipe, load_s = _accelerated(cfg, variant)
    out: dict[str, Any] = {"load_s": load_s}
    with torch.inference_mode(), _Timer(pipe, cuda) as timer:
        if cfg.warmup_steps:
            _generate(pipe, cfg, steps=cfg.warmup_steps)  # warm-up: first-call allocations, engine buffers
        totals, unet_calls, clips, vaes, nets = [], [], [], [], []
        image = None
        for _ in range(cfg.repeats):
            timer.reset()
            start = timer._now()
            image = _generate(pipe, cfg, cfg.steps)
            totals.append(timer._now() - start)
            unet_calls += timer.times["unet"]
            nets += timer.times.get("controlnet", [])
            clips.append(sum(timer.times["clip"]))
            vaes.append(sum(timer.times["vae"]))
        n_unet = len(timer.times["unet"])
        out.update(unet_rows=sorted(timer.unet_rows), unet_calls_per_image=n_unet,
                   denoiser="unet" if getattr(pipe, "unet", None) is not None else "transformer",
                   denoiser_dtype=str(denoiser(pipe).dtype).replace("torch.", ""),
                   weights_handed_back=bool(getattr(pipe, "_bench_hand_back", False)),
                   scheduler=type(pipe.scheduler).__name__,
                   vae=type(getattr(pipe.vae, "torch_module", pipe.vae)).__name__)  # (engine stand-ins hold it)
        if cfg.profile:
            out["trace"] = _profile(pipe, cfg, variant, timer)
    loop = [t - c - v for t, c, v in zip(totals, clips, vaes, strict=True)]
    per_call = _med(unet_calls)
    fixed = _med(clips) + _med(vaes) + (_med(loop) - per_call * n_unet)  # everything but UNet calls
    out.update(
        clip_ms=_med(clips) * 1e3, unet_ms=per_call * 1e3,
        unet_ms_spread=(min(unet_calls) * 1e3, max(unet_calls) * 1e3),
        vae_ms=_med(vaes) * 1e3, it_s=cfg.steps / _med(loop), s_per_image=_med(totals),
        s_per_image_spread=(min(totals), max(totals)),
        # seconds per image at 20 steps, from the same per-call time (equals s_per_image at 20 steps)
        s_per_image_20=fixed + per_call * n_unet * 20 / cfg.steps,
        peak_ram_gb=_peak_ram_gb(),
        peak_vram_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        **({"controlnet_ms": _med(nets) * 1e3} if nets else {}),
    )
    from sd_accel.runtime.swap import stats

    out["engine_stats"] = {k: {"engine_calls": v.get("engine_calls"), "torch_calls": v.get("torch_calls")}
                           for k, v in stats(pipe).items()}
    np.save(work / f"{variant}.latent.npy", timer.last_latent)
    np.save(work / f"{variant}.image.npy", (np.clip(image, 0, 1) * 255).round().astype(np.uint8))
    return out


def _profile(pipe, cfg: BenchConfig, variant: str, timer: _Timer) -> str:
    """One more generation under the PyTorch profiler; a chrome trace (open in chrome://tracing
    or ui.perfetto.dev). Engine calls show as the ``sd-accel:<component>`` ranges."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.device.startswith("cuda") else [])
    path = Path(cfg.out_dir) / f"trace-{variant}.json"
    with profile(activities=activities) as prof, record_function(f"sd-accel:{variant}"):
        handles = []
        for name, module in _timed_modules(pipe):
            ctx: dict[str, Any] = {}
            handles.append(module.register_forward_pre_hook(
                lambda *_a, _n=name, _c=ctx: _c.__setitem__("r", _enter(f"sd-accel:{_n}"))))
            handles.append(module.register_forward_hook(lambda *_a, _c=ctx: _c.pop("r").__exit__(None, None, None)))
        try:
            _generate(pipe, cfg, cfg.steps)
        finally:
            for h in handles:
                h.remove()
    torch.cuda.synchronize() if cfg.device.startswith("cuda") else None
    prof.export_chrome_trace(str(path))
    return str(path)


def _enter(label: str):
    from torch.profiler import record_function

    ctx = record_function(label)
    ctx.__enter__()
    return ctx


# ---- the parent: rows in subprocesses, accuracy, ratios, report ----------------------------


def _worker(mode: str, cfg: BenchConfig, variant: str, work: Path, inprocess: bool) -> dict[str, Any]:
    if inprocess and variant not in OPTIMUM:  # optimum-intel needs its own venv: always a subprocess
        return build_row(cfg, variant) if mode == "build" else run_row(cfg, variant, work)
    result = work / f"{variant}.{mode}.json"
    cmd = [sys.executable, str(SCRIPT), "--worker", mode, "--variant", variant, "--work", str(work),
           "--config", json.dumps(asdict(cfg))]
    if variant in OPTIMUM:
        cmd = _optimum_cmd(cfg, variant, mode, work)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not result.exists():
        # (progress bars redraw with \r: each redraw is a line, so the error is in the tail, not them)
        tail = [ln for ln in (proc.stderr or proc.stdout).replace("\r", "\n").strip().splitlines() if ln.strip()][-8:]
        raise BenchError(f"{variant} {mode} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return json.loads(result.read_text())


_RUN_KEYS = ("clip_ms", "unet_ms", "unet_ms_spread", "vae_ms", "it_s", "s_per_image", "s_per_image_spread",
             "s_per_image_20", "peak_ram_gb", "peak_vram_gb", "load_s", "controlnet_ms")


_DETAILS = ("unet_rows", "unet_calls_per_image", "inference_precision", "scheduler", "vae", "engine_stats", "denoiser",
            "denoiser_dtype", "weights_handed_back")


def _fill(row: RowResult, ran: dict[str, Any]) -> None:
    for key in _RUN_KEYS:
        setattr(row, key, ran.get(key))


def _more_rounds(cfg: BenchConfig, rows: list[RowResult], runs: dict[str, list[dict[str, Any]]], work: Path,
                 inprocess: bool, log) -> None:
    """Rounds 2..N: every row that ran runs again, in turn, so that each row sees the machine's
    slow and fast spells alike (a shared 2-core VM's speed swings by up to 2x for minutes: rows
    run one after the other in one pass can land in different spells). Each row then reports its
    median round by s/image (the faster of the two middle ones for an even count: 2 rounds give
    each row's faster round), with the spreads over all rounds and the highest peak RAM."""
    for n in range(2, cfg.rounds + 1):
        for variant, done in runs.items():  # the rows that ran (skipped and failed rows have none)
            log(f"[bench] {variant}: round {n} of {cfg.rounds}")
            try:
                done.append(_worker("run", cfg, variant, work, inprocess))
            except Exception as exc:
                log(f"[bench] {variant}: round {n} failed: {exc}")
    for row in rows:
        done = runs.get(row.variant, [])
        if len(done) < 2:
            continue
        median = sorted(done, key=lambda r: r.get("s_per_image") or math.inf)[(len(done) - 1) // 2]
        _fill(row, median)
        for key in ("unet_ms_spread", "s_per_image_spread"):
            spans = [r[key] for r in done if r.get(key)]
            if spans:
                setattr(row, key, (min(a for a, _ in spans), max(b for _, b in spans)))
        peaks = [r["peak_ram_gb"] for r in done if r.get("peak_ram_gb") is not None]
        row.peak_ram_gb = max(peaks) if peaks else row.peak_ram_gb
        row.notes = (row.notes + "; " if row.notes else "") + (
            f"median of {len(done)} rounds, s/image " + "/".join(f"{r.get('s_per_image', 0):.2f}" for r in done))


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def run_bench(cfg: BenchConfig, variants: Sequence[str], inprocess: bool = False,
              log=print) -> dict[str, Any]:
    """Measure every variant (the first is the reference) and return the report as a dict."""
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[RowResult] = []
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="sd-accel-bench-") as tmp:
        work = Path(tmp)
        for variant in variants:
            why = _optimum_availability(cfg) if variant in OPTIMUM else _availability(variant, cfg.device)
            if why:
                log(f"[bench] {variant}: skipped ({why})")
                rows.append(RowResult(variant, skipped=why))
                continue
            log(f"[bench] {variant}: {'building engines, then ' if variant in (*ENGINES, *OPTIMUM) else ''}running")
            row = RowResult(variant)
            try:
                if variant in ENGINES or variant in OPTIMUM:
                    built = _worker("build", cfg, variant, work, inprocess)
                    row.build_s, row.build_peak_ram_gb = built["build_s"], built["build_peak_ram_gb"]
                    row.engine_rel_l2 = built["engine_rel_l2"]
                    for component, why in built.get("precision_fallbacks", {}).items():
                        row.notes = (row.notes + "; " if row.notes else "") + f"{component} in {why}"
                    # the engines and the ONNX export they come from (shared by the engine rows)
                    row.disk_gb = built.get("disk_gb", _du_gb(Path(cfg.engine_dir) / variant,
                                                              Path(cfg.engine_dir) / SHARED_ONNX))
                    if built.get("build_cached"):  # as for engine rows: 0 s when built before
                        row.build_s = 0.0
                        row.notes = (row.notes + "; " if row.notes else "") + \
                            f"export cached (built in {built['build_s']:.0f} s)"
                ran = _worker("run", cfg, variant, work, inprocess)
            except Exception as exc:  # a row that fails is reported, the others still run
                log(f"[bench] {variant}: failed: {exc}")
                row.skipped = f"failed: {str(exc).splitlines()[0][:200]}"
                rows.append(row)
                continue
            runs[variant] = [ran]
            _fill(row, ran)
            row.details = {k: ran[k] for k in _DETAILS if ran.get(k) is not None}
            stats = ran.get("engine_stats") or {}
            fallbacks = {k: v["torch_calls"] for k, v in stats.items() if v.get("torch_calls")}
            if fallbacks:
                row.notes = f"torch fallback calls: {fallbacks}"
            if ran.get("gen_peak_ram_gb") is not None:  # optimum rows: what generating alone peaks at
                row.notes = (row.notes + "; " if row.notes else "") + f"{ran['gen_peak_ram_gb']} GB while generating"
            if ran.get("trace"):
                row.notes = (row.notes + " " if row.notes else "") + f"trace: {ran['trace']}"
            rows.append(row)
        _more_rounds(cfg, rows, runs, work, inprocess, log)
        _accuracy(rows, work)
    _ratios(rows)
    report = {"config": asdict(cfg), "machine": machine(cfg.device), "rows": [asdict(r) for r in rows]}
    return report


def _accuracy(rows: list[RowResult], work: Path) -> None:
    ref = next((r for r in rows if not r.skipped), None)
    if ref is None:
        return
    ref_lat = np.load(work / f"{ref.variant}.latent.npy")
    ref_img = np.load(work / f"{ref.variant}.image.npy")
    for r in rows:
        if r.skipped:
            continue
        r.latent_rel_l2 = _rel_l2(np.load(work / f"{r.variant}.latent.npy"), ref_lat)
        r.psnr_db = _psnr(np.load(work / f"{r.variant}.image.npy"), ref_img)


def _ratios(rows: list[RowResult]) -> None:
    ref = next((r for r in rows if not r.skipped), None)
    if ref is None:
        return
    for r in rows:
        if not r.skipped and r.unet_ms and r.s_per_image:
            r.unet_speedup = ref.unet_ms / r.unet_ms
            r.e2e_speedup = ref.s_per_image / r.s_per_image


def machine(device: str) -> dict[str, Any]:
    """Where the numbers come from: CPU/GPU, cores, ISA class, library versions, load."""
    from sd_accel.device import describe, version_of, versions

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu": _cpu_name(),
            "cores": os.cpu_count(), "device": asdict(describe(device)), "versions": versions(),
            "openvino": version_of("openvino"), "nncf": version_of("nncf"),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}
    return info


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


# ---- output --------------------------------------------------------------------------------

_COLUMNS = (
    ("variant", "row", "{}"), ("clip_ms", "CLIP ms", "{:.0f}"), ("unet_ms", "UNet ms/call", "{:.0f}"),
    ("unet_ms_spread", "UNet min-max", "{:.0f}-{:.0f}"), ("controlnet_ms", "ControlNet ms/call", "{:.0f}"),
    ("vae_ms", "VAE ms", "{:.0f}"), ("it_s", "it/s", "{:.2f}"),
    ("s_per_image", "s/image", "{:.2f}"), ("s_per_image_20", "s/image@20", "{:.1f}"),
    ("unet_speedup", "UNet x", "{:.2f}"), ("e2e_speedup", "e2e x", "{:.2f}"), ("peak_ram_gb", "RAM GB", "{:.1f}"),
    ("peak_vram_gb", "VRAM GB", "{:.1f}"), ("disk_gb", "disk GB", "{:.1f}"), ("build_s", "build s", "{:.0f}"), ("load_s", "load s", "{:.1f}"),
    ("latent_rel_l2", "latent relL2", "{:.4f}"), ("psnr_db", "PSNR dB", "{:.1f}"),
)


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if isinstance(value, list | tuple):
        return fmt.format(*value)
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return fmt.format(value)


def table(report: dict[str, Any]) -> list[list[str]]:
    cuda = report["config"]["device"].startswith("cuda")
    control = any(r.get("controlnet_ms") for r in report["rows"])
    columns = [c for c in _COLUMNS if (c[0] != "peak_vram_gb" or cuda) and (c[0] != "controlnet_ms" or control)]
    head = [c[1] for c in columns]
    if _transformer_rows(report):  # SD3 / FLUX.1: the denoiser is a transformer
        head = [h.replace("UNet", "transformer") for h in head]
    rows = [head]
    for r in report["rows"]:
        if r["skipped"]:
            rows.append([r["variant"], f"skipped: {r['skipped']}"] + [""] * (len(head) - 2))
            continue
        rows.append([_cell(r, k, f) for k, _, f in columns])
    return rows


def _transformer_rows(report: dict[str, Any]) -> bool:
    return any((r.get("details") or {}).get("denoiser") == "transformer" for r in report["rows"])


def text_table(report: dict[str, Any]) -> str:
    rows = table(report)
    widths = [max(len(r[i]) for r in rows if len(r[i]) < 40) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def markdown(report: dict[str, Any], command: str) -> str:
    rows = table(report)
    cfg, m = report["config"], report["machine"]
    lines = [
        "# sd-accel benchmark",
        "",
        f"Regenerated by `{command}`. Model `{cfg['model']}`, {cfg['width']}x{cfg['height']}, batch 1, "
        f"{cfg['steps']} steps, {cfg['repeats']} timed runs per row (medians; min-max spread shown)"
        f"{', the median of ' + str(cfg['rounds']) + ' rounds over all rows' if cfg.get('rounds', 1) > 1 else ''}, seed "
        f"{cfg['seed']}, prompt \"{cfg['prompt']}\". Ratios and accuracy are against the first row.",
        *([] if cfg.get("recipe", "default") == "default" else [
            "", f"Recipe `{cfg['recipe']}`: {RECIPES[cfg['recipe']].about}; guidance scale {cfg['guidance_scale']:g}"
            + (f", every row decodes with the tiny autoencoder `{cfg['tiny_vae']}`" if cfg.get("tiny_vae") else "") + "."]),
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "|".join("---" for _ in rows[0]) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    lines += [
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, device {m['device']['device']} ({m['device']['arch']}), "
        f"{m['platform']}, Python {m['python']}; load average at the end {m['load_average']}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in {**m["versions"], "openvino": m["openvino"],
                                                          "nncf": m["nncf"]}.items() if v) + ".",
        "",
        "Columns: UNet ms/call is the median of every UNet call in the timed runs ("
        + ("batch 2: guidance" if cfg.get("guidance_scale", 7.5) > 1 and cfg.get("recipe") != "lcm"
           else "batch 1: no CFG rows") + "); "
        "s/image@20 rescales the loop to 20 steps; disk GB is what the row keeps on disk (its engines plus "
        "what is kept of the ONNX export they come from (its graph, by default), shared by the engine rows; optimum-intel's exported IR); build s is the engines' export+build time from the cache "
        "records (0 when they were already cached); load s is the pipeline load plus the engine swap; latent "
        "relL2 is the final latents' relative L2 error and PSNR the decoded image's, both against the first row.",
    ]
    if _transformer_rows(report):
        lines[-1] = lines[-1].replace("UNet", "transformer")
    return "\n".join(lines) + "\n"


def write_outputs(report: dict[str, Any], json_path: Path, md_path: Path | None, command: str) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    report = {**report, "command": command}
    json_path.write_text(json.dumps(report, indent=2, default=_json_default))
    if md_path is not None:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        extra = Path(md_path).read_text().split(LEVERS_MARK, 1)[1] if md_path.exists() and LEVERS_MARK in \
            md_path.read_text() else ""
        md_path.write_text(markdown(report, command) + (LEVERS_MARK + extra if extra else ""))


LEVERS_MARK = "\n<!-- notes below are kept when the table above is regenerated -->\n"

# The columns of the table docs/figures/runs.json holds (scripts/figures.py renders it on the docs'
# Benchmarks page): one row per bench row of each run appended with --figures.
FIGURES_COLUMNS = [
    {"key": "date", "head": "date"}, {"key": "machine", "head": "machine"},
    {"key": "model", "head": "model, size, steps"}, {"key": "row", "head": "row"},
    {"key": "s_per_image", "head": "s/image", "fmt": "{:.2f}"}, {"key": "e2e_speedup", "head": "e2e x", "fmt": "{:.2f}x"},
    {"key": "psnr_db", "head": "PSNR dB", "fmt": "{:.1f}"}, {"key": "peak_ram_gb", "head": "RAM GB", "fmt": "{:.1f}"},
    {"key": "command", "head": "command", "fmt": "`{}`"},
]


def figures_rows(report: dict[str, Any], command: str, date: str | None = None) -> list[dict[str, Any]]:
    """The report's rows as rows of docs/figures/runs.json: each with its machine, model, size,
    steps and command (skipped rows left out; an infinite PSNR, the reference's, left empty)."""
    cfg, m = report["config"], report["machine"]
    date = date or time.strftime("%Y-%m-%d", time.gmtime())
    machine_name = f"{m['cpu']}, {m['cores']} cores ({m['device']['arch']})"
    model = f"{Path(str(cfg['model'])).name}, {cfg['width']}x{cfg['height']}, {cfg['steps']} steps"

    def finite(value: Any) -> Any:
        return value if isinstance(value, int | float) and math.isfinite(value) else None

    return [{"date": date, "machine": machine_name, "model": model, "row": r["variant"],
             "s_per_image": finite(r.get("s_per_image")), "e2e_speedup": finite(r.get("e2e_speedup")),
             "psnr_db": finite(r.get("psnr_db")), "peak_ram_gb": finite(r.get("peak_ram_gb")), "command": command}
            for r in report["rows"] if not r.get("skipped")]


def append_figures(path: Path, report: dict[str, Any], command: str, date: str | None = None) -> int:
    """Append the run's rows to table ``runs`` of the figures file ``path`` (made if missing);
    ``python scripts/figures.py`` then renders them into the pages. Returns the rows added."""
    data = json.loads(path.read_text()) if path.exists() else {
        "about": "Runs appended by python scripts/bench.py --figures; rendered by scripts/figures.py.", "tables": {}}
    table = data["tables"].setdefault("runs", {"columns": FIGURES_COLUMNS, "rows": []})
    rows = figures_rows(report, command, date)
    table["rows"].extend(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return len(rows)


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


# ---- defaults and the command line ---------------------------------------------------------


def default_model(arch: str = "sd15", recipe: str = "default", tiny: bool = False) -> str:
    """The ``arch`` architecture (a family of ``sd_accel.models.families``: ``sd15``, ``sdxl``)
    with random weights from its shipped configs, built once into ``<cache>/bench/<arch>-random-seed0``
    (fp32 safetensors: the rows load it memory-mapped, as they would a downloaded model). A
    recipe with config overrides (``lcm``: the guidance-embedding UNet and its scheduler) gets its
    own folder, ``<arch>-<recipe>-random-seed0``; ``tiny``: the tiny model of ``arch`` (the
    ``builtin:tiny-*`` configs) with the recipe's overrides, ``tiny-<arch>-<recipe>-seed0``."""
    from filelock import FileLock

    from sd_accel.models.families import get_family
    from sd_accel.paths import cache_dir

    family = get_family(arch)  # says which families exist when arch is none of them
    overrides = RECIPES[recipe].overrides
    name = f"{arch}-{recipe}-random-seed0" if overrides else f"{arch}-random-seed0"
    dest = cache_dir() / "bench" / (f"tiny-{arch}-{recipe}-seed0" if tiny else name)
    with FileLock(str(dest) + ".lock"):
        if not (dest / "model_index.json").exists():
            from sd_accel.models.builtin import tiny_configs
            from sd_accel.models.components import random_pipeline
            from sd_accel.models.families import load_family_configs, merged

            configs = tiny_configs(family.name) if tiny else load_family_configs(family)
            _save_model(random_pipeline(merged(configs, overrides), seed=0), dest)
        else:
            prefix_text_encoder(dest / "text_encoder")  # folders saved before the prefix was added
    return str(dest)


def default_controlnet(model: str, seed: int = 0) -> str:
    """A ControlNet of ``model``'s UNet architecture (``ControlNetModel.from_unet``: the real
    conditioning embedding), its zero convolutions given small random weights so that its residuals
    count, saved once beside the model (``<model>-controlnet-seed<seed>``) for every row to load."""
    from filelock import FileLock

    from sd_accel.paths import cache_dir

    dest = Path(f"{model.rstrip('/')}-controlnet-seed{seed}") if Path(model).is_dir() else \
        cache_dir() / "bench" / f"{Path(model).name.replace(':', '-')}-controlnet-seed{seed}"
    with FileLock(str(dest) + ".lock"):
        if not (dest / "config.json").exists():
            import shutil

            import torch
            from diffusers import ControlNetModel

            from sd_accel import load_pipeline

            unet = load_pipeline(model).unet
            torch.manual_seed(seed)
            net = ControlNetModel.from_unet(unet)
            g = torch.Generator().manual_seed(seed + 1)
            with torch.no_grad():
                for m in (*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out):
                    for p in m.parameters():
                        p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            net.save_pretrained(tmp, safe_serialization=True)
            tmp.rename(dest)
    return str(dest)


def default_tiny_vae() -> str:
    """TAESD's architecture (``AutoencoderTiny``) with seeded random weights: ``builtin:taesd``'s folder."""
    from sd_accel.models.builtin import builtin_tiny_vae_path

    return str(builtin_tiny_vae_path("taesd"))


def _save_model(pipe, dest: Path) -> None:
    """``save_pretrained`` (safetensors) into ``dest`` through a temporary folder, with the text
    encoder in the layout every transformers reads (see ``prefix_text_encoder``)."""
    import shutil

    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # 2 GB shards: safetensors copies a shard into bytes to write it, and SDXL's fp32 UNet (10 GB)
    # in one go would double the 14 GB the random pipeline already holds
    pipe.save_pretrained(tmp, safe_serialization=True, max_shard_size="2GB")
    for te in sorted(tmp.glob("text_encoder*")):  # SDXL, SD3: a second CLIP (with projection); T5 has no prefix
        if '"CLIPTextModel' in ((te / "config.json").read_text() if (te / "config.json").exists() else ""):
            prefix_text_encoder(te)
    tmp.rename(dest)


def prefix_text_encoder(folder: Path) -> bool:
    """Give a saved CLIPTextModel's keys the ``text_model.`` prefix (a CLIP with projection keeps
    its ``text_projection`` at the top, as it is saved); True when it rewrote the file.

    transformers >= 5.6 saves CLIPTextModel without the prefix and reads both layouts; older
    versions (optimum-intel 2.2 pins < 5.6) read only the prefixed one, which hub SD 1.5
    checkpoints have, and without it leave every weight at random init, silently."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if len(files) != 1:  # sharded or absent: leave it as saved
        return False
    with safe_open(str(files[0]), "pt") as f:
        keys = list(f.keys())
        def fixed(k: str) -> str:
            return k if k.startswith((TE_PREFIX, "text_projection.")) else TE_PREFIX + k

        if not keys or all(fixed(k) == k for k in keys):
            return False
        tensors = {fixed(k): f.get_tensor(k) for k in keys}
    tmp = files[0].with_name(files[0].name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(files[0])  # readers that have the old file open keep it
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The harness's options."""
    p.add_argument("--model", default=None, help="a checkpoint, diffusers folder or builtin:NAME "
                   "(default: the SD 1.5 architecture with random weights, built once and cached)")
    p.add_argument("--arch", choices=ARCHS, default="sd15", help="architecture of the default model (random weights "
                   "from its real configs): sd15 (default) or sdxl (1024 px by default); with --tiny, builtin:tiny-<arch>")
    p.add_argument("--recipe", choices=tuple(RECIPES), default="default", help="how the image is made: "
                   + "; ".join(f"{r.name}: {r.about}" for r in RECIPES.values())
                   + " (lcm and turbo default to 512 px; their model is that architecture with random weights)")
    p.add_argument("--tiny-vae", default=None, help="a TAESD folder or taesd_decoder.safetensors that decodes in "
                   "every row (default with --recipe lcm/turbo: TAESD's architecture with random weights)")
    p.add_argument("--guidance-scale", type=float, default=None, help="default: the recipe's (7.5; lcm 8, embedded; turbo 0)")
    p.add_argument("--tiny", action="store_true", help="builtin:tiny-sd15 at 64 px, 3 steps: a smoke run in seconds")
    p.add_argument("--quick", action="store_true", help="1 timed run of 5 steps per row")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 20)")
    p.add_argument("--size", type=int, default=None, help="image side in px (default 256 on CPU, 512 on CUDA; 1024 with --arch sdxl)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per row (default 3)")
    p.add_argument("--rounds", type=int, default=1, help="passes over all rows, in turn (default 1); each row "
                   "reports its median round (the faster middle one for an even count): on a machine whose "
                   "speed drifts (a shared VM), use 3 or more")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--variants", default=None,
                   help=f"comma list; default on CPU: {','.join(CPU_VARIANTS)}; on CUDA: {','.join(CUDA_VARIANTS)}")
    p.add_argument("--engine-dir", default=None, help="where the rows' engines are built (default: <cache>/bench/engines)")
    p.add_argument("--out", default=None, help="folder for the JSON report and traces (default: <cache>/bench/results)")
    p.add_argument("--markdown", default=None, help="also write the Markdown report here")
    p.add_argument("--figures", default=None, help="append the rows to this figures file (docs/figures/runs.json), "
                   "which python scripts/figures.py renders into the docs")
    p.add_argument("--profile", action="store_true", help="write a PyTorch profiler chrome trace per row")
    p.add_argument("--inprocess", action="store_true", help="run every row in this process (default with --tiny; "
                   "never the optimum-intel rows)")
    p.add_argument("--optimum-python", default=None, help="python of the optimum-intel venv for the optimum-intel-* "
                   "rows (default: $SD_ACCEL_OPTIMUM_PYTHON, else <repo>/.venv-optimum/bin/python)")
    p.add_argument("--optimum-samples", type=int, default=None, help="optimum-intel hybrid int8: UNet calls it "
                   "calibrates on (default 200; issue 31 compared at 32)")
    p.add_argument("--text", type=int, default=0, help="SD3 / FLUX.1: T5 tokens of every row and engine "
                   "(max_sequence_length; FLUX.1-schnell 256, dev 512; default: the pipeline's)")
    p.add_argument("--max-size", type=int, default=0, help="engines cover sizes from --size up to this (one engine "
                   "for 512-1024 px, as scripts/bench_full_size.py builds them)")
    p.add_argument("--components", default="", help="comma list: the components engine rows build (default: every "
                   "one the pipeline has; a full-size FLUX.1: transformer)")
    p.add_argument("--no-validate", action="store_true", help="engines are not checked against torch at build "
                   "(FLUX.1's fp32 reference does not fit in 24 GB)")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps of the untimed first generation (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default=PROMPT)


def config_from_args(args: argparse.Namespace) -> tuple[BenchConfig, list[str], bool]:
    import torch

    from sd_accel.paths import cache_dir

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    recipe = RECIPES[getattr(args, "recipe", "default")]
    arch = recipe.arch or getattr(args, "arch", "sd15")
    if recipe.arch and getattr(args, "arch", "sd15") not in ("sd15", recipe.arch):
        raise SystemExit(f"--recipe {recipe.name} is the {recipe.arch} architecture; leave out --arch")
    if args.model:
        model = args.model
    elif args.tiny:
        model = f"builtin:tiny-{arch}" if recipe.name == "default" else default_model(arch, recipe.name, tiny=True)
    else:
        model = default_model(arch) if recipe.name == "default" else default_model(arch, recipe.name)
    size = args.size or (64 if args.tiny else recipe.size or (1024 if arch == "sdxl" else 512 if cuda else 256))
    steps = args.steps or (min(3, recipe.steps or 3) if args.tiny else 5 if args.quick else recipe.steps or 20)
    tiny_vae = getattr(args, "tiny_vae", None) or (default_tiny_vae() if recipe.tiny_vae else "")
    controlnet = default_controlnet(model, seed=args.seed) if recipe.controlnet else ""
    guidance = getattr(args, "guidance_scale", None)
    repeats = args.repeats or (1 if args.tiny or args.quick else 3)
    bench_dir = cache_dir() / "bench"
    engine_dir = args.engine_dir or str(bench_dir / ("engines-tiny" if args.tiny else "engines"))
    cfg = BenchConfig(model=model, device=device, height=size, width=size, steps=steps, repeats=repeats,
                      rounds=max(1, args.rounds), seed=args.seed, prompt=args.prompt, engine_dir=engine_dir, profile=args.profile,
                      out_dir=args.out or str(bench_dir / "results"), optimum_python=args.optimum_python or "",
                      optimum_samples=getattr(args, "optimum_samples", None), recipe=recipe.name,
                      guidance_scale=recipe.guidance_scale if guidance is None else guidance, tiny_vae=tiny_vae,
                      controlnet=controlnet, text_length=getattr(args, "text", 0) or 0,
                      max_size=getattr(args, "max_size", 0) or 0, components=getattr(args, "components", "") or "",
                      validate=not getattr(args, "no_validate", False),
                      warmup_steps=getattr(args, "warmup_steps", 2))
    variants = args.variants.split(",") if args.variants else list(CUDA_VARIANTS if cuda else CPU_VARIANTS)
    if recipe.controlnet:
        variants = variants if args.variants else [v for v in CONTROL_VARIANTS if cuda is False or v == "diffusers"]
        runs = (*CONTROL_VARIANTS, *CONTROL_EXTRA)
        refused = [v for v in variants if v not in runs and v not in ("sd-accel-torch", "tensorrt-fp16")]
        if refused:
            raise SystemExit(f"--recipe controlnet runs {', '.join(runs)} (and sd-accel-torch); not "
                             f"{', '.join(refused)}: optimum-intel has no ControlNet pipeline here, and dynamic "
                             "int8 rows are not part of this recipe")
    unknown = [v for v in variants if v not in ("diffusers", "sd-accel-torch", *ENGINES, *OPTIMUM)]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: diffusers, sd-accel-torch, "
                         f"{', '.join([*ENGINES, *OPTIMUM])}")
    return cfg, variants, args.inprocess or args.tiny


def main(argv: Sequence[str] | None = None, prog: str = "python scripts/bench.py") -> int:
    """Run the benchmark; print the table; write JSON (and Markdown with ``--markdown``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker_main(argv)
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv), command=" ".join([prog, *map(shlex.quote, argv)]))


def run_from_args(args: argparse.Namespace, command: str | None = None) -> int:
    """Run the parsed options: the table printed, the JSON (and Markdown) written."""
    if command is None:
        command = " ".join(["python scripts/bench.py", *map(shlex.quote, sys.argv[1:])])
    cfg, variants, inprocess = config_from_args(args)
    report = run_bench(cfg, variants, inprocess=inprocess, log=lambda m: print(m, file=sys.stderr, flush=True))
    json_path = Path(cfg.out_dir) / "bench.json"
    write_outputs(report, json_path, Path(args.markdown) if args.markdown else None, command)
    if args.figures:
        added = append_figures(Path(args.figures), report, command)
        print(f"figures: {added} rows appended to {args.figures}; python scripts/figures.py renders them", file=sys.stderr)
    print(text_table(report))
    print(f"\nJSON: {json_path}" + (f"\nMarkdown: {args.markdown}" if args.markdown else ""))
    return 0


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=("build", "run"))
    p.add_argument("--variant")
    p.add_argument("--work")
    p.add_argument("--config")
    a = p.parse_args(argv)
    cfg = BenchConfig(**json.loads(a.config))
    work = Path(a.work)
    result = build_row(cfg, a.variant) if a.worker == "build" else run_row(cfg, a.variant, work)
    (work / f"{a.variant}.{a.worker}.json").write_text(json.dumps(result, default=_json_default))
    return 0


def markdown_name(argv: Sequence[str]) -> str:
    """The Markdown report a full run regenerates: ``BENCHMARKS.md``, ``BENCHMARKS-<recipe>.md``
    for another recipe."""
    recipe = next((a.split("=", 1)[1] for a in argv if a.startswith("--recipe=")), None)
    if "--recipe" in argv[:-1]:
        recipe = argv[list(argv).index("--recipe") + 1]
    return "BENCHMARKS.md" if recipe in (None, "default") else f"BENCHMARKS-{recipe}.md"


if __name__ == "__main__":
    argv = sys.argv[1:]
    if not {"--markdown", "--worker", "--tiny", "--quick"} & set(argv):
        argv += ["--markdown", str(SCRIPT.parent / markdown_name(argv))]
    raise SystemExit(main(argv))
