"""Write a diffusers ``ControlNetModel`` as an original-layout single file (``control_model.*``, as
the ControlNet 1.1 files are): the inverse of diffusers' ``convert_controlnet_checkpoint``. The
input and middle blocks share the UNet's layout (``ldm_layout``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from support.ldm_layout import _UNET_FLAT, _unet_block_key, _unet_mid_key, _UNetLayout


def controlnet_to_original(net: torch.nn.Module, prefix: str = "control_model.") -> dict[str, torch.Tensor]:
    layout = _UNetLayout.of(SimpleNamespace(down_blocks=net.down_blocks, up_blocks=[]))
    n_blocks = len(net.controlnet_cond_embedding.blocks)
    out = {}
    for key, tensor in net.state_dict().items():
        name, _, param = key.rpartition(".")
        if key.startswith("controlnet_down_blocks."):
            i = key.split(".")[1]
            new = f"zero_convs.{i}.0.{param}"
        elif name == "controlnet_mid_block":
            new = f"middle_block_out.0.{param}"
        elif name == "controlnet_cond_embedding.conv_in":
            new = f"input_hint_block.0.{param}"
        elif name == "controlnet_cond_embedding.conv_out":
            new = f"input_hint_block.{2 * (n_blocks + 1)}.{param}"
        elif name.startswith("controlnet_cond_embedding.blocks."):
            new = f"input_hint_block.{2 * (int(name.split('.')[-1]) + 1)}.{param}"
        elif name in _UNET_FLAT:
            new = f"{_UNET_FLAT[name]}.{param}"
        else:
            new = _unet_block_key(layout, key) or _unet_mid_key(key)
            assert new is not None, key
        out[prefix + new] = tensor.detach().contiguous().clone()
    return out


def save_controlnet_file(net: torch.nn.Module, path: Path, prefix: str = "control_model.") -> Path:
    save_file(controlnet_to_original(net, prefix), str(path))
    return path
