"""Fit a family's reference configs to the shapes a checkpoint really has.

Fine-tunes of a family share its shapes, so for them this changes nothing; it is what lets a
checkpoint of another width or depth (the tiny test models, pruned or merged oddities) load
through the same path. Head counts are not stored in weights; they follow each family's rule:
SD 1.x UNets use 8 heads, SD 2.x/SDXL UNets and all CLIP text encoders use 64-wide heads.
"""

from __future__ import annotations

from typing import Any

from sd_accel.core import CheckpointError
from sd_accel.models.checkpoint import Shapes
from sd_accel.models.detect import (
    CLIP_L_SD1,
    LCM_COND_PROJ,
    OPENCLIP_SD2,
    UNET,
    VAE,
    XL_TE1,
    XL_TE2,
    Detected,
)

HEAD_WIDTH = 64
Overrides = dict[str, dict[str, Any]]


def _count(shapes: Shapes, pattern: str) -> int:
    """How many consecutive indices ``{i}`` exist for keys starting with ``pattern.format(i=...)``."""
    n = 0
    while any(k.startswith(pattern.format(i=n)) for k in shapes):
        n += 1
    return n


def _need(shapes: Shapes, key: str) -> tuple[int, ...]:
    try:
        return shapes[key]
    except KeyError:
        raise CheckpointError(f"checkpoint is missing {key}; the file may be truncated or not a full model") from None


def _unet_levels(shapes: Shapes) -> list[dict[str, Any]]:
    """Walk LDM ``input_blocks``: per resolution level, its width, res-block count and attention depth."""
    levels: list[dict[str, Any]] = [{"channels": None, "blocks": 0, "depth": 0, "linear": None}]
    i = 1
    while any(k.startswith(f"{UNET}input_blocks.{i}.") for k in shapes):
        p = f"{UNET}input_blocks.{i}."
        if p + "0.op.weight" in shapes:  # a Downsample closes the level
            levels.append({"channels": None, "blocks": 0, "depth": 0, "linear": None})
        else:
            lvl = levels[-1]
            lvl["channels"] = _need(shapes, p + "0.out_layers.3.weight")[0]
            lvl["blocks"] += 1
            if p + "1.proj_in.weight" in shapes:
                lvl["depth"] = _count(shapes, p + "1.transformer_blocks.{i}.")
                lvl["linear"] = len(shapes[p + "1.proj_in.weight"]) == 2
        i += 1
    return levels


def fit_unet(shapes: Shapes, det: Detected, base: dict[str, Any], te2_proj: int | None) -> dict[str, Any]:
    levels = _unet_levels(shapes)
    if not levels or levels[0]["channels"] is None:
        raise CheckpointError("checkpoint UNet has no input blocks; the file is not a full model")
    channels = [lvl["channels"] for lvl in levels]
    attn = [lvl["depth"] > 0 for lvl in levels]
    first_attn = next((k for k in shapes if k.startswith(UNET) and k.endswith("attn2.to_k.weight")), None)
    out: dict[str, Any] = {
        "in_channels": _need(shapes, UNET + "input_blocks.0.0.weight")[1],
        "out_channels": _need(shapes, UNET + "out.2.weight")[0],
        "block_out_channels": channels,
        "layers_per_block": levels[0]["blocks"],
        "down_block_types": ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attn],
        "up_block_types": ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attn)],
    }
    if first_attn:
        out["cross_attention_dim"] = shapes[first_attn][1]
    if LCM_COND_PROJ in shapes:  # (TimestepEmbedding.cond_proj: Linear(time_cond_proj_dim, C, bias=False))
        out["time_cond_proj_dim"] = shapes[LCM_COND_PROJ][1]
    linear = [lvl["linear"] for lvl in levels if lvl["linear"] is not None]
    if linear:
        out["use_linear_projection"] = linear[0]
    if det.family != "sd15":
        out["attention_head_dim"] = [c // HEAD_WIDTH for c in channels]
    if "transformer_layers_per_block" in base:
        out["transformer_layers_per_block"] = [max(lvl["depth"], 1) for lvl in levels]
    if det.is_xl:
        adm = _need(shapes, UNET + "label_emb.0.0.weight")[1]
        if te2_proj is None:
            raise CheckpointError("SDXL checkpoint lacks the second text encoder's projection")
        out["projection_class_embeddings_input_dim"] = adm
        out["addition_time_embed_dim"] = (adm - te2_proj) // 6
    return out


def fit_vae(shapes: Shapes) -> dict[str, Any]:
    p = VAE + "encoder."
    n_levels = _count(shapes, p + "down.{i}.")
    if n_levels == 0:
        raise CheckpointError("checkpoint VAE has no encoder blocks; the file is not a full model")
    channels = [_need(shapes, f"{p}down.{i}.block.0.conv2.weight")[0] for i in range(n_levels)]
    return {
        "in_channels": _need(shapes, p + "conv_in.weight")[1],
        "out_channels": _need(shapes, VAE + "decoder.conv_out.weight")[0],
        "latent_channels": _need(shapes, VAE + "decoder.conv_in.weight")[1],
        "block_out_channels": channels,
        "layers_per_block": _count(shapes, p + "down.0.block.{i}."),
        "down_block_types": ["DownEncoderBlock2D"] * n_levels,
        "up_block_types": ["UpDecoderBlock2D"] * n_levels,
    }


def fit_clip_l(shapes: Shapes, prefix: str) -> dict[str, Any]:
    """HF-layout CLIP text model (SD 1.x, SDXL's first encoder). Older files lack ``text_model.``."""
    tm = prefix + "text_model." if any(k.startswith(prefix + "text_model.") for k in shapes) else prefix
    vocab, hidden = _need(shapes, tm + "embeddings.token_embedding.weight")
    return {
        "hidden_size": hidden,
        "vocab_size": vocab,
        "max_position_embeddings": _need(shapes, tm + "embeddings.position_embedding.weight")[0],
        "num_hidden_layers": _count(shapes, tm + "encoder.layers.{i}."),
        "intermediate_size": _need(shapes, tm + "encoder.layers.0.mlp.fc1.weight")[0],
        "num_attention_heads": max(hidden // HEAD_WIDTH, 1),
    }


def fit_openclip(shapes: Shapes, prefix: str, drop_last: bool) -> dict[str, Any]:
    """OpenCLIP layout (SD 2.x, SDXL's second encoder). SD 2.x uses the penultimate layer, so
    diffusers' config counts one layer fewer than the file holds (``drop_last``)."""
    vocab, hidden = _need(shapes, prefix + "token_embedding.weight")
    layers = _count(shapes, prefix + "transformer.resblocks.{i}.")
    out = {
        "hidden_size": hidden,
        "vocab_size": vocab,
        "max_position_embeddings": _need(shapes, prefix + "positional_embedding")[0],
        "num_hidden_layers": layers - 1 if drop_last else layers,
        "intermediate_size": _need(shapes, prefix + "transformer.resblocks.0.mlp.c_fc.weight")[0],
        "num_attention_heads": max(hidden // HEAD_WIDTH, 1),
    }
    proj = shapes.get(prefix + "text_projection")
    if proj is not None:
        out["projection_dim"] = proj[-1]
    return out


def fit_configs(shapes: Shapes, det: Detected, base: Overrides) -> Overrides:
    """Overrides for each config file of ``base`` (the family's reference configs)."""
    out: Overrides = {}
    te2_proj = None
    if det.text_layout == "clip-l":
        out["text_encoder/config.json"] = fit_clip_l(shapes, CLIP_L_SD1)
    elif det.text_layout == "openclip":
        out["text_encoder/config.json"] = fit_openclip(shapes, OPENCLIP_SD2, drop_last=True)
    else:
        out["text_encoder/config.json"] = fit_clip_l(shapes, XL_TE1)
        out["text_encoder_2/config.json"] = fit_openclip(shapes, XL_TE2, drop_last=False)
        te2_proj = out["text_encoder_2/config.json"].get("projection_dim")
    out["unet/config.json"] = fit_unet(shapes, det, base["unet/config.json"], te2_proj)
    out["vae/config.json"] = fit_vae(shapes)
    return out

