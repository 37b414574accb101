"""``ldm.modules.diffusionmodules.model``: the VAE's ``Encoder`` / ``Decoder``, made tiny.

The real module's structure and names (``conv_in``, ``down[i].block`` / ``.downsample``,
``mid.block_1`` / ``.attn_1`` / ``.block_2``, ``up[i].block`` / ``.upsample``, ``norm_out``,
``conv_out``; classes ``Upsample``, ``Downsample``, ``AttnBlock``, ``ResnetBlock``) at small
widths. ``AttnBlock`` computes attention with bmm and softmax, as A1111's unoptimized one.
"""

from __future__ import annotations

import torch
from torch import nn


def Normalize(channels):
    return nn.GroupNorm(num_groups=4, num_channels=channels, eps=1e-6, affine=True)


class Upsample(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, 1, 1)

    def forward(self, x):
        return self.conv(torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, 2, 0)

    def forward(self, x):
        return self.conv(torch.nn.functional.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class ResnetBlock(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.norm1, self.conv1 = Normalize(in_channels), nn.Conv2d(in_channels, out_channels, 3, 1, 1)
        self.norm2, self.conv2 = Normalize(out_channels), nn.Conv2d(out_channels, out_channels, 3, 1, 1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x, temb=None):
        h = self.conv1(torch.nn.functional.silu(self.norm1(x)))
        h = self.conv2(torch.nn.functional.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.norm = Normalize(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, c, hh, ww = q.shape
        q = q.reshape(b, c, hh * ww).permute(0, 2, 1)
        w_ = torch.bmm(q, k.reshape(b, c, hh * ww)) * (int(c) ** (-0.5))
        w_ = torch.nn.functional.softmax(w_, dim=2)
        h_ = torch.bmm(v.reshape(b, c, hh * ww), w_.permute(0, 2, 1)).reshape(b, c, hh, ww)
        return x + self.proj_out(h_)


class _Level(nn.Module):
    pass


class Encoder(nn.Module):
    def __init__(self, ch=8, ch_mult=(1, 1, 2, 2), in_channels=3, z_channels=4, double_z=True):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, 1, 1)
        self.down = nn.ModuleList()
        block_in = ch
        for i, mult in enumerate(ch_mult):
            level = _Level()
            level.block = nn.ModuleList([ResnetBlock(block_in, ch * mult)])
            level.attn = nn.ModuleList()
            block_in = ch * mult
            if i != len(ch_mult) - 1:
                level.downsample = Downsample(block_in)
            self.down.append(level)
        self.mid = _Level()
        self.mid.block_1, self.mid.attn_1, self.mid.block_2 = (ResnetBlock(block_in, block_in), AttnBlock(block_in),
                                                               ResnetBlock(block_in, block_in))
        self.norm_out = Normalize(block_in)
        self.conv_out = nn.Conv2d(block_in, 2 * z_channels if double_z else z_channels, 3, 1, 1)

    def forward(self, x):
        h = self.conv_in(x)
        for i, level in enumerate(self.down):
            h = level.block[0](h)
            if i != len(self.down) - 1:
                h = level.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(torch.nn.functional.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, ch=8, ch_mult=(1, 1, 2, 2), out_ch=3, z_channels=4):
        super().__init__()
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, 1, 1)
        self.mid = _Level()
        self.mid.block_1, self.mid.attn_1, self.mid.block_2 = (ResnetBlock(block_in, block_in), AttnBlock(block_in),
                                                               ResnetBlock(block_in, block_in))
        self.up = nn.ModuleList()
        for i in reversed(range(len(ch_mult))):
            level = _Level()
            level.block = nn.ModuleList([ResnetBlock(block_in, ch * ch_mult[i])])
            level.attn = nn.ModuleList()
            block_in = ch * ch_mult[i]
            if i != 0:
                level.upsample = Upsample(block_in)
            self.up.insert(0, level)
        self.norm_out = Normalize(block_in)
        self.conv_out = nn.Conv2d(block_in, out_ch, 3, 1, 1)

    def forward(self, z):
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for i in reversed(range(len(self.up))):
            h = self.up[i].block[0](h)
            if i != 0:
                h = self.up[i].upsample(h)
        return self.conv_out(torch.nn.functional.silu(self.norm_out(h)))
