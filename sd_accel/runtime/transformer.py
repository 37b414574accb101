"""Engine-backed stand-ins for the transformer families' modules: ``pipe.transformer`` (SD3 /
SD3.5's ``SD3Transformer2DModel``, FLUX.1's ``FluxTransformer2DModel``) and their T5 encoder.

Same rules as the UNet's (:mod:`sd_accel.runtime.modules`): every call first checks the weights
are those the engines were built from; a call with arguments the engine does not carry (a
ControlNet's block samples, skip-layer guidance, attention kwargs other than a LoRA scale of 1)
or a shape no engine covers runs torch, counted with its reason. ControlNet samples (FLUX.1's, SD3's)
go to the residual-taking engine (``transformer_control``) where there is one.

With a step cache set (:meth:`EngineTransformer.set_step_cache`, ``AccelConfig.step_cache``), a
call goes first to the engines cut for it (:mod:`sd_accel.runtime.step_cache`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sd_accel.components.segments import is_step_cache_layout
from sd_accel.runtime.modules import EngineModule, _out
from sd_accel.runtime.step_cache import StepCache, stream_key
from sd_accel.runtime.transformer_control import (
    attention_kwargs_reason,
    control_residuals,
    sd3_control_residuals,
)

# the keyword arguments each family's engine does not take (present and not None: torch runs the call)
_NOT_IN_ENGINE = ("block_controlnet_hidden_states", "skip_layers", "controlnet_block_samples",
                  "controlnet_single_block_samples", "attention_mask", "encoder_attention_mask")
NO_STEP_CACHE_ENGINE = ("step cache: no transformer engine cut for it covers this call, so its steps run in full; "
                        "build one with build_engines(pipe, step_cache=True) or `sd-accel build --step-cache`")
NO_CONTROL_ENGINE = ("a ControlNet call and no residual-taking transformer engine for these weights: build one "
                     "with the transformer_control component")
# FLUX.1's ControlNet samples: the residual-taking engine's inputs (transformer_control), when it has one
_FLUX_CONTROL = ("controlnet_block_samples", "controlnet_single_block_samples")
_SD3_CONTROL = ("block_controlnet_hidden_states",)  # SD3's


class EngineTransformer(EngineModule):
    """Stands in for ``SD3Transformer2DModel`` or ``FluxTransformer2DModel``."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                pooled_projections: torch.Tensor | None = None, timestep: torch.Tensor | None = None,
                *args, **kwargs):
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        control = self._control(kwargs)
        engines = self.engines["transformer_control" if control else "transformer"]
        reason = self.stale() or self._unsupported(args, kwargs, control)
        if reason is None and control and not engines.handles and engines.builder is None:
            reason = NO_CONTROL_ENGINE
        out = None
        if reason is not None:
            engines.torch_call(reason)
        else:
            try:
                feed = self._feed(hidden_states, encoder_hidden_states, pooled_projections, timestep, kwargs)
                if control and self.flux:
                    feed.update(control_residuals(self.torch_module, kwargs.get("controlnet_block_samples"),
                                                  kwargs.get("controlnet_single_block_samples"),
                                                  bool(kwargs.get("controlnet_blocks_repeat")), hidden_states))
                elif control:
                    takes = {n for h in engines.handles for n in getattr(h, "shapes", {})} or None
                    feed.update(sd3_control_residuals(self.torch_module, kwargs["block_controlnet_hidden_states"],
                                                      hidden_states, takes))
            except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as exc:
                engines.torch_call(f"inputs the engine cannot take ({type(exc).__name__}: {exc})")
            else:
                # the engines ComfyUI built from the same file (:mod:`sd_accel.models.source`) take
                # what this module's own do not cover, counted as this module's
                shared = self.shared.get("transformer")

                def plain() -> dict[str, torch.Tensor] | None:
                    if shared is not None and not control and not engines.covering(feed) and shared.covering(feed):
                        return shared.run(feed, need=("latent",))
                    return engines.run(feed, need=("latent",))

                cache = self.step_cache
                if cache is not None and not control:
                    out = self._run_cached(cache, engines, feed, stream_key(hidden_states, encoder_hidden_states,
                                                                           pooled_projections), plain)
                else:
                    out = plain()
        if out is None and self.step_cache is not None:
            self.step_cache.interrupted(stream_key(hidden_states, encoder_hidden_states, pooled_projections))
        if out is None:
            return self.torch_fallback()(hidden_states, encoder_hidden_states, pooled_projections, timestep,
                                         *args, **kwargs)
        sample = _out(out["latent"], hidden_states, hidden_states.dtype)
        return Transformer2DModelOutput(sample=sample) if kwargs.get("return_dict", True) else (sample,)

    @property
    def step_cache(self) -> StepCache | None:
        return self.__dict__.get("_step_cache")

    def set_step_cache(self, cache: StepCache | None) -> None:
        """Serve the calls through ``cache`` (None: every step in full, as without one)."""
        self.__dict__["_step_cache"] = cache

    def component_stats(self) -> dict[str, Any]:
        out = super().component_stats()
        if self.step_cache is not None and "transformer" in out:
            out["transformer"]["step_cache"] = self.step_cache.stats.to_dict()
        return out

    def _run_cached(self, cache: StepCache, engines, feed: dict[str, torch.Tensor], key: tuple,
                    plain: Callable[[], dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor] | None:
        """A call on the engines cut for the step cache, when one covers it; else ``plain()``, the
        call as without a cache."""
        def is_cut(handle) -> bool:
            return is_step_cache_layout(getattr(handle.record.key, "layout", ""))

        cut = engines.subset(is_cut)
        if not cut.covering(feed) and getattr(engines.builder, "step_cache", False):
            built = engines.builder(engines, feed)  # (engines="auto": one cut for the cache, of this shape)
            if isinstance(built, str):
                cache.interrupted(key)
                engines.torch_call(built)
                return None
            cut = engines.subset(is_cut)
        if cut.covering(feed):
            return cut.run(feed, need=("latent",), infer=lambda runner, f: cache.infer(runner, f, key))
        cache.say_once("no-engine", NO_STEP_CACHE_ENGINE)
        cache.interrupted(key)
        return plain()

    @property
    def flux(self) -> bool:
        return type(self.torch_module).__name__.startswith("Flux")

    def _control(self, kwargs: dict[str, Any]) -> bool:
        """A call with ControlNet samples, and engines that take them (``transformer_control``):
        those serve it."""
        return "transformer_control" in self.engines and any(kwargs.get(k) is not None for k in self._control_args)

    @property
    def _control_args(self) -> tuple[str, ...]:
        return _FLUX_CONTROL if self.flux else _SD3_CONTROL

    def _unsupported(self, args: tuple, kwargs: dict[str, Any], control: bool = False) -> str | None:
        if args:
            return "positional arguments beyond (hidden_states, encoder_hidden_states, pooled_projections, timestep)"
        used = [k for k in _NOT_IN_ENGINE if kwargs.get(k) is not None and not (control and k in self._control_args)]
        if used:
            return f"arguments the engine was not built for: {', '.join(used)}"
        jak = attention_kwargs_reason(kwargs.get("joint_attention_kwargs"))
        if jak:
            return jak
        if self.flux and self.torch_module.config.get("guidance_embeds") and kwargs.get("guidance") is None:
            return "no guidance for a FLUX.1 dev transformer (its engine takes one on every call)"
        return None

    def _feed(self, hidden_states, encoder_hidden_states, pooled_projections, timestep,
              kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        batch = hidden_states.shape[0]

        def per_row(value) -> torch.Tensor:
            t = torch.as_tensor(value, device=hidden_states.device).float().reshape(-1)
            return (t.expand(batch) if t.numel() == 1 else t).contiguous()

        feed = {"hidden_states": hidden_states.float(), "encoder_hidden_states": encoder_hidden_states.float(),
                "pooled_projections": pooled_projections.float(), "timestep": per_row(timestep)}
        if self.flux:
            img_ids, txt_ids = kwargs["img_ids"], kwargs["txt_ids"]
            # (a batch axis on the ids is deprecated in diffusers and ignored there: the first row)
            feed["img_ids"] = (img_ids[0] if img_ids.ndim == 3 else img_ids).float()
            feed["txt_ids"] = (txt_ids[0] if txt_ids.ndim == 3 else txt_ids).float()
            if self.torch_module.config.get("guidance_embeds"):
                feed["guidance"] = per_row(kwargs["guidance"])
        return feed


class EngineT5(EngineModule):
    """Stands in for ``T5EncoderModel`` (SD3's ``text_encoder_3``, FLUX.1's ``text_encoder_2``)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *args,
                output_hidden_states: bool | None = None, output_attentions: bool | None = None,
                return_dict: bool | None = None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        engines = self.engines["t5"]
        reason = self.stale()
        if reason is None and (attention_mask is not None or args or output_hidden_states or output_attentions
                               or any(v is not None for v in kwargs.values())):
            reason = "attention_mask / hidden states / attentions / other arguments are not in the engine"
        out = None
        if reason is not None:
            engines.torch_call(reason)
        else:
            out = engines.run({"input_ids": input_ids.to(torch.int32)}, need=("last_hidden_state",))
        if out is None:
            return self.torch_fallback()(input_ids, attention_mask, *args, output_hidden_states=output_hidden_states,
                                         output_attentions=output_attentions, return_dict=return_dict, **kwargs)
        last = _out(out["last_hidden_state"], input_ids, self.torch_module.dtype)
        result = BaseModelOutput(last_hidden_state=last)
        return result if return_dict is not False else (last,)
