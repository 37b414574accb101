"""FLUX.1 ControlNet residuals on the residual-taking transformer engine in a real, running
ComfyUI (issue 45, ControlNet): ComfyUI's own ControlNet nodes (ControlNetLoader, ControlNetApplyAdvanced
with a VAE, as FLUX ControlNets need) run the net; the pack sends the transformer's calls with
residuals to ``transformer_control`` (built by the Build node's ``unet_control``), against
ComfyUI's own PyTorch run of the same graph.

Reuses ``comfyui_real_lora_check.py``'s files and server (the same tiny FLUX.1-dev file in Black
Forest Labs' layout, 24 heads of 128 lanes, one double and one single block, random weights) and
adds: a FLUX ControlNet in the InstantX (diffusers) key layout ComfyUI's loader detects (one
double and one single block, random weights, its zero-initialised layers made random), a FLUX
autoencoder (ComfyUI's fixed widths, 16 latent channels, random weights) to encode the hint, and a
hint image. Prints each run's pack line and the engine latents' largest difference from ComfyUI's;
fails above 1e-3 or when a ControlNet call ran in PyTorch.

    COMFYUI=/path/to/ComfyUI /path/to/ComfyUI/venv/bin/python scripts/comfyui_real_controlnet_check.py [base dir]
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import comfyui_real_lora_check as base  # noqa: E402

CONTROLNET = "tiny-flux-controlnet.safetensors"
VAE = "tiny-flux-ae.safetensors"
HINT = "hint.png"


def make_files() -> None:
    import diffusers
    import numpy as np
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    base.make_files()
    sys.path.insert(0, str(base.REPO / "tests"))
    from support import transformer_layout as layout

    for d in ("models/controlnet", "models/vae", "input"):
        (base.BASE / d).mkdir(parents=True, exist_ok=True)
    path = base.BASE / "models/controlnet" / CONTROLNET
    if not path.exists():
        torch.manual_seed(3)
        net = diffusers.FluxControlNetModel(num_layers=1, num_single_layers=1, attention_head_dim=128,
                                            num_attention_heads=24, joint_attention_dim=4096,
                                            pooled_projection_dim=768, guidance_embeds=True,
                                            axes_dims_rope=[16, 56, 56])
        with torch.no_grad():
            for n, p in net.named_parameters():
                if n.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
                    p.copy_(1 + 0.1 * torch.randn(p.shape))
                else:  # (controlnet_blocks / controlnet_x_embedder: zero in a new net, random here)
                    p.copy_(torch.randn(p.shape) * (0.5 / max(1, p.shape[-1]) ** 0.5))
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in net.state_dict().items()}, str(path))
        del net
    vae = base.BASE / "models/vae" / VAE
    if not vae.exists():
        torch.manual_seed(4)
        ae = diffusers.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
                                     block_out_channels=(128, 256, 512, 512),
                                     down_block_types=("DownEncoderBlock2D",) * 4,
                                     up_block_types=("UpDecoderBlock2D",) * 4, use_quant_conv=False,
                                     use_post_quant_conv=False)
        layout.save(layout.vae_state_dict(ae), vae)
    hint = base.BASE / "input" / HINT
    if not hint.exists():
        Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8")).save(hint)


def graph(prefix: str, engines: bool, control: bool) -> dict:
    g = base.graph(prefix, engines, None)
    if engines:
        g["7"]["inputs"]["components"] = "unet+unet_control"
    if control:
        g["10"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": CONTROLNET}}
        g["11"] = {"class_type": "VAELoader", "inputs": {"vae_name": VAE}}
        g["12"] = {"class_type": "LoadImage", "inputs": {"image": HINT}}
        g["13"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
            "positive": ["2", 0], "negative": ["3", 0], "control_net": ["10", 0], "image": ["12", 0],
            "strength": 0.8, "start_percent": 0.0, "end_percent": 1.0, "vae": ["11", 0]}}
        g["5"]["inputs"]["positive"] = ["13", 0]
        g["5"]["inputs"]["negative"] = ["13", 1]
    return g


def main() -> None:
    make_files()
    log_path = base.BASE / "server.log"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(base.REPO),
               SD_ACCEL_ENGINE_DIR=str(base.BASE / "engines"))
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, str(base.COMFYUI / "main.py"), "--cpu", "--listen", "127.0.0.1",
                                   "--port", str(base.PORT), "--base-directory", str(base.BASE),
                                   "--disable-auto-launch"], cwd=str(base.BASE), env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
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
        print(f"ComfyUI up in {time.time() - t0:.0f} s (pid {server.pid})", flush=True)
        runs = [("c_t_plain", False, False), ("c_t_cn", False, True), ("c_e_cn", True, True), ("c_e_plain", True, False)]
        lines: dict[str, list[str]] = {}
        for prefix, engines, control in runs:
            start = log_path.stat().st_size
            seconds = base.wait(base.post(graph(prefix, engines, control)))
            time.sleep(0.5)
            with open(log_path) as f:
                f.seek(start)
                text = f.read()
            lines[prefix] = [ln.strip() for ln in text.splitlines()
                             if re.search(r"transformer calls this run|building|failed|Error", ln)]
            print(f"{prefix}: {seconds:.1f} s; " + " | ".join(lines[prefix]), flush=True)
        worst = 0.0
        for eng, ref in (("c_e_cn", "c_t_cn"), ("c_e_plain", "c_t_plain")):
            a, b = base.latent(eng), base.latent(ref)
            diff = (a - b).abs().max().item()
            worst = max(worst, diff)
            print(f"{eng} vs ComfyUI PyTorch {ref}: max |diff| {diff:.2e} (|latent| max {b.abs().max().item():.2f})")
        effect = (base.latent("c_t_cn") - base.latent("c_t_plain")).abs().max().item()
        print(f"ControlNet effect c_t_cn vs c_t_plain: max |diff| {effect:.2e}")
        status = Path(f"/proc/{server.pid}/status")
        if status.is_file():
            hwm = next((ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM")), "")
            print(f"ComfyUI's peak RSS: {int(hwm.split()[1]) / 2**20:.2f} GiB" if hwm else "")
        ok = all(any("2 on engines, 0 in PyTorch" in ln for ln in lines[p]) for p in ("c_e_cn", "c_e_plain"))
        good = ok and worst < 1e-3 and effect > 10 * worst
        print("OK" if good else "FAILED", f"(worst {worst:.2e}, ControlNet effect {effect:.2e})")
        if not good:
            sys.exit(1)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
