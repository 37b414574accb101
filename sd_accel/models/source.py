"""Which checkpoint file a loaded pipeline's UNet, VAE and text encoders hold the weights of.

The WebUI and ComfyUI key their engines by the checkpoint file (``ckpt-<10 hex>`` of its
sha256) and export the original-layout modules (``ldm_unet``, ``ldm_vae_decoder``,
``ldm_vae_encoder``, the WebUI's ``ldm_clip``, ComfyUI's ``comfy_clip``). A pipeline loaded from
the same single file computes the same functions with the same weights, so those engines serve
its calls too (:mod:`sd_accel.runtime.modules` feeds them): an engine built in ComfyUI is the one
the CLI and the app use.

That holds only while the module still has the file's weights. :func:`tag_loaded` records, at
load, the file (size, mtime) and a probe of each weight tensor (five values, read through the
tensor's own indexing, so a memory-format change reads the same); :func:`shared_ids` names a
module by the file only when the file is unchanged and every probe still reads the same (after
casting the recorded values to the tensor's dtype now: ``precision="bf16"`` casts the weights,
which is still the checkpoint). A LoRA fused or loaded, a ``load_state_dict``, another VAE: no
name, and the calls go to the pipeline's own engines.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("sd_accel")

_ATTR = "_sd_accel_source"
_PROBES = 5  # values per tensor
# pipeline attribute -> component -> the WebUI's and ComfyUI's components that compute the same:
# (component, suffix of the weights id after ``ckpt-<hash>``). ComfyUI names its text encoders
# (``.clip_l``: :func:`encoder_name`), the WebUI's one transformers CLIP is the checkpoint's.
SHARED: dict[str, dict[str, tuple[tuple[str, str], ...]]] = {
    "unet": {"unet": (("ldm_unet", ""),)},
    "vae": {"vae_decoder": (("ldm_vae_decoder", ""),), "vae_encoder": (("ldm_vae_encoder", ""),)},
    "text_encoder": {"clip": (("ldm_clip", ""), ("comfy_clip", ".{encoder}"))},
    "text_encoder_2": {"clip2": (("comfy_clip", ".{encoder}"),)},
    # FLUX.1 / SD3: ComfyUI builds diffusers' own transformer from its Flux / MMDiT, keyed by the file
    "transformer": {"transformer": (("transformer", ""),)},
}
# every such component name: they serve a pipeline's components, whose stats count their calls
# (not ``transformer``: ComfyUI's is the pipeline's own component, built from the same module class)
SHARED_COMPONENTS = frozenset(other for slot in SHARED.values() for own, pairs in slot.items() for other, _ in pairs
                              if other != own)


def encoder_name(family: str, slot: str) -> str:
    """ComfyUI's name of a pipeline's text encoder: ``clip_l`` (SD 1.x, SDXL's first), ``clip_h``
    (SD 2.x), ``clip_g`` (SDXL's second); "" for the other modules."""
    if slot == "text_encoder_2":
        return "clip_g"
    if slot == "text_encoder":
        return "clip_h" if family.startswith("sd2") else "clip_l"
    return ""


def _probe(t: torch.Tensor) -> torch.Tensor | None:
    n = t.numel()
    if n == 0 or not t.is_floating_point() or t.device.type == "meta":
        return None
    # float64: float32 positions past 2^24 elements (a 49408 x 1280 token table) may round past the end
    positions = torch.linspace(0, n - 1, steps=min(n, _PROBES), dtype=torch.float64).round().long().clamp_(max=n - 1)
    index = torch.unravel_index(positions, tuple(t.shape)) if t.dim() else ()
    return t.detach()[index].cpu().clone()


@dataclass
class CheckpointSource:
    """The file a module's weights were loaded from, and how they read at load."""

    path: str
    size: int
    mtime_ns: int
    shapes: dict[str, tuple[int, ...]] = field(repr=False)
    probes: dict[str, torch.Tensor] = field(repr=False)
    encoder: str = ""  # a text encoder's name in ComfyUI (clip_l, clip_g, clip_h)

    @classmethod
    def take(cls, module: torch.nn.Module, path: str | Path, encoder: str = "") -> CheckpointSource:
        stat = os.stat(path)
        state = module.state_dict()
        probes = {name: p for name, t in state.items() if (p := _probe(t)) is not None}
        return cls(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns,
                   {name: tuple(t.shape) for name, t in state.items()}, probes, encoder)

    def changed(self, module: torch.nn.Module) -> str | None:
        """Why ``module`` no longer holds this file's weights, or None."""
        try:
            stat = os.stat(self.path)
        except OSError:
            return f"{self.path} is gone"
        if (stat.st_size, stat.st_mtime_ns) != (self.size, self.mtime_ns):
            return f"{self.path} changed on disk since it was loaded"
        state = module.state_dict()
        if {name: tuple(t.shape) for name, t in state.items()} != self.shapes:
            return "its layers changed since loading (LoRA layers, another module)"
        with torch.no_grad():
            for name, recorded in self.probes.items():
                now = _probe(state[name])
                if now is None or not torch.equal(recorded.to(now.dtype), now):
                    return f"its weights changed since loading ({name})"
        return None


def tag_loaded(pipe: Any, path: str | Path, family: str, slots: tuple[str, ...] | None = None) -> None:
    """Record that ``pipe``'s UNet, VAE and text encoders (or only ``slots``: a FLUX.1 / SD3 file's
    transformer, its other parts being files of their own) hold the weights of the checkpoint file
    ``path``, of model family ``family`` (``sd15``, ``sd2-v``, ``sdxl`` ...)."""
    for slot in slots if slots is not None else SHARED:
        module = getattr(pipe, slot, None)
        if isinstance(module, torch.nn.Module):
            object.__setattr__(module, _ATTR, CheckpointSource.take(module, path, encoder_name(family, slot)))


def source_of(module: Any) -> CheckpointSource | None:
    """The :class:`CheckpointSource` recorded on ``module`` (through an engine stand-in too)."""
    inner = getattr(module, "torch_module", module)
    value = getattr(inner, "__dict__", {}).get(_ATTR)
    return value if isinstance(value, CheckpointSource) else None


def shared_ids(pipe: Any, cache: Any) -> dict[str, dict[str, str]]:
    """Component (``unet``, ``vae_decoder``, ``clip`` ...) -> {the WebUI's or ComfyUI's component:
    the weights id its engines of the same module are keyed by}, for each module of ``pipe`` that
    still holds its checkpoint's weights and whose original-layout engines ``cache`` has at all
    (so a cache without any costs no hashing of the file).

    (Skipped in the test suite: it needs a real checkpoint file, which nothing here ships;
    tests/test_shared_engines.py writes tiny ones.)

    >>> shared_ids(load_pipeline("sd15.safetensors"), EngineCache("engines"))   # doctest: +SKIP
    {'unet': {'ldm_unet': 'ckpt-6ce0161689'}, 'clip': {'ldm_clip': 'ckpt-6ce0161689',
     'comfy_clip': 'ckpt-6ce0161689.clip_l'}, ...}
    """
    from sd_accel.models.file_hashes import checkpoint_id

    present = {r.key.component for r in cache.list()}  # (one read of the index)
    out: dict[str, dict[str, str]] = {}
    for slot, components in SHARED.items():
        module = getattr(pipe, slot, None)
        source = source_of(module) if module is not None else None
        config = getattr(module, "config", None)  # (diffusers' a dict; transformers' an object)
        if source is None or (isinstance(config, dict) and config.get("time_cond_proj_dim")):
            continue  # (an LCM UNet's guidance input is not in an original-layout engine)
        wanted = {c: [(other, suffix) for other, suffix in pairs if other in present]
                  for c, pairs in components.items()}
        wanted = {c: pairs for c, pairs in wanted.items() if pairs}
        if not wanted:
            continue
        why = source.changed(getattr(module, "torch_module", module))
        if why is not None:
            log.info("the %s is not served by engines of %s: %s", slot, Path(source.path).name, why)
            continue
        ckpt = checkpoint_id(source.path, cache.root)
        for component, pairs in wanted.items():
            ids = {other: ckpt + suffix.format(encoder=source.encoder) for other, suffix in pairs
                   if source.encoder or "{encoder}" not in suffix}
            if ids:
                out[component] = ids
    return out


__all__ = ["SHARED", "SHARED_COMPONENTS", "CheckpointSource", "encoder_name", "shared_ids", "source_of", "tag_loaded"]
