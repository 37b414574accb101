"""``comfy.model_base.BaseModel``: input scaling, sigma -> timestep, the UNet call, denoised output."""

from __future__ import annotations

import enum

import torch

from comfy import latent_formats, model_sampling, patcher_extension, supported_models


class ModelType(enum.Enum):
    EPS = 1
    V_PREDICTION = 2
    FLOW = 6
    FLUX = 8


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


SD15 = supported_models.SD15


class BaseModel(torch.nn.Module):
    def __init__(self, diffusion_model, model_type: ModelType = ModelType.EPS):
        super().__init__()
        self.diffusion_model = diffusion_model
        self.model_type = model_type
        self.model_config = SD15()
        self.model_sampling = ModelSamplingDiscrete(model_type)
        self.adm_channels = 0
        self.latent_format = latent_formats.SD15()

    def process_latent_in(self, latent):
        return self.latent_format.process_in(latent)

    def process_latent_out(self, latent):
        return self.latent_format.process_out(latent)

    def extra_conds(self, **kwargs):
        """The model's inputs beside the context from one cond (ComfyUI's CONDRegular values, as tensors)."""
        return {}

    def apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):  # noqa: B006  (ComfyUI's signature)
        return patcher_extension.WrapperExecutor.new_class_executor(
            self._apply_model, self,
            patcher_extension.get_all_wrappers(patcher_extension.WrappersMP.APPLY_MODEL, transformer_options),
        ).execute(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)

    def _apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):  # noqa: B006
        sigma = t
        xc = self.model_sampling.calculate_input(sigma, x)
        if c_concat is not None:
            xc = torch.cat([xc, c_concat.to(xc)], dim=1)
        t = self.model_sampling.timestep(t).float()
        t = self.process_timestep(t, x=x, **kwargs)
        out = self.diffusion_model(xc, t, context=c_crossattn, control=control,
                                   transformer_options=transformer_options, **kwargs)
        return self.model_sampling.calculate_denoised(sigma, out.float(), x)

    def process_timestep(self, timestep, **kwargs):
        return timestep


def _sampling(sampling, prediction):
    class ModelSampling(sampling, prediction):
        pass

    return ModelSampling()


class SD3(BaseModel):
    """``comfy.model_base.SD3``: the MMDiT, flow matching with sigma x 1000 as its timestep; the
    pooled CLIP output is ``y``."""

    def __init__(self, diffusion_model, shift: float = 3.0):
        super().__init__(diffusion_model, ModelType.FLOW)
        self.model_config = supported_models.SD3()
        self.model_sampling = _sampling(model_sampling.ModelSamplingDiscreteFlow, model_sampling.CONST)
        self.model_sampling.set_parameters(shift=shift)
        self.adm_channels = diffusion_model.y_embedder.mlp[0].in_features
        self.latent_format = latent_formats.SD3()

    def extra_conds(self, **kwargs):
        return {"y": kwargs["pooled_output"]}


class Flux(BaseModel):
    """``comfy.model_base.Flux``: flow matching whose timestep is the sigma itself (the transformer
    multiplies by 1000); ``y`` the pooled CLIP-L output, ``guidance`` 3.5 unless the cond says."""

    def __init__(self, diffusion_model, shift: float = 1.15):
        super().__init__(diffusion_model, ModelType.FLUX)
        self.model_config = supported_models.Flux()
        self.model_sampling = _sampling(model_sampling.ModelSamplingFlux, model_sampling.CONST)
        self.model_sampling.set_parameters(shift=shift)
        self.adm_channels = diffusion_model.params.vec_in_dim
        self.latent_format = latent_formats.Flux()

    def extra_conds(self, **kwargs):
        out = {"y": kwargs["pooled_output"]}
        guidance = kwargs.get("guidance", 3.5)
        if guidance is not None:
            out["guidance"] = torch.FloatTensor([guidance])
        if kwargs.get("reference_latents") is not None:
            out["ref_latents"] = [self.process_latent_in(lat) for lat in kwargs["reference_latents"]]
        return out
