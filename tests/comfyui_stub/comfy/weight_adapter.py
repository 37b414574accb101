"""``comfy.weight_adapter``: a LoRA's tensors and how they change a weight."""

from __future__ import annotations


class LoRAAdapter:
    name = "lora"

    def __init__(self, loaded_keys, weights):
        self.loaded_keys = loaded_keys
        self.weights = weights  # (up, down, alpha, mid, dora_scale, reshape)

    def calculate_weight(self, weight, key, strength, strength_model, offset, function):
        up, down, alpha = self.weights[:3]
        scale = (alpha / down.shape[0]) if alpha is not None else 1.0
        if strength_model != 1.0:
            weight = weight * strength_model
        return weight + strength * scale * (up.float() @ down.float()).reshape(weight.shape).to(weight.dtype)
