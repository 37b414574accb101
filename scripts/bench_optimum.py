#!/usr/bin/env python
"""optimum-intel's OVStableDiffusionPipeline as a row of sd-accel's benchmark (its own venv).

``scripts/bench.py`` runs this script for the rows ``optimum-intel-default``
and ``optimum-intel-hybrid-int8``, with the python of a separate venv: optimum-intel 2.2.0 pins
``transformers<5.6`` and (through ``huggingface-hub<1.22``) diffusers 0.39, which clash with
sd-accel's. Create it at the repository root with

    python -m venv .venv-optimum && .venv-optimum/bin/pip install "torch==2.13.0" \
        "optimum-intel[openvino,nncf,diffusers]==2.2.0" "diffusers==0.39.0" \
        && .venv-optimum/bin/pip uninstall -y torchvision

(torchvision goes: the PyPI wheel pip picks links CUDA torch, fails to import with the CPU torch,
and transformers then cannot import CLIPTextModel; nothing on the SD path needs it). It imports
nothing from sd_accel.

Measures what a CPU user of optimum-intel gets today, the way ``scripts/bench.py`` measures its
rows: same model folder, prompt, seed, PNDM scheduler (the folder's), guidance 7.5, batch 1, a
static reshape to the bench size, a 2-step warm-up, then ``--repeats`` timed generations.

Modes (row names):
- ``default`` -> ``optimum-intel-default``: ``from_pretrained(export=True)`` with nothing else set:
  fp32 IR on disk, compiled with optimum-intel's ``ov_config`` ({"PERFORMANCE_HINT": "LATENCY"}),
  so the CPU plugin's own inference precision applies (bf16 on CPUs with AVX512-BF16/AMX).
- ``hybrid-int8`` -> ``optimum-intel-hybrid-int8``: ``OVWeightQuantizationConfig(bits=8,
  quant_method="hybrid", dataset=[prompts])``: int8 weights of MatMul/Embedding layers everywhere,
  UNet activations (other layers) int8 from calibration. The prompts are a plain list of strings
  (optimum-intel accepts that for diffusion pipelines), so nothing comes from the hub.

Phases, each in its own process so peak RSS is the phase's own:
- build: prepare the source folder (see ``prepare_source``), export + quantize, save the IR
  folder (``--export-dir``); writes ``build.json`` there. Skipped when that file exists for the
  same model folder and mode (``--rebuild`` forces it). The export is shape-independent (dynamic), so one build serves all sizes.
- run: read the IR, reshape to the size, compile, warm up, time; saves ``<variant>.latent.npy``
  (the latents handed to ``vae.decode``, as the harness saves them) and ``<variant>.image.npy``
  (uint8 HWC) in ``--out-dir``.

Prints one JSON line in the harness's row schema (``RowResult`` fields plus a few extras). With
``--ref-dir`` holding the harness's ``diffusers.latent.npy``/``diffusers.image.npy``, it fills in
``latent_rel_l2`` and ``psnr_db`` the harness's way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub: everything is local
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np

PROMPT = "a photograph of an astronaut riding a horse on mars, highly detailed"  # scripts/bench.py's PROMPT
# sd_accel.calibration.CALIBRATION_PROMPTS (optimum-intel stops at num_samples UNet calls: with its
# default 200 samples and 50 steps per prompt that is the first 4, the same 4 sd-accel calibrates on)
CALIBRATION_PROMPTS = (
    "a photograph of an astronaut riding a horse on mars, highly detailed",
    "a watercolor painting of a quiet harbour at sunset",
    "portrait of an old fisherman, dramatic lighting, 85mm",
    "a bowl of ramen on a wooden table, studio photo",
    "an isometric pixel-art castle in a snowy forest",
    "a futuristic city skyline at night, neon, rain",
    "a close-up of a red fox in autumn leaves",
    "abstract geometric shapes, bauhaus poster",
)
VARIANTS = {"default": "optimum-intel-default", "hybrid-int8": "optimum-intel-hybrid-int8",
            "int8": "optimum-intel-int8", "int4": "optimum-intel-int4"}
# model_index.json's pipeline -> optimum-intel's class for it (anything else: OVStableDiffusionPipeline)
OV_PIPELINES = {"LatentConsistencyModelPipeline": "OVLatentConsistencyModelPipeline",
                "StableDiffusion3Pipeline": "OVStableDiffusion3Pipeline", "FluxPipeline": "OVFluxPipeline"}
# int8 / int4: optimum-intel's weight-only compression of every part (what its default export does to
# a model above 1e9 parameters, ``--weight-format int8``; int4 with its defaults: group 128, ratio 1)
WEIGHT_BITS = {"int8": 8, "int4": 4}
# the exported text encoder's relative error against torch that still means "its weights are in"
TE_TOLERANCE = {"int4": 0.6}
TE_PREFIX = "text_model."


# ---- small helpers --------------------------------------------------------------------------


def _peak_ram_gb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process, so a later read gives the peak of
    what follows only (ru_maxrss cannot be reset)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _hwm_gb() -> float | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 2**20, 2)
    return None


def _du_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("optimum-intel", "optimum", "openvino", "nncf", "diffusers", "transformers", "torch"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


# ---- the text encoder's checkpoint layout ---------------------------------------------------


def _clip_class(te_dir: Path):
    """The transformers CLIP class a text-encoder folder's config names (None: not a CLIP)."""
    import transformers

    names = json.loads((te_dir / "config.json").read_text()).get("architectures") or ["CLIPTextModel"]
    return getattr(transformers, names[0]) if names[0].startswith("CLIPTextModel") else None


def _expected_te_keys(te_dir: Path) -> set[str]:
    import torch
    from transformers import CLIPTextConfig

    with torch.device("meta"):
        model = _clip_class(te_dir)(CLIPTextConfig.from_pretrained(te_dir))
    return set(model.state_dict().keys())


def _te_folders(model_dir: Path) -> list[Path]:
    """The CLIP text-encoder folders of a pipeline (SD: one; SDXL, SD3: two; FLUX.1: one)."""
    return [d for d in sorted(model_dir.glob("text_encoder*")) if (d / "config.json").exists() and _clip_class(d)]


def _te_fix(te_dir: Path) -> tuple[dict[str, Any], Any]:
    """What a CLIP folder's keys need: ``({}, None)`` when they are what this transformers expects,
    else the note and the key renaming."""
    from safetensors import safe_open

    files = sorted(te_dir.glob("*.safetensors"))
    if len(files) != 1:
        return {"te_layout": f"not checked ({len(files)} safetensors files)"}, None
    with safe_open(str(files[0]), "pt") as f:
        keys = set(f.keys())
    expected = _expected_te_keys(te_dir)
    missing = expected - keys
    if not missing:
        return {}, None
    strip = {k.removeprefix(TE_PREFIX) for k in expected} - {k.removeprefix(TE_PREFIX) for k in keys}
    if strip - {"embeddings.position_ids"}:
        raise SystemExit(f"text encoder in {te_dir} does not match {_clip_class(te_dir).__name__} even with the "
                         f"prefix fixed; {len(missing)} keys missing, e.g. {sorted(missing)[:3]}")
    add = any(k.startswith(TE_PREFIX) for k in expected)

    def rename(k: str) -> str:
        if add:
            return k if k.startswith(TE_PREFIX) or k.startswith("text_projection") else TE_PREFIX + k
        return k.removeprefix(TE_PREFIX)

    return {"te_layout": ("added" if add else "removed") + f" the {TE_PREFIX!r} prefix",
            "te_missing_keys_before": len(missing)}, rename


def prepare_source(model_dir: Path, dest: Path) -> dict[str, Any]:
    """The folder optimum-intel exports from: ``model_dir`` itself, or (when a CLIP text encoder's
    keys do not match what this transformers' class expects) a shadow folder whose entries link to
    ``model_dir`` except those text encoders, re-saved with the keys this version expects.

    Why: transformers >= 5.6 saves CLIPTextModel without the ``text_model.`` prefix; the
    transformers that optimum-intel allows (< 5.6) wants the prefix and, without it, silently
    leaves the whole text encoder at its random init (every weight "MISSING")."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    fixes = {d.name: _te_fix(d) for d in _te_folders(model_dir)}
    notes = {name: note or {"te_layout": "as saved", "te_missing_keys": 0} for name, (note, _) in fixes.items()}
    if not any(rename for _, rename in fixes.values()):
        return {"source": str(model_dir), **(notes.get("text_encoder") or {}), "te_folders": notes}
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for entry in model_dir.iterdir():
        if not (entry.name in fixes and fixes[entry.name][1]):
            (dest / entry.name).symlink_to(entry.resolve())
    for name, (_note, rename) in fixes.items():
        if rename is None:
            continue
        (dest / name).mkdir()
        for entry in (model_dir / name).iterdir():
            if entry.suffix != ".safetensors":
                shutil.copy2(entry, dest / name / entry.name)
        file = sorted((model_dir / name).glob("*.safetensors"))[0]
        with safe_open(str(file), "pt") as f:
            tensors = {rename(k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        save_file(tensors, str(dest / name / file.name), metadata={"format": "pt"})
        left = _expected_te_keys(dest / name) - set(tensors) - {"text_model.embeddings.position_ids",
                                                                 "embeddings.position_ids"}
        if left:
            raise SystemExit(f"re-saved {name} still misses {sorted(left)[:3]}")
    return {"source": str(dest), **(notes.get("text_encoder") or {}), "te_folders": notes}


def te_check(source: Path, ov_pipe, prompt: str, out_dir: Path) -> dict[str, Any]:
    """The exported text encoder against torch's CLIP class from the same folder (both must give
    the same hidden states: an export of random-init weights would differ by ~140%). The OV
    model's outputs are compared by shape (a CLIP with projection gives ``text_embeds`` first)."""
    import torch
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(source / "tokenizer")
    ids = tok([prompt], padding="max_length", max_length=tok.model_max_length, truncation=True,
              return_tensors="pt").input_ids
    te, info = _clip_class(source / "text_encoder").from_pretrained(source / "text_encoder", output_loading_info=True)
    with torch.no_grad():
        ref = te.eval()(ids).last_hidden_state.numpy()
    outs = ov_pipe.text_encoder(ids)
    outs = list(outs.values()) if hasattr(outs, "values") else list(outs)
    got = [np.asarray(o) for o in outs if np.asarray(o).shape == ref.shape]
    if not got:
        raise SystemExit(f"the exported text encoder gives no output shaped {ref.shape}")
    errors = [_rel_l2(g, ref) for g in got]
    best = got[int(np.argmin(errors))]
    np.save(out_dir / "te_hidden_torch.npy", ref)
    np.save(out_dir / "te_hidden_ov.npy", best)
    return {"te_missing_keys": len(info["missing_keys"]), "te_unexpected_keys": len(info["unexpected_keys"]),
            "te_ov_vs_torch_rel_l2": min(errors)}


# ---- build ----------------------------------------------------------------------------------


def pipeline_class(model_dir: Path):
    """optimum-intel's pipeline class for the folder's diffusers pipeline."""
    import optimum.intel

    return getattr(optimum.intel, OV_PIPELINES.get(_diffusers_class(model_dir), "OVStableDiffusionPipeline"))


def _diffusers_class(folder: Path) -> str:
    """The diffusers pipeline a model folder or an optimum-intel export (which names its OV class) holds."""
    name = json.loads((Path(folder) / "model_index.json").read_text()).get("_class_name", "")
    return name[2:] if name.startswith("OV") else name


def _is_lcm(folder: Path) -> bool:
    return _diffusers_class(folder) in OV_PIPELINES


def put_tiny_decoder(tiny_vae: Path, folder: Path) -> dict[str, Any]:
    """Replace the exported ``vae_decoder`` IR in ``folder`` with TAESD's decoder, as FastSD CPU
    runs it (it swaps a TAESD OpenVINO IR in for the pipeline's ``vae_decoder``): converted by
    ``openvino.convert_model`` from diffusers' ``AutoencoderTiny``, dynamic batch and size, input
    ``latent_sample``, output ``sample`` in [-1, 1] like the VAE's. Its config is the exported one
    with ``scaling_factor`` 1.0: TAESD takes the UNet's latents as they are."""
    import openvino as ov
    import torch
    from diffusers import AutoencoderTiny

    tae = AutoencoderTiny.from_pretrained(str(tiny_vae)).eval()

    class Decoder(torch.nn.Module):
        def __init__(self, tae):
            super().__init__()
            self.tae = tae

        def forward(self, latent_sample):
            return self.tae.decode(latent_sample, return_dict=False)[0]

    with torch.no_grad():
        model = ov.convert_model(Decoder(tae), example_input=torch.zeros(1, 4, 64, 64))
    model.inputs[0].get_tensor().set_names({"latent_sample"})
    model.outputs[0].get_tensor().set_names({"sample"})
    model.reshape({model.inputs[0]: ov.PartialShape([-1, 4, -1, -1])})
    dec = folder / "vae_decoder"
    config = json.loads((dec / "config.json").read_text())
    for f in dec.iterdir():
        f.unlink()
    ov.save_model(model, str(dec / "openvino_model.xml"), compress_to_fp16=False)  # the export's fp32 IR
    (dec / "config.json").write_text(json.dumps({**config, "scaling_factor": 1.0, "shift_factor": None,
                                                 "tiny_vae_source": str(tiny_vae)}, indent=2))
    return {"tiny_vae": str(tiny_vae), "tiny_decoder_params": sum(p.numel() for p in tae.decoder.parameters())}


def build(args: argparse.Namespace) -> dict[str, Any]:
    from optimum.intel import OVWeightQuantizationConfig

    export_dir = Path(args.export_dir)
    model_dir = str(Path(args.model_dir).resolve())
    tiny = str(Path(args.tiny_vae).resolve()) if args.tiny_vae else None
    if not args.rebuild and (export_dir / "build.json").exists():
        done = json.loads((export_dir / "build.json").read_text())
        if done.get("model_dir") == model_dir and done.get("mode") == args.mode and done.get("tiny_vae") == tiny:
            return {**done, **_disk(export_dir), "build_cached": True}
    start = time.perf_counter()
    prep = prepare_source(Path(model_dir), export_dir.with_name(export_dir.name + ".src"))
    prep_s = time.perf_counter() - start
    qc = None
    if args.mode in WEIGHT_BITS:
        qc = OVWeightQuantizationConfig(bits=WEIGHT_BITS[args.mode])
    if args.mode == "hybrid-int8":
        prompts = list(CALIBRATION_PROMPTS)
        qc = OVWeightQuantizationConfig(bits=8, quant_method="hybrid", dataset=prompts,
                                        num_samples=args.num_samples)
    t0 = time.perf_counter()
    pipe = pipeline_class(Path(model_dir)).from_pretrained(prep["source"], export=True, compile=False,
                                                           quantization_config=qc, local_files_only=True)
    export_s = time.perf_counter() - t0
    tmp = export_dir.with_name(export_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    tiny_info = put_tiny_decoder(Path(tiny), tmp) if tiny else {"tiny_vae": None}
    build_s = time.perf_counter() - t0
    check = te_check(Path(prep["source"]), pipe, args.prompt, tmp)  # compiles the TE only (dynamic)
    # the trap prepare_source avoids: a text encoder left at random init would differ by ~140%;
    # int4 weights alone move a random-weight CLIP by ~30% (SD3.5's CLIP-L: 0.30)
    if check["te_missing_keys"] or check["te_ov_vs_torch_rel_l2"] > TE_TOLERANCE.get(args.mode, 0.2):
        raise SystemExit(f"exported text encoder does not carry the model's weights: {check}")
    shutil.rmtree(export_dir, ignore_errors=True)
    tmp.rename(export_dir)
    out = {"mode": args.mode, "model_dir": model_dir, "build_s": build_s, "export_quantize_s": export_s, "prepare_s": prep_s,
           "build_peak_ram_gb": _peak_ram_gb(), "calibration": (
               {"prompts": len(CALIBRATION_PROMPTS), "num_samples": args.num_samples or 200,
                "note": "optimum-intel calibrates at min(unet.sample_size*8, 512) px, 50 steps"}
               if args.mode == "hybrid-int8" else None),
           **prep, **check, **tiny_info, "engine_rel_l2": {"clip.te_ov_vs_torch": check["te_ov_vs_torch_rel_l2"]},
           "versions": versions()}
    (export_dir / "build.json").write_text(json.dumps(out, indent=2))
    return {**out, **_disk(export_dir), "build_cached": False}


def _disk(export_dir: Path) -> dict[str, Any]:
    """What the row keeps on disk: the exported IR folder, in total and by part."""
    return {"disk_gb": round(_du_bytes(export_dir) / 2**30, 3),
            "disk_gb_by_part": {p.name: round(_du_bytes(p) / 2**30, 3)
                                for p in sorted(export_dir.iterdir()) if p.is_dir()}}


# ---- run ------------------------------------------------------------------------------------


class Timer:
    """Wall time per call of the text encoders (SD3: three, FLUX.1: two; "clip" sums them), the
    denoiser (UNet or transformer: "unet", as the harness's rows name it) and the VAE decoder
    (instance-level wrappers of the OV pipeline parts' ``forward``/``decode``); keeps the latents
    handed to ``vae.decode``."""

    def __init__(self, pipe) -> None:
        self.times: dict[str, list[float]] = {"clip": [], "unet": [], "vae": []}
        self.last_latent = None
        encoders = [getattr(pipe, n, None) for n in ("text_encoder", "text_encoder_2", "text_encoder_3")]
        parts = [("clip", te, "forward") for te in encoders if te is not None]
        parts += [("unet", denoiser(pipe), "forward"), ("vae", pipe.vae, "decode")]
        for name, part, attr in parts:
            setattr(part, attr, self._wrap(name, getattr(part, attr)))

    def _wrap(self, name: str, fn):
        def timed(*a, **kw):
            if name == "vae":
                z = a[0] if a else kw.get("latent_sample", kw.get("z"))
                self.last_latent = np.asarray(z.detach().float().cpu().numpy()).copy()
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.times[name].append(time.perf_counter() - start)

        return timed

    def reset(self) -> None:
        for v in self.times.values():
            v.clear()


def denoiser(pipe):
    """The OV pipeline's UNet, or its transformer (SD3, FLUX.1)."""
    return pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    variant = VARIANTS[args.mode]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # optimum-intel's own ov_config unless --inference-precision says otherwise (a check, not a row)
    ov_config = {"INFERENCE_PRECISION_HINT": args.inference_precision} if args.inference_precision else None
    lcm = _is_lcm(Path(args.export_dir))
    pipe = pipeline_class(Path(args.export_dir)).from_pretrained(args.export_dir, compile=False, local_files_only=True,
                                                                 ov_config=ov_config)
    pipe.reshape(batch_size=1, height=args.height, width=args.width, num_images_per_prompt=1)
    if args.guidance_scale <= 1 and not lcm and getattr(pipe, "unet", None) is not None:
        unet_rows(pipe, 1)
    pipe.compile()
    load_s = time.perf_counter() - start
    load_peak = _peak_ram_gb()
    pipe.set_progress_bar_config(disable=True)
    scheduler = type(pipe.scheduler).__name__
    precision = {name: getattr(pipe, name).request.get_property("INFERENCE_PRECISION_HINT").get_type_name()
                 for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "unet", "transformer", "vae_decoder")
                 if getattr(pipe, name, None) is not None and getattr(getattr(pipe, name), "request", None) is not None}
    hwm_reset = _reset_hwm()
    timer = Timer(pipe)

    def generate(steps: int):
        g = torch.Generator("cpu").manual_seed(args.seed)
        extra = {"max_sequence_length": args.text} if args.text and getattr(pipe, "transformer", None) is not None else {}
        return pipe(args.prompt, height=args.height, width=args.width, num_inference_steps=steps,
                    guidance_scale=args.guidance_scale, generator=g, output_type="np", **extra).images[0]

    generate(2)  # warm-up, as the harness does
    totals, unet_calls, clips, vaes = [], [], [], []
    image = None
    for _ in range(args.repeats):
        timer.reset()
        t = time.perf_counter()
        image = generate(args.steps)
        totals.append(time.perf_counter() - t)
        unet_calls += timer.times["unet"]
        clips.append(sum(timer.times["clip"]))
        vaes.append(sum(timer.times["vae"]))
    n_unet = len(timer.times["unet"])
    loop = [t - c - v for t, c, v in zip(totals, clips, vaes, strict=True)]
    per_call = _med(unet_calls)
    fixed = _med(clips) + _med(vaes) + (_med(loop) - per_call * n_unet)
    np.save(out_dir / f"{variant}.latent.npy", timer.last_latent)
    np.save(out_dir / f"{variant}.image.npy", (np.clip(image, 0, 1) * 255).round().astype(np.uint8))
    return {
        "clip_ms": _med(clips) * 1e3, "unet_ms": per_call * 1e3,
        "unet_ms_spread": (min(unet_calls) * 1e3, max(unet_calls) * 1e3),
        "vae_ms": _med(vaes) * 1e3, "it_s": args.steps / _med(loop), "s_per_image": _med(totals),
        "s_per_image_spread": (min(totals), max(totals)),
        "s_per_image_20": fixed + per_call * n_unet * 20 / args.steps,
        "peak_ram_gb": _peak_ram_gb(), "load_peak_ram_gb": load_peak,
        "gen_peak_ram_gb": _hwm_gb() if hwm_reset else None, "load_s": load_s,
        "unet_calls_per_image": n_unet, "unet_rows": _unet_rows_now(pipe), "scheduler": scheduler, "inference_precision": precision,
        "load_average": os.getloadavg(),  # other processes' load skews the times: say how busy it was
    }


def unet_rows(pipe, rows: int) -> None:
    """Make the reshaped UNet static at ``rows`` rows. optimum-intel's ``reshape`` gives a UNet
    without ``timestep_cond`` two rows per image (it assumes CFG); at CFG <= 1 (SD-Turbo) diffusers
    calls it with one, which a static two-row model refuses. FastSD CPU reshapes to a dynamic batch
    instead; a static one row is the faster of the two on OpenVINO's CPU plugin."""
    model = pipe.unet.model
    shapes = {}
    for inp in model.inputs:
        shape = inp.get_partial_shape()
        if inp.get_any_name() != "timestep" and shape.rank.get_length() > 1:
            shape[0] = rows
        shapes[inp] = shape
    model.reshape(shapes)


def _unet_rows_now(pipe) -> str:
    model = denoiser(pipe).model
    return str(next((i.get_partial_shape() for i in model.inputs if i.get_any_name() in ("sample", "hidden_states")),
                    model.inputs[0].get_partial_shape()))


# ---- the parent: both phases in subprocesses, one JSON row ------------------------------------


def _phase(args: argparse.Namespace, phase: str) -> dict[str, Any]:
    result = Path(args.out_dir) / f"{VARIANTS[args.mode]}.{phase}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), *args.argv, "--phase", phase, "--result", str(result)]
    proc = subprocess.run(cmd, check=False, stdout=sys.stderr)
    if proc.returncode != 0 or not result.exists():
        raise SystemExit(f"{phase} phase failed (exit {proc.returncode}); its output is above")
    return json.loads(result.read_text())


def row(args: argparse.Namespace) -> dict[str, Any]:
    variant = VARIANTS[args.mode]
    export_dir = Path(args.export_dir)
    print(f"[optimum] {variant}: building into {export_dir} (unless built)", file=sys.stderr, flush=True)
    built = _phase(args, "build")
    cached = built["build_cached"]
    print(f"[optimum] {variant}: running at {args.width}x{args.height}, {args.steps} steps", file=sys.stderr, flush=True)
    ran = _phase(args, "run")
    out: dict[str, Any] = {
        # scripts/bench.py's RowResult fields
        "variant": variant, "skipped": "",
        **{k: ran.get(k) for k in ("clip_ms", "unet_ms", "unet_ms_spread", "vae_ms", "it_s", "s_per_image",
                                   "s_per_image_spread", "s_per_image_20", "peak_ram_gb", "load_s")},
        "peak_vram_gb": None, "build_s": built["build_s"], "build_peak_ram_gb": built["build_peak_ram_gb"],
        "latent_rel_l2": None, "psnr_db": None, "unet_speedup": None, "e2e_speedup": None,
        "engine_rel_l2": {"clip.te_ov_vs_torch": built["te_ov_vs_torch_rel_l2"]},
        "notes": f"inference precision forced to {args.inference_precision}" if args.inference_precision else "",
        # extras
        "mode": args.mode, "guidance_scale": args.guidance_scale, "tiny_vae": built.get("tiny_vae"),
        "unet_rows": ran.get("unet_rows"), "height": args.height, "width": args.width, "steps": args.steps, "repeats": args.repeats, "seed": args.seed,
        "build_cached": cached, "disk_gb": built["disk_gb"], "disk_gb_by_part": built["disk_gb_by_part"],
        "gen_peak_ram_gb": ran.get("gen_peak_ram_gb"), "load_peak_ram_gb": ran.get("load_peak_ram_gb"),
        "inference_precision": ran.get("inference_precision"), "scheduler": ran.get("scheduler"),
        "unet_calls_per_image": ran.get("unet_calls_per_image"),
        "te_check": {k: built.get(k) for k in ("te_layout", "te_missing_keys_before", "te_missing_keys",
                                                "te_unexpected_keys", "te_ov_vs_torch_rel_l2")},
        "calibration": built.get("calibration"), "versions": versions(),
        "cpu": _cpu_name(), "cores": os.cpu_count(), "load_average": ran.get("load_average"),
    }
    ref = Path(args.ref_dir) if args.ref_dir else None
    if ref is not None and (ref / "diffusers.latent.npy").exists():
        out_dir = Path(args.out_dir)
        lat = np.load(out_dir / f"{variant}.latent.npy")
        img = np.load(out_dir / f"{variant}.image.npy")
        out["latent_rel_l2"] = _rel_l2(lat, np.load(ref / "diffusers.latent.npy"))
        out["psnr_db"] = _psnr(img, np.load(ref / "diffusers.image.npy"))
        ref_run = ref / "diffusers.run.json"
        if ref_run.exists():
            r = json.loads(ref_run.read_text())
            if out["unet_ms"] and out["s_per_image"]:
                out["unet_speedup"] = r["unet_ms"] / out["unet_ms"]
                out["e2e_speedup"] = r["s_per_image"] / out["s_per_image"]
    return out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="diffusers folder (scripts/bench.py's default model)")
    p.add_argument("--size", type=int, default=256, help="image side in px (--height/--width override it)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mode", choices=tuple(VARIANTS), default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--out-dir", required=True, help="latents, images and the phases' JSON go here")
    p.add_argument("--export-dir", default=None, help="the exported IR folder (default: <out-dir>/export-<mode>)")
    p.add_argument("--ref-dir", default=None, help="folder with the harness's diffusers.latent.npy / .image.npy "
                   "(and diffusers.run.json): fills in latent_rel_l2, psnr_db and the speed-ups")
    p.add_argument("--guidance-scale", type=float, default=7.5, help="7.5 (the harness's default recipe); "
                   "an LCM pipeline embeds it (no CFG rows); <= 1 runs one UNet row per image")
    p.add_argument("--tiny-vae", default=None, help="a diffusers AutoencoderTiny folder (TAESD): its decoder, "
                   "converted to OpenVINO IR, replaces the export's vae_decoder (what FastSD CPU does)")
    p.add_argument("--num-samples", type=int, default=None, help="hybrid-int8: UNet calls to calibrate on "
                   "(default: optimum-intel's, 200)")
    p.add_argument("--inference-precision", default=None, choices=("f32", "bf16"),
                   help="override the CPU plugin's inference precision (a check: f32 should match diffusers fp32)")
    p.add_argument("--text", type=int, default=None, help="T5 tokens (max_sequence_length) of SD3 / FLUX.1 "
                   "pipelines, as the harness's rows use")
    p.add_argument("--rebuild", action="store_true", help="export again even when --export-dir has a build")
    p.add_argument("--phase", choices=("all", "build", "run"), default="all")
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.height, args.width = args.height or args.size, args.width or args.size
    args.export_dir = args.export_dir or str(Path(args.out_dir) / f"export-{args.mode}")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    args.argv = [a for a in argv]
    if args.phase == "all":
        out = row(args)
        (Path(args.out_dir) / f"{out['variant']}.row.json").write_text(json.dumps(out, indent=2, default=_json_default))
        print(json.dumps(out, default=_json_default))
        return 0
    out = build(args) if args.phase == "build" else run(args)
    Path(args.result).write_text(json.dumps(out, default=_json_default))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
