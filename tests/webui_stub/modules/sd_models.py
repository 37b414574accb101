"""``modules/sd_models.py``: checkpoints, their hashes, loading one.

A stub checkpoint is a small JSON file ``{"family": "sd15" | "sdxl", "seed": N}``; its sha256 is
the file's, as the WebUI computes it. Loading builds the tiny UNet from it, applies the hijack
(attention optimization) and, with ``--medvram``/``--lowvram``, the offload hooks.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import torch

from modules import lowvram, script_callbacks, sd_hijack, sd_unet, shared

checkpoints_list = {}
checkpoint_aliases = {}


class CheckpointInfo:
    def __init__(self, filename):
        self.filename = filename
        self.name = os.path.basename(filename)
        self.name_for_extra = os.path.splitext(self.name)[0]
        self.model_name = os.path.splitext(self.name.replace("/", "_").replace("\\", "_"))[0]
        self.hash = None
        self.sha256 = None
        self.shorthash = None
        self.title = self.name
        self.short_title = self.name_for_extra
        self.metadata = {}

    def register(self):
        checkpoints_list[self.title] = self
        for alias in (self.name, self.model_name, self.title, self.shorthash, self.sha256):
            if alias:
                checkpoint_aliases[alias] = self

    def calculate_shorthash(self):
        with open(self.filename, "rb") as file:
            self.sha256 = hashlib.sha256(file.read()).hexdigest()
        if self.sha256 is None:
            return None
        shorthash = self.sha256[0:10]
        if self.shorthash == shorthash:
            return self.shorthash
        self.shorthash = shorthash
        if self.shorthash not in self.title:
            self.title = f"{self.name} [{self.shorthash}]"
            self.short_title = f"{self.name_for_extra} [{self.shorthash}]"
        self.register()
        return self.shorthash


def get_closet_checkpoint_match(search_string):
    if not search_string:
        return None
    info = checkpoint_aliases.get(search_string)
    if info is not None:
        return info
    found = sorted([info for info in checkpoints_list.values() if search_string in info.title], key=lambda x: len(x.title))
    return found[0] if found else None


class DiffusionWrapper(torch.nn.Module):
    """``ldm...ddpm.DiffusionWrapper``: ``forward(x, t, c_crossattn=...)`` -> ``diffusion_model(x, t, context=cc)``."""

    def __init__(self, diffusion_model):
        super().__init__()
        self.diffusion_model = diffusion_model

    def forward(self, x, t, c_concat=None, c_crossattn=None, c_adm=None):
        cc = torch.cat(c_crossattn, 1)
        return self.diffusion_model(x, t, context=cc)


class OpenAIWrapper(DiffusionWrapper):
    """``sgm...wrappers.OpenAIWrapper``: ``forward(x, t, c)`` with SDXL's ``crossattn`` and ``vector``."""

    def forward(self, x, t, c, **kwargs):
        return self.diffusion_model(x, timesteps=t, context=c.get("crossattn"), y=c.get("vector"), **kwargs)


class StubModel(torch.nn.Module):
    """``LatentDiffusion`` (SD 1.x) / ``DiffusionEngine`` (SDXL), reduced to the UNet call, the
    VAE (``first_stage_model``, ``decode_first_stage`` / ``encode_first_stage``) and, for SD 1.x,
    the CLIP text encoder (``cond_stage_model``, wrapped by ``sd_hijack`` at load)."""

    def __init__(self, family, seed, checkpoint_info):
        super().__init__()
        from ldm.models.autoencoder import AutoencoderKL
        from ldm.modules.diffusionmodules.openaimodel import UNetModel
        from ldm.modules.encoders.modules import FrozenCLIPEmbedder

        unet = UNetModel(family, seed)
        self.is_sdxl = family == "sdxl"
        self.is_sd2 = False
        self.is_sd1 = not self.is_sdxl
        self.model = (OpenAIWrapper if self.is_sdxl else DiffusionWrapper)(unet)
        self.first_stage_model = AutoencoderKL(seed=seed)
        self.scale_factor = 0.18215
        if self.is_sd1:
            self.cond_stage_model = FrozenCLIPEmbedder(seed)
        self.sd_checkpoint_info = checkpoint_info
        self.sd_model_checkpoint = checkpoint_info.filename
        self.sd_model_hash = checkpoint_info.shorthash
        self.lowvram = False
        ctx = unet.unet.config.cross_attention_dim
        self.context_dim = ctx[0] if isinstance(ctx, (list, tuple)) else ctx
        self.adm_dim = unet.adm_in_channels or 0

    def get_learned_conditioning(self, prompts):
        """SD 1.x: the CLIP text encoder through A1111's chunking (B, 77 x chunks, D). SDXL: a
        random context with 75 words per chunk and the ADM vector, {"crossattn", "vector"}."""
        if not self.is_sdxl:
            return self.cond_stage_model(prompts)
        chunks = max(max(1, -(-len(p.split()) // 75)) for p in prompts)
        g = torch.Generator().manual_seed(len(prompts) * 1000 + chunks)
        context = torch.randn(len(prompts), 77 * chunks, self.context_dim, generator=g)
        return {"crossattn": context, "vector": torch.randn(len(prompts), self.adm_dim, generator=g)}

    def decode_first_stage(self, z):
        return self.first_stage_model.decode(1.0 / self.scale_factor * z)

    def encode_first_stage(self, x):
        return self.first_stage_model.encode(x)

    def get_first_stage_encoding(self, encoder_posterior, generator=None):
        return self.scale_factor * encoder_posterior.sample(generator)

    def apply_model(self, x_noisy, t, cond):
        if isinstance(cond, dict) and self.is_sdxl:
            return self.model(x_noisy, t, cond)
        return self.model(x_noisy, t, c_crossattn=[cond])


def model_from_file(filename, info):
    with open(filename) as file:
        data = json.load(file)
    return StubModel(data.get("family", "sd15"), int(data.get("seed", 0)), info)


class SdModelData:
    """``model_data``: the loaded model. A1111 (and Forge 1): ``get_sd_model`` loads the selected
    checkpoint the first time anything reads ``shared.sd_model``. Forge 2: a ``FakeInitialModel``
    until ``forge_model_reload`` (which Forge calls when it generates)."""

    def __init__(self):
        self.sd_model = None
        self.was_loaded_at_least_once = False
        self.loads: list[str] = []  # titles loaded, in order (tests: what loaded when)

    def get_sd_model(self):
        if importlib.util.find_spec("modules_forge") is not None:  # Forge 2: never loads here
            return self.sd_model
        if self.was_loaded_at_least_once:
            return self.sd_model
        if self.sd_model is None:
            load_model()
        return self.sd_model

    def set_sd_model(self, v):
        self.sd_model = v


model_data = SdModelData()


class FakeInitialModel:
    """Forge 2's placeholder before the first generation."""

    def __init__(self):
        self.cond_stage_model = None
        self.chunk_length = 75


def select_checkpoint():
    title = shared.opts.data.get("sd_model_checkpoint")
    return checkpoints_list.get(title) or next(iter(checkpoints_list.values()))


def forge_model_reload():
    """Forge 2: load what the checkpoint dropdown selects, unless it is loaded already."""
    info = select_checkpoint()
    if getattr(model_data.sd_model, "sd_checkpoint_info", None) is info:
        return model_data.sd_model, False
    print(f"Loading Model: {info.title}")
    return load_model(info), True


def load_model(checkpoint_info=None):
    checkpoint_info = checkpoint_info or select_checkpoint()
    checkpoint_info.calculate_shorthash()
    if getattr(model_data.sd_model, "sd_checkpoint_info", None) is not None:
        sd_unet.apply_unet("None")
    if importlib.util.find_spec("modules_forge") is not None:  # Forge builds its own model objects
        from backend.loader import forge_loader

        sd_model = forge_loader(checkpoint_info)
    else:
        sd_model = model_from_file(checkpoint_info.filename, checkpoint_info)
        if shared.cmd_opts.lowvram or shared.cmd_opts.medvram:
            lowvram.setup_for_low_vram(sd_model, shared.cmd_opts.medvram)
    model_data.set_sd_model(sd_model)
    model_data.was_loaded_at_least_once = True
    model_data.loads.append(checkpoint_info.title)
    shared.opts.data["sd_model_checkpoint"] = checkpoint_info.title
    sd_hijack.model_hijack.hijack(sd_model)
    script_callbacks.model_loaded_callback(sd_model)
    return sd_model


def reload_model_weights(sd_model=None, info=None):
    return load_model(info)


def register_checkpoint(filename):
    info = CheckpointInfo(filename)
    info.register()
    return info
