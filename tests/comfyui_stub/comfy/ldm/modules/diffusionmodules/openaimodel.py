"""``comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel``, made tiny.

ComfyUI's ``forward`` runs the DIFFUSION_MODEL wrappers around ``_forward``; ``_forward`` here is
a tiny diffusers UNet (the sd-accel built-in tiny SD 1.5 config), which adds the ControlNet's
last output residual and runs ``output_block_patch`` patches the way ComfyUI's does (FreeU)."""

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
        self.dtype = torch.float32

    def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):  # noqa: B006  (ComfyUI's signature)
        return patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self,
            patcher_extension.get_all_wrappers(patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options),
        ).execute(x, timesteps, context, y, control, transformer_options, **kwargs)

    def _forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):  # noqa: B006
        h = self.unet(x, timesteps, encoder_hidden_states=context).sample
        if control is not None and control.get("output"):
            h = h + control["output"][-1]
        for patch in (transformer_options.get("patches") or {}).get("output_block_patch", []):
            h, _ = patch(h, h, transformer_options)
        return h
