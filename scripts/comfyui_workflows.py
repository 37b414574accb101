#!/usr/bin/env python3
"""Run sd-accel's ComfyUI workflows against a real ComfyUI through its HTTP API (``/prompt``).

For anyone with a ComfyUI checkout that has the pack installed (``extension/comfyui`` linked
into ``custom_nodes/``, sd-accel installed into ComfyUI's Python): start ComfyUI, then

    python scripts/comfyui_workflows.py --url http://127.0.0.1:8188 --ckpt sd15-random.safetensors \
        --lora random-lora.safetensors --controlnet cn-random-sd15.safetensors --hint hint.png \
        --img2img hint.png --size 512 --steps 4 --log /path/to/comfyui.log

Each workflow runs in PyTorch (ComfyUI's own nodes) and on engines (sd-accel Apply Engines,
sd-accel CLIP Text Encode, sd-accel VAE Decode / Encode), with the same seed; the script prints,
per workflow, both times, ComfyUI's own s/it of the sampler (read from its log with ``--log``;
else the whole run's seconds per step), the mean absolute difference of the two images (0-255)
and their PSNR in dB; sd-accel's console lines are in ComfyUI's log. Workflows: ``txt2img``; ``lora`` at two
strengths (a refit each, never a rebuild); ``long`` (a 150-token prompt); ``img2img`` (VAE
encode on engines); ``controlnet`` (ControlNetApplyAdvanced: the residuals go to the
residual-taking UNet engine). Engines are built first by the sd-accel Build Engines node (reused
from the cache when present). With ``--repeat 2`` each run is made twice and the second (warm:
models loaded, refits kept) is reported. Only the standard library is used (Pillow, if present,
for the image difference), so any Python runs it.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

# 150 CLIP tokens exactly (ComfyUI: two chunks of 75, a (2, 154, 768) context with CFG)
LONG_PROMPT = ", ".join(["a detailed photo of a red fox in a snowy forest at dawn"] * 10) + ", " + " ".join(["fox"] * 10)


def post(url: str, graph: dict) -> str:
    body = json.dumps({"prompt": graph, "client_id": "sd-accel-workflows-" + uuid.uuid4().hex[:6]}).encode()
    req = urllib.request.Request(url + "/prompt", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["prompt_id"]
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"ComfyUI refused the graph ({exc.code}): {exc.read().decode()[:2000]}") from exc


def wait(url: str, prompt_id: str, timeout: float) -> dict:
    start = time.time()
    while time.time() - start < timeout:
        try:
            with urllib.request.urlopen(f"{url}/history/{prompt_id}", timeout=30) as r:
                h = json.loads(r.read())
        except (TimeoutError, urllib.error.URLError):  # ComfyUI answers slowly while it exports
            time.sleep(2)
            continue
        if prompt_id in h and h[prompt_id].get("status", {}).get("completed") is not None:
            entry = h[prompt_id]
            if entry["status"].get("status_str") != "success":
                msgs = [m for m in entry["status"].get("messages", []) if m[0] == "execution_error"]
                raise SystemExit(f"workflow failed: {json.dumps(msgs)[:3000]}")
            return entry
        time.sleep(0.5)
    raise SystemExit(f"workflow {prompt_id} did not finish in {timeout:.0f} s")


def seconds(entry: dict) -> float:
    """From ComfyUI's own status messages: execution_start -> execution_success (ms timestamps)."""
    stamps = {m[0]: m[1].get("timestamp") for m in entry["status"].get("messages", [])}
    if stamps.get("execution_start") and stamps.get("execution_success"):
        return (stamps["execution_success"] - stamps["execution_start"]) / 1000.0
    return float("nan")


def image(url: str, entry: dict, node: str):
    info = entry["outputs"][node]["images"][0]
    query = urllib.parse.urlencode(info)
    with urllib.request.urlopen(f"{url}/view?{query}", timeout=60) as r:
        data = r.read()
    try:
        from PIL import Image

        return Image.open(io.BytesIO(data)).convert("RGB")
    except ImportError:  # no Pillow: no comparison
        return None


def mean_abs_diff(a, b) -> float:
    if a is None or b is None:
        return float("nan")
    pa, pb = a.tobytes(), b.tobytes()  # RGB bytes
    return sum(abs(x - y) for x, y in zip(pa, pb, strict=True)) / len(pa)


def psnr(a, b) -> float:
    """PSNR in dB of ``b`` against ``a`` (8-bit RGB), the measure the benchmarks use."""
    if a is None or b is None:
        return float("nan")
    pa, pb = a.tobytes(), b.tobytes()
    mse = sum((x - y) ** 2 for x, y in zip(pa, pb, strict=True)) / len(pa)
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def graph(args, engines: bool, prompt: str = "a photo of a cat", lora: float | None = None, img2img: str | None = None,
          controlnet: bool = False, prefix: str = "sdaccel") -> dict:
    g = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": args.ckpt}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": prompt, "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": args.size, "height": args.size, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0],
                                                   "latent_image": ["4", 0], "seed": args.seed, "steps": args.steps,
                                                   "cfg": args.cfg, "sampler_name": "euler", "scheduler": "normal",
                                                   "denoise": 1.0}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": prefix}},
    }
    model = ["1", 0]
    if engines:
        g["20"] = {"class_type": "SdAccelApplyEngines", "inputs": {"model": model}}
        model = ["20", 0]
        g["6"] = {"class_type": "SdAccelVAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}}
        if not args.torch_clip:
            for node in ("2", "3"):
                g[node]["class_type"] = "SdAccelCLIPTextEncode"
    if lora is not None:  # after the engines: ComfyUI's LoRA patches the engine's MODEL (a refit)
        g["10"] = {"class_type": "LoraLoader", "inputs": {"model": model, "clip": ["1", 1], "lora_name": args.lora,
                                                          "strength_model": lora, "strength_clip": lora}}
        model = ["10", 0]
        g["2"]["inputs"]["clip"] = g["3"]["inputs"]["clip"] = ["10", 1]
    g["5"]["inputs"]["model"] = model
    if img2img:
        g["12"] = {"class_type": "LoadImage", "inputs": {"image": img2img}}
        g["13"] = {"class_type": "SdAccelVAEEncode" if engines else "VAEEncode",
                   "inputs": {"pixels": ["12", 0], "vae": ["1", 2]}}
        g["5"]["inputs"]["latent_image"] = ["13", 0]
        g["5"]["inputs"]["denoise"] = 0.6
    if controlnet:
        g["14"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": args.controlnet}}
        g["15"] = {"class_type": "LoadImage", "inputs": {"image": args.hint}}
        g["16"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
            "positive": ["2", 0], "negative": ["3", 0], "control_net": ["14", 0], "image": ["15", 0],
            "strength": 1.0, "start_percent": 0.0, "end_percent": 1.0, "vae": ["1", 2]}}
        g["5"]["inputs"]["positive"], g["5"]["inputs"]["negative"] = ["16", 0], ["16", 1]
    return g


def listed_superset(url: str, wanted: str) -> str:
    """The smallest component choice of the running pack's Build node that holds ``wanted``
    (packs of other versions list other combinations)."""
    try:
        with urllib.request.urlopen(f"{url}/object_info/SdAccelBuildEngines", timeout=60) as r:
            info = json.loads(r.read())
        choices = info["SdAccelBuildEngines"]["input"]["required"]["components"][0]
    except (OSError, KeyError, ValueError, IndexError):
        return wanted
    need = set(wanted.split("+"))
    fits = [c for c in choices if need <= set(c.split("+"))]
    return min(fits, key=lambda c: len(c.split("+"))) if fits else wanted


def build_graph(args) -> dict:
    components = "unet"
    if args.controlnet:
        components += "+unet_control"
    if not args.torch_clip:
        components += "+clip"
    components += "+vae_decoder+vae_encoder" if args.img2img else "+vae_decoder"
    components = listed_superset(args.url.rstrip("/"), components)
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": args.ckpt}},
        "2": {"class_type": "SdAccelBuildEngines", "inputs": {
            "model": ["1", 0], "vae": ["1", 2], "clip": ["1", 1], "components": components,
            "preset": "custom (ranges below)", "backend": args.backend, "precision": args.precision, "batch": "1",
            "height": str(args.size), "width": str(args.size), "tokens": "77-154"}},
    }


_TQDM = re.compile(r"(\d+)/(\d+) \[[^\]]*?([0-9.]+)(s/it|it/s)\]")


def log_mark(path: str | None) -> int:
    try:
        with open(path, "rb") as f:
            return f.seek(0, 2)
    except (OSError, TypeError):
        return -1


def sampler_s_per_it(path: str | None, mark: int) -> float:
    """ComfyUI's own s/it of the last finished sampler bar written to its log after ``mark``."""
    if mark < 0:
        return float("nan")
    with open(path, "rb") as f:
        f.seek(mark)
        text = f.read().decode(errors="replace")
    done = [m for m in _TQDM.finditer(text.replace("\r", "\n")) if m.group(1) == m.group(2) and m.group(2) != "0"]
    if not done:
        return float("nan")
    value = float(done[-1].group(3))
    return value if done[-1].group(4) == "s/it" else 1.0 / value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8188")
    ap.add_argument("--ckpt", required=True, help="a checkpoint name in ComfyUI's models/checkpoints")
    ap.add_argument("--lora", help="a LoRA name in models/loras (runs the lora workflow at --strengths)")
    ap.add_argument("--strengths", default="1.0,0.5")
    ap.add_argument("--img2img", help="an image name in ComfyUI's input/ folder (runs img2img)")
    ap.add_argument("--controlnet", help="a ControlNet name in models/controlnet (runs the controlnet workflow)")
    ap.add_argument("--hint", help="the control image's name in ComfyUI's input/ folder")
    ap.add_argument("--cfg", type=float, default=7.0)
    ap.add_argument("--torch-clip", action="store_true", help="keep ComfyUI's CLIP Text Encode in the engine runs")
    ap.add_argument("--log", help="ComfyUI's log file (stdout and stderr): s/it is read from its sampler bars")
    ap.add_argument("--repeat", type=int, default=1, help="runs per workflow and mode; the last is reported")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--only", default="txt2img,lora,long,img2img,controlnet", help="comma-separated workflows")
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args(argv)
    url = args.url.rstrip("/")
    only = set(args.only.split(","))

    entry = wait(url, post(url, build_graph(args)), args.timeout)
    print(f"build: {seconds(entry):.1f} s (engines reused when cached)", flush=True)
    runs = []
    if "txt2img" in only:
        runs.append(("txt2img", {}))
    if "long" in only:
        runs.append(("150-token prompt", {"prompt": LONG_PROMPT}))
    if args.lora and "lora" in only:
        for s in (float(x) for x in args.strengths.split(",")):
            runs.append((f"lora {s:g}", {"lora": s}))
    if args.img2img and "img2img" in only:
        runs.append(("img2img", {"img2img": args.img2img}))
    if args.controlnet and "controlnet" in only:
        if not args.hint:
            raise SystemExit("--controlnet needs --hint (the control image's name in ComfyUI's input/ folder)")
        runs.append(("controlnet", {"controlnet": True}))
    print(f"{'workflow':18s} {'torch s':>8s} {'engines s':>9s} {'torch s/it':>10s} {'eng s/it':>8s} {'diff/255':>8s} {'PSNR dB':>7s}  "
          f"(whole runs: loads and refits included; s/it: {'the sampler bar' if args.log else 'run s / steps'})")
    for name, kw in runs:
        out = {}
        for engines in (False, True):
            tag = name.replace(" ", "_") + ("_engines" if engines else "_torch")
            for _ in range(max(1, args.repeat)):
                mark = log_mark(args.log)
                e = wait(url, post(url, graph(args, engines, prefix=tag, **kw)), args.timeout)
                took = seconds(e)
                per = sampler_s_per_it(args.log, mark) if args.log else took / args.steps
                out[engines] = (took, image(url, e, "7"), per)
        t, en = out[False], out[True]
        print(f"{name:18s} {t[0]:8.1f} {en[0]:9.1f} {t[2]:10.2f} {en[2]:8.2f} {mean_abs_diff(t[1], en[1]):8.2f} "
              f"{psnr(t[1], en[1]):7.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
