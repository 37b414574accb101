"""A tiny random AutoencoderTiny written in the layouts people download TAESD in."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_TAESD = dict(encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                  num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1))


def tiny_autoencoder(seed: int = 0):
    from diffusers import AutoencoderTiny

    torch.manual_seed(seed)
    return AutoencoderTiny(**TINY_TAESD).eval()


def write_layouts(vae, root: Path) -> dict[str, Path]:
    """``diffusers`` (a from_pretrained folder), ``single`` (taesd_decoder/encoder.safetensors with
    the original bare ``N.weight`` keys: the decoder's index 0 is its Clamp), ``decoder_only``, and
    ``prefixed`` (one file, ``taesd_decoder.N.weight`` / ``taesd_encoder.N.weight``)."""
    from safetensors.torch import save_file

    sd = vae.state_dict()
    dec = {f"{int(k.split('.')[2]) + 1}.{k.split('.', 3)[3]}": v.contiguous()
           for k, v in sd.items() if k.startswith("decoder.layers.")}
    enc = {k[len("encoder.layers."):]: v.contiguous() for k, v in sd.items() if k.startswith("encoder.layers.")}
    vae.save_pretrained(root / "diffusers")
    for name in ("single", "decoder_only"):
        (root / name).mkdir(parents=True)
        save_file(dec, str(root / name / "taesd_decoder.safetensors"))
    save_file(enc, str(root / "single" / "taesd_encoder.safetensors"))
    # ComfyUI's merged state dict: both halves in one file under prefixes
    save_file({**{f"taesd_decoder.{k}": v for k, v in dec.items()}, **{f"taesd_encoder.{k}": v for k, v in enc.items()}},
              str(root / "taesd_merged.safetensors"))
    return {"diffusers": root / "diffusers", "single": root / "single" / "taesd_decoder.safetensors",
            "decoder_only": root / "decoder_only" / "taesd_decoder.safetensors",
            "prefixed": root / "taesd_merged.safetensors"}
