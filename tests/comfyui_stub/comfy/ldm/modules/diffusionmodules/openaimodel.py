"""``comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel``, made tiny.

ComfyUI's ``forward`` runs the DIFFUSION_MODEL wrappers around ``_forward``; ``_forward`` here is
a tiny diffusers UNet (the sd-accel built-in tiny SD 1.5 config). ``control`` is ComfyUI's:
``output`` residuals in input-block order, each added to its skip connection (diffusers' down
residuals), ``middle`` after the middle block (``input``, T2I-Adapters', is left out here); ``output_block_patch`` patches run the way
ComfyUI's do (FreeU). ``model_channels``, ``channel_mult``, ``num_res_blocks`` as ComfyUI's module
has them."""

from __future__ import annotations

import torch

from comfy import patcher_extension


class UNetModel(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        from diffusers import UNet2DConditionModel

        from sd_accel.models.builtin import tiny_configs

        super().__init__()
        cfg = {k: v for k, v in tiny_configs("sd15")["unet/config.json"].items() if not k.startswith("_")}
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.unet = UNet2DConditionModel.from_config(cfg)
            for p in self.unet.parameters():
                p.data.normal_(0, 0.05)
        self.unet.eval()
        self.in_channels = cfg["in_channels"]
        self.out_channels = cfg["out_channels"]
        self.model_channels = cfg["block_out_channels"][0]
        self.channel_mult = [c // self.model_channels for c in cfg["block_out_channels"]]
        self.num_res_blocks = [cfg["layers_per_block"]] * len(self.channel_mult)
        self.dtype = torch.float32

    def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):  # noqa: B006  (ComfyUI's signature)
        return patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self,
            patcher_extension.get_all_wrappers(patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options),
        ).execute(x, timesteps, context, y, control, transformer_options, **kwargs)

    def _forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):  # noqa: B006
        down = mid = None
        if control is not None:
            down = tuple(control["output"]) if control.get("output") else None
            mid = control["middle"][0] if control.get("middle") else None
        h = self.unet(x, timesteps, encoder_hidden_states=context, down_block_additional_residuals=down,
                      mid_block_additional_residual=mid).sample
        for patch in (transformer_options.get("patches") or {}).get("output_block_patch", []):
            h, _ = patch(h, h, transformer_options)
        return h
