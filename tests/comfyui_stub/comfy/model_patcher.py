"""``comfy.model_patcher.ModelPatcher``: clones share the model; patches are recorded on the
clone and written into the weights when the model is loaded for sampling (``load``), with the
originals kept in ``backup`` (shared by the clones) and the patch set's ``patches_uuid``
recorded on the model (``current_weight_patches_uuid``)."""

from __future__ import annotations

import copy
import uuid

import torch

from comfy import utils
from comfy.patcher_extension import WrappersMP


class ModelPatcher:
    def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
        self.model = model
        self.load_device = load_device
        self.offload_device = offload_device
        self.patches = {}
        self.backup = {}
        self.object_patches = {}
        self.object_patches_backup = {}
        self.model_options = {"transformer_options": {}}
        self.patches_uuid = uuid.uuid4()
        self.wrappers = WrappersMP.init_wrappers()
        self.callbacks = {}
        self.hook_patches = {}
        self.current_hooks = None
        if not hasattr(self.model, "current_weight_patches_uuid"):
            self.model.current_weight_patches_uuid = None
        if not hasattr(self.model, "model_lowvram"):
            self.model.model_lowvram = False

    def clone(self):
        n = self.__class__(self.model, self.load_device, self.offload_device)
        n.patches = {k: v[:] for k, v in self.patches.items()}
        n.patches_uuid = self.patches_uuid
        n.object_patches = self.object_patches.copy()
        n.model_options = copy.deepcopy(self.model_options)
        n.backup = self.backup
        n.object_patches_backup = self.object_patches_backup
        n.wrappers = {k: {k1: w1.copy() for k1, w1 in w.items()} for k, w in self.wrappers.items()}
        n.hook_patches = dict(self.hook_patches)
        n.current_hooks = self.current_hooks
        return n

    def is_clone(self, other):
        return hasattr(other, "model") and self.model is other.model

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        model_sd = self.model.state_dict()
        added = []
        for k, v in patches.items():
            key, offset, function = (k, None, None) if isinstance(k, str) else (k[0], k[1], k[2] if len(k) > 2 else None)
            if key in model_sd:
                added.append(k)
                self.patches.setdefault(key, []).append((strength_patch, v, strength_model, offset, function))
        self.patches_uuid = uuid.uuid4()
        return added

    def set_model_unet_function_wrapper(self, fn):
        self.model_options["model_function_wrapper"] = fn

    def set_model_patch(self, patch, name):
        to = self.model_options["transformer_options"]
        to.setdefault("patches", {}).setdefault(name, []).append(patch)

    def set_model_output_block_patch(self, patch):
        self.set_model_patch(patch, "output_block_patch")

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)

    def get_all_wrappers(self, wrapper_type):
        return [w for ws in self.wrappers.get(wrapper_type, {}).values() for w in ws]

    def model_dtype(self):
        return torch.float32

    # ---- weights

    def _weight(self, key):
        obj = self.model
        for p in key.split("."):
            obj = getattr(obj, p)
        return obj

    def patch_weight_to_device(self, key):
        if key not in self.patches:
            return
        weight = self._weight(key)
        if key not in self.backup:
            self.backup[key] = weight.detach().clone()
        out = weight.detach().float().clone()
        for strength, value, strength_model, offset, function in self.patches[key]:
            out = value.calculate_weight(out, key, strength, strength_model, offset, function)
        utils.set_attr_param(self.model, key, out.to(weight.dtype))

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        for key, weight in list(self.backup.items()):
            utils.set_attr_param(self.model, key, weight)
        self.backup.clear()
        self.model.current_weight_patches_uuid = None

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        if self.model.current_weight_patches_uuid == self.patches_uuid and not force_patch_weights:
            return
        if self.model.current_weight_patches_uuid is not None or self.backup:
            self.unpatch_model()
        for key in self.patches:
            self.patch_weight_to_device(key)
        self.model.current_weight_patches_uuid = self.patches_uuid
