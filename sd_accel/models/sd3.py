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
from sd_accel.models.mapped_file import default_dtype, file_dtype, swap_scale_shift
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


# Stability's MMDiT names -> diffusers' SD3Transformer2DModel (diffusers' converter does the same
# with copies: torch.cat of every q / k / v, which would move the weights off the file's mapping)
_GLOBAL: tuple[tuple[str, str], ...] = (
    ("pos_embed", "pos_embed.pos_embed"), ("x_embedder.proj.", "pos_embed.proj."),
    ("t_embedder.mlp.0.", "time_text_embed.timestep_embedder.linear_1."),
    ("t_embedder.mlp.2.", "time_text_embed.timestep_embedder.linear_2."),
    ("y_embedder.mlp.0.", "time_text_embed.text_embedder.linear_1."),
    ("y_embedder.mlp.2.", "time_text_embed.text_embedder.linear_2."),
    ("context_embedder.", "context_embedder."), ("final_layer.linear.", "proj_out."),
)
_BLOCK: tuple[tuple[str, str], ...] = (
    ("x_block.attn.ln_q.", "attn.norm_q."), ("x_block.attn.ln_k.", "attn.norm_k."),
    ("context_block.attn.ln_q.", "attn.norm_added_q."), ("context_block.attn.ln_k.", "attn.norm_added_k."),
    ("x_block.attn.proj.", "attn.to_out.0."), ("context_block.attn.proj.", "attn.to_add_out."),
    ("x_block.attn2.ln_q.", "attn2.norm_q."), ("x_block.attn2.ln_k.", "attn2.norm_k."),
    ("x_block.attn2.proj.", "attn2.to_out.0."), ("x_block.adaLN_modulation.1.", "norm1.linear."),
    ("x_block.mlp.fc1.", "ff.net.0.proj."), ("x_block.mlp.fc2.", "ff.net.2."),
    ("context_block.mlp.fc1.", "ff_context.net.0.proj."), ("context_block.mlp.fc2.", "ff_context.net.2."),
)
_QKV = {"x_block.attn.qkv.": ("attn.to_q.", "attn.to_k.", "attn.to_v."),
        "context_block.attn.qkv.": ("attn.add_q_proj.", "attn.add_k_proj.", "attn.add_v_proj."),
        "x_block.attn2.qkv.": ("attn2.to_q.", "attn2.to_k.", "attn2.to_v.")}


def to_diffusers(name: str, tensor: torch.Tensor, last: int) -> list[tuple[str, torch.Tensor]]:
    """One MMDiT tensor as diffusers' ``SD3Transformer2DModel`` names it (fused q/k/v split as
    views, the final and the last block's context modulation's shift and scale swapped); ``last``
    is the index of the last joint block (its context side has no attention output nor MLP)."""
    if name.startswith("final_layer.adaLN_modulation.1."):
        return [("norm_out.linear." + name.rsplit(".", 1)[1], swap_scale_shift(tensor))]
    for old, new in _GLOBAL:
        if name.startswith(old):
            return [(new + name[len(old):], tensor)]
    match = re.match(r"joint_blocks\.(\d+)\.(.+)", name)
    if match is None:
        raise CheckpointError(f"{name}: not an SD3 transformer weight sd-accel knows")
    index, rest = int(match.group(1)), match.group(2)
    block = f"transformer_blocks.{index}."
    for old, names in _QKV.items():
        if rest.startswith(old):
            suffix = rest[len(old):]
            return [(block + n + suffix, t) for n, t in zip(names, tensor.chunk(3, dim=0), strict=True)]
    if rest.startswith("context_block.adaLN_modulation.1."):
        value = swap_scale_shift(tensor) if index == last else tensor
        return [(block + "norm1_context.linear." + rest.rsplit(".", 1)[1], value)]
    for old, new in _BLOCK:
        if rest.startswith(old):
            return [(block + new + rest[len(old):], tensor)]
    raise CheckpointError(f"{name}: not an SD3 transformer weight sd-accel knows")


def load_transformer(path: Path, config: dict[str, Any], prefix: str, dtype: torch.dtype):
    """The MMDiT built from ``config`` with its weights left on the file's memory mapping
    (:func:`sd_accel.models.mapped_file.model_on_file`): SD3.5 Large's 16 GB of bf16 and T5 would
    not fit a 24 GB machine copied."""
    import diffusers

    from sd_accel.models.mapped_file import model_on_file

    last = int(config["num_layers"]) - 1
    return model_on_file(diffusers.SD3Transformer2DModel, config, path, prefix,
                         lambda name, tensor: to_diffusers(name, tensor, last), dtype, "the SD3 transformer")


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
    dtype = torch_dtype or default_dtype(file_dtype(path, prefix + MARKER))
    transformer = load_transformer(path, configs["transformer/config.json"], prefix, dtype)
    try:
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
