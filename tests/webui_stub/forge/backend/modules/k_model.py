"""``backend/modules/k_model.py``: ``KModel``: predictor scaling around ``diffusion_model``."""

from __future__ import annotations

import torch


class KModel(torch.nn.Module):
    def __init__(self, diffusion_model):
        super().__init__()
        self.diffusion_model = diffusion_model
        self.computation_dtype = torch.float32

    def apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):  # noqa: B006  (Forge's signature)
        sigma = t
        xc = x / (sigma[:, None, None, None] ** 2 + 1) ** 0.5
        if c_concat is not None:
            xc = torch.cat([xc] + [c_concat], dim=1)
        context = c_crossattn.to(self.computation_dtype)
        timesteps = (sigma * 100).clamp(0, 999).float()
        extra_conds = {}
        for o in kwargs:
            extra = kwargs[o]
            if hasattr(extra, "dtype") and extra.dtype not in (torch.int, torch.long):
                extra = extra.to(self.computation_dtype)
            extra_conds[o] = extra
        model_output = self.diffusion_model(xc, timesteps, context=context, control=control,
                                            transformer_options=transformer_options, **extra_conds).float()
        return x - model_output * sigma[:, None, None, None]

    def memory_required(self, input_shape):
        """Bytes one call of ``input_shape`` needs (proportional to rows and area, as in Forge)."""
        return input_shape[0] * input_shape[2] * input_shape[3] * 1_000_000
