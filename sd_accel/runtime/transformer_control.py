"""The transformer families' ControlNets on engines: the stand-ins of FLUX.1's
``FluxControlNetModel`` and SD3's ``SD3ControlNetModel``, and the feed of the residual-taking
transformer (component ``transformer_control``: :mod:`sd_accel.components.flux.controlnet`,
:mod:`sd_accel.components.sd3.controlnet`).

Each stand-in installs on one net as :class:`~sd_accel.runtime.control.EngineControlNet` does
(the multi-net wrappers call each net's ``forward``, then sum their samples); the scale is an
engine input, so every scale and the steps ``control_guidance_start/end`` turn a net off run on
the same engine. :func:`control_residuals` / :func:`sd3_control_residuals` place the samples the
transformer gets on its blocks as the transformer itself does, for ``transformer_control``'s feed.
"""

from __future__ import annotations

import torch

from sd_accel.runtime.control import EngineControlNet
from sd_accel.runtime.modules import _out


def attention_kwargs_reason(jak: dict | None) -> str | None:
    """Why ``joint_attention_kwargs`` keep a call off the engine (anything but a LoRA scale of 1), or None."""
    jak = jak or {}
    if jak and not (set(jak) == {"scale"} and float(jak["scale"]) == 1.0):
        return f"joint_attention_kwargs {sorted(jak)} are not in the engine"
    return None


class EngineFluxControlNet(EngineControlNet):
    """The engines of one ``FluxControlNetModel``; :meth:`install` routes the net's calls here."""

    def forward(self, hidden_states, controlnet_cond, controlnet_mode=None, conditioning_scale: float = 1.0,
                encoder_hidden_states=None, pooled_projections=None, timestep=None, img_ids=None, txt_ids=None,
                guidance=None, joint_attention_kwargs=None, return_dict: bool = True):
        from diffusers.models.controlnets.controlnet_flux import FluxControlNetOutput

        engines = self.engines[self.key]
        kwargs = dict(controlnet_mode=controlnet_mode, conditioning_scale=conditioning_scale,
                      encoder_hidden_states=encoder_hidden_states, pooled_projections=pooled_projections,
                      timestep=timestep, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                      joint_attention_kwargs=joint_attention_kwargs, return_dict=return_dict)
        out = None
        reason = self.stale()
        reason = reason or attention_kwargs_reason(joint_attention_kwargs)
        if reason is None:
            try:
                feed = self._flux_feed(hidden_states, controlnet_cond, kwargs)
            except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as exc:
                reason = f"inputs the engine cannot take ({type(exc).__name__}: {exc})"
        if reason is not None:
            engines.torch_call(reason)
        else:
            out = engines.run(feed)
        if out is None:
            return self._torch_forward(hidden_states, controlnet_cond, **kwargs)
        cfg = self.torch_module.config
        dtype = hidden_states.dtype
        blocks = [_out(out[f"block_{i}"], hidden_states, dtype) for i in range(cfg.num_layers)] or None
        singles = [_out(out[f"single_{i}"], hidden_states, dtype) for i in range(cfg.num_single_layers)] or None
        if not return_dict:
            return blocks, singles
        return FluxControlNetOutput(controlnet_block_samples=blocks, controlnet_single_block_samples=singles)

    def _flux_feed(self, hidden_states, controlnet_cond, kw: dict) -> dict[str, torch.Tensor]:
        cfg = self.torch_module.config
        batch = hidden_states.shape[0]

        def per_row(value) -> torch.Tensor:
            t = torch.as_tensor(value, device=hidden_states.device).float().reshape(-1)
            return (t.expand(batch) if t.numel() == 1 else t).contiguous()

        if controlnet_cond.ndim != 3 or controlnet_cond.shape[0] != batch:
            raise ValueError(f"control latents {tuple(controlnet_cond.shape)} for a latent batch of {batch}")
        img_ids, txt_ids = kw["img_ids"], kw["txt_ids"]
        feed = {"hidden_states": hidden_states.float(), "encoder_hidden_states": kw["encoder_hidden_states"].float(),
                "pooled_projections": kw["pooled_projections"].float(), "timestep": per_row(kw["timestep"]),
                "img_ids": (img_ids[0] if img_ids.ndim == 3 else img_ids).float(),
                "txt_ids": (txt_ids[0] if txt_ids.ndim == 3 else txt_ids).float()}
        if cfg.get("guidance_embeds"):
            feed["guidance"] = per_row(kw["guidance"])
        feed["controlnet_cond"] = controlnet_cond.float()
        if cfg.get("num_mode") is not None:
            mode = kw["controlnet_mode"]
            if mode is None:
                raise ValueError("a union ControlNet needs controlnet_mode")
            feed["controlnet_mode"] = torch.as_tensor(mode).long().reshape(-1, 1).expand(batch, 1).contiguous()
        feed["conditioning_scale"] = per_row(float(kw["conditioning_scale"]))
        return feed


def control_residuals(transformer: torch.nn.Module, blocks, singles, repeat: bool,
                      like: torch.Tensor) -> dict[str, torch.Tensor]:
    """``transformer_control``'s residual inputs for the samples a FLUX.1 transformer call got:
    each block's sample as ``FluxTransformer2DModel`` picks it, the same tensor for the blocks
    that share one, zeros (one tensor) for a block none reaches."""
    from sd_accel.components.flux.controlnet import spread

    zeros = None

    def pick(samples, index: int | None) -> torch.Tensor:
        nonlocal zeros
        if index is None:
            if zeros is None:
                zeros = torch.zeros(like.shape[0], like.shape[1], transformer.inner_dim)
            return zeros
        return samples[index].float().contiguous()

    feed = {}
    for i, k in enumerate(spread(blocks, len(transformer.transformer_blocks), repeat)):
        feed[f"block_{i}"] = pick(blocks, k)
    for i, k in enumerate(spread(singles, len(transformer.single_transformer_blocks))):
        feed[f"single_{i}"] = pick(singles, k)
    return feed


class EngineSD3ControlNet(EngineControlNet):
    """The engines of one ``SD3ControlNetModel``; :meth:`install` routes the net's calls here."""

    def forward(self, hidden_states, controlnet_cond, conditioning_scale: float = 1.0, encoder_hidden_states=None,
                pooled_projections=None, timestep=None, joint_attention_kwargs=None, return_dict: bool = True):
        from diffusers.models.controlnets.controlnet_sd3 import SD3ControlNetOutput

        engines = self.engines[self.key]
        kwargs = dict(conditioning_scale=conditioning_scale, encoder_hidden_states=encoder_hidden_states,
                      pooled_projections=pooled_projections, timestep=timestep,
                      joint_attention_kwargs=joint_attention_kwargs, return_dict=return_dict)
        out = None
        reason = self.stale()
        reason = reason or attention_kwargs_reason(joint_attention_kwargs)
        if reason is None:
            try:
                batch = hidden_states.shape[0]
                if controlnet_cond.shape != hidden_states.shape:
                    raise ValueError(f"control latents {tuple(controlnet_cond.shape)} for latents "
                                     f"{tuple(hidden_states.shape)}")
                t = torch.as_tensor(timestep, device=hidden_states.device).float().reshape(-1)
                feed = {"hidden_states": hidden_states.float(), "encoder_hidden_states": encoder_hidden_states.float(),
                        "pooled_projections": pooled_projections.float(),
                        "timestep": (t.expand(batch) if t.numel() == 1 else t).contiguous(),
                        "controlnet_cond": controlnet_cond.float(),
                        "conditioning_scale": torch.full((batch,), float(conditioning_scale))}
            except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as exc:
                reason = f"inputs the engine cannot take ({type(exc).__name__}: {exc})"
        if reason is not None:
            engines.torch_call(reason)
        else:
            out = engines.run(feed)
        if out is None:
            return self._torch_forward(hidden_states, controlnet_cond, **kwargs)
        n = len(self.torch_module.transformer_blocks)
        samples = [_out(out[f"block_{i}"], hidden_states, hidden_states.dtype) for i in range(n)]
        return SD3ControlNetOutput(controlnet_block_samples=samples) if return_dict else (samples,)


def sd3_control_residuals(transformer: torch.nn.Module, samples, like: torch.Tensor,
                          takes: set[str] | None = None) -> dict[str, torch.Tensor]:
    """``transformer_control``'s residual inputs for an SD3 call's samples: each block's as
    ``SD3Transformer2DModel`` picks it, zeros (one tensor) where none reaches (a last
    ``context_pre_only`` block: always). ``takes``: the engine's input names (one built before
    the last block had an input lacks it)."""
    from sd_accel.components.sd3.controlnet import pick

    chosen = pick(samples, transformer)
    zeros = None
    feed = {}
    for i in range(len(transformer.transformer_blocks)):
        if takes is not None and f"block_{i}" not in takes:
            continue
        if i in chosen:
            feed[f"block_{i}"] = samples[chosen[i]].float().contiguous()
            continue
        if zeros is None:
            patch = int(transformer.config.patch_size)
            tokens = (like.shape[-2] // patch) * (like.shape[-1] // patch)
            zeros = torch.zeros(like.shape[0], tokens, transformer.inner_dim)
        feed[f"block_{i}"] = zeros
    return feed
