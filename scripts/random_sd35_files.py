#!/usr/bin/env python3
"""Random-weight Stable Diffusion 3.5 (Medium layout) files for a real Stable Diffusion WebUI Forge
(docs/dev/forge-real.md, "SD3.5 in a real Forge"): **all weights are random** (seeded), the real
widths, nothing downloaded.

    PYTHONPATH=. .venv/bin/python scripts/random_sd35_files.py OUT [--blocks 2]

writes into ``OUT`` (each file tensor by tensor, as ``random_flux_files.py`` does, so the peak RSS
stays near the largest tensor):

- ``sd35-medium-random.safetensors``: the MMDiT-X of SD3.5 Medium in Stability's single-file layout
  (``model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight``, ``x_embedder.proj``,
  ``pos_embed``, ``t_embedder``, ``y_embedder``, ``context_embedder``, ``final_layer``) at the real
  width (hidden 1536 = 24 heads x 64, patch 2, 16 latent channels, adm_in_channels 2048, context
  4096, pos_embed_max_size 384: ``pos_embed`` is ``[1, 147456, 1536]``, RMS qk norm ``ln_q``/``ln_k``)
  with ``--blocks`` joint blocks (2): every block has the MMDiT-X second self-attention of the image
  stream (``x_block.attn2``, as SD3.5 Medium's blocks 0-12), the last one is ``context_pre_only``
  (context block without ``attn.proj``, ``norm2``/``mlp``, 2 modulations), bf16;
- ``clip_g-random.safetensors``: OpenCLIP ViT-bigG's text tower in transformers'
  ``CLIPTextModelWithProjection`` keys (``text_model.*`` and ``text_projection.weight``; 32 layers,
  width 1280, 20 heads, MLP 5120), the layout Forge's loader takes for ``clip_g`` from a separate
  file, fp16 (695 M parameters);
- with ``--all``, also CLIP-L (with SD3's ``text_projection``), T5-XXL (fp8) and the 16-channel VAE
  of ``random_flux_files.py`` (the SD3 VAE has the FLUX VAE's layout and config). Without ``--all``
  bring those: the FLUX files serve, except FLUX's clip_l, which lacks SD3's projection.

Weights N(0, ``--std``) (0.02), biases 0, norm scales 1 (``pos_embed`` N(0, 0.02) too).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from random_flux_files import Spec, _linear, clip_l_spec, flux_vae_spec, t5xxl_spec, write_safetensors

HIDDEN, HEADS, PATCH, LATENT, ADM, CONTEXT, POS_MAX = 1536, 24, 2, 16, 2048, 4096, 384
PREFIX = "model.diffusion_model."


def _attn(s: Spec, name: str, pre_only: bool) -> None:
    _linear(s, f"{name}.qkv", 3 * HIDDEN, HIDDEN)
    s += [(f"{name}.ln_q.weight", (HIDDEN // HEADS,), "ones"), (f"{name}.ln_k.weight", (HIDDEN // HEADS,), "ones")]
    if not pre_only:
        _linear(s, f"{name}.proj", HIDDEN, HIDDEN)


def _half_block(s: Spec, name: str, pre_only: bool, self_attn2: bool) -> None:
    mods = 2 if pre_only else 9 if self_attn2 else 6
    _linear(s, f"{name}.adaLN_modulation.1", mods * HIDDEN, HIDDEN)
    _attn(s, f"{name}.attn", pre_only)
    if self_attn2:
        _attn(s, f"{name}.attn2", False)
    if not pre_only:
        _linear(s, f"{name}.mlp.fc1", 4 * HIDDEN, HIDDEN)
        _linear(s, f"{name}.mlp.fc2", HIDDEN, 4 * HIDDEN)


def mmditx_spec(blocks: int, self_attn2_blocks: int = 13) -> Spec:
    """SD3.5 Medium's MMDiT-X keys (Stability's ``sd3.5_medium.safetensors`` layout, with
    ``model.diffusion_model.``); ``self_attn2_blocks``: blocks 0..N-1 have ``x_block.attn2``
    (SD3.5 Medium: 13, as Forge's ``MMDiTX`` hard-codes for ``pos_embed_max_size`` 384)."""
    s: Spec = [("pos_embed", (1, POS_MAX * POS_MAX, HIDDEN), "w"),
               ("x_embedder.proj.weight", (HIDDEN, LATENT, PATCH, PATCH), "w"),
               ("x_embedder.proj.bias", (HIDDEN,), "zeros")]
    _linear(s, "t_embedder.mlp.0", HIDDEN, 256)
    _linear(s, "t_embedder.mlp.2", HIDDEN, HIDDEN)
    _linear(s, "y_embedder.mlp.0", HIDDEN, ADM)
    _linear(s, "y_embedder.mlp.2", HIDDEN, HIDDEN)
    _linear(s, "context_embedder", HIDDEN, CONTEXT)
    for i in range(blocks):
        last = i == blocks - 1
        _half_block(s, f"joint_blocks.{i}.context_block", pre_only=last, self_attn2=False)
        _half_block(s, f"joint_blocks.{i}.x_block", pre_only=False, self_attn2=i < self_attn2_blocks)
    _linear(s, "final_layer.linear", PATCH * PATCH * LATENT, HIDDEN)
    _linear(s, "final_layer.adaLN_modulation.1", 2 * HIDDEN, HIDDEN)
    return [(PREFIX + n, shape, init) for n, shape, init in s]


def clip_g_spec(layers: int = 32, width: int = 1280, mlp: int = 5120) -> Spec:
    """transformers' CLIPTextModelWithProjection keys at OpenCLIP ViT-bigG's text config."""
    s: Spec = [("text_model.embeddings.token_embedding.weight", (49408, width), "w"),
               ("text_model.embeddings.position_embedding.weight", (77, width), "w")]
    for i in range(layers):
        p = f"text_model.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            _linear(s, f"{p}.self_attn.{proj}", width, width)
        for norm in ("layer_norm1", "layer_norm2"):
            s += [(f"{p}.{norm}.weight", (width,), "ones"), (f"{p}.{norm}.bias", (width,), "zeros")]
        _linear(s, f"{p}.mlp.fc1", mlp, width)
        _linear(s, f"{p}.mlp.fc2", width, mlp)
    s += [("text_model.final_layer_norm.weight", (width,), "ones"),
          ("text_model.final_layer_norm.bias", (width,), "zeros"),
          ("text_projection.weight", (width, width), "w")]
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--blocks", type=int, default=2, help="joint blocks (SD3.5 Medium has 24)")
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--all", action="store_true", help="also write CLIP-L, T5-XXL (4.8 GB) and the VAE")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"sd_accel": "random weights (scripts/random_sd35_files.py)"}
    jobs = [("sd35-medium-random.safetensors", mmditx_spec(args.blocks), torch.bfloat16, args.seed),
            ("clip_g-random.safetensors", clip_g_spec(), torch.float16, args.seed + 5)]
    if args.all:
        # SD3 ships its CLIP-L with the projection head (FLUX.1's clip_l has none: sd-accel refuses
        # that one for SD3, saying so)
        clip_l = clip_l_spec() + [("text_projection.weight", (768, 768), "w")]
        jobs += [("clip_l-random.safetensors", clip_l, torch.float16, args.seed + 1),
                 ("ae-random.safetensors", flux_vae_spec(), torch.float32, args.seed + 2),
                 ("t5xxl-random-fp8_e4m3fn.safetensors", t5xxl_spec(), torch.float8_e4m3fn, args.seed + 4)]
    for name, spec, dtype, seed in jobs:
        n = write_safetensors(args.out / name, spec, dtype, args.std, seed, meta)
        print(f"{name}: {len(spec)} tensors, {n / 1e6:.1f} M parameters, {dtype}", flush=True)


if __name__ == "__main__":
    main()
