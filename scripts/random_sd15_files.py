#!/usr/bin/env python3
"""The random-weight SD 1.5 files the real-host measurements load (scripts/forge_host_rss.py,
scripts/comfyui_host_rss.py): **random weights**, the real architectures, nothing downloaded.

    python scripts/random_sd15_files.py OUT      # in sd-accel's venv (diffusers, safetensors)

writes into ``OUT``:

- ``sd15-random.safetensors``: SD 1.5 from the shipped configs (seed 0), in the single-file
  layout WebUI users download (``tests/support/ldm_layout.py``), fp16 (about 2.1 GB);
- ``random-lora.safetensors``: a kohya LoRA of rank 4 (alpha 4) on the UNet's 128 attention
  projections (``to_q/k/v/out.0`` of its 16 transformer blocks) and the text encoder's 48
  (``q/k/v/out_proj``), its up weights scaled so each delta is ``--scale`` of its layer's norm;
- ``cn-random-sd15.safetensors``: a ControlNet of that UNet (diffusers' ``from_unet``, random
  weights, zero convolutions made non-zero so that it changes the image) in the ControlNet 1.1
  file layout (``control_model.*``, ``tests/support/controlnet_layout.py``), fp16;
- ``hint.png``: a 512 px noise hint (seed 0).

Forge dfdcbab did not apply the LoRA this script wrote before 2026-12-07 07:10 UTC ("LoRA version
mismatch", docs/dev/forge-real.md): its text-encoder keys lacked ``text_model_``
(``lora_te_encoder_layers_...``), as newer transformers name CLIPTextModel's layers; fixed, not yet
checked in a real Forge.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _kohya_name(prefix: str, module_name: str) -> str:
    return f"{prefix}_{module_name.replace('.', '_')}"


def _lora_pairs(module: torch.nn.Module, prefix: str, targets: tuple[str, ...], rank: int, scale: float,
                gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, layer in module.named_modules():
        if not isinstance(layer, torch.nn.Linear) or not name.endswith(targets):
            continue
        down = torch.randn(rank, layer.in_features, generator=gen)
        up = torch.randn(layer.out_features, rank, generator=gen)
        delta = up @ down
        up *= scale * layer.weight.detach().float().norm() / delta.norm()
        if prefix == "lora_te" and not name.startswith("text_model."):
            name = f"text_model.{name}"  # (newer transformers name CLIPTextModel's layers without it)
        key = _kohya_name(prefix, name)
        out[f"{key}.lora_down.weight"] = down.half()
        out[f"{key}.lora_up.weight"] = up.half()
        out[f"{key}.alpha"] = torch.tensor(float(rank))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--scale", type=float, default=0.1, help="each LoRA delta's norm over its layer's")
    args = parser.parse_args(argv)

    from diffusers import ControlNetModel
    from PIL import Image
    from safetensors.torch import save_file

    from sd_accel.models.components import random_pipeline
    from sd_accel.models.families import get_family, load_family_configs

    from support.controlnet_layout import controlnet_to_original
    from support.ldm_layout import save_single_file

    args.out.mkdir(parents=True, exist_ok=True)
    pipe = random_pipeline(load_family_configs(get_family("sd15")), seed=args.seed)
    save_single_file(pipe, args.out / "sd15-random.safetensors", dtype=torch.float16)
    print("wrote", args.out / "sd15-random.safetensors", flush=True)

    gen = torch.Generator().manual_seed(args.seed + 1)
    lora = _lora_pairs(pipe.unet, "lora_unet", ("to_q", "to_k", "to_v", "to_out.0"), args.rank, args.scale, gen)
    n_unet = len(lora) // 3
    lora.update(_lora_pairs(pipe.text_encoder, "lora_te", ("q_proj", "k_proj", "v_proj", "out_proj"), args.rank,
                            args.scale, gen))
    save_file(lora, str(args.out / "random-lora.safetensors"), metadata={"format": "pt"})
    print("wrote", args.out / "random-lora.safetensors", f"({n_unet} UNet layers, {len(lora) // 3 - n_unet} text)",
          flush=True)

    torch.manual_seed(args.seed + 2)
    net = ControlNetModel.from_unet(pipe.unet).eval()
    with torch.no_grad():  # zero convolutions as trained nets are not: the residuals move the image
        for conv in [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]:
            torch.nn.init.normal_(conv.weight, std=0.02)
    del pipe
    state = {k: v.half() if v.is_floating_point() else v for k, v in controlnet_to_original(net).items()}
    save_file(state, str(args.out / "cn-random-sd15.safetensors"), metadata={"format": "pt"})
    print("wrote", args.out / "cn-random-sd15.safetensors", flush=True)

    noise = np.random.default_rng(args.seed).integers(0, 256, (512, 512, 3), dtype=np.uint8)
    Image.fromarray(noise).save(args.out / "hint.png")
    print("wrote", args.out / "hint.png", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
