"""The ComfyUI half of issue 45's proof, in ONE real, running ComfyUI server: FLUX.1 txt2img with a
LoRA at two strengths AND a ControlNet in one workflow, and SD3.5 txt2img (plain and with an SD3
ControlNet), each on the pack's engines against ComfyUI's own PyTorch run of the same graph.

The baseline is the same graph without the pack's node (``sd-accel Build Engines``, which builds
and applies the engines); the engine graph has it right after the model loader (before the LoRA
loader, as the guide says). Both decode with ComfyUI's VAE (PyTorch), so the comparison is the
saved latent's largest difference and the decoded image's PSNR.

Files (random weights, made once under the base directory, default ``/tmp/cproof45``):

- FLUX.1-dev in Black Forest Labs' layout at the real head width (24 heads of 128 lanes, context
  4096, pooled 768; one double and one single block), a kohya LoRA on it, an InstantX-layout FLUX
  ControlNet, a FLUX autoencoder and a hint: ``comfyui_real_lora_check.py`` /
  ``comfyui_real_controlnet_check.py``'s helpers, imported.
- SD3.5-Medium-like MMDiT in Stability's layout (``joint_blocks.*``, RMS q/k norms, a second image
  self-attention in block 0 as SD3.5 Medium has), TINY widths: ComfyUI derives hidden width =
  64 x depth and heads = depth, so depth 2 = 2 joint blocks, hidden 128, 2 heads of 64; T5 width
  4096 and pooled 2048 as the real model; position table 96 x 96 patches.
- An SD3 ControlNet in InstantX's (diffusers ``SD3ControlNetModel``) layout that ComfyUI's
  ``load_controlnet_mmdit`` takes (one joint block, same widths; its zero layers made random).

Conditionings are random T5 / CLIP states at the real widths (a probe node; no text encoders).

    COMFYUI=/path/to/ComfyUI /path/to/ComfyUI/venv/bin/python scripts/comfyui_real_proof.py [base dir]

Prints each run's pack line, time and s/it, then a JSON summary; exits 1 if a covered call ran in
PyTorch, or a latent differs by more than 1e-3, or a decoded image's PSNR is under 40 dB.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import comfyui_real_controlnet_check as cn  # noqa: E402
import comfyui_real_lora_check as base  # noqa: E402

BASE = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/cproof45")
PORT = int(os.environ.get("PORT", "8193"))
base.BASE, base.PORT, base.URL = BASE, PORT, f"http://127.0.0.1:{PORT}"
SD3_MODEL = "tiny-sd35-medium.safetensors"
SD3_CONTROLNET = "tiny-sd3-controlnet.safetensors"
LATENT_TOL, PSNR_MIN = 1e-3, 40.0
STEPS = 4

SD3_COND_NODE = '''import torch


class ProbeProof45SD3Cond:
    """An SD3 conditioning of random CLIP-L/G + T5 states (77 + tokens columns of 4096) and pooled 2048."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0}), "tokens": ("INT", {"default": 16})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "probe"

    def make(self, seed, tokens):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, 77 + tokens, 4096, generator=g), {"pooled_output": torch.randn(1, 2048, generator=g)}]],)


NODE_CLASS_MAPPINGS = {"ProbeProof45SD3Cond": ProbeProof45SD3Cond}
'''


# ---- pure helpers (tests/test_comfyui_real_proof.py) ------------------------------------------

def run_lines(text: str) -> list[str]:
    """The pack's per-run report lines (and failures) in a stretch of the server's log."""
    return [ln.strip() for ln in text.splitlines()
            if re.search(r"calls this run|on engine|refitting|building|failed|Error", ln)]


def calls(lines: list[str]) -> tuple[int, int] | None:
    """(on engines, in PyTorch) summed over the ``... calls this run: N on engines, M in PyTorch`` lines."""
    found = [re.search(r"calls this run: (\d+) on engines, (\d+) in PyTorch", ln) for ln in lines]
    found = [m for m in found if m]
    if not found:
        return None
    return sum(int(m[1]) for m in found), sum(int(m[2]) for m in found)


def seconds_per_step(text: str) -> float | None:
    """The sampler's rate from ComfyUI's last tqdm bar in ``text`` (s/it; it/s turned around)."""
    bars = re.findall(r"(\d+)/(\d+) \[[^\]]*?,\s*([\d.]+)(s/it|it/s)\]", text)
    done = [b for b in bars if b[0] == b[1]] or bars
    if not done:
        return None
    rate, unit = float(done[-1][2]), done[-1][3]
    return rate if unit == "s/it" else (1.0 / rate if rate else None)


def executed_seconds(text: str) -> float | None:
    """ComfyUI's own ``Prompt executed in X seconds`` (the last in ``text``)."""
    found = re.findall(r"Prompt executed in ([\d.]+) seconds", text)
    return float(found[-1]) if found else None


def psnr(a, b) -> float:
    """PSNR in dB of two uint8 images (arrays); inf when they are equal."""
    import numpy as np

    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def saved(folder: Path, prefix: str, ext: str) -> Path:
    """The newest file ComfyUI saved under exactly ``prefix`` (``<prefix>_00001_.<ext>``): a glob on
    ``prefix_*`` would also take a longer prefix's (``s_t_cn_00001_`` for ``s_t``)."""
    pattern = re.compile(re.escape(prefix) + r"_\d+_?\." + re.escape(ext))
    files = sorted(f for f in folder.iterdir() if pattern.fullmatch(f.name))
    if not files:
        raise FileNotFoundError(f"{folder}/{prefix}_*.{ext}")
    return files[-1]


def verdict(runs: dict, pairs: list[dict], effects: dict | None = None) -> list[str]:
    """What fails the proof: an engine run with a PyTorch call or no engine call, a latent beyond
    LATENT_TOL, an image under PSNR_MIN, an effect (LoRA strength, ControlNet: ComfyUI's own latents
    apart) under 10 x the largest engine difference (it would not show that the engine took it)."""
    bad = [f"{name}: {r['error']}" for name, r in runs.items() if r.get("error")]
    for name, r in runs.items():
        if not r["engines"]:
            continue
        c = r.get("calls")
        if c is None or c[0] == 0 or c[1] != 0:
            bad.append(f"{name}: pack calls {c} (need N on engines, 0 in PyTorch)")
    for p in pairs:
        if not p["latent_max_diff"] <= LATENT_TOL:
            bad.append(f"{p['engine']}: latent max diff {p['latent_max_diff']:.2e} > {LATENT_TOL}")
        if p.get("psnr_db") is not None and not p["psnr_db"] >= PSNR_MIN:
            bad.append(f"{p['engine']}: PSNR {p['psnr_db']:.1f} dB < {PSNR_MIN}")
    worst = max([p["latent_max_diff"] for p in pairs if p["latent_max_diff"] == p["latent_max_diff"]], default=0.0)
    bad += [f"{what}: effect {e:.2e} not above 10 x {worst:.2e}" for what, e in (effects or {}).items()
            if not e > 10 * worst]
    return bad


# ---- files ------------------------------------------------------------------------------------

def _randomize(module, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if n.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:  # (a ControlNet's zero-initialised layers made random too)
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / max(1, p.shape[-1]) ** 0.5))


def _sd3_side_files() -> None:
    import diffusers
    import numpy as np
    import torch
    from PIL import Image

    sys.path.insert(0, str(base.REPO / "tests"))
    from support import transformer_layout as layout

    for d in ("models/diffusion_models", "models/controlnet", "models/vae", "input", "output", "engines"):
        (BASE / d).mkdir(parents=True, exist_ok=True)
    pack = BASE / "custom_nodes/sd_accel"
    pack.parent.mkdir(parents=True, exist_ok=True)
    if not pack.exists():
        pack.symlink_to(base.REPO / "extension/comfyui")
    vae = BASE / "models/vae" / cn.VAE
    if not vae.exists():  # (the same autoencoder as comfyui_real_controlnet_check.py's)
        torch.manual_seed(4)
        ae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
                                     block_out_channels=(128, 256, 512, 512),
                                     down_block_types=("DownEncoderBlock2D",) * 4,
                                     up_block_types=("UpDecoderBlock2D",) * 4, use_quant_conv=False,
                                     use_post_quant_conv=False)
        layout.save(layout.vae_state_dict(ae), vae)
    hint = BASE / "input" / cn.HINT
    if not hint.exists():
        Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8")).save(hint)


def make_files() -> None:
    import diffusers
    import torch
    from safetensors.torch import save_file

    only = set(os.environ.get("ONLY", "").split(",")) - {""}
    if not only or any(o.startswith("f") for o in only):
        cn.make_files()
    else:  # (SD3 only: its VAE and hint, no FLUX transformer, LoRA or ControlNet)
        _sd3_side_files()
    sys.path.insert(0, str(base.REPO / "tests"))
    from support import transformer_layout as layout

    (BASE / "custom_nodes/probe_proof45").mkdir(parents=True, exist_ok=True)
    (BASE / "custom_nodes/probe_proof45/__init__.py").write_text(SD3_COND_NODE)
    widths = dict(patch_size=2, in_channels=16, attention_head_dim=64, num_attention_heads=2, joint_attention_dim=4096,
                  caption_projection_dim=128, pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=96,
                  qk_norm="rms_norm")
    path = BASE / "models/diffusion_models" / SD3_MODEL
    if not path.exists():
        t = diffusers.SD3Transformer2DModel(sample_size=64, num_layers=2, dual_attention_layers=(0,), **widths)
        _randomize(t, 5)
        layout.save({k: v.to(torch.bfloat16) for k, v in layout.sd3_transformer_state_dict(t, prefix="").items()}, path)
        del t
    path = BASE / "models/controlnet" / SD3_CONTROLNET
    if not path.exists():
        net = diffusers.SD3ControlNetModel(sample_size=64, num_layers=1, **widths)
        _randomize(net, 6)
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in net.state_dict().items()}, str(path))
        del net


# ---- graphs -----------------------------------------------------------------------------------

def _outputs(g: dict, prefix: str, sampler: str) -> None:
    g["20"] = {"class_type": "VAELoader", "inputs": {"vae_name": cn.VAE}}
    g["21"] = {"class_type": "VAEDecode", "inputs": {"samples": [sampler, 0], "vae": ["20", 0]}}
    g["22"] = {"class_type": "SaveImage", "inputs": {"images": ["21", 0], "filename_prefix": f"images/{prefix}"}}


def flux_graph(prefix: str, engines: bool, strength: float, control: bool, seed: int = 0) -> dict:
    """UNETLoader -> [Build Engines unet+unet_control] -> LoraLoaderModelOnly -> KSampler, with
    [ControlNetLoader + ControlNetApplyAdvanced] on the conditioning; SaveLatent and VAEDecode/SaveImage."""
    g = cn.graph(prefix, engines, control)
    g["5"]["inputs"].update(seed=seed, steps=STEPS)
    g["8"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["7", 0] if engines else ["1", 0],
              "lora_name": base.LORA, "strength_model": strength}}
    g["5"]["inputs"]["model"] = ["8", 0]
    _outputs(g, prefix, "5")
    return g


def sd3_graph(prefix: str, engines: bool, control: bool, seed: int = 0) -> dict:
    """UNETLoader (SD3.5) -> [Build Engines unet+unet_control] -> KSampler (CFG 4.5: cond and uncond),
    with [ControlNetLoader + ControlNetApplyAdvanced (SD3 ControlNet, VAE-encoded hint)]."""
    g = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": SD3_MODEL, "weight_dtype": "default"}},
         "2": {"class_type": "ProbeProof45SD3Cond", "inputs": {"seed": 11, "tokens": 16}},
         "3": {"class_type": "ProbeProof45SD3Cond", "inputs": {"seed": 12, "tokens": 16}},
         "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
         "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0],
               "latent_image": ["4", 0], "seed": seed, "steps": STEPS, "cfg": 4.5, "sampler_name": "euler",
               "scheduler": "simple", "denoise": 1.0}},
         "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"latents/{prefix}"}}}
    if engines:
        g["7"] = {"class_type": "SdAccelBuildEngines", "inputs": {"model": ["1", 0], "components": "unet+unet_control",
                  "preset": "custom (ranges below)", "backend": "onnxruntime", "precision": "fp32", "batch": "1-2",
                  "height": "64", "width": "64", "tokens": "77", "text": "16"}}
        g["5"]["inputs"]["model"] = ["7", 0]
    _outputs(g, prefix, "5")
    if control:
        g["10"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": SD3_CONTROLNET}}
        g["12"] = {"class_type": "LoadImage", "inputs": {"image": cn.HINT}}
        g["13"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
            "positive": ["2", 0], "negative": ["3", 0], "control_net": ["10", 0], "image": ["12", 0],
            "strength": 0.8, "start_percent": 0.0, "end_percent": 1.0, "vae": ["20", 0]}}
        g["5"]["inputs"]["positive"], g["5"]["inputs"]["negative"] = ["13", 0], ["13", 1]
    return g


# name: (graph, engines, ComfyUI-PyTorch twin); order = the order run (PyTorch first, then the builds)
RUNS = {
    "s_t": (lambda: sd3_graph("s_t", False, False), False, None),
    "s_t_cn": (lambda: sd3_graph("s_t_cn", False, True), False, None),
    "s_e": (lambda: sd3_graph("s_e", True, False), True, "s_t"),
    "s_e_cn": (lambda: sd3_graph("s_e_cn", True, True), True, "s_t_cn"),
    "f_t_l07_cn": (lambda: flux_graph("f_t_l07_cn", False, 0.7, True), False, None),
    "f_t_l10_cn": (lambda: flux_graph("f_t_l10_cn", False, 1.0, True), False, None),
    "f_t_l07": (lambda: flux_graph("f_t_l07", False, 0.7, False), False, None),
    "f_e_l07_cn": (lambda: flux_graph("f_e_l07_cn", True, 0.7, True), True, "f_t_l07_cn"),
    "f_e_l10_cn": (lambda: flux_graph("f_e_l10_cn", True, 1.0, True), True, "f_t_l10_cn"),
    "f_t_l10_cn_s1": (lambda: flux_graph("f_t_l10_cn_s1", False, 1.0, True, seed=1), False, None),
    "f_e_l10_cn_s1": (lambda: flux_graph("f_e_l10_cn_s1", True, 1.0, True, seed=1), True, "f_t_l10_cn_s1"),
}
EFFECTS = (("f_t_l10_cn", "f_t_l07_cn", "FLUX LoRA 1.0 vs 0.7"), ("f_t_l07_cn", "f_t_l07", "FLUX ControlNet"),
           ("s_t_cn", "s_t", "SD3 ControlNet"))


def image(prefix: str):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(saved(BASE / "output/images", prefix, "png")).convert("RGB"))


def latent(prefix: str):
    from safetensors.torch import load_file

    return load_file(str(saved(BASE / "output/latents", prefix, "latent")))["latent_tensor"].float()


def vm_hwm(pid: int) -> float | None:
    status = Path(f"/proc/{pid}/status")
    if not status.is_file():
        return None
    line = next((ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM")), "")
    return int(line.split()[1]) / 2**20 if line else None


def main() -> None:
    t_files = time.time()
    make_files()
    files_s = time.time() - t_files
    log_path = BASE / "server.log"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(base.REPO), SD_ACCEL_ENGINE_DIR=str(BASE / "engines"))
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, str(base.COMFYUI / "main.py"), "--cpu", "--listen", "127.0.0.1",
                                   "--port", str(PORT), "--base-directory", str(BASE), "--disable-auto-launch"],
                                  cwd=str(BASE), env=env, stdout=log, stderr=subprocess.STDOUT)
    summary: dict = {"comfyui": str(base.COMFYUI), "files_s": round(files_s, 1), "runs": {}, "pairs": [], "effects": {}}
    try:
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(base.URL + "/system_stats", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.time() - t0 > 300:
                    raise SystemExit(f"ComfyUI did not start: see {log_path}") from None
                time.sleep(2)
        summary["ready_s"] = round(time.time() - t0, 1)
        print(f"ComfyUI up in {summary['ready_s']} s (pid {server.pid})", flush=True)
        only = set(os.environ.get("ONLY", "").split(",")) - {""}
        for name, (make, engines, _) in RUNS.items():
            if only and not any(name.startswith(o) for o in only):
                continue
            start = log_path.stat().st_size
            try:
                seconds, error = base.wait(base.post(make()), limit=1800), None
            except (SystemExit, Exception) as exc:  # noqa: BLE001  (the next runs still go; the verdict fails)
                seconds, error = math.nan, f"{type(exc).__name__}: {str(exc)[:1500]}"
            time.sleep(0.5)
            with open(log_path, errors="replace") as f:
                f.seek(start)
                text = f.read()
            lines = run_lines(text)
            summary["runs"][name] = {"engines": engines, "seconds": executed_seconds(text) or round(seconds, 1), "s_per_it": seconds_per_step(text),
                                     "calls": calls(lines), "lines": lines, "peak_rss_gib_so_far": vm_hwm(server.pid),
                                     "error": error}
            print(f"{name}: {summary['runs'][name]['seconds']} s, {summary['runs'][name]['s_per_it']} s/it; " + " | ".join(lines), flush=True)
        for name, (_, engines, twin) in RUNS.items():
            if not engines or not all(summary["runs"].get(n, {}).get("error", 1) is None for n in (name, twin)):
                continue
            a, b = latent(name), latent(twin)
            summary["pairs"].append({"engine": name, "pytorch": twin,
                                     "latent_max_diff": (a - b).abs().max().item(),
                                     "latent_abs_max": b.abs().max().item(), "psnr_db": psnr(image(name), image(twin)),
                                     "s_per_it_engine": summary["runs"][name]["s_per_it"],
                                     "s_per_it_pytorch": summary["runs"][twin]["s_per_it"]})
        for x, y, what in EFFECTS:
            if all(summary["runs"].get(n, {}).get("error", 1) is None for n in (x, y)):
                summary["effects"][what] = (latent(x) - latent(y)).abs().max().item()
        summary["peak_rss_gib"] = vm_hwm(server.pid)
        summary["failures"] = verdict(summary["runs"], summary["pairs"], summary["effects"])
        print(json.dumps(summary, indent=1, default=str))
        print("OK" if not summary["failures"] else "FAILED: " + "; ".join(summary["failures"]))
        out = os.environ.get("SUMMARY")
        if out:
            Path(out).write_text(json.dumps(summary, indent=1, default=str))
        if summary["failures"]:
            sys.exit(1)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
