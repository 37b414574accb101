#!/usr/bin/env python3
"""Peak RSS of a real ComfyUI process: the same LoRA + ControlNet workflow in ComfyUI's own
PyTorch and on sd-accel's engines (issue 46: "a host process on engines, LoRA changes included,
peaks no higher than the same workflow in the host's own PyTorch").

Given a ComfyUI folder (the pack linked into ``custom_nodes/``, sd-accel installed into its
Python) and that Python:

    python scripts/comfyui_host_rss.py --comfy /work/comfy/ComfyUI --python /work/comfy/venv/bin/python \
        --ckpt sd15-random.safetensors --lora random-lora.safetensors \
        --controlnet cn-random-sd15.safetensors --hint hint.png --out host_rss.json

Each mode runs in a fresh ComfyUI process (started here, stopped by its own pid at the end):

- ``torch``: ComfyUI's own nodes: txt2img at ``--size`` with the LoRA at each of ``--strengths``
  (in order: 0.7 then 1.0 by default), each with a ControlNet applied;
- ``engines``: first the pack's Build Engines node builds (or finds cached) the UNet for each of
  ``--presets`` (static-512 and dynamic-512-768: two profiles), the residual-taking UNet for
  ``--control-presets`` (static-512) and the VAE decoder; then the same runs with sd-accel Apply Engines in front of the LoRA loader
  (a strength change is a refit) and sd-accel's VAE Decode;
- ``engines-cached``: the same runs in a fresh process with the engines already in the cache (no
  build in the process: what a later session of the same workflow holds).

Measured from outside the process: ``VmHWM`` (peak RSS, reported in GiB) of the ComfyUI process from
``/proc/<pid>/status``; the engine build's peak is read after the build, then the mark is reset
(``/proc/<pid>/clear_refs``, ``5``) so that the runs' peak is their own; the mode's overall peak is
the larger of the two. From ComfyUI's log (its stdout and stderr): the sampler's s/it (the last
finished progress bar of each run) and sd-accel's per-run line ("UNet calls this run: N on
engines, M in PyTorch"). The images of the two modes for the same seed and strength are compared
(PSNR in dB; random weights: bf16-level agreement is what is expected). A JSON summary goes to
``--out``. Only the standard library is needed (Pillow, when present, for the PSNR).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyui_workflows import graph, image, mean_abs_diff, post, psnr, sampler_s_per_it, seconds  # noqa: E402

_CALLS = re.compile(r"sd-accel: UNet calls this run: (\d+) on engines, (\d+) in PyTorch(.*)")


def vm_kib(pid: int, field: str) -> int:
    """``VmHWM`` / ``VmRSS`` of ``pid`` in KiB (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak(pid: int) -> bool:
    """Start ``pid``'s VmHWM again from its current RSS (Linux >= 4.0; our own processes only)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def unet_calls(text: str) -> list[dict]:
    """sd-accel's per-run lines in a slice of ComfyUI's log."""
    return [{"engines": int(m.group(1)), "pytorch": int(m.group(2)), "note": m.group(3).strip()}
            for m in _CALLS.finditer(text)]


def log_since(path: Path, mark: int) -> str:
    with open(path, "rb") as f:
        f.seek(mark)
        return f.read().decode(errors="replace")


class Sampler(threading.Thread):
    """VmHWM of ``pid`` read every ``every`` s: what it was last seen at when the process is
    killed (its /proc entry goes with it)."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.every, self.peak = pid, every, 0
        self._halt = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._halt.wait(self.every):
            self.peak = max(self.peak, vm_kib(self.pid, "VmHWM"))

    def stop(self) -> None:
        self._halt.set()


class Comfy:
    """One ComfyUI process, started in ``folder`` with ``python`` and its log in ``log``."""

    def __init__(self, folder: Path, python: str, port: int, log: Path, extra: list[str]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._out = open(log, "wb")  # noqa: SIM115  (closed in stop)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                                      "--disable-auto-launch", *extra], cwd=folder, stdout=self._out,
                                     stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid

    def ready(self, timeout: float) -> float:
        start = time.time()
        while time.time() - start < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"ComfyUI exited ({self.proc.returncode}) before it was ready; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/system_stats", timeout=5) as r:
                    if r.status == 200:
                        return time.time() - start
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1)
        raise SystemExit(f"ComfyUI was not ready in {timeout:.0f} s; see {self.log}")

    def mark(self) -> int:
        self._out.flush()
        return self.log.stat().st_size

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, prompt_id: str, timeout: float) -> dict:
        """The history entry of a finished prompt; raises when it failed or ComfyUI died (an
        OOM kill is what this script looks for: it must not wait out the timeout)."""
        start = time.time()
        while time.time() - start < timeout:
            if not self.alive():
                raise SystemExit(f"ComfyUI died (exit {self.proc.returncode}; -9: killed, e.g. out of memory); "
                                 f"see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/history/{prompt_id}", timeout=30) as r:
                    h = json.loads(r.read())
            except (OSError, urllib.error.URLError):  # it answers slowly while it exports
                time.sleep(2)
                continue
            entry = h.get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                if entry["status"].get("status_str") != "success":
                    msgs = [m for m in entry["status"].get("messages", []) if m[0] == "execution_error"]
                    raise SystemExit(f"workflow failed: {json.dumps(msgs)[:3000]}")
                return entry
            time.sleep(0.5)
        raise SystemExit(f"prompt {prompt_id} did not finish in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def build_graph(args) -> dict:
    """One Build Engines node per (component, preset): the UNet at each of ``--presets``, the
    residual-taking UNet (what ControlNet calls run on) at each of ``--control-presets``, the VAE
    decoder at the first preset."""
    g: dict = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": args.ckpt}}}
    jobs = [("unet", p) for p in args.presets.split(",")]
    jobs += [("unet_control", p) for p in args.control_presets.split(",") if p]
    jobs.append(("vae_decoder", args.presets.split(",")[0]))
    for n, (component, preset) in enumerate(jobs, start=2):
        g[str(n)] = {"class_type": "SdAccelBuildEngines", "inputs": {
            "model": ["1", 0], "vae": ["1", 2], "clip": ["1", 1], "components": component, "preset": preset,
            "backend": args.backend, "precision": args.precision}}
    return g


def run_mode(args, mode: str, root: Path) -> dict:
    engines = mode.startswith("engines")
    log = root / f"comfyui-{mode}.log"
    comfy = Comfy(Path(args.comfy), args.python, args.port, log, args.comfy_arg or [])
    out: dict = {"mode": mode, "pid": comfy.pid, "log": str(log), "runs": []}
    sampler = Sampler(comfy.pid)
    try:
        out["ready_s"] = round(comfy.ready(args.timeout), 1)
        out["idle_rss_gib"] = vm_kib(comfy.pid, "VmRSS") / 2**20
        if mode == "engines":
            mark = comfy.mark()
            start = time.time()
            comfy.wait(post(comfy.url, build_graph(args)), args.timeout)
            out["build_s"] = round(time.time() - start, 1)
            out["build_peak_gib"] = vm_kib(comfy.pid, "VmHWM") / 2**20
            out["after_build_rss_gib"] = vm_kib(comfy.pid, "VmRSS") / 2**20
            out["build_log_lines"] = [ln for ln in log_since(log, mark).splitlines() if "sd-accel" in ln][-12:]
            out["peak_reset"] = reset_peak(comfy.pid)
        runs_start_peak = vm_kib(comfy.pid, "VmHWM")
        ns = argparse.Namespace(ckpt=args.ckpt, lora=args.lora, controlnet=args.controlnet, hint=args.hint,
                                size=args.size, steps=args.steps, cfg=args.cfg, seed=args.seed, torch_clip=True)
        for strength in (float(s) for s in args.strengths.split(",")):
            mark = comfy.mark()
            tag = f"hostrss_{mode}_lora{strength:g}"
            entry = comfy.wait(post(comfy.url, graph(ns, engines, lora=strength, controlnet=True, prefix=tag)),
                               args.timeout)
            text = log_since(log, mark)
            img = image(comfy.url, entry, "7")
            if img is not None:
                img.save(root / f"{tag}.png")
            out["runs"].append({"strength": strength, "seconds": seconds(entry),
                                "s_per_it": sampler_s_per_it(str(log), mark),
                                "peak_so_far_gib": vm_kib(comfy.pid, "VmHWM") / 2**20,
                                "rss_after_gib": vm_kib(comfy.pid, "VmRSS") / 2**20,
                                "unet_calls": unet_calls(text), "image": f"{tag}.png" if img is not None else None,
                                "sd_accel_lines": [ln for ln in text.splitlines() if "sd-accel" in ln][-8:]})
        out["runs_peak_gib"] = max(vm_kib(comfy.pid, "VmHWM"), runs_start_peak) / 2**20
        out["peak_gib"] = max(out["runs_peak_gib"], out.get("build_peak_gib", 0.0))
    except SystemExit as exc:  # a mode that failed (killed for memory) is a result too
        out["failed"] = str(exc)
        out["last_seen_peak_gib"] = sampler.peak / 2**20
    finally:
        sampler.stop()
        if not comfy.alive():
            out["exit_code"] = comfy.proc.returncode  # -9: the kernel's OOM killer
        comfy.stop()
    return out


def compare(root: Path, modes: dict) -> list[dict]:
    try:
        from PIL import Image
    except ImportError:
        return []
    rows = []
    torch_runs = modes.get("torch", {}).get("runs", [])
    engine_runs = (modes.get("engines") or modes.get("engines-cached") or {}).get("runs", [])
    for t, e in zip(torch_runs, engine_runs, strict=False):
        if t["image"] and e["image"]:
            a, b = Image.open(root / t["image"]).convert("RGB"), Image.open(root / e["image"]).convert("RGB")
            rows.append({"strength": t["strength"], "psnr_db": psnr(a, b), "mean_abs_diff": mean_abs_diff(a, b)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfy", required=True, help="ComfyUI's folder (with main.py)")
    ap.add_argument("--python", required=True, help="ComfyUI's Python (sd-accel installed into it)")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--lora", required=True)
    ap.add_argument("--controlnet", required=True)
    ap.add_argument("--hint", required=True, help="the control image's name in ComfyUI's input/ folder")
    ap.add_argument("--strengths", default="0.7,1.0")
    ap.add_argument("--presets", default="static-512,dynamic-512-768")
    ap.add_argument("--control-presets", default="static-512",
                    help="profiles of the residual-taking UNet (a 512 px run calls only the static one)")
    ap.add_argument("--modes", default="torch,engines")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cfg", type=float, default=7.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="openvino")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--port", type=int, default=8188)
    ap.add_argument("--comfy-arg", action="append", help="one more argument for ComfyUI's main.py (repeatable)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--work", default=".", help="where logs and images go")
    ap.add_argument("--out", help="the JSON summary")
    args = ap.parse_args(argv)
    root = Path(args.work).resolve()
    root.mkdir(parents=True, exist_ok=True)
    modes = {}
    for mode in args.modes.split(","):
        modes[mode] = run_mode(args, mode, root)
        print(json.dumps(modes[mode], indent=1), flush=True)
    summary = {"modes": modes, "psnr": compare(root, modes),
               "args": {k: v for k, v in vars(args).items() if k not in ("timeout",)}}
    for mode in ("engines", "engines-cached"):
        if "runs_peak_gib" in modes.get("torch", {}) and "runs_peak_gib" in modes.get(mode, {}):
            summary[f"{mode}_over_torch_gib"] = modes[mode]["runs_peak_gib"] - modes["torch"]["runs_peak_gib"]
    for mode, m in modes.items():
        if "failed" in m:
            print(f"{mode:8s} FAILED (peak last seen {m['last_seen_peak_gib']:.2f} GiB): {m['failed'][:300]}")
            continue
        line = f"{mode:8s} peak {m.get('peak_gib', float('nan')):.2f} GiB (runs {m.get('runs_peak_gib', float('nan')):.2f}"
        if "build_peak_gib" in m:
            line += f", build {m['build_peak_gib']:.2f}"
        its = ", ".join(f"{r['s_per_it']:.2f}" for r in m["runs"])
        print(line + f"); s/it {its}; UNet calls {[r['unet_calls'] for r in m['runs']]}")
    for row in summary["psnr"]:
        print(f"LoRA {row['strength']:g}: PSNR {row['psnr_db']:.1f} dB, mean abs diff {row['mean_abs_diff']:.2f}/255")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
