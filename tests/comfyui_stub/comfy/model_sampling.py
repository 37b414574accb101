"""``comfy.model_sampling``: CONST (flow matching: x = sigma * noise + (1 - sigma) * x0, the model
predicts the velocity), SD3's discrete flow (timestep = sigma x multiplier, 1000) and Flux's (the
timestep is the sigma)."""

import math

import torch


def _shape(sigma, ndim):
    return sigma.view(sigma.shape[:1] + (1,) * (ndim - 1))


class CONST:
    def calculate_input(self, sigma, noise):
        return noise

    def calculate_denoised(self, sigma, model_output, model_input):
        return model_input - model_output * _shape(sigma, model_output.ndim)

    def noise_scaling(self, sigma, noise, latent_image, max_denoise=False):
        sigma = _shape(sigma, noise.ndim)
        return sigma * noise + (1.0 - sigma) * latent_image


def time_snr_shift(alpha, t):
    if alpha == 1.0:
        return t
    return alpha * t / (1 + (alpha - 1) * t)


class ModelSamplingDiscreteFlow(torch.nn.Module):
    def set_parameters(self, shift=1.0, timesteps=1000, multiplier=1000):
        self.shift = shift
        self.multiplier = multiplier
        self.register_buffer("sigmas", self.sigma((torch.arange(1, timesteps + 1, 1) / timesteps) * multiplier))

    def timestep(self, sigma):
        return sigma * self.multiplier

    def sigma(self, timestep):
        return time_snr_shift(self.shift, timestep / self.multiplier)


def flux_time_shift(mu, sigma, t):
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)


class ModelSamplingFlux(torch.nn.Module):
    def set_parameters(self, shift=1.15, timesteps=10000):
        self.shift = shift
        self.register_buffer("sigmas", self.sigma(torch.arange(1, timesteps + 1, 1) / timesteps))

    def timestep(self, sigma):
        return sigma

    def sigma(self, timestep):
        return flux_time_shift(self.shift, 1.0, timestep)
