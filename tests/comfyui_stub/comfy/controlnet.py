"""``comfy.controlnet.ControlNet``, made small: ``get_control(x, t, cond, batch)`` gives ComfyUI's
``{"output": [...], "middle": [m], "input": []}`` (residuals in input-block order, times the
strength), ``None`` outside its step range (``sigma_range``: sigmas it is on for), chained nets
summed level by level (``previous_controlnet``, ComfyUI's ``control_merge``). The control model is
a tiny diffusers ControlNetModel made from the stand-in UNet, with random weights."""

from __future__ import annotations

import torch


class ControlNet:
    def __init__(self, unet_model, hint: torch.Tensor, strength: float = 1.0, seed: int = 0,
                 sigma_range: tuple[float, float] | None = None, previous=None):
        from diffusers import ControlNetModel

        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.net = ControlNetModel.from_unet(unet_model.unet).eval()
            for p in self.net.parameters():  # from_unet zeroes the output convolutions
                p.data.normal_(0, 0.05)
        self.hint = hint
        self.strength = strength
        self.sigma_range = sigma_range
        self.previous_controlnet = previous

    def get_control(self, x, t, cond, batch):
        previous = self.previous_controlnet.get_control(x, t, cond, batch) if self.previous_controlnet else None
        sigma = float(t.reshape(-1)[0])
        if self.sigma_range is not None and not (self.sigma_range[0] <= sigma <= self.sigma_range[1]):
            return previous
        hint = self.hint.expand(x.shape[0], -1, -1, -1)
        with torch.no_grad():
            down, mid = self.net(x, t, cond["c_crossattn"], hint, return_dict=False)
        out = {"output": [d * self.strength for d in down], "middle": [mid * self.strength], "input": []}
        if previous is not None:
            for key in ("output", "middle"):
                out[key] = [a + b for a, b in zip(out[key], previous[key], strict=True)]
        return out
