"""``comfy.ldm.flux.model.Flux``: FLUX.1's transformer as ComfyUI 0.8 runs it.

``forward(x, timestep, context, y, guidance, ref_latents, control, transformer_options)`` runs the
DIFFUSION_MODEL wrappers around ``_forward``, which pads the latent to the patch size (circular),
patchifies it 2x2 into tokens with their rotary ids (``process_img``: (index, row, column)), gives
the text tokens zero ids, runs ``forward_orig`` (timestep and guidance embedded with
``time_factor=1000``: the timestep is the sigma) and unpatchifies. ``params`` is ComfyUI's
``FluxParams``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from comfy import patcher_extension
from comfy.ldm.common_dit import pad_to_patch_size
from comfy.ldm.flux.layers import (
    DoubleStreamBlock,
    EmbedND,
    LastLayer,
    MLPEmbedder,
    SingleStreamBlock,
    timestep_embedding,
)


@dataclass
class FluxParams:
    in_channels: int
    out_channels: int
    vec_in_dim: int
    context_in_dim: int
    hidden_size: int
    mlp_ratio: float
    num_heads: int
    depth: int
    depth_single_blocks: int
    axes_dim: list
    theta: int
    patch_size: int
    qkv_bias: bool
    guidance_embed: bool
    txt_ids_dims: list = field(default_factory=list)
    global_modulation: bool = False
    mlp_silu_act: bool = False
    ops_bias: bool = True
    default_ref_method: str = "offset"
    ref_index_scale: float = 1.0
    yak_mlp: bool = False
    txt_norm: bool = False


class Flux(nn.Module):
    def __init__(self, image_model=None, final_layer=True, dtype=None, device=None, operations=None, **kwargs):
        super().__init__()
        self.dtype = dtype
        params = FluxParams(**kwargs)
        self.params = params
        self.patch_size = params.patch_size
        self.in_channels = params.in_channels * params.patch_size**2
        self.out_channels = params.out_channels * params.patch_size**2
        self.hidden_size = params.hidden_size
        self.num_heads = params.num_heads
        ops = operations if operations is not None else nn
        self.pe_embedder = EmbedND(params.hidden_size // params.num_heads, params.theta, params.axes_dim)
        self.img_in = ops.Linear(self.in_channels, self.hidden_size, bias=True, dtype=dtype, device=device)
        self.time_in = MLPEmbedder(256, self.hidden_size, dtype=dtype, device=device, operations=operations)
        self.vector_in = MLPEmbedder(params.vec_in_dim, self.hidden_size, dtype=dtype, device=device,
                                     operations=operations)
        self.guidance_in = (MLPEmbedder(256, self.hidden_size, dtype=dtype, device=device, operations=operations)
                            if params.guidance_embed else nn.Identity())
        self.txt_in = ops.Linear(params.context_in_dim, self.hidden_size, dtype=dtype, device=device)
        self.double_blocks = nn.ModuleList([
            DoubleStreamBlock(self.hidden_size, self.num_heads, mlp_ratio=params.mlp_ratio, qkv_bias=params.qkv_bias,
                              dtype=dtype, device=device, operations=operations) for _ in range(params.depth)])
        self.single_blocks = nn.ModuleList([
            SingleStreamBlock(self.hidden_size, self.num_heads, mlp_ratio=params.mlp_ratio, dtype=dtype,
                              device=device, operations=operations) for _ in range(params.depth_single_blocks)])
        self.final_layer = LastLayer(self.hidden_size, 1, self.out_channels, dtype=dtype, device=device,
                                     operations=operations)

    def forward_orig(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None, control=None,
                     transformer_options={}, attn_mask=None):  # noqa: B006  (ComfyUI's signature)
        patches_replace = transformer_options.get("patches_replace", {})
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, 256).to(img.dtype))
        if self.params.guidance_embed and guidance is not None:
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
        if y is None:
            y = torch.zeros((img.shape[0], self.params.vec_in_dim), device=img.device, dtype=img.dtype)
        vec = vec + self.vector_in(y[:, :self.params.vec_in_dim])
        txt = self.txt_in(txt)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        blocks_replace = patches_replace.get("dit", {})
        for i, block in enumerate(self.double_blocks):
            if ("double_block", i) in blocks_replace:
                out = blocks_replace[("double_block", i)](
                    {"img": img, "txt": txt, "vec": vec, "pe": pe, "transformer_options": transformer_options},
                    {"original_block": lambda a, block=block: dict(zip(("img", "txt"), block(
                        img=a["img"], txt=a["txt"], vec=a["vec"], pe=a["pe"]), strict=True))})
                img, txt = out["img"], out["txt"]
            else:
                img, txt = block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=attn_mask,
                                 transformer_options=transformer_options)
            if control is not None:  # ControlNet
                control_i = control.get("input")
                if i < len(control_i) and control_i[i] is not None:
                    img[:, :control_i[i].shape[1]] += control_i[i]
        img = torch.cat((txt, img), 1)
        for i, block in enumerate(self.single_blocks):
            img = block(img, vec=vec, pe=pe, attn_mask=attn_mask, transformer_options=transformer_options)
            if control is not None:
                control_o = control.get("output")
                if i < len(control_o) and control_o[i] is not None:
                    add = control_o[i]
                    img[:, txt.shape[1]:txt.shape[1] + add.shape[1], ...] += add
        img = img[:, txt.shape[1]:, ...]
        return self.final_layer(img, vec)

    def process_img(self, x, index=0, h_offset=0, w_offset=0, transformer_options={}):  # noqa: B006
        bs, c, h, w = x.shape
        p = self.patch_size
        x = pad_to_patch_size(x, (p, p))
        hp, wp = x.shape[-2] // p, x.shape[-1] // p
        img = x.reshape(bs, c, hp, p, wp, p).permute(0, 2, 4, 1, 3, 5).reshape(bs, hp * wp, c * p * p)
        h_len, w_len = (h + p // 2) // p, (w + p // 2) // p
        h_offset, w_offset = (h_offset + p // 2) // p, (w_offset + p // 2) // p
        steps_h, steps_w = h_len, w_len
        rope_options = transformer_options.get("rope_options", None)
        if rope_options is not None:
            h_len = (h_len - 1.0) * rope_options.get("scale_y", 1.0) + 1.0
            w_len = (w_len - 1.0) * rope_options.get("scale_x", 1.0) + 1.0
            index += rope_options.get("shift_t", 0.0)
            h_offset += rope_options.get("shift_y", 0.0)
            w_offset += rope_options.get("shift_x", 0.0)
        ids = torch.zeros((steps_h, steps_w, len(self.params.axes_dim)), device=x.device, dtype=torch.float32)
        ids[:, :, 0] = ids[:, :, 1] + index
        ids[:, :, 1] = ids[:, :, 1] + torch.linspace(h_offset, h_len - 1 + h_offset, steps=steps_h).unsqueeze(1)
        ids[:, :, 2] = ids[:, :, 2] + torch.linspace(w_offset, w_len - 1 + w_offset, steps=steps_w).unsqueeze(0)
        return img, ids.reshape(1, steps_h * steps_w, -1).repeat(bs, 1, 1)

    def forward(self, x, timestep, context, y=None, guidance=None, ref_latents=None, control=None,
                transformer_options={}, **kwargs):  # noqa: B006
        return patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self,
            patcher_extension.get_all_wrappers(patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options),
        ).execute(x, timestep, context, y, guidance, ref_latents, control, transformer_options, **kwargs)

    def _forward(self, x, timestep, context, y=None, guidance=None, ref_latents=None, control=None,
                 transformer_options={}, **kwargs):  # noqa: B006
        bs, c, h_orig, w_orig = x.shape
        p = self.patch_size
        h_len, w_len = (h_orig + p // 2) // p, (w_orig + p // 2) // p
        img, img_ids = self.process_img(x, transformer_options=transformer_options)
        img_tokens = img.shape[1]
        for ref in ref_latents or []:  # Kontext: the "offset" method's first reference
            kontext, kontext_ids = self.process_img(ref, index=1)
            img = torch.cat([img, kontext], dim=1)
            img_ids = torch.cat([img_ids, kontext_ids], dim=1)
        txt_ids = torch.zeros((bs, context.shape[1], len(self.params.axes_dim)), device=x.device, dtype=torch.float32)
        for i in self.params.txt_ids_dims:
            txt_ids[:, :, i] = torch.linspace(0, context.shape[1] - 1, steps=context.shape[1])
        out = self.forward_orig(img, img_ids, context, txt_ids, timestep, y, guidance, control, transformer_options,
                                attn_mask=kwargs.get("attention_mask", None))
        out = out[:, :img_tokens]
        co = out.shape[-1] // (p * p)
        out = out.reshape(bs, h_len, w_len, co, p, p).permute(0, 3, 1, 4, 2, 5).reshape(bs, co, h_len * p, w_len * p)
        return out[:, :, :h_orig, :w_orig]
