"""ControlNet on engines: the ControlNet's stand-in, and the entry of the residual-taking UNet.

:func:`run_control_unet` is the public entry for any host that has a UNet's inputs and a list of
ControlNet residuals (diffusers' ``EngineUNet`` calls it; a ComfyUI or WebUI adapter can too):
give it the :class:`~sd_accel.runtime.selection.ComponentEngines` of component ``unet_control``
(:func:`sd_accel.runtime.engines_for`), the UNet inputs, the down residuals and the mid residual
(several ControlNets: their sum, as diffusers' ``MultiControlNetModel`` adds them), and it returns
the noise prediction, or None when no engine serves the call (the caller runs torch; the call is
counted as a fallback with its reason).

:class:`EngineControlNet` stands beside one ``ControlNetModel``: its ``install`` replaces the
model's ``forward`` on that instance only, so that the pipelines' ``isinstance(controlnet,
ControlNetModel)`` checks and ``MultiControlNetModel`` (which calls each net) work unchanged, and
``uninstall`` restores it. Guess mode's per-level scales and the user's scale are one engine input
(``conditioning_scale``, per batch item and residual), so every scale, guess mode and the steps
where ``control_guidance_start/end`` turn a net off (scale 0) run on the same engine.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from sd_accel.runtime.modules import EngineModule, _out
from sd_accel.runtime.residuals import CONTROL_UNET, control_unet_feed, run_control_unet
from sd_accel.runtime.selection import ComponentEngines

log = logging.getLogger("sd_accel")

__all__ = ["CONTROL_UNET", "EngineControlNet", "control_unet_feed", "installed", "run_control_unet"]


class EngineControlNet(EngineModule):
    """The engines of one ``ControlNetModel``; :meth:`install` routes the model's calls here."""

    def __init__(self, torch_module: torch.nn.Module, engines: dict[str, ComponentEngines]) -> None:
        super().__init__(torch_module, engines)
        self.__dict__["_original_forward"] = None

    @property
    def key(self) -> str:
        return next(iter(self.engines))

    def install(self) -> None:
        """Replace the ControlNet's ``forward`` on its instance (keeping any instance-level one,
        such as an offload hook's, for the fallback)."""
        net = self.torch_module
        self.__dict__["_original_forward"] = net.__dict__.get("forward")
        object.__setattr__(net, "forward", self.forward)
        object.__setattr__(net, "_sd_accel_engine", self)

    def uninstall(self) -> None:
        net = self.torch_module
        original = self.__dict__.get("_original_forward")
        if original is not None:
            object.__setattr__(net, "forward", original)
        else:
            net.__dict__.pop("forward", None)
        net.__dict__.pop("_sd_accel_engine", None)

    def _torch_forward(self, *args, **kwargs):
        self.torch_fallback()
        original = self.__dict__.get("_original_forward")
        if original is not None:
            return original(*args, **kwargs)
        net = self.torch_module
        return type(net).forward(net, *args, **kwargs)

    def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale: float = 1.0,
                class_labels=None, timestep_cond=None, attention_mask=None, added_cond_kwargs=None,
                cross_attention_kwargs=None, guess_mode: bool = False, return_dict: bool = True):
        from diffusers.models.controlnets.controlnet import ControlNetOutput

        engines = self.engines[self.key]
        out = None
        reason = self.stale()
        if reason is None and (class_labels is not None or timestep_cond is not None or attention_mask is not None
                               or cross_attention_kwargs):
            reason = "class_labels / timestep_cond / attention_mask / cross_attention_kwargs are not in the engine"
        if reason is None:
            try:
                feed = self._feed(sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale,
                                  guess_mode, added_cond_kwargs)
            except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as exc:
                reason = f"inputs the engine cannot take ({type(exc).__name__}: {exc})"
        if reason is not None:
            engines.torch_call(reason)
        else:
            out = self._run(engines, feed)
        if out is None:
            return self._torch_forward(sample, timestep, encoder_hidden_states, controlnet_cond,
                                       conditioning_scale=conditioning_scale, class_labels=class_labels,
                                       timestep_cond=timestep_cond, attention_mask=attention_mask,
                                       added_cond_kwargs=added_cond_kwargs,
                                       cross_attention_kwargs=cross_attention_kwargs, guess_mode=guess_mode,
                                       return_dict=return_dict)
        dtype = sample.dtype
        n = sum(1 for k in out if k.startswith("down_"))
        down = tuple(_out(out[f"down_{i}"], sample, dtype) for i in range(n))
        mid = _out(out["mid"], sample, dtype)
        return ControlNetOutput(down_block_res_samples=down, mid_block_res_sample=mid) if return_dict else (down, mid)

    @staticmethod
    def _run(engines: ComponentEngines, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """``engines.run``; a batch only an engine of twice that batch covers (guess mode runs the
        net on the conditional half, and a static profile's engine takes the 2B rows of guidance)
        runs doubled there and returns its first half, rather than falling back to torch."""
        from sd_accel.core import covers

        live = [h for h in engines.handles if h.broken is None]
        if live and not any(covers(h.shapes, feed) for h in live):
            doubled = {k: torch.cat([v, v]) for k, v in feed.items()}
            if any(covers(h.shapes, doubled) for h in live):
                out = engines.run(doubled)
                return None if out is None else {k: v[: v.shape[0] // 2] for k, v in out.items()}
        return engines.run(feed)

    def _feed(self, sample, timestep, ehs, cond, scale, guess_mode: bool, added) -> dict[str, torch.Tensor]:
        batch = sample.shape[0]
        if cond.shape[0] != batch:
            raise ValueError(f"control image batch {cond.shape[0]} != latent batch {batch}")
        cfg = self.torch_module.config
        n = _num_residuals(cfg)
        if guess_mode and not cfg.get("global_pool_conditions", False):
            # as ControlNetModel does: from 0.1 (the first residual) to 1.0 (mid), times the scale
            per = torch.logspace(-1, 0, n, device=sample.device) * float(scale)
        else:
            per = torch.full((n,), float(scale), device=sample.device)
        t = torch.as_tensor(timestep, device=sample.device).float().reshape(-1)
        if t.numel() == 1:
            t = t.expand(batch)
        feed = {"sample": sample.float(), "timestep": t.contiguous(), "encoder_hidden_states": ehs.float(),
                "controlnet_cond": cond.float(), "conditioning_scale": per.float().expand(batch, n).contiguous()}
        if added:
            feed["text_embeds"] = added["text_embeds"].float()
            feed["time_ids"] = added["time_ids"].float()
        return feed


def _num_residuals(cfg: Any) -> int:
    from sd_accel.components.controlnet import residual_layout

    return len(residual_layout(cfg)[0]) + 1  # and mid


def installed(net: torch.nn.Module) -> EngineControlNet | None:
    """The stand-in installed on ``net``, if any."""
    return net.__dict__.get("_sd_accel_engine")
