"""``modules/lowvram.py``: forward pre-hooks that move modules to the GPU on use.

There is no GPU here, so ``send_me_to_gpu`` records which module it would have moved; an
export that leaves the hooks in place shows up in ``calls``.
"""

from __future__ import annotations

calls: list[str] = []


def is_enabled(sd_model):
    return sd_model.lowvram


def setup_for_low_vram(sd_model, use_medvram):
    sd_model.lowvram = True

    def send_me_to_gpu(module, _):
        calls.append(type(module).__name__)

    # medvram: the whole UNet wrapper moves as one; lowvram: the UNet's blocks one by one
    sd_model.model.register_forward_pre_hook(send_me_to_gpu)
    if not use_medvram:
        unet = sd_model.model.diffusion_model
        for block in unet.unet.down_blocks:
            block.register_forward_pre_hook(send_me_to_gpu)
        unet.unet.mid_block.register_forward_pre_hook(send_me_to_gpu)
        for block in unet.unet.up_blocks:
            block.register_forward_pre_hook(send_me_to_gpu)
