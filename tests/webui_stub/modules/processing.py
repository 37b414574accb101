"""``modules/processing.py``: a txt2img job through the hooks, in the WebUI's order.

``process_images`` follows ``process_images_inner``: ``scripts.process`` -> ``sd_unet.apply_unet``
-> per batch: extra networks parsed and activated (``extra_networks.activate``: A1111's Lora
loads the job's LoRAs; Forge: ``backend.loader.apply_loras``), ``scripts.process_batch``, sampling (hires
fix: ``scripts.before_hr``, a second pass at the larger size) -> ``scripts.postprocess``. On Forge
each pass is preceded by ``scripts.process_before_every_sampling`` and samples through the UNet
patcher (``backend.sampling``).

Sampling is a plain Euler loop over sigmas; the UNet calls are what matters: A1111's
``CFGDenoiser`` runs cond and uncond in one call of 2B rows with ``batch_cond_uncond`` and the
same token count, in B-row calls otherwise (the prompt at 154 tokens, the negative at 77).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from modules import extra_networks, sd_unet, shared


class Processed:
    def __init__(self, p, samples, images=None):
        self.samples = samples
        self.images = images  # decoded, (N, 3, H, W) in about [-1, 1]
        self.prompt = p.prompt
        self.info = ""


class StableDiffusionProcessing:
    def __init__(self, sd_model=None, prompt="", negative_prompt="", steps=3, cfg_scale=7.0, width=64,
                 height=64, batch_size=1, n_iter=1, seed=0, scripts=None, script_args=None):
        self.sd_model = sd_model if sd_model is not None else shared.sd_model
        self.prompt = prompt
        self.negative_prompt = negative_prompt
        self.steps = steps
        self.cfg_scale = cfg_scale
        self.width = width
        self.height = height
        self.batch_size = batch_size
        self.n_iter = n_iter
        self.seed = seed
        self.scripts = scripts
        self.script_args = script_args or []
        self.extra_network_data = {}
        self.disable_extra_networks = False

    def setup_prompts(self):
        self.all_prompts = [self.prompt] * (self.batch_size * self.n_iter)
        self.all_negative_prompts = [self.negative_prompt] * (self.batch_size * self.n_iter)

    def parse_extra_network_prompts(self):
        self.prompts, self.extra_network_data = extra_networks.parse_prompts(self.prompts)

    def init(self):
        pass

    def initial_latents(self, n, g):
        return torch.randn(self.batch_size, 4, self.height // 8, self.width // 8, generator=g) * 2.0


class StableDiffusionProcessingTxt2Img(StableDiffusionProcessing):
    def __init__(self, enable_hr=False, hr_scale=2.0, hr_second_pass_steps=2, **kwargs):
        super().__init__(**kwargs)
        self.enable_hr = enable_hr
        self.hr_scale = hr_scale
        self.hr_second_pass_steps = hr_second_pass_steps


class StableDiffusionProcessingImg2Img(StableDiffusionProcessing):
    """img2img: ``init`` encodes each init image on its own (``images_tensor_to_samples``)."""

    def __init__(self, init_images=None, denoising_strength=0.5, **kwargs):
        super().__init__(**kwargs)
        self.init_images = init_images  # (N, 3, H, W) in [0, 1]
        self.denoising_strength = denoising_strength
        self.init_latent = None

    def init(self):
        image = self.init_images * 2 - 1
        g = torch.Generator().manual_seed(self.seed)
        self.init_latent = torch.stack([
            self.sd_model.get_first_stage_encoding(self.sd_model.encode_first_stage(img[None]), g)[0] for img in image])

    def initial_latents(self, n, g):
        noise = torch.randn(self.init_latent.shape, generator=g)
        return self.init_latent + noise * self.denoising_strength


# --------------------------------------------------------------------------- A1111's denoiser


def _subscript(cond, a, b):
    if isinstance(cond, dict):
        return {k: v[a:b] for k, v in cond.items()}
    return cond[a:b]


def _cat(conds):
    if isinstance(conds[0], dict):
        return {k: torch.cat([c[k] for c in conds]) for k in conds[0]}
    return torch.cat(conds)


def _tokens(cond):
    return (cond["crossattn"] if isinstance(cond, dict) else cond).shape[1]


def inner_model(sd_model, x, sigma, cond):
    """k-diffusion's ``CompVisDenoiser``: scale, sigma -> t, eps prediction -> denoised."""
    c_in = 1 / (sigma**2 + 1) ** 0.5
    t = (sigma * 100).clamp(0, 999)
    eps = sd_model.apply_model(x * c_in[:, None, None, None], t, cond)
    return x - eps * sigma[:, None, None, None]


def cfg_denoiser(p, x, sigma, cond, uncond):
    """``CFGDenoiser.forward``'s batching of cond and uncond."""
    batch = x.shape[0]
    x_in = torch.cat([x, x])
    sigma_in = torch.cat([sigma, sigma])
    if _tokens(cond) == _tokens(uncond):
        cond_in = _cat([cond, uncond])
        if shared.opts.batch_cond_uncond:
            x_out = inner_model(p.sd_model, x_in, sigma_in, cond_in)
        else:
            x_out = torch.zeros_like(x_in)
            for a in range(0, x_out.shape[0], batch):
                b = a + batch
                x_out[a:b] = inner_model(p.sd_model, x_in[a:b], sigma_in[a:b], _subscript(cond_in, a, b))
    else:
        x_out = torch.zeros_like(x_in)
        x_out[:batch] = inner_model(p.sd_model, x_in[:batch], sigma_in[:batch], cond)
        x_out[batch:] = inner_model(p.sd_model, x_in[batch:], sigma_in[batch:], uncond)
    denoised, denoised_uncond = x_out[:batch], x_out[batch:]
    return denoised_uncond + (denoised - denoised_uncond) * p.cfg_scale


def sample_a1111(p, x, steps, cond, uncond):
    sigmas = torch.linspace(2.0, 0.0, steps + 1)
    for i in range(steps):
        sigma = sigmas[i].expand(x.shape[0])
        denoised = cfg_denoiser(p, x, sigma, cond, uncond)
        x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    return x


# --------------------------------------------------------------------------- the job


def _sample(p, x, steps, cond, uncond):
    if getattr(p.sd_model, "forge_objects", None) is not None:
        from backend.sampling.sampling_function import sample_forge

        p.scripts.process_before_every_sampling(p, x=x, noise=x, c=cond, uc=uncond)
        return sample_forge(p, x, steps, cond, uncond)
    return sample_a1111(p, x, steps, cond, uncond)


@torch.no_grad()
def process_images(p):
    """A job: every hook in the WebUI's order; the final latents, and the images decoded one by one."""
    if importlib.util.find_spec("modules_forge") is not None:
        from modules import sd_models

        p.sd_model, _ = sd_models.forge_model_reload()  # Forge 2 loads the checkpoint here
    p.setup_prompts()
    if p.scripts is not None:
        p.scripts.process(p)
    p.init()
    if importlib.util.find_spec("modules_forge") is None:
        sd_unet.apply_unet()
    samples = []
    for n in range(p.n_iter):
        p.prompts = p.all_prompts[n * p.batch_size:(n + 1) * p.batch_size]
        p.negative_prompts = p.all_negative_prompts[n * p.batch_size:(n + 1) * p.batch_size]
        p.parse_extra_network_prompts()
        if getattr(p.sd_model, "forge_objects", None) is not None:
            from backend.loader import apply_loras

            apply_loras(p)
        elif not p.disable_extra_networks:
            extra_networks.activate(p, p.extra_network_data)
        if p.scripts is not None:
            p.scripts.process_batch(p, batch_number=n, prompts=p.prompts, seeds=[p.seed] * p.batch_size)
        cond = p.sd_model.get_learned_conditioning(p.prompts)
        uncond = p.sd_model.get_learned_conditioning(p.negative_prompts)
        g = torch.Generator().manual_seed(p.seed + n)
        x = p.initial_latents(n, g)
        x = _sample(p, x, p.steps, cond, uncond)
        if getattr(p, "enable_hr", False):
            if p.scripts is not None:
                p.scripts.before_hr(p)
            size = (int(p.height * p.hr_scale) // 8, int(p.width * p.hr_scale) // 8)
            x = F.interpolate(x, size=size, mode="nearest") + torch.randn(x.shape[0], 4, *size, generator=g) * 0.5
            x = _sample(p, x, p.hr_second_pass_steps, cond, uncond)
        samples.append(x)
    samples = torch.cat(samples)
    # decode_latent_batch: one image per call
    images = torch.cat([p.sd_model.decode_first_stage(samples[i:i + 1]) for i in range(samples.shape[0])])
    processed = Processed(p, samples, images)
    if p.scripts is not None:
        p.scripts.postprocess(p, processed)
    return processed
