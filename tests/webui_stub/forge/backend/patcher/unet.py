"""``backend/patcher/unet.py``: ``UnetPatcher``, with Forge's ControlNet chain
(``controlnet_linked_list``: the last added net, each pointing to the one before)."""

from backend.patcher.base import ModelPatcher


class UnetPatcher(ModelPatcher):
    def __init__(self, model, load_device=None, offload_device=None):
        super().__init__(model, load_device, offload_device)
        self.controlnet_linked_list = None

    def clone(self):
        n = super().clone()
        n.controlnet_linked_list = self.controlnet_linked_list
        return n

    def add_patched_controlnet(self, cnet):
        cnet.set_previous_controlnet(self.controlnet_linked_list)
        self.controlnet_linked_list = cnet
