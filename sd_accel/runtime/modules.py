"""Engine-backed stand-ins for ``pipe.unet``, ``pipe.vae``, ``pipe.text_encoder(_2)``.

They keep the torch module (for ``config``, ``dtype``, ``device``, every other attribute, and
the fallback), accept the same calls and return the same output types, so diffusers pipelines
run unchanged. Engine outputs live in reused buffers; what is handed to diffusers is a copy.

While engines serve it, the torch module's weights are parked (memory-mapped from their model
files or from a spill file, :mod:`sd_accel.runtime.weights`): they cost no RAM until a fallback
pages them in, which is said once per module.

Every call first checks that the torch weights are still those the engines were built from
(:mod:`sd_accel.runtime.freshness`): after a LoRA, an edit or ``load_state_dict`` the call runs
torch, counted with the reason, and the log says once what to do (``refit_engines(pipe)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from sd_accel.runtime import weights
from sd_accel.runtime.freshness import VALUES, WeightsSnapshot
from sd_accel.runtime.selection import ComponentEngines

log = logging.getLogger("sd_accel")

STALE = "weights changed since the engines were built"
_WHAT_TO_DO = "run sd_accel.refit_engines(pipe) to update the engines, or build new ones"

_TITLES = {"unet": "UNet", "vae_decoder": "VAE", "vae_encoder": "VAE", "clip": "text encoder",
           "clip2": "second text encoder", "t5": "T5 encoder", "transformer": "transformer"}


def _out(t: torch.Tensor, like: torch.Tensor | torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    device = like.device
    # clone: the engine reuses its output buffers on the next call, and schedulers keep outputs.
    return t.to(device=device, dtype=dtype, copy=True)


class ProxyModule(torch.nn.Module):
    """Forwards every attribute it lacks to the submodule named ``_proxied``: callers read the
    stood-in module's config, dtype, device and anything else from the stand-in."""

    _proxied = "torch_module"

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if self._proxied not in modules:
                raise
            return getattr(modules[self._proxied], name)


class EngineModule(ProxyModule):
    """Base of the engine-backed stand-ins for a pipeline's modules."""

    def __init__(self, torch_module: torch.nn.Module, engines: dict[str, ComponentEngines]) -> None:
        super().__init__()
        self.torch_module = torch_module
        self.engines = engines
        self.remember_weights()

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        if callable(value) and name != "torch_module":  # a method or a submodule: it may change weights
            self.__dict__["_touched"] = True
        return value

    @property
    def shared(self) -> dict[str, ComponentEngines]:
        """The WebUI's and ComfyUI's engines of the checkpoint this module was loaded from
        (``ldm_unet``, ``ldm_vae_decoder``, ``ldm_vae_encoder``), used for calls this module's own
        engines do not cover, until its weights change (:mod:`sd_accel.models.source`)."""
        return self.__dict__.setdefault("_shared", {})

    def set_shared(self, shared: dict[str, ComponentEngines]) -> None:
        self.__dict__["_shared"] = dict(shared)

    @property
    def _weights(self) -> WeightsSnapshot:
        return self.__dict__["_weights"]

    def remember_weights(self) -> None:
        """Take the weights the engines serve as they are now (after a build, a park, a refit)."""
        self.__dict__["_weights"] = WeightsSnapshot.take(self.torch_module)
        self.__dict__["_touched"] = False
        self.__dict__["_values_changed"] = None

    def touched(self) -> None:
        """The torch module may have been changed behind the cheap checks: the next call makes
        the full one (see :mod:`sd_accel.runtime.freshness`)."""
        self.__dict__["_touched"] = True

    def stale(self) -> str | None:
        """Why the engines no longer fit the torch weights (a fallback reason), or None. Cheap:
        runs on every call."""
        d = self.__dict__
        if self._reads_live_weights():
            return None  # its runners read the torch weights as they are on each call: never stale
        full = d["_touched"]
        what = d["_values_changed"] or d["_weights"].changed(full=full)
        if full and what in (None, VALUES):
            d["_touched"] = False  # (while otherwise stale, each call checks in full: it runs torch anyway)
            # only the full check sees changed values: remember them until a refit or a new swap
            d["_values_changed"] = what
        if what is not None and d.get("_shared"):
            # those engines hold the checkpoint's weights: never again for this module (a new swap decides)
            log.info("%s: weights changed (%s); the engines of its checkpoint file serve it no more",
                     _TITLES.get(next(iter(self.engines), ""), "module"), what)
            d["_shared"] = {}
        if what is not None and self._refit_now():
            what = d["_weights"].changed(full=True)
        return None if what is None else f"{STALE} ({what}): {_WHAT_TO_DO}"

    def _reads_live_weights(self) -> bool:
        """Whether every engine of this module reads the live torch weights (the compiled backend)."""
        handles = [h for e in self.engines.values() for h in e.handles]
        return bool(handles) and all(getattr(h.backend, "reads_live_weights", False) for h in handles)

    def _refit_now(self) -> bool:
        """``refit_engines(pipe, auto=True)``: refit (or take a kept refit) for the weights as they are."""
        refit = self.__dict__.get("_auto_refit")
        if refit is None:
            return False
        try:
            return bool(refit(self))
        except Exception as exc:  # a failed refit must not end the image; the calls run torch
            self.__dict__["_auto_refit"] = None
            log.error("%s: automatic refit failed, calls run torch until refit_engines(pipe) succeeds: %s",
                      _TITLES.get(next(iter(self.engines), ""), "module"), exc)
            return False

    @property
    def auto_refit(self) -> bool:
        return self.__dict__.get("_auto_refit") is not None

    # The stood-in module's keys, not ``torch_module.``-prefixed ones: ``pipe.unet.load_state_dict(sd)``
    # loads into the torch module as it would without engines (and the next call sees the change).
    def state_dict(self, *args, **kwargs):
        return self.torch_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.torch_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def component_stats(self) -> dict[str, Any]:
        out = {name: e.stats.to_dict() for name, e in self.engines.items()}
        for name, e in self.engines.items():
            # runners that count more than calls (the compiled backend: compiles, CUDA-graph captures
            # and replays, refusals by kind), under "compiled", by engine
            more = {h.name: h.runner.stats() for h in e.handles if callable(getattr(h.runner, "stats", None))}
            if more:
                out[name]["compiled"] = more
        return out

    def torch_fallback(self) -> torch.nn.Module:
        """The torch module, for a call the engines did not serve. Said once per module when its
        weights were parked: this is when they load (page in) from their files."""
        module = self.torch_module
        if not self.__dict__.get("_said_fallback"):
            spill = weights.parked(module)
            if spill is not None:
                self.__dict__["_said_fallback"] = True
                title = _TITLES.get(next(iter(self.engines), ""), type(module).__name__)
                log.warning("loading the torch %s for a fallback (%s)", title, spill.describe())
        return module


class EngineUNet(EngineModule):
    """Stands in for ``UNet2DConditionModel``; SDXL's added conditions included."""

    _UNSUPPORTED = (
        "class_labels", "attention_mask", "down_block_additional_residuals",
        "mid_block_additional_residual", "down_intrablock_additional_residuals", "encoder_attention_mask",
    )

    def forward(self, sample, timestep, encoder_hidden_states, *args, **kwargs):
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

        # ControlNet residuals go to the residual-taking engines (sd_accel.runtime.control), when swapped in
        control = "unet_control" in self.engines and kwargs.get("down_block_additional_residuals") is not None \
            and kwargs.get("mid_block_additional_residual") is not None
        # T2I-Adapter features go to the feature-taking engines (sd_accel.components.adapter)
        adapter = not control and "unet_adapter" in self.engines \
            and kwargs.get("down_intrablock_additional_residuals") is not None
        engines = self.engines["unet_control" if control else "unet_adapter" if adapter else "unet"]
        return_dict = kwargs.get("return_dict", True)
        cak = kwargs.get("cross_attention_kwargs") or {}
        scale = float(cak["scale"]) if set(cak) == {"scale"} else None  # a LoRA scale for this call
        scaled = False
        out = None
        try:
            if scale is not None and scale != 1.0 and self.auto_refit and self._weights.has_adapters():
                # as the torch UNet would for this call; the engines serve it through a refit at this scale
                from diffusers.utils import scale_lora_layers

                scale_lora_layers(self.torch_module, scale)
                scaled = True
            reason = self.stale() or self._unsupported(args, kwargs, lora_scale=scale, control=control,
                                                        adapter=adapter)
            features = kwargs.get("down_intrablock_additional_residuals") if adapter else None
            names: list[str] = []
            if reason is None and adapter:
                names = self._adapter_names()
                if len(features) != len(names):
                    reason = (f"the T2I-Adapter gave {len(features)} features, the engine takes {len(names)} "
                              "(one per down block)")
            if reason is not None:
                engines.torch_call(reason)
            elif control:
                from sd_accel.runtime.residuals import run_control_unet

                latent = run_control_unet(engines, sample, timestep, encoder_hidden_states,  # None: counted there
                                          kwargs["down_block_additional_residuals"],
                                          kwargs["mid_block_additional_residual"], kwargs.get("added_cond_kwargs"))
                out = None if latent is None else {"latent": latent}
            else:
                try:
                    feed = self._feed(sample, timestep, encoder_hidden_states, kwargs.get("added_cond_kwargs"),
                                      kwargs.get("timestep_cond"))
                except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as exc:
                    engines.torch_call(f"inputs the engine cannot take ({type(exc).__name__}: {exc})")
                else:
                    if adapter:
                        feed.update({n: f.float() for n, f in zip(names, features, strict=True)})
                        shared = None
                    else:
                        shared = self._shared_for(feed)
                    out = shared[0].run(shared[1], need=("latent",)) if shared else engines.run(feed, need=("latent",))
        finally:
            if scaled:  # torch (a fallback below) scales by itself
                from diffusers.utils import unscale_lora_layers

                unscale_lora_layers(self.torch_module, scale)
        if out is None:
            return self.torch_fallback()(sample, timestep, encoder_hidden_states, *args, **kwargs)
        latent = out["latent"] if control else _out(out["latent"], sample, sample.dtype)
        return UNet2DConditionOutput(sample=latent) if return_dict else (latent,)

    def _adapter_names(self) -> list[str]:
        from sd_accel.components.adapter import adapter_names

        return adapter_names(self.torch_module.config)

    def _unsupported(self, args: tuple, kwargs: dict, lora_scale: float | None = None,
                     control: bool = False, adapter: bool = False) -> str | None:
        if args:
            return "positional arguments beyond (sample, timestep, encoder_hidden_states)"
        taken = ("down_block_additional_residuals", "mid_block_additional_residual") if control else ()
        taken += ("down_intrablock_additional_residuals",) if adapter else ()
        used = [k for k in self._UNSUPPORTED if kwargs.get(k) is not None and k not in taken]
        guided = self.torch_module.config.get("time_cond_proj_dim") is not None
        if kwargs.get("timestep_cond") is not None and (not guided or control):
            used.append("timestep_cond")  # the residual-taking engines have no guidance input
        if used:
            return f"arguments the engine was not built for: {', '.join(used)}"
        if guided and kwargs.get("timestep_cond") is None:
            # the torch UNet then skips its cond_proj; the engine always applies it
            return "no timestep_cond for a UNet with time_cond_proj_dim (its engine takes one on every call)"
        cak = kwargs.get("cross_attention_kwargs")
        if cak and lora_scale is None:
            return f"cross_attention_kwargs {sorted(cak)} are not in the engine"
        if lora_scale is not None and lora_scale != 1.0 and self._weights.has_adapters() and not self.auto_refit:
            # (without LoRA layers a scale changes nothing: the engine serves the call)
            return ("a LoRA scale in cross_attention_kwargs is not in the engine: refit_engines(pipe, auto=True) "
                    "serves it on the engines")
        return None

    def _shared_for(self, feed: dict[str, torch.Tensor]) -> tuple[ComponentEngines, dict[str, torch.Tensor]] | None:
        """The checkpoint's original-layout UNet engines (``ldm_unet``: the WebUI's, ComfyUI's) and
        their feed, when they cover a call the pipeline's own engines do not."""
        from sd_accel.components.ldm_unet import latent_ok

        ldm = self.shared.get("ldm_unet")
        if ldm is None or "timestep_cond" in feed or self.engines["unet"].covering(feed):
            return None
        x = feed["sample"]
        ldm_feed = {"x": x, "timesteps": feed["timestep"], "context": feed["encoder_hidden_states"]}
        if "text_embeds" in feed:
            # the ADM vector of the original layout: what UNet2DConditionModel.get_aug_embed concatenates
            # before add_embedding (the pooled text embedding, then each size/crop value embedded)
            text = feed["text_embeds"]
            times = self.torch_module.add_time_proj(feed["time_ids"].flatten()).reshape(text.shape[0], -1)
            ldm_feed["y"] = torch.cat([text, times.to(text.dtype)], dim=-1)
        hw = tuple(x.shape[-2:])

        def fits(handle) -> bool:  # an engine traced at a divisible latent size serves only those
            facts = (getattr(handle.record, "extra", None) or {}).get("webui") or {}
            return latent_ok(hw, int(facts.get("latent_multiple") or 1))

        covering = ldm.covering(ldm_feed)
        if not any(fits(h) for h in covering):
            return None
        return (ldm if all(fits(h) for h in covering) else ldm.subset(fits)), ldm_feed

    def _feed(self, sample, timestep, ehs, added, timestep_cond=None) -> dict[str, torch.Tensor]:
        batch = sample.shape[0]
        t = torch.as_tensor(timestep, device=sample.device).float().reshape(-1)
        if t.numel() == 1:
            t = t.expand(batch)
        feed = {"sample": sample.float(), "timestep": t.contiguous(), "encoder_hidden_states": ehs.float()}
        if added:
            feed["text_embeds"] = added["text_embeds"].float()
            feed["time_ids"] = added["time_ids"].float()
        if timestep_cond is not None:
            # StableDiffusionPipeline passes one row per image even under CFG; the UNet broadcasts it
            cond = timestep_cond.float()
            feed["timestep_cond"] = cond.expand(batch, -1).contiguous() if cond.shape[0] == 1 else cond
        return feed


class EngineTextEncoder(EngineModule):
    """Stands in for ``CLIPTextModel`` (``clip``) or ``CLIPTextModelWithProjection`` (``clip2``)."""

    def __init__(self, torch_module, engines, component: str) -> None:
        super().__init__(torch_module, engines)
        self.component = component

    def forward(self, input_ids, attention_mask=None, position_ids=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        engines = self.engines[self.component]
        out = None
        reason = self.stale()
        if reason is not None:
            engines.torch_call(reason)
        elif attention_mask is not None or position_ids is not None or output_attentions:
            engines.torch_call("attention_mask / position_ids / attentions are not in the engine")
        else:
            need = ("last_hidden_state", "text_embeds" if self.projected else "pooler_output")
            feed = {"input_ids": input_ids.to(torch.int32)}
            if engines.covering(feed) or not self.shared:
                out = engines.run(feed, need=need)
            else:
                out = self._shared_run(feed, need)
        if out is None:
            return self.torch_fallback()(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                     output_attentions=output_attentions,
                                     output_hidden_states=output_hidden_states, return_dict=return_dict, **kwargs)
        return self._outputs(out, input_ids, bool(output_hidden_states), return_dict)

    def _shared_run(self, feed: dict[str, torch.Tensor], need: tuple[str, ...]) -> dict[str, torch.Tensor] | None:
        """The WebUI's (``ldm_clip``: the same inputs and outputs) or ComfyUI's (``comfy_clip``)
        engine of the checkpoint's text encoder, where the pipeline's own engines do not cover
        the call; None when it ran torch (counted)."""
        webui = self.shared.get("ldm_clip")
        if webui is not None and self.component == "clip" and webui.covering(feed):
            return webui.run(feed, need=need)
        comfy = self.shared.get("comfy_clip")
        text_model = self._text_model()
        embeds = text_model.embeddings.token_embedding(feed["input_ids"].long()).float() if comfy is not None else None
        if comfy is None or not comfy.covering({"embeds": embeds}):
            return self.engines[self.component].run(feed, need=need)  # (no engine: counted there)
        out = comfy.run({"embeds": embeds}, need=("last", "hidden"))
        return None if out is None else self._from_comfy(out, feed["input_ids"], embeds)

    @property
    def projected(self) -> bool:
        """With a projection head (SDXL's and SD3's second encoder, SD3's first): ``text_embeds``."""
        return hasattr(self.torch_module, "text_projection")

    def _text_model(self) -> torch.nn.Module:
        # transformers 5's CLIPTextModel is the text transformer itself; WithProjection (and 4.x) wrap it
        return getattr(self.torch_module, "text_model", self.torch_module)

    def _from_comfy(self, out: dict[str, torch.Tensor], ids: torch.Tensor, embeds: torch.Tensor) -> dict[str, torch.Tensor]:
        """ComfyUI's CLIP engine outputs (``last``: after the final norm; ``hidden``: every layer's
        output) as a transformers CLIP text model's. ComfyUI keeps all of SD 2.x's 24 layers where
        diffusers' converted model may hold 23: then the last state is taken after layer 23."""
        text_model = self._text_model()
        layers = len(text_model.encoder.layers)
        hidden = out["hidden"].float()
        with torch.no_grad():
            last = out["last"].float() if hidden.shape[1] == layers else text_model.final_layer_norm(hidden[:, layers - 1])
            position = text_model.embeddings.position_embedding.weight[: ids.shape[1]].float()
            eos = getattr(text_model, "eos_token_id", 2)
            # transformers' pooled row: the first end-of-text token (the highest id, for configs of eos id 2)
            rows = ids.argmax(dim=-1) if eos == 2 else (ids == eos).int().argmax(dim=-1)
            pooled = last[torch.arange(last.shape[0]), rows]
            result = {"last_hidden_state": last, "hidden_states.0": embeds + position}
            result.update({f"hidden_states.{i + 1}": hidden[:, i] for i in range(layers)})
            if self.projected:
                result["text_embeds"] = self.torch_module.text_projection(pooled.to(self.torch_module.dtype)).float()
            else:
                result["pooler_output"] = pooled
        return result

    def _outputs(self, out, like, hidden: bool, return_dict):
        from transformers.modeling_outputs import BaseModelOutputWithPooling
        from transformers.models.clip.modeling_clip import CLIPTextModelOutput

        dtype = self.torch_module.dtype
        conv = {k: _out(v, like, dtype) for k, v in out.items()}
        states = None
        if hidden:
            n = sum(1 for k in conv if k.startswith("hidden_states."))
            states = tuple(conv[f"hidden_states.{i}"] for i in range(n))
        if self.projected:
            result = CLIPTextModelOutput(text_embeds=conv["text_embeds"],
                                         last_hidden_state=conv["last_hidden_state"], hidden_states=states)
        else:
            result = BaseModelOutputWithPooling(last_hidden_state=conv["last_hidden_state"],
                                                pooler_output=conv["pooler_output"], hidden_states=states)
        return result if return_dict is not False else result.to_tuple()


class EngineVAE(EngineModule):
    """Stands in for ``AutoencoderKL`` or ``AutoencoderTiny`` (TAESD): ``decode`` and ``encode`` on
    engines, the rest on torch."""

    def forward(self, *args, **kwargs):
        return self.torch_fallback()(*args, **kwargs)

    def decode(self, z: torch.Tensor, return_dict: bool = True, generator=None, **kwargs):
        from diffusers.models.autoencoders.vae import DecoderOutput

        engines = self.engines.get("vae_decoder")
        sample = None
        if engines is not None and self._fresh(engines):
            shared = self._shared_vae("ldm_vae_decoder", engines, "latent", z)
            if shared is not None:  # the checkpoint's decoder engine: post_quant_conv (1x1) here
                h = self._conv(getattr(self.torch_module, "post_quant_conv", None), z)
                sample = self._per_item(shared, "z", "images", h, check=self._finite("images"))
            else:
                sample = self._per_item(engines, "latent", "images", z, check=self._finite("images"))
        if sample is None:
            return self.torch_fallback().decode(z, return_dict=return_dict, generator=generator, **kwargs)
        return DecoderOutput(sample=sample) if return_dict else (sample,)

    def encode(self, x: torch.Tensor, return_dict: bool = True, **kwargs):
        from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        engines = self.engines.get("vae_encoder")
        fresh = engines is not None and self._fresh(engines)
        from diffusers import AutoencoderTiny

        tiny = isinstance(self.torch_module, AutoencoderTiny)  # TAESD: latents, no distribution
        shared = self._shared_vae("ldm_vae_encoder", engines, "images", x) if fresh and not tiny else None
        if shared is not None:  # the checkpoint's encoder engine: quant_conv (1x1) here
            moments = self._per_item(shared, "images", "moments", x)
            if moments is not None:
                moments = self._conv(getattr(self.torch_module, "quant_conv", None), moments).to(moments.dtype)
        else:
            moments = self._per_item(engines, "images", "latents" if tiny else "moments", x) if fresh else None
        if moments is None:
            return self.torch_fallback().encode(x, return_dict=return_dict, **kwargs)
        if tiny:
            from diffusers.models.autoencoders.autoencoder_tiny import AutoencoderTinyOutput

            return AutoencoderTinyOutput(latents=moments) if return_dict else (moments,)
        dist = DiagonalGaussianDistribution(moments)
        return AutoencoderKLOutput(latent_dist=dist) if return_dict else (dist,)

    def _shared_vae(self, component: str, engines: ComponentEngines, name_in: str,
                    x: torch.Tensor) -> ComponentEngines | None:
        """The checkpoint's original-layout VAE engines (the WebUI's, ComfyUI's) for a call the
        pipeline's own ``engines`` do not cover (one image, with slicing on)."""
        shared = self.shared.get(component)
        if shared is None:
            return None
        item = x[:1] if getattr(self.torch_module, "use_slicing", False) else x
        if engines.covering({name_in: item}):
            return None
        # the 1x1 quant convolutions between the two keep every SD VAE's shapes
        return shared if shared.covering({"z" if component.endswith("decoder") else "images": item}) else None

    @staticmethod
    def _conv(conv, x: torch.Tensor) -> torch.Tensor:
        """A 1x1 quant conv in fp32 (its weights may be parked, fp16 or bf16), or ``x`` without one."""
        if conv is None:
            return x
        bias = None if conv.bias is None else conv.bias.float()
        return torch.nn.functional.conv2d(x.float(), conv.weight.float(), bias)

    def _fresh(self, engines: ComponentEngines) -> bool:
        reason = self.stale()
        if reason is not None:
            engines.torch_call(reason)
        return reason is None

    def _finite(self, name_out: str) -> Callable[[dict[str, torch.Tensor]], str | None]:
        """The decode's output check: NaN/inf (in the dtype the caller gets) sends the call to torch."""
        dtype = self.torch_module.dtype

        def check(out: dict[str, torch.Tensor]) -> str | None:
            return None if torch.isfinite(out[name_out].to(dtype)).all() else "engine decode produced NaN/inf"
        return check

    def _per_item(self, engines: ComponentEngines, name_in: str, name_out: str, x: torch.Tensor,
                  check: Callable[[dict[str, torch.Tensor]], str | None] | None = None):
        """With VAE slicing on, run one image at a time, as the torch VAE would."""
        dtype = self.torch_module.dtype
        if getattr(self.torch_module, "use_slicing", False) and x.shape[0] > 1:
            parts = []
            for item in x.split(1):
                out = engines.run({name_in: item.float()}, need=(name_out,), check=check)
                if out is None:
                    return None
                parts.append(_out(out[name_out], x, dtype))
            return torch.cat(parts)
        out = engines.run({name_in: x.float()}, need=(name_out,), check=check)
        return None if out is None else _out(out[name_out], x, dtype)
