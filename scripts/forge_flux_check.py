#!/usr/bin/env python3
"""FLUX.1 (or SD3.5) txt2img in a real Stable Diffusion WebUI Forge, over its API, from the random-weight
files of ``scripts/random_flux_files.py`` (``scripts/random_sd35_files.py``) (docs/dev/forge-real.md,
"FLUX.1 in a real Forge", "SD3.5 in a real Forge").

    flock /work/bigmem.lock /work/forge/venv/bin/python scripts/forge_flux_check.py --forge /work/forge/webui \
        --python /work/forge/venv/bin/python --models /work/forge/models-flux --out /work/forge/out-flux

``--models`` holds ``Stable-diffusion/``, ``VAE/``, ``text_encoder/`` and ``Lora/`` (hard links to the
files); Forge is pointed at them with its own ``--ckpt-dir``, ``--vae-dir``, ``--text-encoder-dir``
and ``--lora-dir`` and given its own settings file (``--ui-settings-file``), so a Forge sharing the
folder is not affected. ``--nowebui`` starts it without its web UI (as ``forge_host_rss.py`` does);
either way ``GET /sdapi/v1/sd-modules`` lists the VAE / text-encoder files and
``forge_additional_modules`` takes their file names.

``--family`` picks the defaults of every other option: ``flux`` (the default: FLUX.1-dev, cfg 1,
distilled guidance 3.5, a LoRA run, port 7862, ``/work/forge/{models,out,engines}-flux``) or ``sd35``
(SD3.5 Medium layout: ``sd35-medium-random.safetensors`` with CLIP-L, CLIP-G, T5-XXL and the 16-channel
VAE as modules, cfg 4.5 so the unconditional pass runs, no distilled guidance (``--guidance none``:
the key is left out of the payload), T5 on (``sd3_enable_t5: true`` in ``override_settings``: Forge's
default, off, gives the transformer zeros in T5's place), and ``--pythonpath /work/forge/pyshim-sd35``
(sentencepiece 0.2.0 before Forge's venv: SD3's T5 tokenizer is converted from the slow one, and the
venv's sentencepiece 0.2.3 needs a newer protobuf than Forge's pinned 3.20.0), live previews off
(``live_previews_enable: false``: Forge's default "Approx NN" preview downloads ``vaeapprox-sd3.pt``
for SD3, a "legacy" model, where FLUX gets none), no LoRA run (``--strengths ''``), port 7863,
``/work/forge/{models,out,engines}-sd35``). Files are named after the family (``<family>_<mode>_<run>.png``,
``forge_<family>-<mode>.json``, ``forge-<family>-<mode>.log``).

Runs, each ``POST /sdapi/v1/txt2img`` (the payloads are written to ``<out>/payload-<run>.json``): plain,
then with ``<lora:NAME:S>`` in the prompt at each of ``--strengths``. ``--mode``:

- ``torch`` (default): sd-accel's engine folder (``SD_ACCEL_ENGINE_DIR``) is an empty one under
  ``<out>``: every call in Forge's PyTorch;
- ``engines``: a 1-step 64 px txt2img loads the checkpoint with its modules, ``POST /sd-accel/build``
  builds (or finds, in ``--engine-dir``) the transformer engine at static ``--size``, batch 1
  (``--backend`` / ``--precision``, default auto), VmHWM is reset, then the same runs.

``--batch N`` asks each job for N images (``batch_size``; the engine is built for batch 1, so it runs
in chunks); every image is saved (``..._<run>.png``, ``..._<run>_1.png`` ...) and compared.

Recorded to ``<out>/forge_<family>-<mode>.json``: the Forge process's VmHWM (the runs' own in engines
mode), each run's s/it and seconds, the FLUX/LoRA/sd-accel lines of Forge's log, the mean absolute
difference of the images from the plain one, and, where ``<out>`` holds the torch mode's images,
each engine image's PSNR against Forge's own.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyui_host_rss import Sampler, log_since, reset_peak, vm_kib  # noqa: E402
from forge_host_rss import request, sampler_s_per_it  # noqa: E402

FLAGS = ["--always-cpu", "--skip-torch-cuda-test", "--skip-version-check", "--skip-python-version-check",
         "--no-download-sd-model", "--api"]
KEEP = ("flux", "Flux", "SD3", "sd3", "mmdit", "MMDiT", "Skipping", "CFG", "LORA", "LoRA", "K-Model", "StateDict", "Missing", "Unexpected", "Data Type", "dtype",
        "Model selected", "Distilled", "Loading", "Moving", "Model loaded", "Traceback", "Error", "error",
        "sd-accel", "Begin to load", "Unload", "UNet Type", "memory")


FAMILIES = {
    "flux": {"models": "/work/forge/models-flux", "out": "/work/forge/out-flux", "port": 7862,
             "checkpoint": "flux1-dev-random.safetensors",
             "modules": "clip_l-random.safetensors,t5xxl-random-fp8_e4m3fn.safetensors,ae-random.safetensors",
             "lora": "flux-lora-random", "strengths": "1.0", "cfg": 1.0, "guidance": "3.5",
             "engine_dir": "/work/forge/engines-flux", "pythonpath": "", "settings": {}},
    "sd35": {"models": "/work/forge/models-sd35", "out": "/work/forge/out-sd35", "port": 7863,
             "checkpoint": "sd35-medium-random.safetensors",
             "modules": "clip_l-random.safetensors,clip_g-random.safetensors,t5xxl-random-fp8_e4m3fn.safetensors,"
                        "ae-random.safetensors",
             "lora": "sd35-lora-random", "strengths": "", "cfg": 4.5, "guidance": "none",
             "engine_dir": "/work/forge/engines-sd35", "pythonpath": "/work/forge/pyshim-sd35",
             "settings": {"sd3_enable_t5": True, "live_previews_enable": False}},
}


def payload(args, strength: float | None, steps: int | None = None, size: int | None = None) -> dict:
    prompt = args.prompt + (f" <lora:{args.lora}:{strength:g}>" if strength is not None else "")
    size = size or args.size
    body = {"prompt": prompt, "negative_prompt": args.negative, "seed": 0, "steps": steps or args.steps,
            "cfg_scale": args.cfg}
    if args.guidance.lower() != "none":
        body["distilled_cfg_scale"] = float(args.guidance)
    return {**body, "width": size, "height": size, "sampler_name": args.sampler,
            "scheduler": args.scheduler, "batch_size": args.batch, "n_iter": 1, "send_images": True, "save_images": False,
            "do_not_save_grid": True,
            "override_settings": {"sd_model_checkpoint": args.checkpoint,
                                  "forge_additional_modules": args.modules.split(","),
                                  **FAMILIES[args.family]["settings"]},
            "override_settings_restore_afterwards": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--forge", default="/work/forge/webui")
    ap.add_argument("--python", default="/work/forge/venv/bin/python")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="flux",
                    help="defaults of the options below that are not given")
    ap.add_argument("--models")
    ap.add_argument("--out")
    ap.add_argument("--port", type=int)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--checkpoint")
    ap.add_argument("--modules", help="forge_additional_modules, comma-separated file names")
    ap.add_argument("--lora")
    ap.add_argument("--cfg", type=float, help="cfg_scale (FLUX 1: no unconditional pass; SD3.5 4.5)")
    ap.add_argument("--guidance", help="distilled_cfg_scale (FLUX-dev 3.5), or none to leave it out")
    ap.add_argument("--sampler", default="Euler")
    ap.add_argument("--scheduler", default="Simple")
    ap.add_argument("--prompt", default="a photo of a cat")
    ap.add_argument("--negative", default="")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--nowebui", action="store_true", help="start Forge without its web UI (API only)")
    ap.add_argument("--mode", choices=("torch", "engines"), default="torch")
    ap.add_argument("--engine-dir")
    ap.add_argument("--pythonpath", help="prepended to Forge's PYTHONPATH (sd35: a folder with sentencepiece "
                                         "0.2.0, see docs/dev/forge-real.md; '' for none)")
    ap.add_argument("--strengths", help="LoRA strengths, comma-separated ('' for no LoRA run)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--batch", type=int, default=1, help="images per job (batch_size); the engine is built for "
                    "batch 1, so a larger batch runs the engine in chunks")
    args = ap.parse_args()
    for key, value in FAMILIES[args.family].items():
        if key != "settings" and getattr(args, key) is None:
            setattr(args, key, value)
    fam = args.family
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = Path(args.models)
    log = out / f"forge-{fam}-{args.mode}.log"
    engine_dir = args.engine_dir if args.mode == "engines" else str(out / "no-engines")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SD_ACCEL_ENGINE_DIR": engine_dir, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "INSIGHTFACE_WHEEL": "joblib", "HANDREFINER_WHEEL": "joblib", "DEPTH_ANYTHING_WHEEL": "joblib",
           "DEPTH_ANYTHING_V2_WHEEL": "joblib"}
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.pythonpath, env.get("PYTHONPATH", "")) if p)
    cmd = [args.python, "launch.py", *FLAGS, "--server-name", "127.0.0.1", "--port", str(args.port),
           "--ckpt-dir", str(models / "Stable-diffusion"), "--vae-dir", str(models / "VAE"),
           "--text-encoder-dir", str(models / "text_encoder"), "--lora-dir", str(models / "Lora"),
           "--ui-settings-file", str(out / "config.json"), *(["--nowebui"] if args.nowebui else [])]
    result: dict = {"command": cmd, "family": fam, "mode": args.mode, "engine_dir": engine_dir, "runs": []}
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=args.forge, stdout=sink, stderr=subprocess.STDOUT, env=env)
        sampler = Sampler(proc.pid)
        url = f"http://127.0.0.1:{args.port}"
        try:
            start = time.time()
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"Forge exited ({proc.returncode}); see {log}")
                try:
                    with urllib.request.urlopen(url + "/sdapi/v1/options", timeout=5):
                        break
                except OSError:
                    time.sleep(2)
            result["ready_s"] = round(time.time() - start, 1)
            result["ready_peak_gib"] = vm_kib(proc.pid, "VmHWM") / 2**20
            result["sd_modules"] = [m["model_name"] for m in request(url + "/sdapi/v1/sd-modules")]
            if args.mode == "engines":
                request(url + "/sdapi/v1/txt2img", payload(args, None, steps=1, size=64), timeout=args.timeout)
                sink.flush()
                mark = log.stat().st_size
                t0 = time.time()
                size = args.size
                answer = request(url + "/sd-accel/build", {
                    "components": ["unet"], "backend": args.backend, "precision": args.precision,
                    "profile": {"batch": [1, 1, 1], "height": [size] * 3, "width": [size] * 3}}, timeout=args.timeout)
                sink.flush()
                result["build"] = {"s": round(time.time() - t0, 1), "built": answer.get("built"),
                                   "not_built": answer.get("not_built"),
                                   "peak_gib": vm_kib(proc.pid, "VmHWM") / 2**20,
                                   "log": [ln for ln in log_since(log, mark).splitlines() if "sd-accel" in ln][-20:]}
                print(json.dumps(result["build"], indent=1), flush=True)
                result["peak_reset"] = reset_peak(proc.pid)
            images = {}
            runs = [("plain", None)] + [(f"lora{float(s):g}", float(s)) for s in args.strengths.split(",") if s.strip()]
            for name, strength in runs:
                body = payload(args, strength)
                (out / f"payload-{name}.json").write_text(json.dumps(body, indent=1))
                sink.flush()
                mark = log.stat().st_size
                t0 = time.time()
                answer = request(url + "/sdapi/v1/txt2img", body, timeout=args.timeout)
                seconds = time.time() - t0
                sink.flush()
                text = log_since(log, mark)
                pngs = [base64.b64decode(b) for b in answer["images"]]
                for i, png in enumerate(pngs):
                    (out / f"{fam}_{args.mode}_{name}{f'_{i}' if i else ''}.png").write_bytes(png)
                images[name] = pngs
                info = json.loads(answer.get("info") or "{}")
                result["runs"].append({"name": name, "s": round(seconds, 1), "s_per_it": sampler_s_per_it(text),
                                       "peak_gib": vm_kib(proc.pid, "VmHWM") / 2**20,
                                       "rss_gib": vm_kib(proc.pid, "VmRSS") / 2**20,
                                       "infotext": info.get("infotexts", [""])[0],
                                       "log": [ln.strip() for ln in text.replace("\r", "\n").splitlines()
                                               if any(k in ln for k in KEEP) and "it/s]" not in ln][:80]})
                print(json.dumps(result["runs"][-1], indent=1), flush=True)
            import numpy as np
            from PIL import Image  # Forge's Python has Pillow and numpy

            def pixels(pngs: list[bytes]):
                return np.stack([np.asarray(Image.open(io.BytesIO(p)).convert("RGB"), dtype=np.float64) for p in pngs])

            plain = pixels(images["plain"])
            for run in result["runs"]:
                a = pixels(images[run["name"]])
                run["stats"] = {"mean": float(a.mean()), "std": float(a.std())}
                run["mean_abs_diff_from_plain"] = float(np.abs(a - plain).mean())
                run["images"] = len(a)
                theirs = [out / f"{fam}_torch_{run['name']}{f'_{i}' if i else ''}.png" for i in range(len(a))]
                if args.mode == "engines" and all(t.is_file() for t in theirs):
                    mse = float(((a - pixels([t.read_bytes() for t in theirs])) ** 2).mean())
                    run["psnr_vs_torch_db"] = float("inf") if mse == 0 else 10 * float(np.log10(255.0**2 / mse))
        finally:
            result["peak_gib"] = max(sampler.peak, vm_kib(proc.pid, "VmHWM")) / 2**20
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            (out / f"forge_{fam}-{args.mode}.json").write_text(json.dumps(result, indent=1))
            print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
