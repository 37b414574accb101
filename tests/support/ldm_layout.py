"""Write a diffusers Stable Diffusion pipeline in the original single-file checkpoint layout.

The original layout is the one of the ``.safetensors`` files WebUI users download (CompVis/LDM and
Stability's ``sgm`` names): ``model.diffusion_model.*`` for the UNet, ``first_stage_model.*`` for
the VAE, and per family

* SD 1.x: ``cond_stage_model.transformer.text_model.*`` (Hugging Face CLIP-L names),
* SD 2.x: ``cond_stage_model.model.*`` (OpenCLIP names, q/k/v packed into ``in_proj_*``),
* SDXL base: ``conditioner.embedders.0.transformer.text_model.*`` + ``conditioner.embedders.1.model.*``.

This is the inverse of ``diffusers.loaders.single_file_utils`` (``convert_ldm_unet_checkpoint``,
``convert_ldm_vae_checkpoint``, ``convert_ldm_clip_checkpoint``, ``convert_open_clip_checkpoint``):
a file written here is read back by diffusers into exactly the tensors it came from.

The block numbering is derived from the models themselves (how many resnets each block has,
whether it has attentions, up/down samplers), so any UNet/VAE built from the SD block types
converts, whatever its widths and depths (the tiny test models included).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
SD1_CLIP_PREFIX = "cond_stage_model.transformer."
SD2_OPEN_CLIP_PREFIX = "cond_stage_model.model."
SDXL_CLIP_PREFIX = "conditioner.embedders.0.transformer."
SDXL_OPEN_CLIP_PREFIX = "conditioner.embedders.1.model."

TextLayout = Literal["sd1", "sd2", "sdxl"]
StateDict = dict[str, torch.Tensor]

# -- UNet -------------------------------------------------------------------------------------

# Top-level UNet tensors. The SDXL ``add_embedding`` and a class embedding both live at
# ``label_emb`` in the original model; a UNet never has both.
_UNET_FLAT = {
    "conv_in": "input_blocks.0.0",
    # LCM-distilled UNets: diffusers' conversion keeps the name (no original-layout one exists)
    "time_embedding.cond_proj": "time_embedding.cond_proj",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "class_embedding.linear_1": "label_emb.0.0",
    "class_embedding.linear_2": "label_emb.0.2",
    "class_embedding": "label_emb",  # nn.Embedding (x4 upscaler's num_class_embeds)
}
_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}
_UNET_BLOCK_KEY = re.compile(
    r"(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)"
)
_MID_KEY = re.compile(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)")


@dataclass(frozen=True)
class _UNetLayout:
    """Where each diffusers block starts in the original ``input_blocks``/``output_blocks`` lists.

    The original UNet is flat: every resnet (with its attention, if any) is one entry, and each
    down sampler is an entry of its own; an up sampler shares the entry of its block's last resnet.
    """

    down_start: tuple[int, ...]
    down_len: tuple[int, ...]
    up_start: tuple[int, ...]
    up_len: tuple[int, ...]
    up_has_attn: tuple[bool, ...]

    @classmethod
    def of(cls, unet: torch.nn.Module) -> _UNetLayout:
        down_start, down_len = [], []
        index = 1  # input_blocks.0 is conv_in
        for block in unet.down_blocks:
            down_start.append(index)
            down_len.append(len(block.resnets))
            index += len(block.resnets) + (1 if getattr(block, "downsamplers", None) else 0)
        up_start, up_len, up_attn = [], [], []
        index = 0
        for block in unet.up_blocks:
            up_start.append(index)
            up_len.append(len(block.resnets))
            up_attn.append(bool(getattr(block, "attentions", None)))
            index += len(block.resnets)
        return cls(tuple(down_start), tuple(down_len), tuple(up_start), tuple(up_len), tuple(up_attn))


def _unet_resnet_name(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return f"{_UNET_RESNET.get(head, head)}.{tail}"


def _unet_block_key(layout: _UNetLayout, key: str) -> str | None:
    m = _UNET_BLOCK_KEY.fullmatch(key)
    if m is None:
        return None
    side, block, kind, layer, rest = m[1], int(m[2]), m[3], int(m[4]), m[5]
    if side == "down_blocks":
        start = layout.down_start[block]
        if kind == "resnets":
            return f"input_blocks.{start + layer}.0.{_unet_resnet_name(rest)}"
        if kind == "attentions":
            return f"input_blocks.{start + layer}.1.{rest}"
        # Downsample2D's conv is ``op`` in the original, one entry after the block's last layer.
        return f"input_blocks.{start + layout.down_len[block]}.0.{rest.replace('conv.', 'op.', 1)}"
    start = layout.up_start[block]
    if kind == "resnets":
        return f"output_blocks.{start + layer}.0.{_unet_resnet_name(rest)}"
    if kind == "attentions":
        return f"output_blocks.{start + layer}.1.{rest}"
    # The upsampler follows the last resnet's attention when the block has one.
    slot = 2 if layout.up_has_attn[block] else 1
    return f"output_blocks.{start + layout.up_len[block] - 1}.{slot}.{rest}"


def _unet_mid_key(key: str) -> str | None:
    m = _MID_KEY.fullmatch(key)
    if m is None:
        return None
    kind, index, rest = m[1], int(m[2]), m[3]
    # middle_block is [resnet, attention, resnet, ...]: resnets at even slots, attentions at odd.
    if kind == "resnets":
        return f"middle_block.{2 * index}.{_unet_resnet_name(rest)}"
    return f"middle_block.{2 * index + 1}.{rest}"


def _unet_flat_key(key: str) -> str | None:
    module, _, param = key.rpartition(".")
    target = _UNET_FLAT.get(module)
    return f"{target}.{param}" if target else None


def unet_to_original(unet: torch.nn.Module) -> StateDict:
    """A ``UNet2DConditionModel``'s weights under their ``model.diffusion_model.*`` names.

    Transformer (attention) blocks keep their names: diffusers adopted the original ones.
    """
    layout = _UNetLayout.of(unet)
    out: StateDict = {}
    for key, value in unet.state_dict().items():
        name = _unet_block_key(layout, key) or _unet_mid_key(key) or _unet_flat_key(key)
        if name is None:
            raise ValueError(f"no original-layout name for UNet weight {key!r}")
        if UNET_PREFIX + name in out:
            raise ValueError(f"two UNet weights map to {UNET_PREFIX + name!r}")
        out[UNET_PREFIX + name] = value
    return out


# -- VAE --------------------------------------------------------------------------------------

# Top-level VAE modules: only the output norms change name (conv_norm_out -> norm_out).
_VAE_FLAT = {
    "encoder.conv_in": "encoder.conv_in",
    "encoder.conv_norm_out": "encoder.norm_out",
    "encoder.conv_out": "encoder.conv_out",
    "decoder.conv_in": "decoder.conv_in",
    "decoder.conv_norm_out": "decoder.norm_out",
    "decoder.conv_out": "decoder.conv_out",
    "quant_conv": "quant_conv",
    "post_quant_conv": "post_quant_conv",
}
_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_VAE_KEY = re.compile(
    r"(encoder|decoder)\.(down_blocks|up_blocks)\.(\d+)\.(resnets|downsamplers|upsamplers)\.(\d+)\.(.+)"
)
_VAE_MID = re.compile(r"(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d+)\.(.+)")


def _vae_resnet_name(rest: str) -> str:
    return rest.replace("conv_shortcut.", "nin_shortcut.", 1)


def _vae_block_key(n_up: int, key: str) -> str | None:
    m = _VAE_KEY.fullmatch(key)
    if m is None:
        return None
    part, side, block, kind, layer, rest = m[1], m[2], int(m[3]), m[4], int(m[5]), m[6]
    if side == "down_blocks":
        if kind == "resnets":
            return f"{part}.down.{block}.block.{layer}.{_vae_resnet_name(rest)}"
        return f"{part}.down.{block}.downsample.{rest}"
    # The original decoder numbers its levels from the highest resolution up: reversed.
    level = n_up - 1 - block
    if kind == "resnets":
        return f"{part}.up.{level}.block.{layer}.{_vae_resnet_name(rest)}"
    return f"{part}.up.{level}.upsample.{rest}"


def _vae_mid_key(key: str) -> tuple[str, bool] | None:
    """The original name of a mid-block weight, and whether it is an attention projection."""
    m = _VAE_MID.fullmatch(key)
    if m is None:
        return None
    part, kind, index, rest = m[1], m[2], int(m[3]), m[4]
    if kind == "resnets":
        return f"{part}.mid.block_{index + 1}.{_vae_resnet_name(rest)}", False
    module, _, param = rest.rpartition(".")
    if module not in _VAE_ATTN:
        raise ValueError(f"unexpected VAE attention weight {key!r}")
    return f"{part}.mid.attn_{index + 1}.{_VAE_ATTN[module]}.{param}", module != "group_norm"


def _vae_flat_key(key: str) -> str | None:
    module, _, param = key.rpartition(".")
    target = _VAE_FLAT.get(module)
    return f"{target}.{param}" if target else None


def vae_to_original(vae: torch.nn.Module) -> StateDict:
    """An ``AutoencoderKL``'s weights under their ``first_stage_model.*`` names.

    The mid-block attention projections are 1x1 convolutions in the original model, so their
    linear weights get two trailing unit dimensions.
    """
    n_up = len(vae.decoder.up_blocks)
    out: StateDict = {}
    for key, value in vae.state_dict().items():
        name = _vae_block_key(n_up, key) or _vae_flat_key(key)
        if name is None and (mid := _vae_mid_key(key)) is not None:
            name, is_projection = mid
            if is_projection and value.ndim == 2:
                value = value.reshape(*value.shape, 1, 1)
        if name is None:
            raise ValueError(f"no original-layout name for VAE weight {key!r}")
        out[VAE_PREFIX + name] = value
    return out


# -- Text encoders ----------------------------------------------------------------------------


def _hf_text_state(text_encoder: torch.nn.Module) -> StateDict:
    """The encoder's weights with ``text_model.`` on every transformer key.

    transformers >= 5.6 flattened ``CLIPTextModel`` (keys start at ``embeddings.``) while
    ``CLIPTextModelWithProjection`` still wraps its ``text_model``; the files always have the prefix.
    """
    out: StateDict = {}
    for key, value in text_encoder.state_dict().items():
        if key.startswith("text_model.") or key.startswith("text_projection."):
            out[key] = value
        else:
            out["text_model." + key] = value
    return out


def clip_to_original(text_encoder: torch.nn.Module, prefix: str) -> StateDict:
    """A CLIP-L text encoder in the Hugging Face names the original files use, under ``prefix``.

    Only the text transformer is written: SD 1.x and SDXL's first encoder use no projection.
    """
    return {prefix + k: v for k, v in _hf_text_state(text_encoder).items() if k.startswith("text_model.")}


_OPEN_CLIP_FLAT = {
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.final_layer_norm.weight": "ln_final.weight",
    "text_model.final_layer_norm.bias": "ln_final.bias",
}
_OPEN_CLIP_LAYER = {
    "self_attn.out_proj": "attn.out_proj",
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}
_HF_LAYER = re.compile(r"text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)")


def _open_clip_layers(state: StateDict) -> StateDict:
    """The transformer layers as OpenCLIP ``resblocks``, with q, k, v packed into ``in_proj``."""
    out: StateDict = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        m = _HF_LAYER.fullmatch(key)
        if m is None:
            continue
        layer, module, param = int(m[1]), m[2], m[3]
        if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            qkv.setdefault((layer, param), {})[module[-6]] = value
        elif module in _OPEN_CLIP_LAYER:
            out[f"transformer.resblocks.{layer}.{_OPEN_CLIP_LAYER[module]}.{param}"] = value
        else:
            raise ValueError(f"no OpenCLIP name for text encoder weight {key!r}")
    for (layer, param), parts in qkv.items():
        # diffusers splits in_proj back at the projection width, in q, k, v order.
        out[f"transformer.resblocks.{layer}.attn.in_proj_{param}"] = torch.cat([parts[c] for c in "qkv"])
    return out


def _copy_final_resblock(layers: StateDict, n_layers: int) -> StateDict:
    """Append a copy of the last resblock as resblock ``n_layers``.

    SD 2.x conditions on OpenCLIP's penultimate layer, so diffusers' text encoder has one layer
    fewer than the files, whose last resblock it ignores on load. The copy makes the file's
    depth, and so any depth-based detection, match a real SD 2.x file.
    """
    last = f"transformer.resblocks.{n_layers - 1}."
    return {
        f"transformer.resblocks.{n_layers}.{k[len(last) :]}": v.detach().clone()
        for k, v in layers.items()
        if k.startswith(last)
    }


def open_clip_to_original(text_encoder: torch.nn.Module, prefix: str, extra_final_layer: bool) -> StateDict:
    """A CLIP text encoder in OpenCLIP names under ``prefix`` (SD 2.x, SDXL's second encoder).

    ``text_projection`` is ``[width, embed_dim]`` (the transpose of diffusers' Linear weight);
    diffusers reads its first dimension to split ``in_proj``. SD 2.x's encoder has no projection
    (SD 2.x never uses it), so an identity of the real file's shape stands in for it there.
    """
    state = _hf_text_state(text_encoder)
    out = {v: state[k] for k, v in _OPEN_CLIP_FLAT.items()}
    layers = _open_clip_layers(state)
    out.update(layers)
    if extra_final_layer:
        out.update(_copy_final_resblock(layers, text_encoder.config.num_hidden_layers))
    if "text_projection.weight" in state:
        out["text_projection"] = state["text_projection.weight"].T.contiguous()
    else:
        width = text_encoder.config.hidden_size
        ref = state["text_model.final_layer_norm.weight"]
        out["text_projection"] = torch.eye(width, dtype=ref.dtype, device=ref.device)
    return {prefix + k: v for k, v in out.items()}


def text_encoder_layout(pipe: Any) -> TextLayout:
    """Which text-encoder layout a pipeline's file gets: ``"sdxl"``, ``"sd2"`` (OpenCLIP) or ``"sd1"``.

    SD 2.x's OpenCLIP ViT-H uses exact GELU, OpenAI's CLIP-L (SD 1.x) the quick approximation.
    """
    if getattr(pipe, "text_encoder_2", None) is not None:
        if getattr(pipe, "text_encoder", None) is None:
            raise ValueError("SDXL refiner pipelines (no first text encoder) are not supported")
        return "sdxl"
    text_encoder = getattr(pipe, "text_encoder", None)
    if text_encoder is None:
        raise ValueError(f"{type(pipe).__name__} has no text encoder to write")
    return "sd2" if text_encoder.config.hidden_act == "gelu" else "sd1"


def _text_encoders_to_original(pipe: Any, layout: TextLayout) -> StateDict:
    if layout == "sd1":
        return clip_to_original(pipe.text_encoder, SD1_CLIP_PREFIX)
    if layout == "sd2":
        return open_clip_to_original(pipe.text_encoder, SD2_OPEN_CLIP_PREFIX, extra_final_layer=True)
    # SDXL keeps all of bigG's layers (it picks the penultimate hidden state at run time), and
    # diffusers loads every resblock of embedders.1, so no extra layer is written there.
    out = clip_to_original(pipe.text_encoder, SDXL_CLIP_PREFIX)
    out.update(open_clip_to_original(pipe.text_encoder_2, SDXL_OPEN_CLIP_PREFIX, extra_final_layer=False))
    return out


# -- Public API -------------------------------------------------------------------------------


def _merge(parts: list[StateDict]) -> StateDict:
    out: StateDict = {}
    for part in parts:
        clash = out.keys() & part.keys()
        if clash:
            raise ValueError(f"duplicate checkpoint keys: {sorted(clash)[:5]}")
        out.update(part)
    return out


def to_original_layout(pipe: Any) -> StateDict:
    """All of a Stable Diffusion pipeline's weights under the original single-file key names.

    ``pipe`` is a ``StableDiffusionPipeline``, ``StableDiffusionInpaintPipeline`` or
    ``StableDiffusionXLPipeline`` (anything with the same ``unet``/``vae``/``text_encoder``/
    ``text_encoder_2`` attributes). Tensors are detached, on their original device and dtype;
    some are views of the model's parameters.
    """
    layout = text_encoder_layout(pipe)
    return _merge(
        [unet_to_original(pipe.unet), vae_to_original(pipe.vae), _text_encoders_to_original(pipe, layout)]
    )


def _for_safetensors(state: StateDict, dtype: torch.dtype | None) -> StateDict:
    """CPU, contiguous, optionally cast tensors, none sharing memory (safetensors refuses that)."""
    out: StateDict = {}
    seen: set[int] = set()
    for key, value in state.items():
        tensor = value.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def save_single_file(pipe: Any, path: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write ``pipe`` as an original-layout ``.safetensors`` checkpoint; returns the path.

    ``dtype`` casts the floating-point tensors (e.g. ``torch.float16`` for the usual 2 GB SD 1.5
    file); by default they keep the pipeline's dtype.
    """
    path = Path(path)
    tensors = _for_safetensors(to_original_layout(pipe), dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


__all__ = [
    "clip_to_original",
    "open_clip_to_original",
    "save_single_file",
    "text_encoder_layout",
    "to_original_layout",
    "unet_to_original",
    "vae_to_original",
]
