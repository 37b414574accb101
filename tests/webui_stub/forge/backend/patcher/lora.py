"""``backend/patcher/lora.py``: ``LoraLoader`` merges a patcher's LoRA patches into the model's
weights when Forge loads the model for sampling (``refresh``, under inference mode, new
``Parameter`` objects, the originals kept in ``backup`` and put back when the set changes);
``loaded_hash`` records which patches are merged. Online patches (``online_mode``) stay out of
the weights (Forge computes them in each forward). A patch is Forge's
``(strength_patch, ("lora", (up, down, alpha, mid, dora_scale)), strength_model, offset, function)``.
"""

from __future__ import annotations

import torch


def get_attr_with_parent(obj, attr):
    attrs = attr.split(".")
    parent = obj
    for name in attrs[:-1]:
        parent = getattr(parent, name)
    return parent, attrs[-1], getattr(parent, attrs[-1])


def merge_lora_to_weight(patches, weight, key="online_lora", computation_dtype=torch.float32):
    weight = weight.to(computation_dtype, copy=True)
    for strength_patch, v, strength_model, _offset, _function in patches:
        if strength_model != 1.0:
            weight *= strength_model
        kind, (up, down, alpha, _mid, _dora) = v
        assert kind == "lora"
        scale = alpha / down.shape[0] if alpha is not None else 1.0
        weight += strength_patch * scale * (up.to(computation_dtype) @ down.to(computation_dtype)).reshape(weight.shape)
    return weight


class LoraLoader:
    def __init__(self, model):
        self.model = model
        self.backup = {}
        self.loaded_hash = str([])

    @torch.inference_mode()
    def refresh(self, lora_patches, offload_device=torch.device("cpu"), force_refresh=False):
        hashes = str(list(lora_patches.keys()))
        if hashes == self.loaded_hash and not force_refresh:
            return
        all_patches = {}
        for (_, _, _, online_mode), patches in lora_patches.items():
            for key, current_patches in patches.items():
                all_patches[(key, online_mode)] = all_patches.get((key, online_mode), []) + current_patches
        for k, w in self.backup.items():
            parent, child, _ = get_attr_with_parent(self.model, k)
            setattr(parent, child, torch.nn.Parameter(w, requires_grad=False))
        self.backup = {}
        for (key, online_mode), current_patches in all_patches.items():
            parent, child, weight = get_attr_with_parent(self.model, key)
            if online_mode:
                continue
            if key not in self.backup:
                self.backup[key] = weight.to(device=offload_device)
            merged = merge_lora_to_weight(current_patches, weight, key).to(weight.dtype)
            setattr(parent, child, torch.nn.Parameter(merged, requires_grad=False))
        self.loaded_hash = hashes
