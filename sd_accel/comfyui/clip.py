"""CLIP text encode on engines: ComfyUI's own ``CLIPTextEncode`` (tokenize, ``encode_from_tokens_scheduled``)
with each of the CLIP's text encoders served by engines for the call.

Everything around the encoder stays ComfyUI's: tokenizing and prompt weights, textual-inversion
embeddings (spliced into ``embeds`` before the encoder), chunks of 77, the layer choice of
``CLIPSetLastLayer``, SDXL's two encoders and their pooled output. For the node's call each
``CLIPTextModel`` gets an instance ``forward`` that sends ``embeds`` to its ``comfy_clip`` engine
(:mod:`sd_accel.components.comfy_clip`) and does the rest (layer pick, final norm, pooled row,
projection) as ComfyUI's forward does; what the engine cannot take (attention masks, token ids
without embeddings, more chunks than any profile covers) runs ComfyUI's forward, counted and
said once. An encoder whose LoRA patches ComfyUI writes into its weights runs in PyTorch (said
once): the engine holds the file's weights and is never used with others.

FLUX.1's and SD3's ``t5xxl`` (ComfyUI's ``T5``) the same way, on its ``comfy_t5`` engine
(:mod:`sd_accel.components.comfy_t5`): ``embeds`` in, the last layer out; a call with an attention
mask or an intermediate layer runs ComfyUI's forward.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from sd_accel.comfyui.identity import checkpoint_id
from sd_accel.comfyui.state import State, state
from sd_accel.components.comfy_clip import COMPONENT, is_comfy_clip
from sd_accel.components.comfy_t5 import COMPONENT as T5_COMPONENT
from sd_accel.components.comfy_t5 import is_comfy_t5

log = logging.getLogger("sd_accel")


def encoders(clip) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of each of ComfyUI's CLIP text models in a CLIP (``clip_l``; SDXL's
    ``clip_l`` and ``clip_g``; SD 2.x's ``clip_h``) and T5s (FLUX.1's / SD3's ``t5xxl``)."""
    root = getattr(clip, "cond_stage_model", None)
    if root is None:
        return []
    out = []
    for name, module in root.named_modules():
        if name and (is_comfy_clip(module) or is_comfy_t5(module)):
            out.append((name.removesuffix(".transformer"), module))
    return out


def clip_weights_id(clip, name: str, module: torch.nn.Module, st: State) -> str:
    """``ckpt-<10 hex>.clip_l``: the checkpoint's id and the encoder's name."""
    root = clip.cond_stage_model
    return f"{checkpoint_id(root, st.engine_dir(), fingerprint_of=module)}.{name}"


def patched(clip, name: str) -> bool:
    """Whether the CLIP carries weight patches (a LoRA loader's) for encoder ``name``."""
    patches = getattr(getattr(clip, "patcher", None), "patches", None) or {}
    prefix = f"{name}."
    return any(str(k if isinstance(k, str) else k[0]).startswith(prefix) for k in patches)


class ClipForward:
    """The instance ``forward`` of one ComfyUI ``CLIPTextModel`` while the node runs."""

    def __init__(self, module: torch.nn.Module, engines, original) -> None:
        self.module = module
        self.engines = engines
        self.original = original if original is not None else type(module).forward.__get__(module)

    def _torch(self, reason: str | None, args: tuple, kwargs: dict):
        if reason is not None:
            self.engines.torch_call(reason)
        return self.original(*args, **kwargs)

    def __call__(self, input_tokens=None, attention_mask=None, embeds=None, num_tokens=None,
                 intermediate_output=None, final_layer_norm_intermediate=True, dtype=torch.float32, **kwargs):
        args = (input_tokens, attention_mask)
        kw = dict(embeds=embeds, num_tokens=num_tokens, intermediate_output=intermediate_output,
                  final_layer_norm_intermediate=final_layer_norm_intermediate, dtype=dtype, **kwargs)
        if embeds is None:
            return self._torch("token ids without embeddings", args, kw)
        if attention_mask is not None:
            return self._torch("attention masks are not in the engine", args, kw)
        if isinstance(intermediate_output, list | str):
            return self._torch(f"intermediate_output={intermediate_output!r} is not served", args, kw)
        if num_tokens is None and input_tokens is None:
            return self._torch("no token counts for the pooled row", args, kw)
        out = self.engines.run({"embeds": embeds.float()}, need=("last", "hidden"))
        if out is None:  # counted by the engines
            return self.original(*args, **kw)
        text_model = self.module.text_model
        last = out["last"].to(embeds.device, torch.float32, copy=True)
        hidden = None
        if intermediate_output is not None:
            layers = out["hidden"].shape[1]
            index = intermediate_output + layers if intermediate_output < 0 else intermediate_output
            hidden = out["hidden"][:, index].to(embeds.device, torch.float32, copy=True)
            if final_layer_norm_intermediate:
                hidden = text_model.final_layer_norm(hidden)
        rows = torch.arange(last.shape[0], device=last.device)
        if num_tokens is not None:
            pooled = last[rows, torch.as_tensor([n - 1 for n in num_tokens], device=last.device)]
        else:
            eos = text_model.eos_token_id if hasattr(text_model, "eos_token_id") else 49407
            pooled = last[rows, (torch.round(input_tokens).int() == eos).int().argmax(dim=-1)]
        projection = getattr(self.module, "text_projection", None)
        projected = projection(pooled) if projection is not None else pooled
        return last, hidden, projected, pooled


class T5Forward(ClipForward):
    """The instance ``forward`` of one ComfyUI ``T5`` while the node runs."""

    def __call__(self, input_ids=None, attention_mask=None, embeds=None, num_tokens=None, intermediate_output=None,
                 **kwargs):
        args = (input_ids, attention_mask)
        kw = dict(embeds=embeds, num_tokens=num_tokens, intermediate_output=intermediate_output, **kwargs)
        if embeds is None:
            return self._torch("token ids without embeddings", args, kw)
        if attention_mask is not None:
            return self._torch("attention masks are not in the engine", args, kw)
        if intermediate_output is not None:
            return self._torch(f"intermediate_output={intermediate_output!r} is not served", args, kw)
        out = self.engines.run({"embeds": embeds.float()}, need=("last",))
        if out is None:  # counted by the engines
            return self.original(*args, **kw)
        return out["last"].to(embeds.device, torch.float32, copy=True), None


def component_of(module: torch.nn.Module) -> str:
    """The engine component of one of :func:`encoders`' modules."""
    return T5_COMPONENT if is_comfy_t5(module) else COMPONENT


@contextlib.contextmanager
def on_engines(clip, st: State | None = None) -> Iterator[list[tuple[str, Any]]]:
    """The CLIP's text encoders on engines for the block; yields (name, engines) of those that have
    them (their ``stats`` count the calls)."""
    st = st or state()
    swapped: list[tuple[torch.nn.Module, Any]] = []
    used: list[tuple[str, Any]] = []
    try:
        for name, module in encoders(clip):
            wid = clip_weights_id(clip, name, module, st)
            if patched(clip, name):
                st.say_once(f"the text encoder {name} carries LoRA patches: it runs in PyTorch (its engine holds "
                            "the checkpoint's weights)")
                continue
            component = component_of(module)
            engines, why = st.engines_or_reason(wid, component)
            if engines is None:
                st.say_once(f"no {component} engine for {wid} ({why or 'none built'}): the text encoder runs in "
                            "PyTorch")
                continue
            engines.reset_stats()
            previous = module.__dict__.get("forward")
            kind = T5Forward if component == T5_COMPONENT else ClipForward
            module.__dict__["forward"] = kind(module, engines, previous if callable(previous) else None)
            swapped.append((module, previous))
            used.append((name, engines))
        yield used
    finally:
        for module, previous in swapped:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous


def encode(clip, text: str, st: State | None = None):
    """ComfyUI's ``CLIPTextEncode`` (the CONDITIONING) with the text encoders on engines."""
    from sd_accel.core import InvalidValue

    if clip is None:
        raise InvalidValue("no CLIP: the checkpoint has no text encoder (connect a CLIP loader's output)")
    with on_engines(clip, st) as used:
        tokens = clip.tokenize(text)
        scheduled = getattr(clip, "encode_from_tokens_scheduled", None)
        if scheduled is not None:
            conditioning = scheduled(tokens)
        else:  # ComfyUI before the scheduled hooks
            cond, pooled = clip.encode_from_tokens(tokens, return_pooled=True)
            conditioning = [[cond, {"pooled_output": pooled}]]
    for name, engines in used:
        s = engines.stats
        line = f"sd-accel: text encoder {name} calls: {s.engine_calls} on engines, {s.torch_calls} in PyTorch"
        if s.fallbacks:
            line += " (" + "; ".join(f"{n}x {why}" for why, n in s.fallbacks.items()) + ")"
        log.info("%s", line)
    return conditioning


__all__ = ["ClipForward", "T5Forward", "clip_weights_id", "component_of", "encode", "encoders", "on_engines",
           "patched"]
