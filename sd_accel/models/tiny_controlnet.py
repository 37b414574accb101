"""Tiny random ControlNets shaped like a tiny pipeline's UNet, for the demo and the tests.

A ControlNet made from a UNet (``ControlNetModel.from_unet``) starts with its zero convolutions
at zero, so it adds nothing; these get small random weights there, so their residuals are not
zero and a wrong residual on an engine shows in the image.
"""

from __future__ import annotations

import torch


def tiny_controlnet(unet: torch.nn.Module, seed: int = 0, conditioning_channels: int = 3) -> torch.nn.Module:
    """A random ``ControlNetModel`` with ``unet``'s architecture (SD 1.x or SDXL, added embeddings
    included), non-zero residuals, in float32.

    >>> from sd_accel.models.builtin import build_tiny_pipeline
    >>> type(tiny_controlnet(build_tiny_pipeline("sd15").unet)).__name__
    'ControlNetModel'
    """
    from diffusers import ControlNetModel

    torch.manual_seed(seed)
    levels = len(unet.config.block_out_channels)
    embed = tuple(8 * 2 ** min(i // 2, 2) for i in range(4))  # the real (16, 32, 96, 256), narrower
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=embed,
                                    conditioning_channels=conditioning_channels, load_weights_from_unet=False)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        zero_convs = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]
        for conv in zero_convs:
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * 0.2 / conv.weight[0].numel() ** 0.5)
    assert levels == len(net.config.block_out_channels)
    return net.eval()
