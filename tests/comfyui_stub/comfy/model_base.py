"""``comfy.model_base.BaseModel``: input scaling, sigma -> timestep, the UNet call, denoised output."""

from __future__ import annotations

import enum

import torch

from comfy import patcher_extension


class ModelType(enum.Enum):
    EPS = 1
    V_PREDICTION = 2


class ModelSamplingDiscrete(torch.nn.Module):
    def __init__(self, prediction: ModelType = ModelType.EPS):
        super().__init__()
        self.prediction = prediction
        betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
        alphas = torch.cumprod(1 - betas, 0)
        self.register_buffer("sigmas", (((1 - alphas) / alphas) ** 0.5).float())
        self.register_buffer("log_sigmas", self.sigmas.log())

    def calculate_input(self, sigma, noise):
        return noise / (sigma.view(sigma.shape[:1] + (1,) * (noise.ndim - 1)) ** 2 + 1.0) ** 0.5

    def calculate_denoised(self, sigma, model_output, model_input):
        sigma = sigma.view(sigma.shape[:1] + (1,) * (model_output.ndim - 1))
        if self.prediction == ModelType.V_PREDICTION:
            return model_input * 1.0 / (sigma**2 + 1.0) - model_output * sigma / (sigma**2 + 1.0) ** 0.5
        return model_input - model_output * sigma

    def timestep(self, sigma):
        dists = sigma.log().unsqueeze(0) - self.log_sigmas.unsqueeze(1)
        return dists.abs().argmin(dim=0).view(sigma.shape).float()


class SD15:
    """A model_config class (ComfyUI's supported_models.SD15)."""


class BaseModel(torch.nn.Module):
    def __init__(self, diffusion_model, model_type: ModelType = ModelType.EPS):
        super().__init__()
        self.diffusion_model = diffusion_model
        self.model_type = model_type
        self.model_config = SD15()
        self.model_sampling = ModelSamplingDiscrete(model_type)
        self.adm_channels = 0

    def apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):  # noqa: B006  (ComfyUI's signature)
        return patcher_extension.WrapperExecutor.new_class_executor(
            self._apply_model, self,
            patcher_extension.get_all_wrappers(patcher_extension.WrappersMP.APPLY_MODEL, transformer_options),
        ).execute(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)

    def _apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):  # noqa: B006
        sigma = t
        xc = self.model_sampling.calculate_input(sigma, x)
        t = self.model_sampling.timestep(t).float()
        out = self.diffusion_model(xc, t, context=c_crossattn, control=control,
                                   transformer_options=transformer_options, **kwargs)
        return self.model_sampling.calculate_denoised(sigma, out.float(), x)
