#!/usr/bin/env python
"""A diffusers folder of SD 3.5 Medium or FLUX.1 at their real widths with fewer blocks (random
weights), for comparisons that need every tool to load the same folder: optimum-intel exports
from a diffusers folder and keeps a whole fp32 model in memory while it does, which the real
sizes (T5-XXL 19 GB in fp32, FLUX.1 44 GB) do not allow on a 24 GB machine.

    .venv/bin/python scripts/scaled_pipeline.py /work/scaled/sd35m-2 --family sd3 --blocks 2 --t5-layers 2

Everything but the block counts is the real model's config (sd-accel's shipped configs: SD 3.5
Medium's dual-attention layers and qk-norm, CLIP-L, CLIP-G, T5-XXL's width and heads, the
16-channel VAE). A transformer call costs about (blocks / real blocks) of the real one; say so
with every figure made on such a folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from sd_accel.models.components import random_pipeline
from sd_accel.models.families import FAMILIES, load_family_configs, merged

REAL_BLOCKS = {"sd3": (24,), "flux-schnell": (19, 38), "flux-dev": (19, 38)}


def overrides(family: str, blocks: int, single: int, t5_layers: int) -> dict[str, dict]:
    """What changes in the family's real configs: the block counts and T5's layers."""
    t5 = "text_encoder_3" if family == "sd3" else "text_encoder_2"
    out: dict[str, dict] = {f"{t5}/config.json": {"num_layers": t5_layers}}
    if family == "sd3":
        # SD 3.5 Medium's first 13 of 24 blocks have the x-block self-attention: keep that share
        out["transformer/config.json"] = {"num_layers": blocks,
                                          "dual_attention_layers": list(range(max(1, round(blocks * 13 / 24))))}
    else:
        out["transformer/config.json"] = {"num_layers": blocks, "num_single_layers": single}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--family", choices=sorted(REAL_BLOCKS), default="sd3")
    ap.add_argument("--blocks", type=int, default=2, help="joint (SD3) or double (FLUX.1) blocks")
    ap.add_argument("--single", type=int, default=2, help="FLUX.1's single blocks")
    ap.add_argument("--t5-layers", type=int, default=2, help="T5-XXL's encoder layers (24 in the real one)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    configs = merged(load_family_configs(FAMILIES[args.family]),
                     overrides(args.family, args.blocks, args.single, args.t5_layers))
    pipe = random_pipeline(configs, seed=args.seed)
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    params = {name: sum(p.numel() for p in part.parameters()) for name, part in pipe.components.items()
              if hasattr(part, "parameters")}
    real = REAL_BLOCKS[args.family]
    (tmp / "scaled.json").write_text(json.dumps({
        "family": args.family, "blocks": args.blocks, "single": args.single if args.family != "sd3" else None,
        "real_blocks": real, "t5_layers": args.t5_layers, "seed": args.seed, "parameters": params}, indent=1))
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    print(json.dumps(params))


if __name__ == "__main__":
    main()
