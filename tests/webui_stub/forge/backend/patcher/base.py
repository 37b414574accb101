"""``backend/patcher/base.py``: ``ModelPatcher`` (object patches, LoRA patches, wrappers)."""

from __future__ import annotations

import copy


class ModelPatcher:
    def __init__(self, model, load_device=None, offload_device=None):
        self.model = model
        self.load_device = load_device
        self.offload_device = offload_device
        self.model_options = {"transformer_options": {}}
        self.object_patches = {}
        self.object_patches_backup = {}
        self.lora_patches = {}
        if not hasattr(model, "lora_loader"):
            from backend.patcher.lora import LoraLoader

            model.lora_loader = LoraLoader(model)
        self.lora_loader = model.lora_loader

    def clone(self):
        n = type(self).__new__(type(self))
        n.model = self.model
        n.load_device, n.offload_device = self.load_device, self.offload_device
        n.model_options = copy.deepcopy(self.model_options)
        n.object_patches = self.object_patches.copy()
        n.object_patches_backup = {}
        n.lora_patches = self.lora_patches.copy()
        n.lora_loader = self.lora_loader
        return n

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def set_model_unet_function_wrapper(self, unet_wrapper_function):
        self.model_options["model_function_wrapper"] = unet_wrapper_function

    def add_patches(self, *, filename, patches, strength_patch=1.0, strength_model=1.0, online_mode=False):
        """Forge's: only keys that name a parameter of the model (``named_parameters``) are taken,
        each patch scaled by ``strength_patch`` (Forge wraps the file's values as
        ``[strength_patch, value, strength_model, offset, function]``; the stub's come wrapped at 1)."""
        lora_identifier = (filename, strength_patch, strength_model, online_mode)
        model_keys = set(k for k, _ in self.model.named_parameters())
        self.lora_patches[lora_identifier] = {
            k: [(s * strength_patch, value, *rest) for s, value, *rest in v] for k, v in patches.items() if k in model_keys}
        return set(self.lora_patches[lora_identifier])

    def has_online_lora(self):
        return any(online for (_, _, _, online) in self.lora_patches)

    def refresh_loras(self):
        """Forge 2's ``LoadedModel.model_load`` calls this: the LoRA patches merged into the weights."""
        self.lora_loader.refresh(lora_patches=self.lora_patches, offload_device=self.offload_device or "cpu")

    def patch_model(self):
        """Object patches in place (Forge does this when it loads the model for sampling)."""
        for k, obj in self.object_patches.items():
            if k not in self.object_patches_backup:
                self.object_patches_backup[k] = getattr(self.model, k)
            setattr(self.model, k, obj)
        return self.model

    def unpatch_model(self):
        for k, obj in self.object_patches_backup.items():
            setattr(self.model, k, obj)
        self.object_patches_backup = {}
