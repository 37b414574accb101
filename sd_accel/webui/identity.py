"""Which weights a job samples with, as a short id engines are keyed by (``EngineKey.model``).

``ckpt-<hash>`` names the checkpoint: the first 10 hex digits of its sha256, A1111's "short
hash" (``Model hash`` in the infotext), so users recognise it. LoRAs merged into the UNet's
weights change what an engine computes, so they are part of the id: ``+lora-<8 hex>`` over the
sorted (name, UNet strength, dim) of each. Text-encoder strengths do not touch the UNet and are
left out. Reading the id costs no hashing of weights, so it is checked on every job; the
exported weights' content hash is kept in the engine record as well (``weights_fingerprint``).

Where the LoRA set comes from:

- A1111, export: the ``network_current_names`` each layer of the built-in Lora extension
  carries (``lora_current_names`` before 1.5): what is merged into the weights right now.
- A1111, job: the job's ``<lora:...>`` tags, ``p.extra_network_data["lora"]``, read like the
  Lora extension reads them (``name:te:unet:dyn`` positionally, or ``te=``/``unet=``/``dyn=``).
- Forge: the UNet patcher's ``lora_patches`` (keyed ``(file, strength_patch, strength_model,
  online)``), both for export and for the job.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

LoraSet = tuple[tuple[str, float, int | None], ...]  # sorted (name, unet strength, dim)
# Extra-network kinds whose effect an engine can carry once merged into the weights.
LORA_KINDS = ("lora", "lyco")


def checkpoint_hash(info: Any) -> str | None:
    """The checkpoint's short sha256 (10 hex), computing it like the WebUI does when unknown."""
    sha = getattr(info, "sha256", None)
    if not sha and callable(getattr(info, "calculate_shorthash", None)):
        try:
            info.calculate_shorthash()  # hashes the file once; the WebUI caches it in cache.json
        except Exception:  # an unreadable file: fall back to the weights' own fingerprint
            sha = None
        sha = getattr(info, "sha256", None)
    if sha:
        return str(sha)[:10].lower()
    short = getattr(info, "shorthash", None)
    return str(short).lower() if short else None


def _entry(name: Any, unet: Any, dyn: Any) -> tuple[str, float, int | None] | None:
    strength = round(float(unet), 4)
    if strength == 0.0:
        return None  # a LoRA at UNet strength 0 leaves the UNet as it is
    return str(name), strength, (None if dyn in (None, "") else int(dyn))


def _sorted(entries) -> LoraSet:
    return tuple(sorted((e for e in entries if e is not None), key=lambda e: (e[0], e[1], e[2] or 0)))


def merged_loras(module: torch.nn.Module, part: str = "unet") -> LoraSet:
    """LoRAs the A1111 Lora extension has merged into ``module``'s weights right now, with their
    strength for ``part``: ``"unet"`` (the UNet) or ``"te"`` (the text encoder)."""
    found: set = set()
    for sub in module.modules():
        names = getattr(sub, "network_current_names", None) or getattr(sub, "lora_current_names", None)
        for item in names or ():
            item = tuple(item)
            if len(item) >= 4:  # (name, te_multiplier, unet_multiplier, dyn_dim)
                found.add(_entry(item[0], item[2] if part == "unet" else item[1], item[3]))
            elif len(item) >= 2:  # before 1.5: (name, multiplier)
                found.add(_entry(item[0], item[1], None))
    return _sorted(found)


def _params_lora(params: Any, part: str = "unet") -> tuple[str, float, int | None] | None:
    """One ``<lora:...>`` tag (an ``ExtraNetworkParams``) as the Lora extension reads it, with its
    strength for ``part`` (``"unet"`` or ``"te"``)."""
    positional = list(getattr(params, "positional", None) or getattr(params, "items", None) or [])
    named = dict(getattr(params, "named", None) or {})
    if not positional:
        return None
    te = float(positional[1]) if len(positional) > 1 else 1.0
    te = float(named.get("te", te))
    unet = float(positional[2]) if len(positional) > 2 else te
    unet = float(named.get("unet", unet))
    dyn = positional[3] if len(positional) > 3 else None
    dyn = named.get("dyn", dyn)
    return _entry(positional[0], unet if part == "unet" else te, dyn)


def job_loras(extra_network_data: dict | None, part: str = "unet") -> tuple[LoraSet, list[str]]:
    """(LoRAs of the job with their ``part`` strengths, other extra-network kinds it uses) from
    ``p.extra_network_data``.

    Other kinds (hypernetworks above all) patch attention at run time; an engine cannot carry
    them, so the caller runs such jobs in PyTorch.
    """
    loras, others = [], []
    for kind, params_list in (extra_network_data or {}).items():
        if not params_list:
            continue
        if kind in LORA_KINDS:
            loras.extend(_params_lora(p, part) for p in params_list)
        else:
            others.append(kind)
    return _sorted(loras), sorted(others)


def forge_loras(patcher: Any) -> LoraSet:
    """LoRAs a Forge UNet patcher carries (``lora_patches`` keys: file, strength_patch,
    strength_model, online); a Forge 1 patcher with anonymous ``patches`` gets one opaque entry.

    Forge's LoRA extension passes the tag's strength as ``strength_patch`` (the delta's scale;
    ``strength_model``, which scales the base weight, stays 1.0): that is the strength. A
    ``strength_model`` other than 1 goes into the name (``film*0.5``): another weight."""
    lora_patches = getattr(patcher, "lora_patches", None)
    if isinstance(lora_patches, dict):
        entries = []
        for key in lora_patches:
            key = key if isinstance(key, tuple) else (key,)
            strength = key[1] if len(key) > 1 else 1.0
            model_strength = float(key[2]) if len(key) > 2 else 1.0
            name = Path(str(key[0])).stem
            entries.append(_entry(name if model_strength == 1.0 else f"{name}*{model_strength:g}", strength, None))
        return _sorted(entries)
    patches = getattr(patcher, "patches", None)
    if isinstance(patches, dict) and patches:
        return (("patched-" + _patches_digest(patches), 1.0, None),)
    return ()


def _patches_digest(patches: dict) -> str:
    """8 hex over a Forge 1 patcher's ``patches`` (layer key -> [(strength_patch, value,
    strength_model), ...]): the keys, the strengths, and each patch tensor's shape and first
    values. The keys alone are the same for most LoRAs (they patch the same attention layers):
    an engine built with one LoRA would have served another, or another strength."""
    h = hashlib.sha256()
    for key in sorted(patches, key=str):
        h.update(f"{key}\n".encode())
        for entry in patches[key] if isinstance(patches[key], (list, tuple)) else [patches[key]]:
            parts = entry if isinstance(entry, tuple) else (entry,)
            h.update(repr([p for p in parts if isinstance(p, (int, float, str))]).encode())
            for t in _tensors(parts):
                h.update(f"{tuple(t.shape)}".encode())
                h.update(t.detach().reshape(-1)[:16].to("cpu", torch.float32).numpy().tobytes())
    return h.hexdigest()[:8]


def _tensors(value) -> list:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def weights_id(ckpt_hash: str, loras: LoraSet = ()) -> str:
    """``ckpt-<hash>`` plus ``+lora-<8 hex>`` when LoRAs are merged.

    >>> weights_id("0123456789")
    'ckpt-0123456789'
    >>> weights_id("0123456789", (("film", 0.8, None),))
    'ckpt-0123456789+lora-7fc9dbfb'
    """
    if not loras:
        return f"ckpt-{ckpt_hash}"
    blob = json.dumps([list(e) for e in loras], sort_keys=True).encode()
    return f"ckpt-{ckpt_hash}+lora-{hashlib.sha256(blob).hexdigest()[:8]}"


def _digest(items) -> str:
    return hashlib.sha256(json.dumps(list(items), sort_keys=True).encode()).hexdigest()[:8]


def modules_suffix(modules: tuple[str, ...] = ()) -> str:
    """``+mods-<8 hex>`` over Forge 2's additional modules (VAE / text encoder files), else ""."""
    return f"+mods-{_digest(sorted(Path(m).name for m in modules))}" if modules else ""


def vae_id(ckpt_hash: str, vae_hash: str | None = None, modules: tuple[str, ...] = ()) -> str:
    """The VAE's weights id: ``vae-<10 hex>`` for a separate VAE file (A1111's ``sd_vae``; the
    same engine then serves every checkpoint that uses it), else the checkpoint's own VAE,
    ``ckpt-<hash>`` (plus Forge 2's additional modules).

    >>> vae_id("0123456789"), vae_id("0123456789", "abcdef0123")
    ('ckpt-0123456789', 'vae-abcdef0123')
    """
    if vae_hash:
        return f"vae-{vae_hash}"
    return f"ckpt-{ckpt_hash}{modules_suffix(modules)}"


def clip_id(ckpt_hash: str, te_loras: LoraSet = (), modules: tuple[str, ...] = ()) -> str:
    """The text encoder's weights id: the checkpoint's, plus the LoRAs merged into the text
    encoder (their text-encoder strengths), plus Forge 2's additional modules."""
    return weights_id(ckpt_hash, te_loras).replace(f"ckpt-{ckpt_hash}", f"ckpt-{ckpt_hash}{modules_suffix(modules)}", 1)


def describe(loras: LoraSet) -> str:
    """``film (0.8), ink (1.0)``, or ``no LoRA``."""
    return ", ".join(f"{n} ({s:g})" for n, s, _ in loras) if loras else "no LoRA"
