"""Which weights a ComfyUI MODEL / VAE computes with, as the id its engines are keyed by.

The checkpoint is named as the WebUI names it: ``ckpt-<10 hex>``, the first 10 hex digits of
the file's sha256 (:func:`sd_accel.webui.identity.weights_id`), so an engine built in ComfyUI
for a checkpoint is the engine the WebUI uses for the same file, and the other way round. The
file is known from :func:`sd_accel.comfyui.host.tag_checkpoint_loads`; a model loaded another
way (a UNet-only file, a merge) is named by its weights' fingerprint instead (``fp-<10 hex>``).

ComfyUI's LoRA loaders do not change the weights when they run: they add *patches* to a
ModelPatcher clone (``patches``: weight key -> [(strength_patch, adapter, strength_model,
offset, function), ...]), which ComfyUI writes into the weights when it loads the model for
sampling. The patches carry no file name, so a LoRA is named by a digest of what it patches
(keys, adapter types, tensor shapes and first values) and its strength: ``patch-<8 hex>``.
Two strengths of one LoRA are two entries of one name: another weights id, a refit of the
checkpoint's engine, never a rebuild.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from sd_accel.comfyui import host
from sd_accel.models.file_hashes import checkpoint_id as file_checkpoint_id
from sd_accel.webui.identity import LoraSet, weights_id


def checkpoint_id(module: Any, cache_dir: Path | None = None, fingerprint_of: torch.nn.Module | None = None) -> str:
    """``ckpt-<10 hex>`` for a module loaded from a checkpoint file, else ``fp-<10 hex>`` of
    ``fingerprint_of``'s weights (those must then be the unpatched ones)."""
    path = host.source_of(module)
    if path and Path(path).is_file():
        return file_checkpoint_id(path, cache_dir)
    from sd_accel.onnx.fingerprint import fingerprint

    return "fp-" + fingerprint(fingerprint_of if fingerprint_of is not None else module)[:10]


def _tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if depth > 4:
        return []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v, depth + 1)]
    weights = getattr(value, "weights", None)  # comfy.weight_adapter's LoRAAdapter, LoHaAdapter ...
    if weights is not None:
        return _tensors(weights, depth + 1)
    return []


def _kind(value: Any) -> str:
    if isinstance(value, tuple) and value and isinstance(value[0], str):
        return value[0]  # old-style ("diff", (tensor,)), ("lora", ...)
    return type(value).__name__


def patch_set(patches: dict, prefix: str = "diffusion_model.") -> LoraSet:
    """The LoRA set of a ModelPatcher's ``patches`` (the keys under ``prefix``): one entry per
    (strength_patch, strength_model) group, named by a digest of what the group patches."""
    groups: dict[tuple[float, float], hashlib._Hash] = {}
    for key in sorted(k for k in patches if str(k if isinstance(k, str) else k[0]).startswith(prefix)):
        for entry in patches[key]:
            parts = entry if isinstance(entry, tuple) else (entry,)
            strength = round(float(parts[0]), 4) if len(parts) > 0 else 1.0
            model = round(float(parts[2]), 4) if len(parts) > 2 else 1.0
            value = parts[1] if len(parts) > 1 else None
            h = groups.setdefault((strength, model), hashlib.sha256())
            h.update(f"{key}|{_kind(value)}|{parts[3:] if len(parts) > 3 else ()!r}\n".encode())
            for t in _tensors(value):
                h.update(f"{tuple(t.shape)}".encode())
                h.update(t.detach().reshape(-1)[:16].to("cpu", torch.float32).numpy().tobytes())
    entries = []
    for (strength, model), h in groups.items():
        if strength == 0.0:
            continue
        name = f"patch-{h.hexdigest()[:8]}" + ("" if model == 1.0 else f"*{model:g}")
        entries.append((name, strength, None))
    return tuple(sorted(entries, key=lambda e: (e[0], e[1])))


def unet_weights_id(ckpt_id: str, loras: LoraSet = ()) -> str:
    """The UNet's weights id: the checkpoint's id plus ``+lora-<8 hex>`` over its patch set,
    as :func:`sd_accel.webui.identity.weights_id` composes it."""
    if ckpt_id.startswith("ckpt-"):
        return weights_id(ckpt_id.removeprefix("ckpt-"), loras)
    return weights_id("x", loras).replace("ckpt-x", ckpt_id, 1)


def describe(loras: LoraSet) -> str:
    """``patch-1a2b3c4d at 0.8``, or ``no LoRA``."""
    return ", ".join(f"{n} at {s:g}" for n, s, _ in loras) if loras else "no LoRA"
