"""Write tiny SD3 / FLUX.1 models as the single files people download, in their original key layouts.

* ``flux_transformer_state_dict``: Black Forest Labs' layout (``flux1-dev.safetensors``: ``double_blocks.*``,
  ``single_blocks.*``, ``img_in``, ...), optionally under ``model.diffusion_model.`` (ComfyUI's
  checkpoint-style files);
* ``vae_state_dict``: the LDM autoencoder layout without prefix (FLUX's ``ae.safetensors``);
* ``clip_state_dict`` / ``t5_state_dict``: the separate text-encoder files ComfyUI users hold
  (``clip_l.safetensors``, ``clip_g.safetensors``, ``t5xxl_fp16.safetensors``, ``t5xxl_fp8_e4m3fn.safetensors``):
  transformers' own names;
* ``sd3_state_dict``: Stability's SD3 / SD3.5 single file (``model.diffusion_model.`` MMDiT,
  ``first_stage_model.`` VAE, optionally ``text_encoders.{clip_l,clip_g,t5xxl}.transformer.``).

Each is the inverse of diffusers' single-file converters (``convert_flux_transformer_checkpoint_to_diffusers``,
``convert_sd3_transformer_checkpoint_to_diffusers``, ``convert_ldm_vae_checkpoint``,
``convert_sd3_t5_checkpoint_to_diffusers``, ``create_diffusers_clip_model_from_ldm``): the tensors are
moved, concatenated or have their halves swapped, never computed, so a file read back gives the same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from support.ldm_layout import VAE_PREFIX, vae_to_original

StateDict = dict[str, torch.Tensor]

DIFFUSION_MODEL_PREFIX = "model.diffusion_model."
SD3_CLIP_L_PREFIX = "text_encoders.clip_l.transformer."
SD3_CLIP_G_PREFIX = "text_encoders.clip_g.transformer."
SD3_T5_PREFIX = "text_encoders.t5xxl.transformer."

_PARAMS = ("weight", "bias")


class _Writer:
    """Takes the diffusers tensors out of ``source`` one by one into ``out`` under original names, so that
    ``done()`` can tell which diffusers weights were given no original name."""

    def __init__(self, model: torch.nn.Module, prefix: str) -> None:
        self.source: StateDict = dict(model.state_dict())
        self.out: StateDict = {}
        self.prefix = prefix

    def has(self, module: str) -> bool:
        return f"{module}.weight" in self.source

    def put(self, original: str, module: str) -> None:
        """``module``'s weight (and bias, where it has one) as ``original``'s."""
        for param in _PARAMS:
            if f"{module}.{param}" in self.source:
                self.out[f"{self.prefix}{original}.{param}"] = self.source.pop(f"{module}.{param}")

    def tensor(self, original: str, key: str) -> None:
        """One tensor under another full name (norm scales, the position embedding)."""
        self.out[self.prefix + original] = self.source.pop(key)

    def cat(self, original: str, modules: list[str]) -> None:
        """Several linear layers packed into one along the output dimension (``qkv``, ``linear1``)."""
        for param in _PARAMS:
            if f"{modules[0]}.{param}" in self.source:
                self.out[f"{self.prefix}{original}.{param}"] = torch.cat(
                    [self.source.pop(f"{m}.{param}") for m in modules]
                )

    def swapped(self, original: str, module: str) -> None:
        """An adaLN projection whose halves diffusers keeps as (scale, shift); the originals keep (shift, scale)."""
        for param in _PARAMS:
            scale, shift = self.source.pop(f"{module}.{param}").chunk(2, dim=0)
            self.out[f"{self.prefix}{original}.{param}"] = torch.cat([shift, scale])

    def done(self) -> StateDict:
        if self.source:
            raise ValueError(f"no original-layout name for {sorted(self.source)}")
        return self.out


def _embedder(w: _Writer, original: str, diffusers: str, first: str = "in_layer", second: str = "out_layer") -> None:
    w.put(f"{original}.{first}", f"{diffusers}.linear_1")
    w.put(f"{original}.{second}", f"{diffusers}.linear_2")


# -- FLUX.1 -----------------------------------------------------------------------------------


def flux_transformer_state_dict(transformer: torch.nn.Module, prefix: str = "") -> StateDict:
    """A diffusers ``FluxTransformer2DModel``'s weights in Black Forest Labs' layout.

    ``prefix=""`` gives ``flux1-dev.safetensors``'s names; ``prefix=DIFFUSION_MODEL_PREFIX`` those of
    ComfyUI's checkpoint-style files. ``guidance_in`` is there only for guidance-distilled models (dev).
    """
    w = _Writer(transformer, prefix)
    _embedder(w, "time_in", "time_text_embed.timestep_embedder")
    _embedder(w, "vector_in", "time_text_embed.text_embedder")
    if w.has("time_text_embed.guidance_embedder.linear_1"):
        _embedder(w, "guidance_in", "time_text_embed.guidance_embedder")
    w.put("img_in", "x_embedder")
    w.put("txt_in", "context_embedder")
    for i in range(len(transformer.transformer_blocks)):
        src, dst = f"transformer_blocks.{i}", f"double_blocks.{i}"
        w.put(f"{dst}.img_mod.lin", f"{src}.norm1.linear")
        w.put(f"{dst}.txt_mod.lin", f"{src}.norm1_context.linear")
        w.cat(f"{dst}.img_attn.qkv", [f"{src}.attn.to_{x}" for x in "qkv"])
        w.cat(f"{dst}.txt_attn.qkv", [f"{src}.attn.add_{x}_proj" for x in "qkv"])
        for side, q, k in (("img", "norm_q", "norm_k"), ("txt", "norm_added_q", "norm_added_k")):
            w.tensor(f"{dst}.{side}_attn.norm.query_norm.scale", f"{src}.attn.{q}.weight")
            w.tensor(f"{dst}.{side}_attn.norm.key_norm.scale", f"{src}.attn.{k}.weight")
        w.put(f"{dst}.img_attn.proj", f"{src}.attn.to_out.0")
        w.put(f"{dst}.txt_attn.proj", f"{src}.attn.to_add_out")
        for side, ff in (("img", "ff"), ("txt", "ff_context")):
            w.put(f"{dst}.{side}_mlp.0", f"{src}.{ff}.net.0.proj")
            w.put(f"{dst}.{side}_mlp.2", f"{src}.{ff}.net.2")
    for i in range(len(transformer.single_transformer_blocks)):
        src, dst = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        w.put(f"{dst}.modulation.lin", f"{src}.norm.linear")
        w.cat(f"{dst}.linear1", [f"{src}.attn.to_q", f"{src}.attn.to_k", f"{src}.attn.to_v", f"{src}.proj_mlp"])
        w.tensor(f"{dst}.norm.query_norm.scale", f"{src}.attn.norm_q.weight")
        w.tensor(f"{dst}.norm.key_norm.scale", f"{src}.attn.norm_k.weight")
        w.put(f"{dst}.linear2", f"{src}.proj_out")
    w.swapped("final_layer.adaLN_modulation.1", "norm_out.linear")
    w.put("final_layer.linear", "proj_out")
    return w.done()


# -- SD3 / SD3.5 ------------------------------------------------------------------------------


def sd3_transformer_state_dict(transformer: torch.nn.Module, prefix: str = DIFFUSION_MODEL_PREFIX) -> StateDict:
    """A diffusers ``SD3Transformer2DModel``'s weights in Stability's MMDiT layout (``joint_blocks.*``),
    under ``prefix``. The last block's context stream is "pre-only" (no output projection or MLP, its
    adaLN has (shift, scale) halves only, swapped like the final layer's)."""
    w = _Writer(transformer, prefix)
    w.tensor("pos_embed", "pos_embed.pos_embed")
    w.put("x_embedder.proj", "pos_embed.proj")
    _embedder(w, "t_embedder", "time_text_embed.timestep_embedder", "mlp.0", "mlp.2")
    _embedder(w, "y_embedder", "time_text_embed.text_embedder", "mlp.0", "mlp.2")
    w.put("context_embedder", "context_embedder")
    for i, block in enumerate(transformer.transformer_blocks):
        src, x, c = f"transformer_blocks.{i}", f"joint_blocks.{i}.x_block", f"joint_blocks.{i}.context_block"
        w.cat(f"{x}.attn.qkv", [f"{src}.attn.to_{n}" for n in "qkv"])
        w.cat(f"{c}.attn.qkv", [f"{src}.attn.add_{n}_proj" for n in "qkv"])
        if w.has(f"{src}.attn.norm_q"):
            w.tensor(f"{x}.attn.ln_q.weight", f"{src}.attn.norm_q.weight")
            w.tensor(f"{x}.attn.ln_k.weight", f"{src}.attn.norm_k.weight")
            w.tensor(f"{c}.attn.ln_q.weight", f"{src}.attn.norm_added_q.weight")
            w.tensor(f"{c}.attn.ln_k.weight", f"{src}.attn.norm_added_k.weight")
        w.put(f"{x}.attn.proj", f"{src}.attn.to_out.0")
        w.put(f"{c}.attn.proj", f"{src}.attn.to_add_out")
        if w.has(f"{src}.attn2.to_q"):  # SD3.5's dual-attention layers
            w.cat(f"{x}.attn2.qkv", [f"{src}.attn2.to_{n}" for n in "qkv"])
            if w.has(f"{src}.attn2.norm_q"):
                w.tensor(f"{x}.attn2.ln_q.weight", f"{src}.attn2.norm_q.weight")
                w.tensor(f"{x}.attn2.ln_k.weight", f"{src}.attn2.norm_k.weight")
            w.put(f"{x}.attn2.proj", f"{src}.attn2.to_out.0")
        w.put(f"{x}.adaLN_modulation.1", f"{src}.norm1.linear")
        if block.context_pre_only:
            w.swapped(f"{c}.adaLN_modulation.1", f"{src}.norm1_context.linear")
        else:
            w.put(f"{c}.adaLN_modulation.1", f"{src}.norm1_context.linear")
        w.put(f"{x}.mlp.fc1", f"{src}.ff.net.0.proj")
        w.put(f"{x}.mlp.fc2", f"{src}.ff.net.2")
        w.put(f"{c}.mlp.fc1", f"{src}.ff_context.net.0.proj")
        w.put(f"{c}.mlp.fc2", f"{src}.ff_context.net.2")
    w.swapped("final_layer.adaLN_modulation.1", "norm_out.linear")
    w.put("final_layer.linear", "proj_out")
    return w.done()


def sd3_state_dict(pipe: Any, with_text_encoders: bool, t5_embed_tokens: bool = False) -> StateDict:
    """An SD3 / SD3.5 pipeline as Stability's single file (``sd3_medium.safetensors``, or with
    ``with_text_encoders`` ``sd3_medium_incl_clips_t5xxlfp16.safetensors`` / ``sd3.5_large.safetensors``):
    the MMDiT under ``model.diffusion_model.``, the VAE under ``first_stage_model.``, and CLIP-L, CLIP-G
    and T5 in transformers' names under ``text_encoders.{clip_l,clip_g,t5xxl}.transformer.``.

    diffusers replaces CLIP-L's ``text_projection`` by the identity on reading these files
    (``create_diffusers_clip_model_from_ldm``); it is written all the same, as the encoder has it.
    T5's tied ``encoder.embed_tokens.weight`` is left out unless ``t5_embed_tokens`` (``t5_state_dict``).
    """
    out = sd3_transformer_state_dict(pipe.transformer)
    out.update({VAE_PREFIX + k: v for k, v in vae_state_dict(pipe.vae).items()})
    if with_text_encoders:
        for prefix, part in (
            (SD3_CLIP_L_PREFIX, clip_state_dict(pipe.text_encoder)),
            (SD3_CLIP_G_PREFIX, clip_state_dict(pipe.text_encoder_2)),
            (SD3_T5_PREFIX, t5_state_dict(pipe.text_encoder_3, embed_tokens=t5_embed_tokens)),
        ):
            out.update({prefix + k: v for k, v in part.items()})
    return out


# -- VAE and text encoders --------------------------------------------------------------------


def vae_state_dict(vae: torch.nn.Module) -> StateDict:
    """A diffusers ``AutoencoderKL`` in the LDM layout without prefix, as FLUX's ``ae.safetensors``
    (``encoder.down.0.block.0.norm1.weight``, ``encoder.mid.attn_1.q.weight`` as a 1x1 conv, ...). Quant
    convs are written where the VAE has them (SD's; FLUX's and SD3's have none)."""
    return {k.removeprefix(VAE_PREFIX): v for k, v in vae_to_original(vae).items()}


def _cast(state: StateDict, dtype: torch.dtype | None) -> StateDict:
    if dtype is None:
        return state
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def clip_state_dict(encoder: torch.nn.Module, dtype: torch.dtype | None = None) -> StateDict:
    """A CLIP text encoder (``CLIPTextModel`` / ``CLIPTextModelWithProjection``) in transformers' names, as
    ``clip_l.safetensors`` / ``clip_g.safetensors`` hold it: ``text_model.*`` (also where transformers >= 5.6
    flattened ``CLIPTextModel`` to ``embeddings.*``), plus ``text_projection.weight`` where the encoder has one.
    ``dtype`` casts the floating-point tensors (``torch.float16``, ``torch.float8_e4m3fn``)."""
    out: StateDict = {}
    for key, value in encoder.state_dict().items():
        keep = key.startswith("text_model.") or key.startswith("text_projection.")
        out[key if keep else "text_model." + key] = value
    return _cast(out, dtype)


def t5_state_dict(
    encoder: torch.nn.Module, dtype: torch.dtype | None = None, embed_tokens: bool = False
) -> StateDict:
    """A ``T5EncoderModel`` in transformers' names, as ``t5xxl_fp16.safetensors`` holds it (``shared.weight``,
    ``encoder.block.*``, ``encoder.final_layer_norm.weight``). The tied ``encoder.embed_tokens.weight`` (the
    same tensor as ``shared.weight``) is left out, as ``save_pretrained`` and the stripped published files
    leave it; ``embed_tokens=True`` keeps it, as "unstripped" files have it. ``dtype=torch.float8_e4m3fn``
    gives ``t5xxl_fp8_e4m3fn``'s plain cast (every floating-point tensor; no scales)."""
    tied = set() if embed_tokens else set(getattr(encoder, "_tied_weights_keys", None) or ())
    return _cast({k: v for k, v in encoder.state_dict().items() if k not in tied}, dtype)


def save(state_dict: StateDict, path: str | os.PathLike) -> Path:
    """Write ``state_dict`` as a ``.safetensors`` file (CPU, contiguous, no two tensors sharing memory,
    which safetensors refuses); returns the path."""
    tensors: StateDict = {}
    seen: set[int] = set()
    for key, value in state_dict.items():
        tensor = value.detach().to("cpu").contiguous()
        if tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[key] = tensor
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


__all__ = [
    "DIFFUSION_MODEL_PREFIX",
    "SD3_CLIP_G_PREFIX",
    "SD3_CLIP_L_PREFIX",
    "SD3_T5_PREFIX",
    "clip_state_dict",
    "flux_transformer_state_dict",
    "save",
    "sd3_state_dict",
    "sd3_transformer_state_dict",
    "t5_state_dict",
    "vae_state_dict",
]
