"""``backend/loader.py``: ``forge_loader`` builds Forge's model objects (here from a stub
checkpoint); ``apply_loras`` is what Forge's extra-network activation does to the UNet patcher."""

from __future__ import annotations

import types

import torch

from backend.modules.k_model import KModel
from backend.patcher.base import ModelPatcher
from backend.patcher.unet import UnetPatcher


class ForgeObjects:
    def __init__(self, unet, clip, vae, clipvision):
        self.unet, self.clip, self.vae, self.clipvision = unet, clip, vae, clipvision

    def shallow_copy(self):
        return ForgeObjects(self.unet, self.clip, self.vae, self.clipvision)


class IntegratedCLIP(torch.nn.Module):
    """``backend/nn/clip.py``: holds the transformers ``CLIPTextModel`` as ``transformer``."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer


class CLIP:
    """``backend/patcher/clip.py``: ``cond_stage_model`` (a ModuleDict of encoders) and its patcher."""

    def __init__(self, cond_stage_model):
        self.cond_stage_model = cond_stage_model
        self.patcher = ModelPatcher(cond_stage_model)

    def clone(self):
        n = CLIP.__new__(CLIP)
        n.cond_stage_model, n.patcher = self.cond_stage_model, self.patcher.clone()
        return n


class VAE:
    """``backend/patcher/vae.py``: decodes / encodes through ``first_stage_model`` in batches."""

    def __init__(self, first_stage_model):
        self.first_stage_model = first_stage_model
        self.patcher = ModelPatcher(first_stage_model)

    def decode(self, samples):
        return torch.cat([self.first_stage_model.decode(samples[i:i + 1]) for i in range(samples.shape[0])])


class ForgeDiffusionEngine:
    """``backend/diffusion_engine/base.py``: what ``shared.sd_model`` is on Forge 2. The UNet's
    linear layers are ``ForgeOperations.Linear`` with inference-tensor weights and its attention
    goes through ``backend.nn.unet.attention_function``, as in Forge."""

    def __init__(self, stub_model, checkpoint_info):
        from backend.nn.unet import ForgeAttnProcessor
        from backend.operations import forge_linears
        from backend.text_processing.classic_engine import ClassicTextProcessingEngine

        unet = stub_model.model.diffusion_model
        forge_linears(unet.unet)
        unet.unet.set_attn_processor(ForgeAttnProcessor())
        clip = None
        self.text_processing_engine = None
        if stub_model.is_sd1:
            clip = CLIP(torch.nn.ModuleDict({"clip_l": IntegratedCLIP(stub_model.cond_stage_model.transformer)}))
            self.text_processing_engine = ClassicTextProcessingEngine(clip.cond_stage_model["clip_l"])
        self.forge_objects = ForgeObjects(UnetPatcher(KModel(unet)), clip, VAE(stub_model.first_stage_model), None)
        self.forge_objects_original = self.forge_objects.shallow_copy()
        self.forge_objects_after_applying_lora = self.forge_objects.shallow_copy()
        self.sd_checkpoint_info = checkpoint_info
        self.is_sdxl = stub_model.is_sdxl
        self.is_sd1, self.is_sd2 = stub_model.is_sd1, False
        self.lowvram = False
        self.scale_factor = stub_model.scale_factor
        self._stub = stub_model

    def get_learned_conditioning(self, prompts):
        if self.text_processing_engine is not None:
            return self.text_processing_engine(prompts)
        return self._stub.get_learned_conditioning(prompts)

    def decode_first_stage(self, z):
        return self.forge_objects.vae.decode(1.0 / self.scale_factor * z)


def forge_loader(checkpoint_info):
    from modules.sd_models import model_from_file

    return ForgeDiffusionEngine(model_from_file(checkpoint_info.filename, checkpoint_info), checkpoint_info)


LORA_RANK = 2


def lora_patches(model: torch.nn.Module, filename: str) -> dict:
    """A stub LoRA file's UNet patches: rank-2 deltas for every linear weight of ``model`` (a
    ``KModel``, keys as Forge's: ``diffusion_model....weight``), drawn from the file name."""
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(filename.encode()))
    patches = {}
    for name, module in sorted(model.named_modules()):
        if type(module).__name__ == "Linear" and getattr(module, "weight", None) is not None:
            out_f, in_f = module.weight.shape
            up = torch.randn(out_f, LORA_RANK, generator=g) * 1.0
            down = torch.randn(LORA_RANK, in_f, generator=g) * 1.0
            patches[f"{name}.weight"] = [(1.0, ("lora", (up, down, float(LORA_RANK), None, None)), 1.0, None, None)]
    return patches


def apply_loras(p):
    """Forge's LoRA activation (``sd_forge_lora``'s ``load_lora_for_models``): a patcher clone
    carrying the job's LoRA patches; the weights are untouched until Forge loads the UNet for
    sampling (``UnetPatcher.refresh_loras``). The CLIP's patches are left empty here."""
    model = p.sd_model
    model.forge_objects = model.forge_objects_original.shallow_copy()
    loras = (p.extra_network_data or {}).get("lora", [])
    if loras:
        unet = model.forge_objects.unet.clone()
        clip = model.forge_objects.clip.clone() if model.forge_objects.clip is not None else None
        for params in loras:
            strength = float(params.positional[1]) if len(params.positional) > 1 else 1.0
            filename = f"/models/Lora/{params.positional[0]}.safetensors"
            unet.add_patches(filename=filename, patches=lora_patches(unet.model, filename),
                             strength_patch=strength, strength_model=1.0)
            if clip is not None:
                clip.patcher.add_patches(filename=f"/models/Lora/{params.positional[0]}.safetensors", patches={},
                                         strength_patch=strength, strength_model=strength)
        model.forge_objects.unet = unet
        model.forge_objects.clip = clip
    model.forge_objects_after_applying_lora = model.forge_objects.shallow_copy()
    return types.SimpleNamespace(loras=len(loras))
