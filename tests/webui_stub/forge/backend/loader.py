"""``backend/loader.py``: ``forge_loader`` builds Forge's model objects (here from a stub
checkpoint); ``apply_loras`` is what Forge's extra-network activation does to the UNet patcher."""

from __future__ import annotations

import types

from backend.modules.k_model import KModel
from backend.patcher.unet import UnetPatcher


class ForgeObjects:
    def __init__(self, unet, clip, vae, clipvision):
        self.unet, self.clip, self.vae, self.clipvision = unet, clip, vae, clipvision

    def shallow_copy(self):
        return ForgeObjects(self.unet, self.clip, self.vae, self.clipvision)


class ForgeDiffusionEngine:
    """``backend/diffusion_engine/base.py``: what ``shared.sd_model`` is on Forge 2."""

    def __init__(self, stub_model, checkpoint_info):
        unet = stub_model.model.diffusion_model
        self.forge_objects = ForgeObjects(UnetPatcher(KModel(unet)), None, None, None)
        self.forge_objects_original = self.forge_objects.shallow_copy()
        self.forge_objects_after_applying_lora = self.forge_objects.shallow_copy()
        self.sd_checkpoint_info = checkpoint_info
        self.is_sdxl = stub_model.is_sdxl
        self.is_sd1, self.is_sd2 = stub_model.is_sd1, False
        self.lowvram = False
        self._stub = stub_model

    def get_learned_conditioning(self, prompts):
        return self._stub.get_learned_conditioning(prompts)


def forge_loader(checkpoint_info):
    from modules.sd_models import model_from_file

    return ForgeDiffusionEngine(model_from_file(checkpoint_info.filename, checkpoint_info), checkpoint_info)


def apply_loras(p):
    """Forge's LoRA activation: a patcher clone carrying the job's LoRAs (weights untouched here)."""
    model = p.sd_model
    model.forge_objects = model.forge_objects_original.shallow_copy()
    loras = (p.extra_network_data or {}).get("lora", [])
    if loras:
        unet = model.forge_objects.unet.clone()
        for params in loras:
            strength = float(params.positional[1]) if len(params.positional) > 1 else 1.0
            unet.add_patches(filename=f"/models/Lora/{params.positional[0]}.safetensors", patches={},
                             strength_patch=strength, strength_model=strength)
        model.forge_objects.unet = unet
    model.forge_objects_after_applying_lora = model.forge_objects.shallow_copy()
    return types.SimpleNamespace(loras=len(loras))
