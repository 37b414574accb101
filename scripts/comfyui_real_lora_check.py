"""LoRA on a FLUX.1 transformer engine in a real, running ComfyUI (issue 45): the engine refitted
with ComfyUI's own patched weights, against ComfyUI's own PyTorch run with the same LoRA.

Sets up a base directory (default ``/tmp/clora45``: models, custom_nodes, output; ComfyUI's own
tree is only read), makes a FLUX.1-dev file in Black Forest Labs' layout that ComfyUI's detection
takes (24 heads of 128 lanes, context 4096, pooled 768: what it fixes; one double and one single
block, random weights, bf16) and a LoRA file in kohya's key format (``lora_unet_double_blocks_0_img_attn_qkv``
...: ComfyUI's loader maps those onto its fused q/k/v, the engine holds them split), starts ComfyUI
(``main.py --cpu``) with this checkout's sd_accel and node pack, and queues over its HTTP API:
UNETLoader -> [sd-accel Build Engines] -> [LoraLoaderModelOnly at 0.7 / 1.0] -> KSampler (euler,
simple, 2 steps, CFG 1, 64 px) -> SaveLatent, with a conditioning node of random T5 / CLIP-L
states (no text encoders needed). Prints the pack's run lines (engine / PyTorch call counts,
refits) and each engine latent's largest difference from ComfyUI's PyTorch latent; fails above 1e-3.

    COMFYUI=/path/to/ComfyUI /path/to/ComfyUI/venv/bin/python scripts/comfyui_real_lora_check.py [base dir]

(that venv needs diffusers and safetensors; the server gets this checkout on PYTHONPATH).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMFYUI = Path(os.environ.get("COMFYUI", "/work/comfy/ComfyUI"))
BASE = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/clora45")
PORT = int(os.environ.get("PORT", "8191"))
URL = f"http://127.0.0.1:{PORT}"
MODEL = "tiny-flux-dev.safetensors"
LORA = "tiny-flux-kohya.safetensors"

COND_NODE = '''import torch


class ProbeClora45FluxCond:
    """A FLUX conditioning of random T5 states and pooled CLIP-L output at the real widths."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0}), "tokens": ("INT", {"default": 16})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "probe"

    def make(self, seed, tokens):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, 4096, generator=g), {"pooled_output": torch.randn(1, 768, generator=g),
                                                               "guidance": 3.5}]],)


NODE_CLASS_MAPPINGS = {"ProbeClora45FluxCond": ProbeClora45FluxCond}
'''


def make_files() -> None:
    import diffusers
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO / "tests"))
    from support import transformer_layout as layout

    for d in ("models/diffusion_models", "models/loras", "custom_nodes/probe_clora45", "output", "engines"):
        (BASE / d).mkdir(parents=True, exist_ok=True)
    (BASE / "custom_nodes/probe_clora45/__init__.py").write_text(COND_NODE)
    pack = BASE / "custom_nodes/sd_accel"
    if not pack.exists():
        pack.symlink_to(REPO / "extension/comfyui")
    path = BASE / "models/diffusion_models" / MODEL
    if not path.exists():
        torch.manual_seed(0)
        t = diffusers.FluxTransformer2DModel(num_layers=1, num_single_layers=1, attention_head_dim=128,
                                             num_attention_heads=24, joint_attention_dim=4096,
                                             pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56])
        with torch.no_grad():
            for n, p in t.named_parameters():
                if n.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
                    p.copy_(1 + 0.1 * torch.randn(p.shape))
                else:
                    p.copy_(torch.randn(p.shape) * (0.5 / max(1, p.shape[-1]) ** 0.5))
        layout.save({k: v.to(torch.bfloat16) for k, v in layout.flux_transformer_state_dict(t).items()}, path)
        del t
    lora = BASE / "models/loras" / LORA
    if not lora.exists():
        hidden, rank = 3072, 8
        g = torch.Generator().manual_seed(1)
        sd = {}
        # (kohya / ComfyUI key format: lora_unet_<BFL path, . -> _>); out, in features
        for name, out_f, in_f in (("double_blocks_0_img_attn_qkv", 3 * hidden, hidden),
                                  ("double_blocks_0_txt_attn_qkv", 3 * hidden, hidden),
                                  ("double_blocks_0_img_attn_proj", hidden, hidden),
                                  ("double_blocks_0_img_mlp_0", 4 * hidden, hidden),
                                  ("single_blocks_0_linear1", 7 * hidden, hidden),
                                  ("single_blocks_0_linear2", hidden, 5 * hidden)):
            sd[f"lora_unet_{name}.lora_down.weight"] = (torch.randn(rank, in_f, generator=g) / in_f ** 0.5).half()
            sd[f"lora_unet_{name}.lora_up.weight"] = (torch.randn(out_f, rank, generator=g) * 0.5 / rank ** 0.5).half()
            sd[f"lora_unet_{name}.alpha"] = torch.tensor(float(rank)).half()
        save_file(sd, str(lora))


def post(graph: dict) -> str:
    req = urllib.request.Request(URL + "/prompt", data=json.dumps({"prompt": graph, "client_id": "clora45"}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        return json.loads(urllib.request.urlopen(req).read())["prompt_id"]
    except urllib.error.HTTPError as e:
        raise SystemExit(e.read().decode()) from e


def wait(pid: str, limit: float = 900) -> float:
    t0 = time.time()
    while time.time() - t0 < limit:
        h = json.loads(urllib.request.urlopen(f"{URL}/history/{pid}").read())
        if pid in h and h[pid].get("status", {}).get("completed") is not None:
            st = h[pid]["status"]
            if st["status_str"] != "success":
                raise SystemExit(json.dumps(st, indent=1)[:3000])
            return time.time() - t0
        time.sleep(2)
    raise TimeoutError(pid)


def graph(prefix: str, engines: bool, strength: float | None, seed: int = 0) -> dict:
    g = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL, "weight_dtype": "default"}},
         "2": {"class_type": "ProbeClora45FluxCond", "inputs": {"seed": 1, "tokens": 16}},
         "3": {"class_type": "ProbeClora45FluxCond", "inputs": {"seed": 2, "tokens": 16}},
         "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
         "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0],
               "latent_image": ["4", 0], "seed": seed, "steps": 2, "cfg": 1.0, "sampler_name": "euler",
               "scheduler": "simple", "denoise": 1.0}},
         "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"latents/{prefix}"}}}
    model = ["1", 0]
    if engines:
        g["7"] = {"class_type": "SdAccelBuildEngines", "inputs": {"model": model, "components": "unet",
                  "preset": "custom (ranges below)", "backend": "onnxruntime", "precision": "fp32", "batch": "1",
                  "height": "64", "width": "64", "tokens": "77", "text": "16"}}
        model = ["7", 0]
    if strength is not None:
        g["8"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": model, "lora_name": LORA,
                  "strength_model": strength}}
        model = ["8", 0]
    g["5"]["inputs"]["model"] = model
    return g


def latent(prefix: str):
    from safetensors.torch import load_file

    files = sorted((BASE / "output/latents").glob(f"{prefix}_*.latent"))
    return load_file(str(files[-1]))["latent_tensor"].float()


def main() -> None:
    make_files()
    log_path = BASE / "server.log"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(REPO), SD_ACCEL_ENGINE_DIR=str(BASE / "engines"))
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, str(COMFYUI / "main.py"), "--cpu", "--listen", "127.0.0.1",
                                   "--port", str(PORT), "--base-directory", str(BASE), "--disable-auto-launch"],
                                  cwd=str(BASE), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(URL + "/system_stats", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.time() - t0 > 300:
                    raise SystemExit(f"ComfyUI did not start: see {log_path}") from None
                time.sleep(2)
        print(f"ComfyUI up in {time.time() - t0:.0f} s (pid {server.pid})", flush=True)
        runs = [("t_base", False, None, 0), ("t_07", False, 0.7, 0), ("t_10", False, 1.0, 0), ("t_07s1", False, 0.7, 1),
                ("e_base", True, None, 0), ("e_07", True, 0.7, 0), ("e_10", True, 1.0, 0), ("e_07s1", True, 0.7, 1),
                ("e_base2", True, None, 0)]
        lines: dict[str, list[str]] = {}
        for prefix, engines, strength, seed in runs:
            start = log_path.stat().st_size
            seconds = wait(post(graph(prefix, engines, strength, seed)))
            time.sleep(0.5)
            with open(log_path) as f:
                f.seek(start)
                text = f.read()
            lines[prefix] = [ln.strip() for ln in text.splitlines()
                             if re.search(r"transformer calls this run|transformer on engine|refitting|failed", ln)]
            print(f"{prefix}: {seconds:.1f} s; " + " | ".join(lines[prefix]), flush=True)
        worst = 0.0
        for eng, ref in (("e_base", "t_base"), ("e_07", "t_07"), ("e_10", "t_10"), ("e_07s1", "t_07s1"),
                         ("e_base2", "t_base")):
            a, b = latent(eng), latent(ref)
            diff = (a - b).abs().max().item()
            worst = max(worst, diff)
            print(f"{eng} vs ComfyUI PyTorch {ref}: max |diff| {diff:.2e} (|latent| max {b.abs().max().item():.2f})")
        for x, y in (("t_07", "t_base"), ("t_10", "t_base"), ("t_10", "t_07")):
            print(f"LoRA effect {x} vs {y}: max |diff| {(latent(x) - latent(y)).abs().max().item():.2e}")
        status = Path(f"/proc/{server.pid}/status")
        if status.is_file():
            hwm = next((ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM")), "")
            print(f"ComfyUI's peak RSS: {int(hwm.split()[1]) / 2**20:.2f} GiB" if hwm else "")
        calls = {p: ls for p, ls in lines.items() if p.startswith("e_")}
        ok = all(any("1 on engines, 0 in PyTorch" in ln or "2 on engines, 0 in PyTorch" in ln for ln in ls)
                 for ls in calls.values())
        print("OK" if ok and worst < 1e-3 else "FAILED", f"(worst {worst:.2e})")
        if not ok or worst >= 1e-3:
            sys.exit(1)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
