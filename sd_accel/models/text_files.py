"""Text encoders and VAEs from the separate files people hold beside SD3 and FLUX.1 models:
``clip_l.safetensors``, ``clip_g.safetensors``, ``t5xxl_fp16.safetensors`` /
``t5xxl_fp8_e4m3fn.safetensors`` (transformers' own key names, as ComfyUI ships them) and FLUX.1's
``ae.safetensors`` (the LDM VAE layout).

Each model is built from its family's shipped config, fitted to the widths and depths the file's
tensors have, then filled tensor by tensor from the memory-mapped file: an fp8 (e4m3) file is cast
straight to the model's dtype, with no fp32 copy of the whole encoder.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from sd_accel.core import CheckpointError
from sd_accel.models.checkpoint import Shapes, read_shapes

# where ComfyUI keeps a model's parts, relative to the model file's folder
PLACES = (".", "../vae", "../clip", "../text_encoders")


def find_files(path: Path, given: dict[str, str | Path] | None, table: dict[str, tuple[str, ...]],
               what: str, optional: tuple[str, ...] = ()) -> dict[str, Path]:
    """The files of the parts in ``table`` (part -> file name patterns, preferred first) for the
    model file ``path``: ``given`` first, then beside it and in ComfyUI's ``vae`` / ``clip`` /
    ``text_encoders`` folders next to its own. A part not found raises CheckpointError naming the
    file wanted and the folders looked in, unless it is ``optional``."""
    given = {k: Path(v).expanduser() for k, v in (given or {}).items()}
    unknown = set(given) - set(table)
    if unknown:
        raise CheckpointError(f"unknown parts {sorted(unknown)}; {what} takes {', '.join(table)}")
    found: dict[str, Path] = {}
    folders = [(path.parent / p).resolve() for p in PLACES]
    for part, patterns in table.items():
        if part in given:
            if not given[part].is_file():
                raise CheckpointError(f"the {part} file {given[part]} does not exist")
            found[part] = given[part]
            continue
        hit = next((f for folder in folders if folder.is_dir() for pattern in patterns
                    for f in sorted(folder.glob(pattern)) if f.resolve() != path.resolve()), None)
        if hit is not None:
            found[part] = hit
    missing = [p for p in table if p not in found and p not in optional]
    if missing:
        wanted = ", ".join(f"{p} ({table[p][0]})" for p in missing)
        places = ", ".join(str(f) for f in folders)
        names = ", ".join(f"'{p}': ..." for p in table)
        raise CheckpointError(f"{path.name} is {what}; it needs its {wanted} beside it. Looked in {places}. "
                              f"Put the files there or name them: load_pipeline(path, parts={{{names}}})")
    return found


def _count(shapes: Shapes, pattern: str) -> int:
    found = {int(m.group(1)) for k in shapes if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def clip_config(base: dict[str, Any], shapes: Shapes, prefix: str = "") -> dict[str, Any]:
    """A CLIP text config fitted to a file: width, depth, MLP width, vocabulary, projection."""
    embed = shapes.get(f"{prefix}text_model.embeddings.token_embedding.weight")
    if embed is None:
        raise CheckpointError(f"no CLIP text model in it ({prefix}text_model.embeddings.token_embedding.weight "
                              "missing): is it a CLIP-L / CLIP-G text encoder file?")
    width = embed[1]
    out = dict(base, vocab_size=embed[0], hidden_size=width,
               num_hidden_layers=_count(shapes, re.escape(prefix) + r"text_model\.encoder\.layers\.(\d+)\."),
               intermediate_size=shapes[f"{prefix}text_model.encoder.layers.0.mlp.fc1.weight"][0],
               num_attention_heads=max(1, width // 64))  # every CLIP text model has 64-wide heads
    projection = shapes.get(f"{prefix}text_projection.weight")
    if projection is not None:
        out["projection_dim"] = projection[0]
    return out


def t5_config(base: dict[str, Any], shapes: Shapes, prefix: str = "") -> dict[str, Any]:
    """A T5 encoder config fitted to a file: width, depth, heads, MLP width, vocabulary."""
    shared = shapes.get(f"{prefix}shared.weight") or shapes.get(f"{prefix}encoder.embed_tokens.weight")
    bias = shapes.get(f"{prefix}encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    if shared is None or bias is None:
        raise CheckpointError("no T5 encoder in it (shared.weight / encoder.block.0...relative_attention_bias "
                              "missing): is it a t5xxl text encoder file?")
    heads = bias[1]
    inner = shapes[f"{prefix}encoder.block.0.layer.0.SelfAttention.q.weight"][0]
    return dict(base, vocab_size=shared[0], d_model=shared[1], num_heads=heads, d_kv=inner // heads,
                d_ff=shapes[f"{prefix}encoder.block.0.layer.1.DenseReluDense.wo.weight"][1],
                num_layers=_count(shapes, re.escape(prefix) + r"encoder\.block\.(\d+)\."))


# Pages of the file read while filling stay counted in the process's RSS until the file is closed:
# T5-XXL's fp8 file (4.8 GB) on top of its bf16 model (9.5 GB). Handed back every this many bytes.
_RELEASE_EVERY = 64 << 20


def fill(model: torch.nn.Module, path: Path, prefix: str = "", rename=None, keep_fp8: bool = False) -> torch.nn.Module:
    """Copy the file's tensors into ``model`` one at a time (cast to the model's dtype there: an
    fp8 file never becomes an fp32 copy). Every parameter the model has must be in the file.

    ``keep_fp8``: fp8 weights (but embedding tables) are not copied at all: they stay fp8 on the
    file's memory mapping and each layer computes in the model's dtype
    (:mod:`sd_accel.models.stored_dtype`): T5-XXL's 4.8 GB instead of 9.5 GB of bf16, none of it
    resident until a layer runs, and its pages can be handed back after (paged encoders)."""
    from sd_accel.models.mapped_file import open_mapped
    from sd_accel.models.stored_dtype import FP8, compute_in
    from sd_accel.pages import release_file, trim_heap

    own = model.state_dict()
    missing = set(own)
    read = 0
    embeddings = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    kept = 0
    with open_mapped(path) as f, torch.no_grad():
        if any(k.startswith(prefix) and (k.endswith(".scale_weight") or k == prefix + "scaled_fp8") for k in f.keys()):
            # (each fp8 weight times its scale: read plainly it would give a wrong model, silently)
            raise CheckpointError(f"{path.name} holds a 'scaled fp8' encoder (weights with scale_weight tensors), "
                                  "which sd-accel does not read yet: use the fp16 or plain fp8_e4m3fn file "
                                  "(t5xxl_fp16.safetensors, t5xxl_fp8_e4m3fn.safetensors)")
        for key in f.keys():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix):]
            name = rename(name) if rename else name
            if name not in own and name.startswith("text_model.") and name[len("text_model."):] in own:
                name = name[len("text_model."):]  # transformers 5's CLIPTextModel is the text model itself
            target = own.get(name)
            if target is None:
                continue
            tensor = f[key]
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"{path.name}: {key} is {tuple(tensor.shape)}, the model expects "
                                      f"{tuple(target.shape)}")
            owner, _, attr = name.rpartition(".")
            if keep_fp8 and tensor.dtype in FP8 and owner not in embeddings and owner:
                module = model.get_submodule(owner)
                if attr in module._parameters:  # the file's tensor itself: the empty one is never touched
                    module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
                else:
                    module._buffers[attr] = tensor
                missing.discard(name)
                kept += 1
                continue
            target.copy_(tensor.to(target.dtype))
            missing.discard(name)
            read += tensor.numel() * tensor.element_size()
            del tensor
            if read >= _RELEASE_EVERY:  # the file's pages read so far, and the casts' freed buffers
                release_file(path)
                trim_heap()
                read = 0
    # tied or derived entries the files leave out
    missing -= {"text_model.embeddings.position_ids", "embeddings.position_ids", "encoder.embed_tokens.weight"}
    if missing:
        raise CheckpointError(f"{path.name} lacks {len(missing)} weights of the model (e.g. {sorted(missing)[:3]}); "
                              "it may be truncated or a different model")
    if hasattr(model, "encoder") and hasattr(model, "shared"):  # T5: the encoder reads the shared table
        model.encoder.embed_tokens = model.shared
    if kept:
        compute_in(model, next(p.dtype for n, p in model.named_parameters() if n.rpartition(".")[0] in embeddings),
                   blocks=("T5Block",))
    return model.eval()


def empty_model(cls, config, dtype: torch.dtype) -> torch.nn.Module:
    """``cls(config)`` in ``dtype`` with its weights left for :func:`fill`: built on the meta device,
    so neither a float32 model first (T5-XXL: 19 GB, which peaked a SD3.5 load at 21.7 GB) nor a
    random initialisation the file overwrites. Buffers the files leave out (CLIP's
    ``position_ids``) are made here; :func:`fill` checks that every parameter came from the file."""
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype).to_empty(device="cpu")
    for name, buf in model.named_buffers():
        if not name.endswith("position_ids"):
            raise CheckpointError(f"{cls.__name__} has a buffer {name} that sd-accel does not know how to make")
        buf.copy_(torch.arange(buf.shape[-1]).expand_as(buf))
    return model


def load_clip(path: Path, base: dict[str, Any], projected: bool, dtype: torch.dtype, prefix: str = ""):
    """A CLIP text encoder (with the projection head for SD3's, without for FLUX.1's) from a file."""
    import transformers

    shapes = read_shapes(path)
    config = clip_config(base, shapes, prefix)
    cls = transformers.CLIPTextModelWithProjection if projected else transformers.CLIPTextModel
    if projected and f"{prefix}text_projection.weight" not in shapes:
        raise CheckpointError(f"{path.name} has no text_projection: SD3 needs its CLIPs with projection "
                              "(clip_l.safetensors / clip_g.safetensors as SD3 ships them)")
    return fill(empty_model(cls, transformers.CLIPTextConfig(**{k: v for k, v in config.items()
                                                               if not k.startswith("_")}), dtype), path, prefix)


def load_t5(path: Path, base: dict[str, Any], dtype: torch.dtype, prefix: str = ""):
    """A T5 encoder from a file (fp16, bf16 or fp8 e4m3 as published)."""
    import transformers

    config = t5_config(base, read_shapes(path), prefix)
    model = empty_model(transformers.T5EncoderModel,
                        transformers.T5Config(**{k: v for k, v in config.items() if not k.startswith("_")}), dtype)
    return fill(model, path, prefix, keep_fp8=True)


def vae_config(base: dict[str, Any], shapes: Shapes, prefix: str = "") -> dict[str, Any]:
    """The KL VAE's config fitted to an LDM-layout file: latent channels, level widths, depth."""
    conv_in = shapes.get(f"{prefix}decoder.conv_in.weight")
    if conv_in is None:
        raise CheckpointError("no VAE decoder in it (decoder.conv_in.weight missing): is it a VAE file "
                              "such as FLUX.1's ae.safetensors?")
    levels = _count(shapes, re.escape(prefix) + r"encoder\.down\.(\d+)\.")
    widths = [shapes[f"{prefix}encoder.down.{i}.block.0.conv1.weight"][0] for i in range(levels)]
    return dict(base, latent_channels=conv_in[1], block_out_channels=widths,
                layers_per_block=_count(shapes, re.escape(prefix) + r"encoder\.down\.0\.block\.(\d+)\."),
                use_quant_conv=f"{prefix}quant_conv.weight" in shapes,
                use_post_quant_conv=f"{prefix}post_quant_conv.weight" in shapes)


__all__ = ["PLACES", "clip_config", "empty_model", "fill", "find_files", "load_clip", "load_t5", "t5_config", "vae_config"]
