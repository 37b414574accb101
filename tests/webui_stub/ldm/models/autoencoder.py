"""``ldm.models.autoencoder.AutoencoderKL``: ``decode(z) = decoder(post_quant_conv(z))`` and
``encode(x)`` a Gaussian over ``quant_conv(encoder(x))``, as in the real module."""

from __future__ import annotations

import torch
from torch import nn

from ldm.modules.diffusionmodules.model import Decoder, Encoder


class DiagonalGaussianDistribution:
    def __init__(self, parameters):
        self.mean, self.logvar = torch.chunk(parameters, 2, dim=1)
        self.std = torch.exp(0.5 * torch.clamp(self.logvar, -30.0, 20.0))

    def sample(self, generator=None):
        return self.mean + self.std * torch.randn(self.mean.shape, generator=generator)

    def mode(self):
        return self.mean


class AutoencoderKL(nn.Module):
    def __init__(self, embed_dim=4, seed=0):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed + 7)
            self.encoder = Encoder(z_channels=embed_dim)
            self.decoder = Decoder(z_channels=embed_dim)
            self.quant_conv = nn.Conv2d(2 * embed_dim, 2 * embed_dim, 1)
            self.post_quant_conv = nn.Conv2d(embed_dim, embed_dim, 1)
            for param in self.parameters():
                param.data.normal_(0, 0.2)
        self.eval()

    @property
    def dtype(self):
        return next(self.parameters()).dtype

    def encode(self, x):
        return DiagonalGaussianDistribution(self.quant_conv(self.encoder(x)))

    def decode(self, z):
        return self.decoder(self.post_quant_conv(z))
