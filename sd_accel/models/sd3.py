"""SD3 / SD3.5 single files as Stability publishes them: ``model.diffusion_model.`` (the MMDiT),
``first_stage_model.`` (the VAE) and, in the "include clips" files, ``text_encoders.clip_l`` /
``clip_g`` / ``t5xxl``; without them, the encoders are the separate ``clip_l.safetensors``,
``clip_g.safetensors`` and ``t5xxl_fp16.safetensors`` (or ``t5xxl_fp8_e4m3fn``) beside the file or
in ComfyUI's ``clip`` / ``text_encoders`` folders. A bare MMDiT file (ComfyUI's diffusion_models
folder: no prefix, no VAE) takes the VAE from a file too.

Detected by keys and shapes (3.5 Medium's dual-attention layers: ``x_block.attn2``; qk-norm:
``ln_q``); the configs come from the shipped SD 3.5 Medium folder, fitted to the file.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from sd_accel.core import CheckpointError
from sd_accel.models.checkpoint import Shapes, read_shapes
from sd_accel.models.families import get_family, load_family_configs, materialize
from sd_accel.models.text_files import find_files, load_clip, load_t5, vae_config

MARKER = "joint_blocks.0.x_block.attn.qkv.weight"
PREFIXES = ("model.diffusion_model.", "")
VAE_PREFIX = "first_stage_model."
ENCODERS = {"clip_l": "text_encoders.clip_l.transformer.", "clip_g": "text_encoders.clip_g.transformer.",
            "t5": "text_encoders.t5xxl.transformer."}
PARTS: dict[str, tuple[str, ...]] = {
    "vae": ("sd3*vae*.safetensors", "*sd3*vae*.safetensors", "*sd35*vae*.safetensors"),
    "clip_l": ("clip_l.safetensors", "clip_l*.safetensors", "*clip_l*.safetensors"),
    "clip_g": ("clip_g.safetensors", "clip_g*.safetensors", "*clip_g*.safetensors"),
    "t5": ("t5xxl_fp16.safetensors", "t5xxl*.safetensors", "*t5xxl*.safetensors"),
}


def sd3_prefix(shapes: Shapes) -> str | None:
    """The MMDiT's key prefix in an SD3 / SD3.5 file, or None when it is not one."""
    return next((p for p in PREFIXES if p + MARKER in shapes), None)


def transformer_config(base: dict[str, Any], shapes: Shapes, prefix: str) -> dict[str, Any]:
    """SD3Transformer2DModel's config fitted to the file."""
    proj = shapes[f"{prefix}x_embedder.proj.weight"]  # (hidden, channels, patch, patch)
    hidden, patch = proj[0], proj[2]
    norm = shapes.get(f"{prefix}joint_blocks.0.x_block.attn.ln_q.weight")
    head = norm[0] if norm else 64
    layers = sorted({int(m.group(1)) for k in shapes if (m := re.match(re.escape(prefix) + r"joint_blocks\.(\d+)\.", k))})
    context = shapes[f"{prefix}context_embedder.weight"]
    positions = shapes[f"{prefix}pos_embed"][1]
    return dict(base, in_channels=proj[1], patch_size=patch, attention_head_dim=head, num_attention_heads=hidden // head,
                num_layers=len(layers), caption_projection_dim=context[0], joint_attention_dim=context[1],
                pooled_projection_dim=shapes[f"{prefix}y_embedder.mlp.0.weight"][1],
                out_channels=shapes[f"{prefix}final_layer.linear.weight"][0] // (patch * patch),
                pos_embed_max_size=math.isqrt(positions), qk_norm="rms_norm" if norm else None,
                dual_attention_layers=[i for i in layers if f"{prefix}joint_blocks.{i}.x_block.attn2.qkv.weight" in shapes])


def load_sd3(path: Path, shapes: Shapes, parts: dict[str, str | Path] | None = None,
             torch_dtype: torch.dtype | None = None):
    """A ``StableDiffusion3Pipeline`` from an SD3 / SD3.5 file and, for what it lacks, its part files."""
    import diffusers
    import transformers

    prefix = sd3_prefix(shapes)
    if prefix is None:
        raise CheckpointError(f"{path.name} is not an SD3 / SD3.5 checkpoint ({MARKER} missing)")
    inside = {part for part, p in ENCODERS.items() if any(k.startswith(p) for k in shapes)}
    if any(k.startswith(VAE_PREFIX) for k in shapes):
        inside.add("vae")
    wanted = {k: v for k, v in PARTS.items() if k not in inside or k in (parts or {})}
    files = find_files(path, parts, wanted, "an SD3 / SD3.5 model") if wanted else {}
    configs = load_family_configs(get_family("sd3"))
    configs["transformer/config.json"] = transformer_config(configs["transformer/config.json"], shapes, prefix)
    vae_file, vae_prefix = (files["vae"], "") if "vae" in files else (path, VAE_PREFIX)
    configs["vae/config.json"] = vae_config(configs["vae/config.json"], read_shapes(vae_file), vae_prefix)
    folder = materialize(configs)
    dtype = torch_dtype or torch.float32
    try:
        transformer = diffusers.SD3Transformer2DModel.from_single_file(
            str(path), config=str(folder), subfolder="transformer", local_files_only=True, torch_dtype=dtype)
        vae = diffusers.AutoencoderKL.from_single_file(str(vae_file), config=str(folder), subfolder="vae",
                                                       local_files_only=True, torch_dtype=dtype)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{path.name} looks like {get_family('sd3').title} but its weights do not fit "
                              f"({type(exc).__name__}: {str(exc)[:300]}); it may be truncated or another variant") from exc

    def source(part: str) -> tuple[Path, str]:  # (the file, the key prefix there)
        return (files[part], "") if part in files else (path, ENCODERS[part])

    (l_file, l_prefix), (g_file, g_prefix), (t_file, t_prefix) = source("clip_l"), source("clip_g"), source("t5")
    clip_l = load_clip(l_file, configs["text_encoder/config.json"], True, dtype, l_prefix)
    clip_g = load_clip(g_file, configs["text_encoder_2/config.json"], True, dtype, g_prefix)
    t5 = load_t5(t_file, configs["text_encoder_3/config.json"], dtype, t_prefix)
    tokenizers = {"tokenizer": transformers.CLIPTokenizer.from_pretrained(folder / "tokenizer"),
                  "tokenizer_2": transformers.CLIPTokenizer.from_pretrained(folder / "tokenizer_2"),
                  "tokenizer_3": transformers.T5TokenizerFast.from_pretrained(folder / "tokenizer_3")}
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    return diffusers.StableDiffusion3Pipeline(
        scheduler=scheduler, vae=vae, text_encoder=clip_l, text_encoder_2=clip_g, text_encoder_3=t5,
        transformer=transformer.eval(), **tokenizers)


__all__ = ["PARTS", "load_sd3", "sd3_prefix", "transformer_config"]
