#!/usr/bin/env python3
"""FLUX.1 txt2img in a real Stable Diffusion WebUI Forge, over its API, from the random-weight files
of ``scripts/random_flux_files.py`` (docs/dev/forge-real.md, "FLUX.1 in a real Forge").

    flock /work/bigmem.lock /work/forge/venv/bin/python scripts/forge_flux_check.py --forge /work/forge/webui \
        --python /work/forge/venv/bin/python --models /work/forge/models-flux --out /work/forge/out-flux

``--models`` holds ``Stable-diffusion/``, ``VAE/``, ``text_encoder/`` and ``Lora/`` (hard links to the
files); Forge is pointed at them with its own ``--ckpt-dir``, ``--vae-dir``, ``--text-encoder-dir``
and ``--lora-dir`` and given its own settings file (``--ui-settings-file``), so a Forge sharing the
folder is not affected. ``--nowebui`` starts it without its web UI (as ``forge_host_rss.py`` does);
either way ``GET /sdapi/v1/sd-modules`` lists the VAE / text-encoder files and
``forge_additional_modules`` takes their file names.

Two runs, each ``POST /sdapi/v1/txt2img`` (the payloads are written to ``<out>/payload-<run>.json``): plain,
then with ``<lora:NAME:1>`` in the prompt. Recorded to ``<out>/forge_flux.json``: the Forge
process's VmHWM, each run's s/it and seconds, the FLUX/LoRA lines of Forge's log, the mean absolute
difference of the two images.
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
from comfyui_host_rss import Sampler, log_since, vm_kib  # noqa: E402
from forge_host_rss import request, sampler_s_per_it  # noqa: E402

FLAGS = ["--always-cpu", "--skip-torch-cuda-test", "--skip-version-check", "--skip-python-version-check",
         "--no-download-sd-model", "--api"]
KEEP = ("flux", "Flux", "LORA", "LoRA", "K-Model", "StateDict", "Missing", "Unexpected", "Data Type", "dtype",
        "Model selected", "Distilled", "Loading", "Moving", "Model loaded", "Traceback", "Error", "error",
        "sd-accel", "Begin to load", "Unload", "UNet Type", "memory")


def payload(args, lora: bool) -> dict:
    prompt = "a photo of a cat" + (f" <lora:{args.lora}:1.0>" if lora else "")
    return {"prompt": prompt, "negative_prompt": "", "seed": 0, "steps": args.steps, "cfg_scale": 1.0,
            "distilled_cfg_scale": 3.5, "width": args.size, "height": args.size, "sampler_name": "Euler",
            "scheduler": "Simple", "batch_size": 1, "n_iter": 1, "send_images": True, "save_images": False,
            "override_settings": {"sd_model_checkpoint": args.checkpoint,
                                  "forge_additional_modules": args.modules.split(",")},
            "override_settings_restore_afterwards": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--forge", default="/work/forge/webui")
    ap.add_argument("--python", default="/work/forge/venv/bin/python")
    ap.add_argument("--models", default="/work/forge/models-flux")
    ap.add_argument("--out", default="/work/forge/out-flux")
    ap.add_argument("--port", type=int, default=7862)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--checkpoint", default="flux1-dev-random.safetensors")
    ap.add_argument("--modules", default="clip_l-random.safetensors,t5xxl-random-fp8_e4m3fn.safetensors,"
                                         "ae-random.safetensors")
    ap.add_argument("--lora", default="flux-lora-random")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--nowebui", action="store_true", help="start Forge without its web UI (API only)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = Path(args.models)
    log = out / "forge-flux.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "INSIGHTFACE_WHEEL": "joblib", "HANDREFINER_WHEEL": "joblib", "DEPTH_ANYTHING_WHEEL": "joblib",
           "DEPTH_ANYTHING_V2_WHEEL": "joblib"}
    cmd = [args.python, "launch.py", *FLAGS, "--server-name", "127.0.0.1", "--port", str(args.port),
           "--ckpt-dir", str(models / "Stable-diffusion"), "--vae-dir", str(models / "VAE"),
           "--text-encoder-dir", str(models / "text_encoder"), "--lora-dir", str(models / "Lora"),
           "--ui-settings-file", str(out / "config.json"), *(["--nowebui"] if args.nowebui else [])]
    result: dict = {"command": cmd, "runs": []}
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
            images = {}
            for name, lora in (("plain", False), ("lora", True)):
                body = payload(args, lora)
                (out / f"payload-{name}.json").write_text(json.dumps(body, indent=1))
                sink.flush()
                mark = log.stat().st_size
                t0 = time.time()
                answer = request(url + "/sdapi/v1/txt2img", body, timeout=args.timeout)
                seconds = time.time() - t0
                sink.flush()
                text = log_since(log, mark)
                png = base64.b64decode(answer["images"][0])
                (out / f"flux_{name}.png").write_bytes(png)
                images[name] = png
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
            a, b = (np.asarray(Image.open(io.BytesIO(images[k])).convert("RGB"), dtype=np.float64)
                    for k in ("plain", "lora"))
            result["mean_abs_diff_plain_lora"] = float(np.abs(a - b).mean())
            result["plain_stats"] = {"mean": float(a.mean()), "std": float(a.std())}
            result["lora_stats"] = {"mean": float(b.mean()), "std": float(b.std())}
        finally:
            result["peak_gib"] = max(sampler.peak, vm_kib(proc.pid, "VmHWM")) / 2**20
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            (out / "forge_flux.json").write_text(json.dumps(result, indent=1))
            print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
