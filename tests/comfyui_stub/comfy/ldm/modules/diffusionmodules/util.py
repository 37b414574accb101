"""``comfy.ldm.modules.diffusionmodules.util.timestep_embedding``: sinusoids of the timestep as given
(no factor: SD3's model sampling hands the MMDiT sigma x 1000), cos first."""

import math

import torch


def timestep_embedding(timesteps, dim, max_period=10000, repeat_only=False):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=timesteps.device) / half)
    args = timesteps[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
