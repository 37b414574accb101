"""Tiny FLUX.1 / SD3 ControlNets of a tiny transformer's widths, with random weights (their
zero-initialised projections made random, so that a net changes the picture): shared by the
ControlNet tests of diffusers, the CLI and the service."""

from __future__ import annotations

import torch


def flux_net(transformer, seed: int, modes: int | None = None):
    """A one-block ``FluxControlNetModel``; ``modes``: a union net with that many control types."""
    from diffusers import FluxControlNetModel

    torch.manual_seed(seed)
    net = FluxControlNetModel.from_transformer(transformer, num_layers=1, num_single_layers=1,
                                               attention_head_dim=transformer.config.attention_head_dim,
                                               num_attention_heads=transformer.config.num_attention_heads)
    if modes is not None:  # a union net: the same net with a control-mode embedding
        config = {k: v for k, v in net.config.items() if not k.startswith("_") and k != "out_channels"}
        union = FluxControlNetModel.from_config({**config, "num_mode": modes})
        union.load_state_dict(net.state_dict(), strict=False)
        net = union
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 100)
        for name, param in net.named_parameters():
            if "controlnet_" in name:  # zero-initialised: random, or the net would change nothing
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    return net


def sd3_net(transformer, seed: int):
    """A one-block ``SD3ControlNetModel`` of the transformer's widths (diffusers' from_transformer
    writes into the transformer's config: built from a copy here)."""
    from diffusers import SD3ControlNetModel

    config = {k: v for k, v in transformer.config.items() if not k.startswith("_")}
    torch.manual_seed(seed)
    net = SD3ControlNetModel.from_config({**config, "num_layers": 1, "extra_conditioning_channels": 0})
    for part in ("pos_embed", "time_text_embed", "context_embedder"):
        getattr(net, part).load_state_dict(getattr(transformer, part).state_dict())
    net.transformer_blocks.load_state_dict(transformer.transformer_blocks.state_dict(), strict=False)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 100)
        for name, param in net.named_parameters():
            if name.startswith(("controlnet_blocks", "pos_embed_input")):
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    return net
