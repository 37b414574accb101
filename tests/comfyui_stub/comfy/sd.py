"""``comfy.sd``: the checkpoint loader (MODEL, CLIP, VAE), the VAE's decode/encode, LoRA loading.

The stand-in checkpoint is a small JSON file (``{"seed": N}``); its weights come from the seed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from comfy import model_management, sd1_clip
from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
from comfy.model_base import BaseModel
from comfy.model_patcher import ModelPatcher
from comfy.sd1_clip import SD1ClipModel
from comfy.weight_adapter import LoRAAdapter

_WEBUI_VAE = Path(__file__).resolve().parents[2] / "webui_stub" / "ldm" / "modules" / "diffusionmodules" / "model.py"


def _vae_module():
    spec = importlib.util.spec_from_file_location("_comfy_stub_vae_model", _WEBUI_VAE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class AutoencoderKL(torch.nn.Module):
    """SD's autoencoder (4 latent channels, quant convs); ``z_channels=16``: FLUX.1's / SD3's
    (16 channels and no quant convs: ComfyUI's ``use_quant_conv=False``, Identity in their place)."""

    def __init__(self, seed: int = 0, z_channels: int = 4):
        super().__init__()
        mod = _vae_module()
        with torch.random.fork_rng():
            torch.manual_seed(seed + 1)
            self.encoder = mod.Encoder(z_channels=z_channels)
            self.decoder = mod.Decoder(z_channels=z_channels)
            quant = z_channels == 4
            self.quant_conv = torch.nn.Conv2d(8, 8, 1) if quant else torch.nn.Identity()
            self.post_quant_conv = torch.nn.Conv2d(4, 4, 1) if quant else torch.nn.Identity()

    def decode(self, z, **kwargs):
        return self.decoder(self.post_quant_conv(z), **kwargs)

    def encode(self, x):
        mean, _ = self.quant_conv(self.encoder(x)).chunk(2, dim=1)
        return mean  # DiagonalGaussianRegularizer(sample=False)


class VAE:
    def __init__(self, first_stage_model):
        self.first_stage_model = first_stage_model.eval()

    def decode(self, samples_in):
        out = []
        for i in range(samples_in.shape[0]):  # ComfyUI sizes the batches by free memory: one here
            out.append(self.first_stage_model.decode(samples_in[i:i + 1].float()))
        images = torch.cat(out)
        return torch.clamp((images + 1.0) / 2.0, 0.0, 1.0).movedim(1, -1)

    def encode(self, pixel_samples):
        x = pixel_samples.movedim(-1, 1) * 2.0 - 1.0
        return self.first_stage_model.encode(x.float())


class CLIP:
    """ComfyUI's CLIP: a ModelPatcher over ``SD1ClipModel`` (``clip_l``), ``tokenize``,
    ``encode_from_tokens`` (the patches written into the weights first, as ``load_model`` does),
    ``clip_layer`` (CLIPSetLastLayer), ``clone``; ``encode(text)`` is the tests' shortcut."""

    def __init__(self, seed: int | None = None, flux: bool = False):
        self.flux = flux
        if seed is None:
            return
        with torch.random.fork_rng():
            torch.manual_seed(seed + 2)
            if flux:  # FLUX.1's CLIP (DualCLIPLoader type flux: clip_l + t5xxl)
                from comfy.text_encoders.flux import FluxClipModel

                model = FluxClipModel().eval()
            else:
                model = SD1ClipModel().eval()
            for name, p in model.named_parameters():
                if "embedding" in name:
                    p.data.normal_(0, 0.02)
        self.cond_stage_model = model
        self.patcher = ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))
        self.layer_idx = None
        self.embeddings: dict = {}

    def clone(self):
        n = CLIP()
        n.cond_stage_model = self.cond_stage_model
        n.patcher = self.patcher.clone()
        n.layer_idx = self.layer_idx
        n.embeddings = self.embeddings
        n.flux = self.flux
        return n

    def clip_layer(self, layer_idx):
        self.layer_idx = layer_idx

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        return self.patcher.add_patches(patches, strength_patch, strength_model)

    def tokenize(self, text: str):
        if self.flux:
            from comfy.text_encoders.flux import tokenize

            return tokenize(text, self.embeddings)
        return sd1_clip.tokenize(text, self.embeddings)

    def encode_from_tokens(self, tokens, return_pooled=False):
        self.cond_stage_model.clip_l.layer, self.cond_stage_model.clip_l.layer_idx = "last", None
        if self.layer_idx is not None:
            self.cond_stage_model.set_clip_options({"layer": self.layer_idx})
        model_management.load_models_gpu([self.patcher])
        cond, pooled = self.cond_stage_model.encode_token_weights(tokens)
        return (cond, pooled) if return_pooled else cond

    def encode_from_tokens_scheduled(self, tokens):
        cond, pooled = self.encode_from_tokens(tokens, return_pooled=True)
        return [[cond, {"pooled_output": pooled}]]

    def encode(self, text: str) -> torch.Tensor:
        with torch.inference_mode():
            return self.encode_from_tokens(self.tokenize(text))


# Tiny widths of the transformer families, with ComfyUI's unet_config keys (model_detection's).
FLUX_CONFIG = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=48,
                   hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[4, 14, 14],
                   theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True, txt_ids_dims=[])
SD3_CONFIG = dict(in_channels=16, out_channels=16, patch_size=2, depth=2, adm_in_channels=64, pos_embed_max_size=16,
                  num_patches=256, qk_norm="rms", x_block_self_attn_layers=[0],
                  context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 48, "out_features": 128}})


def _randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in module.named_parameters():
            if name.endswith(("scale", "ln_q.weight", "ln_k.weight")):  # RMS norm gains around 1
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / max(1, p.shape[-1]) ** 0.5))
        for name, b in module.named_buffers():
            if name == "pos_embed":
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
    return module.eval()


def diffusion_model_for(family: str, seed: int = 0) -> BaseModel:
    """The BaseModel of a stand-in file's family: ``sd15`` (default), ``flux-dev``, ``flux-schnell``, ``sd3``."""
    from comfy import model_base

    if family.startswith("flux"):
        from comfy.ldm.flux.model import Flux

        cfg = dict(FLUX_CONFIG, guidance_embed=family == "flux-dev")
        return model_base.Flux(_randomized(Flux(**cfg), seed), shift=1.15 if family == "flux-dev" else 1.0)
    if family == "sd3":
        from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper

        return model_base.SD3(_randomized(OpenAISignatureMMDITWrapper(**SD3_CONFIG), seed))
    return BaseModel(UNetModel(seed))


def _read(path) -> tuple[int, str]:
    data = json.loads(Path(path).read_text())
    return int(data.get("seed", 0)), str(data.get("family", "sd15"))


def load_checkpoint_guess_config(ckpt_path, output_vae=True, output_clip=True, output_clipvision=False,
                                 embedding_directory=None, output_model=True, model_options={}, te_model_options={}):  # noqa: B006  (ComfyUI's signature)
    seed, family = _read(ckpt_path)
    if family != "sd15":  # (the transformer families' text encoders and VAE are not stood in for)
        with torch.inference_mode():  # ComfyUI runs its loader nodes so: the weights are inference tensors
            model = ModelPatcher(diffusion_model_for(family, seed).eval(), torch.device("cpu"), torch.device("cpu"))
        return model, None, None, None
    model = ModelPatcher(diffusion_model_for(family, seed).eval(), torch.device("cpu"), torch.device("cpu"))
    return model, CLIP(seed), VAE(AutoencoderKL(seed)), None


def flux_config(shapes: dict, prefix: str = "") -> dict:
    """model_detection's unet_config of a FLUX.1 file in Black Forest Labs' layout. (ComfyUI fixes 24
    heads of 128 lanes, rotary axes [16, 56, 56]; the stand-in reads the head width from the file,
    so that tiny files load.)"""
    head = shapes[f"{prefix}double_blocks.0.img_attn.norm.query_norm.scale"][0]
    hidden = shapes[f"{prefix}img_in.weight"][0]
    first = head // 8

    def count(kind):
        return len({k[len(prefix + kind) + 1:].split(".")[0] for k in shapes if k.startswith(prefix + kind + ".")})

    return dict(FLUX_CONFIG, in_channels=shapes[f"{prefix}img_in.weight"][1] // 4, hidden_size=hidden,
                num_heads=hidden // head, axes_dim=[first, (head - first) // 2, head - first - (head - first) // 2],
                context_in_dim=shapes[f"{prefix}txt_in.weight"][1], vec_in_dim=shapes[f"{prefix}vector_in.in_layer.weight"][1],
                depth=count("double_blocks"), depth_single_blocks=count("single_blocks"),
                guidance_embed=f"{prefix}guidance_in.in_layer.weight" in shapes)


def load_diffusion_model(unet_path, model_options={}):  # noqa: B006  (ComfyUI's signature: UNETLoader)
    """A diffusion-model-only file (``models/diffusion_models``): the MODEL alone. A real FLUX.1
    safetensors file (Black Forest Labs' keys) loads as ComfyUI loads it; a stand-in JSON file by seed."""
    with torch.inference_mode():  # ComfyUI runs its loader nodes so: the weights are inference tensors
        return _load_diffusion_model(unet_path)


def _load_diffusion_model(unet_path):
    try:
        seed, family = _read(unet_path)
    except (UnicodeDecodeError, ValueError):
        from safetensors.torch import load_file

        from comfy import model_base
        from comfy.ldm.flux.model import Flux

        state = load_file(str(unet_path))
        prefix = "model.diffusion_model." if any(k.startswith("model.diffusion_model.") for k in state) else ""
        state = {k[len(prefix):]: v.float() for k, v in state.items() if k.startswith(prefix)}
        dm = Flux(**flux_config({k: tuple(v.shape) for k, v in state.items()}))
        dm.load_state_dict(state)
        return ModelPatcher(model_base.Flux(dm.eval()).eval(), torch.device("cpu"), torch.device("cpu"))
    return ModelPatcher(diffusion_model_for(family, seed).eval(), torch.device("cpu"), torch.device("cpu"))


def lora_for(model: ModelPatcher, seed: int, rank: int = 2) -> dict:
    """A LoRA's patches in ComfyUI's form (key -> LoRAAdapter) on the UNet's attention projections."""
    g = torch.Generator().manual_seed(seed)
    patches = {}
    for key, w in model.model.state_dict().items():
        if key.endswith(("attn1.to_v.weight", "attn2.to_v.weight", "to_out.0.weight")):
            up = torch.randn(w.shape[0], rank, generator=g) * 0.5
            down = torch.randn(rank, w.shape[1], generator=g) * 0.5
            patches[key] = LoRAAdapter(set(), (up, down, torch.tensor(float(rank)), None, None, None))
    return patches


def clip_lora_for(clip: CLIP, seed: int, rank: int = 2) -> dict:
    """A LoRA's text-encoder patches (ComfyUI's keys: ``clip_l.transformer.text_model...``)."""
    g = torch.Generator().manual_seed(seed)
    patches = {}
    for key, w in clip.cond_stage_model.state_dict().items():
        if key.endswith(("q_proj.weight", "v_proj.weight")):
            up = torch.randn(w.shape[0], rank, generator=g) * 0.5
            down = torch.randn(rank, w.shape[1], generator=g) * 0.5
            patches[key] = LoRAAdapter(set(), (up, down, torch.tensor(float(rank)), None, None, None))
    return patches


def load_lora_for_models(model, clip, lora, strength_model, strength_clip):
    """``lora``: the patches (as ``comfy.lora.load_lora`` gives them); the UNet's go to the MODEL's
    clone, the text encoder's (``clip_l.`` keys) to the CLIP's."""
    new_model = model.clone()
    new_model.add_patches({k: v for k, v in lora.items() if not k.startswith("clip_")}, strength_model)
    te = {k: v for k, v in lora.items() if k.startswith("clip_")}
    new_clip = clip
    if te and clip is not None:
        new_clip = clip.clone()
        new_clip.add_patches(te, strength_clip)
    return new_model, new_clip
