#!/usr/bin/env python3
"""Peak RSS, s/it and images of a real Stable Diffusion WebUI Forge: txt2img in Forge's own
PyTorch and on sd-accel's engines (issue 46, "measured in a real Forge").

Given a Forge folder (sd-accel's ``extension/`` linked into its ``extensions/``) and its Python
(run the script with that Python too: the PSNR needs Pillow, which Forge has):

    flock /work/bigmem.lock /work/forge/venv/bin/python scripts/forge_host_rss.py --forge /work/forge/webui \
        --python /work/forge/venv/bin/python --lora random-lora --controlnet cn-random-sd15 \
        --hint /work/forge/hint.png --engine-dir /work/forge/engines --out /work/forge/out

Each mode runs in a fresh Forge process (``launch.py`` with ``--always-cpu --nowebui``, started
here and stopped by its own pid at the end):

- ``torch``: the extension is loaded but its engine folder (``<out>/no-engines``) is empty, so
  every call runs in Forge's PyTorch;
- ``engines``: ``POST /sd-accel/build`` first builds (or finds) the UNet at each of ``--presets``
  (static-512 and dynamic-512-768: two profiles) with the VAE decoder and the CLIP text encoder at
  the first, and the residual-taking UNet (``unet_control``) at the first; then the same runs;
- ``engines-cached``: the same runs in a fresh process with the engines already built;
- ``build``: the builds of ``engines`` only (no runs), so builds and runs can go in two processes.

Runs, each ``POST /sdapi/v1/txt2img`` at ``--size``, ``--steps``, Euler, cfg 7, seed 0: plain; the
LoRA (``<lora:NAME:S>`` in the prompt) at each of ``--strengths``; Forge's built-in ControlNet
(``alwayson_scripts.ControlNet``, no preprocessor, the hint image) with the LoRA at
``--controlnet-lora``.

Measured from outside: the Forge process's ``VmHWM`` (``/proc/<pid>/status``; reset with
``clear_refs`` after the build so the runs' peak is their own), the last finished progress bar's
s/it of each run, sd-accel's per-job lines (``UNet calls this job: N on engines, M in PyTorch``).
Engine images are compared with the torch mode's (PSNR). JSON to ``<out>/forge_host_rss-<modes>.json``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyui_host_rss import Sampler, log_since, reset_peak, vm_kib  # noqa: E402
from comfyui_workflows import _TQDM, mean_abs_diff, psnr  # noqa: E402

FLAGS = ["--always-cpu", "--skip-torch-cuda-test", "--skip-version-check", "--skip-python-version-check",
         "--no-download-sd-model", "--nowebui", "--api"]
_CALLS = re.compile(r"sd-accel: (UNet(?: with ControlNet residuals)?|VAE decoder|VAE encoder|text encoder|CLIP[^:]*) "
                    r"calls this job: (\d+) on engines, (\d+) in PyTorch(.*)")


def job_calls(text: str) -> list[dict]:
    """sd-accel's per-job summary lines in a slice of Forge's log."""
    return [{"component": m.group(1), "engines": int(m.group(2)), "pytorch": int(m.group(3)),
             "note": m.group(4).strip()} for m in _CALLS.finditer(text)]


def sampler_s_per_it(text: str) -> float:
    """The sampler's own s/it: its last finished progress bar in ``text`` (Forge also draws a
    "Total progress" bar, of the whole job, on the same lines: left out)."""
    parts = re.split(r"[\r\n]|\x1b\[A", text)
    done = [m for part in parts if "Total progress" not in part for m in _TQDM.finditer(part)
            if m.group(1) == m.group(2) and m.group(2) != "0"]
    if not done:
        return float("nan")
    value = float(done[-1].group(3))
    return value if done[-1].group(4) == "s/it" else 1.0 / value


def request(url: str, body: dict | None = None, method: str | None = None, timeout: float = 3600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"{method or 'POST'} {url}: HTTP {exc.code}: {exc.read()[:3000]!r}") from exc


class Forge:
    """One Forge process (``launch.py``) in ``folder`` with ``python``, its log in ``log``."""

    def __init__(self, folder: Path, python: str, port: int, log: Path, env: dict, extra: list[str]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._out = open(log, "wb")  # noqa: SIM115  (closed in stop)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **env}
        self.proc = subprocess.Popen([python, "launch.py", *FLAGS, "--server-name", "127.0.0.1", "--port", str(port),
                                      *extra], cwd=folder, stdout=self._out, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid

    def ready(self, timeout: float) -> float:
        start = time.time()
        while time.time() - start < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"Forge exited ({self.proc.returncode}) before it was ready; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/sdapi/v1/options", timeout=5) as r:
                    if r.status == 200:
                        return time.time() - start
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(2)
        raise SystemExit(f"Forge was not ready in {timeout:.0f} s; see {self.log}")

    def mark(self) -> int:
        self._out.flush()
        return self.log.stat().st_size

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def txt2img_body(args, lora: float | None = None, controlnet: str | None = None, hint_b64: str | None = None) -> dict:
    prompt = "a photo of a cat"
    if lora is not None:
        prompt += f" <lora:{args.lora}:{lora:g}>"
    body = {"prompt": prompt, "negative_prompt": "blurry", "seed": args.seed, "steps": args.steps, "cfg_scale": 7.0,
            "width": args.size, "height": args.size, "sampler_name": "Euler", "scheduler": "Automatic",
            "batch_size": 1, "n_iter": 1, "send_images": True, "save_images": False}
    if controlnet is not None:
        body["alwayson_scripts"] = {"ControlNet": {"args": [{
            "enabled": True, "module": "None", "model": controlnet, "weight": 1.0, "image": hint_b64,
            "resize_mode": "Crop and Resize", "guidance_start": 0.0, "guidance_end": 1.0,
            "control_mode": "Balanced", "pixel_perfect": False}]}}
    return body


def runs(args) -> list[tuple[str, dict]]:
    out = [("plain", {})]
    out += [(f"lora{s:g}", {"lora": s}) for s in (float(x) for x in args.strengths.split(",") if x)]
    if args.controlnet:
        lora = float(args.controlnet_lora) if args.controlnet_lora else None
        out.append(("controlnet" + (f"_lora{lora:g}" if lora is not None else ""), {"controlnet": True, "lora": lora}))
    return out


def controlnet_name(url: str, wanted: str) -> str:
    names = request(url + "/controlnet/model_list").get("model_list", [])
    found = [n for n in names if n.split(" [")[0] == wanted or n == wanted]
    if not found:
        raise SystemExit(f"ControlNet {wanted!r} not in Forge's list {names}")
    return found[0]


def run_mode(args, mode: str, root: Path) -> dict:
    engines = mode.startswith("engines") or mode == "build"
    log = root / f"forge-{mode}.log"
    engine_dir = args.engine_dir if engines else str(root / "no-engines")
    forge = Forge(Path(args.forge), args.python, args.port, log, {"SD_ACCEL_ENGINE_DIR": engine_dir},
                  args.forge_arg or [])
    out: dict = {"mode": mode, "pid": forge.pid, "log": str(log), "engine_dir": engine_dir, "runs": []}
    sampler = Sampler(forge.pid)
    try:
        out["ready_s"] = round(forge.ready(args.timeout), 1)
        out["ready_rss_gib"] = vm_kib(forge.pid, "VmRSS") / 2**20
        out["ready_peak_gib"] = vm_kib(forge.pid, "VmHWM") / 2**20
        if mode in ("engines", "build"):
            mark = forge.mark()
            start = time.time()
            out["builds"] = []
            presets = args.presets.split(",")
            for n, preset in enumerate(presets):
                components = ["unet"] + (args.first_components.split(",") if n == 0 else [])
                t0 = time.time()
                answer = request(forge.url + "/sd-accel/build", {"preset": preset, "components": components,
                                                                 "backend": args.backend,
                                                                 "precision": args.precision}, timeout=args.timeout)
                out["builds"].append({"preset": preset, "components": components, "s": round(time.time() - t0, 1),
                                      "built": [b["name"] for b in answer.get("built", [])],
                                      "not_built": answer.get("not_built")})
            out["build_s"] = round(time.time() - start, 1)
            out["build_peak_gib"] = vm_kib(forge.pid, "VmHWM") / 2**20
            out["after_build_rss_gib"] = vm_kib(forge.pid, "VmRSS") / 2**20
            out["build_log_lines"] = [ln for ln in log_since(log, mark).splitlines() if "sd-accel" in ln][-30:]
            out["peak_reset"] = reset_peak(forge.pid)
        if engines:
            out["engines"] = [{k: e[k] for k in ("name", "component", "weights", "profile", "size_bytes")}
                              for e in request(forge.url + "/sd-accel/engines")["engines"]]
        if mode == "build":
            return out
        runs_start_peak = vm_kib(forge.pid, "VmHWM")
        cn = controlnet_name(forge.url, args.controlnet) if args.controlnet else None
        hint = base64.b64encode(Path(args.hint).read_bytes()).decode() if args.hint else None
        for tag, spec in runs(args):
            mark = forge.mark()
            t0 = time.time()
            body = txt2img_body(args, spec.get("lora"), cn if spec.get("controlnet") else None, hint)
            answer = request(forge.url + "/sdapi/v1/txt2img", body, timeout=args.timeout)
            seconds = round(time.time() - t0, 1)
            text = log_since(log, mark)
            name = f"forge_{mode}_{tag}.png"
            images = answer.get("images") or []
            if images:
                (root / name).write_bytes(base64.b64decode(images[0]))
            out["runs"].append({"run": tag, "seconds": seconds, "s_per_it": sampler_s_per_it(text),
                                "peak_so_far_gib": vm_kib(forge.pid, "VmHWM") / 2**20,
                                "rss_after_gib": vm_kib(forge.pid, "VmRSS") / 2**20,
                                "calls": job_calls(text), "image": name if images else None,
                                "sd_accel_lines": [ln for ln in text.splitlines() if "sd-accel" in ln][-16:]})
            print(json.dumps(out["runs"][-1]), flush=True)
        out["runs_peak_gib"] = max(vm_kib(forge.pid, "VmHWM"), runs_start_peak) / 2**20
        out["peak_gib"] = max(out["runs_peak_gib"], out.get("build_peak_gib", 0.0))
    except SystemExit as exc:  # a failed mode (killed for memory, an HTTP error) is a result too
        out["failed"] = str(exc)
        out["last_seen_peak_gib"] = sampler.peak / 2**20
    finally:
        sampler.stop()
        if not forge.alive():
            out["exit_code"] = forge.proc.returncode
        forge.stop()
    return out


def compare(root: Path, modes: dict) -> list[dict]:
    """PSNR of each engine run's image against the torch mode's image of the same run (from this
    invocation or an earlier one into the same ``--out``)."""
    try:
        from PIL import Image
    except ImportError:
        return [{"psnr": "not computed: Pillow is missing here (run this script with Forge's Python)"}]
    rows = []
    for mode in ("engines", "engines-cached"):
        for e in modes.get(mode, {}).get("runs", []):
            ref = root / f"forge_torch_{e['run']}.png"
            if ref.is_file() and e["image"]:
                a = Image.open(ref).convert("RGB")
                b = Image.open(root / e["image"]).convert("RGB")
                rows.append({"mode": mode, "run": e["run"], "psnr_db": psnr(a, b), "mean_abs_diff": mean_abs_diff(a, b)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forge", required=True, help="the Forge folder (launch.py)")
    ap.add_argument("--python", required=True, help="Forge's Python")
    ap.add_argument("--out", required=True, help="folder for logs, images and forge_host_rss.json")
    ap.add_argument("--engine-dir", required=True)
    ap.add_argument("--modes", default="torch,engines")
    ap.add_argument("--lora", default="random-lora")
    ap.add_argument("--strengths", default="0.7,1.0")
    ap.add_argument("--controlnet", default="cn-random-sd15", help="its name in Forge's list, without the hash")
    ap.add_argument("--controlnet-lora", default="1.0", help="the LoRA strength of the ControlNet run ('': none)")
    ap.add_argument("--hint")
    ap.add_argument("--presets", default="static-512,dynamic-512-768")
    ap.add_argument("--first-components", default="unet_control,vae_decoder,clip")
    ap.add_argument("--backend", default="openvino")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=7861)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--forge-arg", action="append", help="another Forge flag (repeatable)")
    args = ap.parse_args(argv)
    root = Path(args.out)
    (root / "no-engines").mkdir(parents=True, exist_ok=True)
    modes = {}
    for mode in args.modes.split(","):
        modes[mode] = run_mode(args, mode, root)
        print(json.dumps({k: v for k, v in modes[mode].items() if k != "runs"}), flush=True)
    summary = {"modes": modes, "psnr": compare(root, modes)}
    (root / f"forge_host_rss-{args.modes.replace(',', '+')}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary["psnr"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
