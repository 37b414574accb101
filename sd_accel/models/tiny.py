"""Tiny models of the real architectures, for the demo and the tests.

Each is the family's real config with small widths and depths. They keep every rule the real
models follow (SD 1.x UNet: 8 heads; SD 2.x/SDXL UNet and every text encoder: 64-wide heads;
the real 49408-token CLIP vocabulary; four VAE levels, so latents are 1/8 of the image), which
is what lets a tiny single-file checkpoint be loaded back through the same code as a real one.
Their weights are random: their images are noise.
"""

from __future__ import annotations

from typing import Any

_TINY_VAE = {"block_out_channels": [32, 32, 64, 64], "layers_per_block": 1}
_TINY_CLIP = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 1, "num_hidden_layers": 2}

TINY_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    "sd15": {
        "unet/config.json": {
            "block_out_channels": [32, 64],
            "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
            "layers_per_block": 1,
            "cross_attention_dim": 64,
            "attention_head_dim": 8,
        },
        "vae/config.json": _TINY_VAE,
        "text_encoder/config.json": dict(_TINY_CLIP, projection_dim=64),
    },
    "sd2-v": {
        "unet/config.json": {
            "block_out_channels": [64, 128],
            "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
            "layers_per_block": 1,
            "cross_attention_dim": 64,
            "attention_head_dim": [1, 2],
        },
        "vae/config.json": _TINY_VAE,
        "text_encoder/config.json": dict(_TINY_CLIP, projection_dim=64),
    },
    "sdxl": {
        "unet/config.json": {
            "block_out_channels": [64, 128],
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
            "layers_per_block": 1,
            "cross_attention_dim": 64 + 128,
            "attention_head_dim": [1, 2],
            "transformer_layers_per_block": [1, 2],
            "addition_time_embed_dim": 8,
            "projection_class_embeddings_input_dim": 128 + 6 * 8,
        },
        "vae/config.json": _TINY_VAE,
        "text_encoder/config.json": dict(_TINY_CLIP, projection_dim=64),
        # Wider than the first encoder, as in the real model: diffusers' single-file loader tells
        # the two encoders apart by width.
        "text_encoder_2/config.json": dict(
            _TINY_CLIP, hidden_size=128, intermediate_size=256, num_attention_heads=2, projection_dim=128
        ),
    },
}
TINY_OVERRIDES["sd2-base"] = TINY_OVERRIDES["sd2-v"]

# The transformer families. SD3 concatenates both CLIPs' hidden states padded to T5's width, so the
# tiny T5 is as wide as the two tiny CLIPs together (the real one: 4096 >= 768 + 1280); T5 keeps
# its real 32,128-token vocabulary (the shipped tokenizer's ids must fit).
_TINY_T5 = {"d_model": 192, "d_ff": 256, "d_kv": 16, "num_heads": 4, "num_layers": 2, "num_decoder_layers": 2}
_TINY_CLIP2 = dict(_TINY_CLIP, hidden_size=128, intermediate_size=256, num_attention_heads=2, projection_dim=128)
TINY_OVERRIDES["sd3"] = {
    "transformer/config.json": {
        "attention_head_dim": 16, "num_attention_heads": 2, "num_layers": 2, "dual_attention_layers": [0],
        "caption_projection_dim": 32, "joint_attention_dim": 192, "pooled_projection_dim": 64 + 128,
        "pos_embed_max_size": 96, "sample_size": 32,
    },
    "vae/config.json": _TINY_VAE,
    "text_encoder/config.json": dict(_TINY_CLIP, projection_dim=64),
    "text_encoder_2/config.json": _TINY_CLIP2,
    "text_encoder_3/config.json": _TINY_T5,
}
_TINY_FLUX = {
    "transformer/config.json": {
        "attention_head_dim": 32, "axes_dims_rope": [4, 14, 14], "num_attention_heads": 2, "num_layers": 1,
        "num_single_layers": 2, "joint_attention_dim": 192, "pooled_projection_dim": 64,
    },
    "vae/config.json": _TINY_VAE,
    "text_encoder/config.json": dict(_TINY_CLIP, projection_dim=64),
    "text_encoder_2/config.json": _TINY_T5,
}
TINY_OVERRIDES["flux-dev"] = _TINY_FLUX
TINY_OVERRIDES["flux-schnell"] = _TINY_FLUX
