"""``ldm.modules.diffusionmodules.openaimodel.UNetModel`` as the WebUI calls it, made tiny.

The WebUI's UNet signature, ``forward(x, timesteps=None, context=None, y=None, **kwargs)``, over a
tiny diffusers ``UNet2DConditionModel`` (the sd-accel built-in tiny configs). SDXL's ``y`` (the
ADM vector LDM's ``label_emb`` consumes) goes to diffusers' ``class_embed_type="projection"``
embedding: the same Linear-SiLU-Linear added to the time embedding. ``label_emb`` is exposed
as LDM names it, so code reading the ADM width finds it where it is in the real model.
``th`` stands for the module's torch alias that A1111's hijack swaps (see ``sd_hijack``).
"""

from __future__ import annotations

import torch
import torch as th  # noqa: F401  (the real module calls torch through ``th``; sd_hijack swaps it)

from sd_accel.models.builtin import tiny_configs

TRACE_LOG: list[str] = []  # attention optimization seen by each call made while exporting ONNX


def tiny_unet_config(family: str) -> dict:
    cfg = dict(tiny_configs("sdxl" if family == "sdxl" else "sd15")["unet/config.json"])
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    if family == "sdxl":
        adm = cfg["projection_class_embeddings_input_dim"]
        cfg.update(addition_embed_type=None, class_embed_type="projection",
                   projection_class_embeddings_input_dim=adm)
    return cfg


class UNetModel(torch.nn.Module):
    def __init__(self, family: str = "sd15", seed: int = 0) -> None:
        from diffusers import UNet2DConditionModel

        super().__init__()
        cfg = tiny_unet_config(family)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.unet = UNet2DConditionModel.from_config(cfg)
            for param in self.unet.parameters():  # diffusers zero-inits some outputs: give them values
                param.data.normal_(0, 0.05)
        self.unet.eval()
        self.in_channels = cfg["in_channels"]
        self.out_channels = cfg["out_channels"]
        self.model_channels = cfg["block_out_channels"][0]
        self.channel_mult = [c // self.model_channels for c in cfg["block_out_channels"]]
        self.num_res_blocks = [cfg["layers_per_block"]] * len(self.channel_mult)
        self.num_classes = "sequential" if family == "sdxl" else None
        self.adm_in_channels = cfg.get("projection_class_embeddings_input_dim") if family == "sdxl" else None
        self.use_checkpoint = True  # A1111's inference configs say so; exports must switch it off

    @property
    def label_emb(self):
        emb = getattr(self.unet, "class_embedding", None)
        if emb is None:
            return None
        return torch.nn.Sequential(torch.nn.Sequential(emb.linear_1, emb.act, emb.linear_2))

    def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options=None, **kwargs):
        # ``control`` and ``transformer_options``: Forge 2's UNet takes them (A1111's passes **kwargs).
        # ``control`` is Forge's (ComfyUI's) dict: ``output`` residuals in input-block order, each
        # added to its skip connection (diffusers' down residuals; Forge pops them from the end as
        # the skips are popped), ``middle`` after the middle block. Forge's sampling function also
        # passes ``control_model`` (the ControlNet object), which its UNet's **kwargs swallow.
        if torch.onnx.is_in_onnx_export():
            from modules import sd_hijack

            TRACE_LOG.append(getattr(sd_hijack.current_optimizer, "name", "None"))
        kwargs.pop("control_model", None)
        if kwargs or (control is not None and any(control.get("input") or [])):
            raise TypeError(f"the stub UNet takes no {sorted(kwargs) or 'control input'}")
        down = mid = None
        if control is not None:
            output, middle = list(control.get("output") or []), list(control.get("middle") or [])
            down = tuple(output) if output else None
            mid = middle[0] if middle else None
        return self.unet(x, timesteps, encoder_hidden_states=context, class_labels=y, return_dict=False,
                         down_block_additional_residuals=down, mid_block_additional_residual=mid)[0]
