"""FLUX.1 single files, the way ComfyUI users hold them: the transformer in Black Forest Labs'
original key layout (``flux1-dev.safetensors``, ``flux1-schnell.safetensors``, with or without the
``model.diffusion_model.`` prefix), and beside it (or in the ``vae`` / ``clip`` / ``text_encoders``
folders next to its own) the VAE ``ae.safetensors``, CLIP-L ``clip_l.safetensors`` and T5
``t5xxl_fp16.safetensors`` (or ``t5xxl_fp8_e4m3fn.safetensors``).

Detected by keys and shapes (dev carries ``guidance_in``); configs, tokenizers and the scheduler
come from the shipped family folder, fitted to the file's widths and depths; nothing is downloaded.
A part that cannot be found is an error naming the file wanted and where it was looked for.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from sd_accel.core import CheckpointError
from sd_accel.models.checkpoint import Shapes, read_shapes
from sd_accel.models.families import get_family, load_family_configs, materialize
from sd_accel.models.mapped_file import default_dtype, file_dtype, swap_scale_shift
from sd_accel.models.text_files import find_files

MARKER = "double_blocks.0.img_attn.qkv.weight"
PREFIXES = ("", "model.diffusion_model.")
# each part: the file names it goes by, in the order they are preferred
PARTS: dict[str, tuple[str, ...]] = {
    "vae": ("ae.safetensors", "flux*ae*.safetensors", "*flux*vae*.safetensors"),
    "clip_l": ("clip_l.safetensors", "clip_l*.safetensors", "*clip_l*.safetensors"),
    "t5": ("t5xxl_fp16.safetensors", "t5xxl*.safetensors", "*t5xxl*.safetensors"),
}


def flux_prefix(shapes: Shapes) -> str | None:
    """The key prefix of a FLUX.1 transformer file, or None when it is not one."""
    return next((p for p in PREFIXES if p + MARKER in shapes), None)


def family_of(shapes: Shapes, prefix: str) -> str:
    """``flux-dev`` (a guidance embedding) or ``flux-schnell``."""
    return "flux-dev" if f"{prefix}guidance_in.in_layer.weight" in shapes else "flux-schnell"


def rope_axes(head_dim: int) -> list[int]:
    """The rotary split of a head (FLUX.1: 16 + 56 + 56 of 128): an eighth for the unused axis."""
    first = head_dim // 8
    rest = (head_dim - first) // 2
    return [first, rest, head_dim - first - rest]


def transformer_config(base: dict[str, Any], shapes: Shapes, prefix: str) -> dict[str, Any]:
    """FluxTransformer2DModel's config fitted to the file."""
    img_in = shapes[f"{prefix}img_in.weight"]
    head = shapes[f"{prefix}double_blocks.0.img_attn.norm.query_norm.scale"][0]

    def count(kind: str) -> int:
        return len({m.group(1) for k in shapes if (m := re.match(re.escape(prefix + kind) + r"\.(\d+)\.", k))})

    return dict(base, in_channels=img_in[1], attention_head_dim=head, num_attention_heads=img_in[0] // head,
                num_layers=count("double_blocks"), num_single_layers=count("single_blocks"),
                joint_attention_dim=shapes[f"{prefix}txt_in.weight"][1],
                pooled_projection_dim=shapes[f"{prefix}vector_in.in_layer.weight"][1],
                guidance_embeds=f"{prefix}guidance_in.in_layer.weight" in shapes, axes_dims_rope=rope_axes(head))


# Black Forest Labs' names -> diffusers' (a whole-name prefix rename; the fused ones are below)
_RENAMES: tuple[tuple[str, str], ...] = (
    ("time_in.in_layer.", "time_text_embed.timestep_embedder.linear_1."),
    ("time_in.out_layer.", "time_text_embed.timestep_embedder.linear_2."),
    ("vector_in.in_layer.", "time_text_embed.text_embedder.linear_1."),
    ("vector_in.out_layer.", "time_text_embed.text_embedder.linear_2."),
    ("guidance_in.in_layer.", "time_text_embed.guidance_embedder.linear_1."),
    ("guidance_in.out_layer.", "time_text_embed.guidance_embedder.linear_2."),
    ("txt_in.", "context_embedder."), ("img_in.", "x_embedder."), ("final_layer.linear.", "proj_out."),
)
_DOUBLE: dict[str, str] = {
    "img_mod.lin.": "norm1.linear.", "txt_mod.lin.": "norm1_context.linear.",
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight", "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
    "img_mlp.0.": "ff.net.0.proj.", "img_mlp.2.": "ff.net.2.", "txt_mlp.0.": "ff_context.net.0.proj.",
    "txt_mlp.2.": "ff_context.net.2.", "img_attn.proj.": "attn.to_out.0.", "txt_attn.proj.": "attn.to_add_out.",
}
_SINGLE: dict[str, str] = {
    "modulation.lin.": "norm.linear.", "norm.query_norm.scale": "attn.norm_q.weight",
    "norm.key_norm.scale": "attn.norm_k.weight", "linear2.": "proj_out.",
}


def to_diffusers(name: str, tensor: torch.Tensor, hidden: int) -> list[tuple[str, torch.Tensor]]:
    """One tensor of the original layout as diffusers' ``FluxTransformer2DModel`` names it (the
    fused q/k/v projections split, the final modulation's shift and scale swapped), for any width
    ``hidden`` (diffusers' own converter assumes FLUX.1's 3072)."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return [(new + name[len(old):], tensor)]
    if name.startswith("final_layer.adaLN_modulation.1."):
        return [("norm_out.linear." + name.rsplit(".", 1)[1], swap_scale_shift(tensor))]
    match = re.match(r"(double|single)_blocks\.(\d+)\.(.+)", name)
    if match is None:
        raise CheckpointError(f"{name}: not a FLUX.1 transformer weight sd-accel knows")
    kind, index, rest = match.groups()
    block = f"{'transformer_blocks' if kind == 'double' else 'single_transformer_blocks'}.{index}."
    suffix = rest.rsplit(".", 1)[1]
    if kind == "double" and rest.startswith(("img_attn.qkv.", "txt_attn.qkv.")):
        names = ("to_q", "to_k", "to_v") if rest.startswith("img") else ("add_q_proj", "add_k_proj", "add_v_proj")
        return [(f"{block}attn.{n}.{suffix}", t) for n, t in zip(names, tensor.chunk(3, dim=0), strict=True)]
    if kind == "single" and rest.startswith("linear1."):
        parts = tensor.split([hidden, hidden, hidden, tensor.shape[0] - 3 * hidden], dim=0)
        names = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
        return [(f"{block}{n}.{suffix}", t) for n, t in zip(names, parts, strict=True)]
    for old, new in (_DOUBLE if kind == "double" else _SINGLE).items():
        if rest.startswith(old):
            return [(block + new + rest[len(old):], tensor)]
    raise CheckpointError(f"{name}: not a FLUX.1 transformer weight sd-accel knows")


def load_transformer(path: Path, config: dict[str, Any], prefix: str, dtype: torch.dtype):
    """The transformer built from ``config`` with its weights left on the file's memory mapping
    (:func:`sd_accel.models.mapped_file.model_on_file`; fp8 files stay fp8)."""
    import diffusers

    from sd_accel.models.mapped_file import model_on_file

    hidden = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    return model_on_file(diffusers.FluxTransformer2DModel, config, path, prefix,
                         lambda name, tensor: to_diffusers(name, tensor, hidden), dtype, "the FLUX.1 transformer")


def find_parts(path: Path, given: dict[str, str | Path] | None = None) -> dict[str, Path]:
    """The VAE, CLIP-L and T5 files of the FLUX.1 transformer file ``path`` (see
    :func:`sd_accel.models.text_files.find_parts`)."""
    return find_files(path, given, PARTS, "a FLUX.1 transformer")


def load_flux(path: Path, shapes: Shapes, parts: dict[str, str | Path] | None = None,
              torch_dtype: torch.dtype | None = None):
    """A ``FluxPipeline`` from a FLUX.1 transformer file and its parts (see the module doc)."""
    import diffusers

    from sd_accel.models.text_files import load_clip, load_t5, vae_config

    prefix = flux_prefix(shapes)
    if prefix is None:
        raise CheckpointError(f"{path.name} is not a FLUX.1 transformer ({MARKER} missing)")
    files = find_parts(path, parts)
    family = family_of(shapes, prefix)
    configs = load_family_configs(get_family(family))
    configs["transformer/config.json"] = transformer_config(configs["transformer/config.json"], shapes, prefix)
    configs["vae/config.json"] = vae_config(configs["vae/config.json"], read_shapes(files["vae"]))
    folder = materialize(configs)
    dtype = torch_dtype or default_dtype(file_dtype(path, prefix + MARKER))
    transformer = load_transformer(path, configs["transformer/config.json"], prefix, dtype)
    try:
        vae = diffusers.AutoencoderKL.from_single_file(str(files["vae"]), config=str(folder), subfolder="vae",
                                                       local_files_only=True, torch_dtype=dtype)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{path.name} looks like {get_family(family).title} but its weights do not fit "
                              f"({type(exc).__name__}: {str(exc)[:300]}); it may be truncated or another variant") from exc
    clip = load_clip(files["clip_l"], configs["text_encoder/config.json"], projected=False, dtype=dtype)
    t5 = load_t5(files["t5"], configs["text_encoder_2/config.json"], dtype=dtype)
    tokenizers = {name: getattr(__import__("transformers"), cls).from_pretrained(folder / name)
                  for name, cls in (("tokenizer", "CLIPTokenizer"), ("tokenizer_2", "T5TokenizerFast"))}
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    pipe = diffusers.FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, text_encoder_2=t5,
                                  transformer=transformer.eval(), **tokenizers)
    return pipe, family, files


__all__ = ["PARTS", "family_of", "find_parts", "flux_prefix", "load_flux", "rope_axes", "transformer_config"]
