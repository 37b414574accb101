"""The tiny autoencoder (TAESD, TAESDXL: diffusers' ``AutoencoderTiny``), loaded offline.

Three layouts people have on disk:

- a diffusers folder (``config.json`` + ``diffusion_pytorch_model.safetensors``, as
  ``madebyollin/taesd`` on the hub);
- the single files A1111 and ComfyUI use (``taesd_decoder.safetensors`` /
  ``taesd_encoder.safetensors``, also ``taesdxl_*``; ``.pth`` too): bare ``N.weight`` keys of the
  original ``nn.Sequential``; the decoder's index 0 is a parameter-free ``Clamp``, so decoder key
  ``N`` is diffusers' ``decoder.layers.{N-1}`` while encoder key ``N`` is ``encoder.layers.N``
  (what diffusers' own ``convert_tiny_autoencoder_to_diffusers.py`` does);
- one file with both halves, prefixed ``taesd_decoder.`` / ``taesd_encoder.`` (ComfyUI's own
  merged state dict), or diffusers' keys (``decoder.layers.*``).

The structure (channels, blocks per level, latent channels) is read from the weights' shapes, so
TAESD, TAESDXL and smaller test models load through one path; the rest of the config
(``latent_magnitude``, ``scaling_factor`` 1.0 ...) comes from ``configs/taesd/config.json``,
shipped in the package: nothing is downloaded.

TAESD decodes the UNet's latents as they are: its ``scaling_factor`` is 1.0, so the pipelines'
``latents / vae.config.scaling_factor`` leaves them unchanged (SD 1.5's VAE divides by 0.18215).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from sd_accel.core import CheckpointError, ModelNotFound
from sd_accel.models.checkpoint import PICKLE_SUFFIXES, SAFE_SUFFIXES, load_pickle_state_dict

log = logging.getLogger("sd_accel")

CONFIG = Path(__file__).resolve().parent / "configs" / "taesd" / "config.json"
_INDEX = re.compile(r"^(\d+)\.(.+)$")


class MissingEncoder(torch.nn.Module):
    """Stands in for the encoder of a tiny VAE loaded from a decoder file alone: txt2img needs no
    encoder, and an img2img call says what is missing instead of encoding with random weights."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise CheckpointError(
            f"the tiny VAE from {self.source} has no encoder weights, which img2img and inpainting need: put "
            "the matching taesd_encoder.safetensors (taesdxl_encoder for SDXL) beside the decoder file")


def _read(path: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    if path.suffix in SAFE_SUFFIXES:
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as exc:
            raise CheckpointError(f"{path} is not a readable .safetensors file ({exc})") from exc
    if path.suffix in PICKLE_SUFFIXES:
        return load_pickle_state_dict(path, allow_pickle)
    raise CheckpointError(f"{path}: a tiny VAE file must be .safetensors (or .pth with allow_pickle)")


def _sequential(sd: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Index -> its parameters, for bare ``N.rest`` keys."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        m = _INDEX.match(key)
        if m is None:
            raise CheckpointError(f"key {key!r} is not of a TAESD file (expected bare 'N.weight' keys)")
        out.setdefault(int(m.group(1)), {})[m.group(2)] = value
    return out


def _groups(layers: dict[int, dict[str, torch.Tensor]], start: int) -> tuple[list[int], list[int], int, int]:
    """(blocks per level, channels per level, channels in, channels out) of a TAESD Sequential whose
    first conv is at ``start``: a level opens at a plain conv; blocks (``conv.0.weight``) follow it."""
    blocks: list[int] = []
    channels: list[int] = []
    convs = [i for i in sorted(layers) if "conv.0.weight" not in layers[i]]
    first, last = convs[0], convs[-1]
    if first != start:
        raise CheckpointError(f"a TAESD layer list starts with a convolution at index {start}, this one at {first}")
    for i in sorted(layers):
        if i == last:
            break
        if "conv.0.weight" in layers[i]:
            blocks[-1] += 1
        else:
            blocks.append(0)
            channels.append(int(layers[i]["weight"].shape[0]))
    return blocks, channels, int(layers[first]["weight"].shape[1]), int(layers[last]["weight"].shape[0])


def _split(sd: dict[str, torch.Tensor]) -> tuple[dict | None, dict | None, str]:
    """(decoder, encoder) as bare-key dicts, or diffusers' full state dict, and the layout's name."""
    if any(k.startswith(("decoder.layers.", "encoder.layers.")) for k in sd):
        return None, None, "diffusers"
    dec = {k[len("taesd_decoder."):]: v for k, v in sd.items() if k.startswith("taesd_decoder.")}
    enc = {k[len("taesd_encoder."):]: v for k, v in sd.items() if k.startswith("taesd_encoder.")}
    if dec or enc:
        return dec or None, enc or None, "prefixed"
    return sd, None, "bare"


def _is_encoder(layers: dict[int, dict[str, torch.Tensor]]) -> bool:
    """An encoder starts with its RGB input conv at index 0; a decoder's index 0 is the Clamp."""
    return 0 in layers and int(layers[0]["weight"].shape[1]) == 3


def _partner(path: Path) -> Path | None:
    """``taesd_decoder.safetensors`` -> ``taesd_encoder.safetensors`` (and back), if it exists."""
    for a, b in (("decoder", "encoder"), ("encoder", "decoder")):
        if a in path.name:
            other = path.with_name(path.name.replace(a, b))
            return other if other.exists() else None
    return None


def _files_in(folder: Path) -> list[Path]:
    """The TAESD single files of a folder (ComfyUI's ``models/vae_approx``): one decoder, else an error."""
    found = sorted(p for p in folder.iterdir() if "decoder" in p.name and p.suffix in (*SAFE_SUFFIXES, *PICKLE_SUFFIXES))
    if len(found) == 1:
        return found
    names = ", ".join(p.name for p in found) or "none"
    raise ModelNotFound(f"{folder} holds no config.json and {len(found)} TAESD decoder files ({names}); "
                        "pass one file, e.g. tiny:{folder}/taesd_decoder.safetensors")


def load_tiny_vae(source: str | Path, allow_pickle: bool = False) -> torch.nn.Module:
    """An ``AutoencoderTiny`` from a diffusers folder, a TAESD single file (its encoder or decoder
    partner beside it is loaded too), or a folder holding one such decoder file.

    >>> vae = load_tiny_vae("builtin:taesd")   # or "models/vae_approx/taesd_decoder.safetensors"
    >>> type(vae).__name__, vae.config.scaling_factor
    ('AutoencoderTiny', 1.0)
    """
    from diffusers import AutoencoderTiny

    if str(source).startswith("builtin:"):
        from sd_accel.models.builtin import builtin_tiny_vae_path

        source = builtin_tiny_vae_path(str(source))
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelNotFound(f"tiny VAE {source}: no such file or folder")
    if path.is_dir() and (path / "config.json").exists():
        vae = AutoencoderTiny.from_pretrained(str(path), local_files_only=True)
        vae.eval()
        return vae
    if path.is_dir():
        path = _files_in(path)[0]
    files = [path] + [p for p in (_partner(path),) if p is not None]
    decoder: dict | None = None
    encoder: dict | None = None
    for f in files:
        sd = _read(f, allow_pickle)
        dec, enc, layout = _split(sd)
        if layout == "diffusers":
            return _build(json.loads(CONFIG.read_text()), None, None, sd, str(f))
        if layout == "bare" and _is_encoder(_sequential(dec)):
            dec, enc = None, dec
        decoder = decoder or dec
        encoder = encoder or enc
    if decoder is None:
        raise CheckpointError(f"{path} holds a TAESD encoder but no decoder was found beside it "
                              "(expected taesd_decoder.safetensors in the same folder)")
    return _build(json.loads(CONFIG.read_text()), _sequential(decoder),
                  _sequential(encoder) if encoder else None, None, str(path))


def _build(config: dict, dec, enc, diffusers_sd: dict | None, source: str) -> torch.nn.Module:
    from diffusers import AutoencoderTiny

    config = {k: v for k, v in config.items() if not k.startswith("_")}
    state: dict[str, torch.Tensor] = {}
    if diffusers_sd is not None:
        state = diffusers_sd
        enc_present = any(k.startswith("encoder.") for k in state)
        dec_present = any(k.startswith("decoder.") for k in state)
        if not dec_present:
            raise CheckpointError(f"{source} holds no decoder.layers.* weights")
    else:
        # The decoder: Clamp at 0, its input conv at 1; the last level's conv has bias (RGB out).
        blocks, channels, lat, out = _groups(dec, 1)
        config.update(latent_channels=lat, out_channels=out, num_decoder_blocks=blocks,
                      decoder_block_out_channels=channels)
        state.update({f"decoder.layers.{i - 1}.{k}": v for i, p in dec.items() for k, v in p.items()})
        enc_present = enc is not None
        if enc is not None:
            eblocks, echannels, in_ch, elat = _groups(enc, 0)
            if elat != lat:
                raise CheckpointError(f"{source}: the encoder makes {elat} latent channels, the decoder takes {lat}: "
                                      "they are not one pair (TAESD and TAESDXL files mixed?)")
            config.update(in_channels=in_ch, num_encoder_blocks=eblocks, encoder_block_out_channels=echannels)
            state.update({f"encoder.layers.{i}.{k}": v for i, p in enc.items() for k, v in p.items()})
        else:
            # shapes only: the encoder is replaced below
            config.update(num_encoder_blocks=[1] * len(blocks), encoder_block_out_channels=channels)
    vae = AutoencoderTiny(**config)
    wanted = {k for k in vae.state_dict() if enc_present or not k.startswith("encoder.")}
    missing = sorted(wanted - set(state))
    unexpected = sorted(set(state) - set(vae.state_dict()))
    if missing or unexpected:
        raise CheckpointError(f"{source} does not fit a TAESD autoencoder: missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]} (is it a TAESD file?)")
    vae.load_state_dict(state, strict=False)
    if not enc_present:
        vae.encoder = MissingEncoder(source)
        log.info("tiny VAE %s: decoder only (no encoder file beside it)", source)
    vae.eval()
    return vae
