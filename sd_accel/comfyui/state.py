"""The engines of this ComfyUI process: folder, backend, engines per weights id, LoRA refits.

One :class:`State` per process (:func:`state`). Engines of a weights id stay loaded until the
engine set changes (a build, a delete) or ``KEPT_CHECKPOINTS`` other checkpoints were used since;
the UNet's (plain and residual-taking) come as the WebUI's :class:`~sd_accel.webui.runner.LdmEngines`
(per-call choice, batch chunks, PyTorch for the rest, counted and said once per reason), the VAE's
as the runtime's ``ComponentEngines``.
LoRA refits are the WebUI's (:class:`~sd_accel.webui.lora.LoraRefits`): the last patch set of
each checkpoint stays refitted (``KEPT_REFITS`` in :mod:`.unet`), each profile at its first call.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sd_accel.comfyui import host
from sd_accel.components.ldm_control_unet import COMPONENT as CONTROL_UNET
from sd_accel.components.ldm_unet import COMPONENT as UNET
from sd_accel.webui.runner import LdmEngines

log = logging.getLogger("sd_accel")

ENV_BACKEND = "SD_ACCEL_COMFYUI_BACKEND"  # the backend engines are loaded for (default auto)
KEPT_CHECKPOINTS = 2  # a base + refiner workflow keeps both; a third checkpoint closes the oldest's engines


def checkpoint_of(wid: str) -> str:
    """``ckpt-0123456789`` of ``ckpt-0123456789+lora-…`` / ``….clip_l``: the checkpoint a weights id is of."""
    return re.split(r"[.+]", wid, maxsplit=1)[0]


@dataclass
class Job:
    """What the running node used (the VAE stand-ins report into it, as in the WebUI)."""

    used: set = field(default_factory=set)


class State:
    """Engine folder, backend, engines per (weights id, component), refits, once-said notes."""

    def __init__(self, engine_dir: Path | None = None, backend: str | None = None) -> None:
        self._lock = threading.RLock()
        self._dir = Path(engine_dir) if engine_dir is not None else None
        self._backend_name = backend
        self._backends: dict[str, Any] = {}
        self._engines: dict[tuple, Any] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()  # checkpoint ids, least recently used first
        self._said: set[str] = set()
        self.generation = 0
        self.job = Job()
        self.weights: dict[str, str] = {}  # component -> weights id, set by the VAE nodes for a call
        from sd_accel.webui.lora import LoraRefits

        self.refits = LoraRefits()

    # ---- settings

    def engine_dir(self) -> Path:
        return self._dir if self._dir is not None else host.default_engine_dir()

    def backend_name(self) -> str:
        return self._backend_name or os.environ.get(ENV_BACKEND) or "auto"

    def cache(self):
        from sd_accel import EngineCache

        return EngineCache(self.engine_dir())

    def backend(self, name: str | None = None):
        """The runtime backend ``name`` (default: this state's); raises with the reason when unusable."""
        from sd_accel.backends.registry import get_backend

        name = name or self.backend_name()
        with self._lock:
            if name not in self._backends:
                device = "cpu" if name == "auto" and host.runs_on_cpu() else None
                # (the compiled backend runs a diffusers pipeline's own modules: not ComfyUI's model)
                self._backends[name] = get_backend(name, cache_root=self.engine_dir(), device=device,
                                                   live_modules=False)
            return self._backends[name]

    def backends_here(self) -> list:
        """The chosen backend first, then (with auto) every other one that runs here."""
        from sd_accel.backends.registry import auto_order

        first = self.backend()
        out = [first]
        if self.backend_name() == "auto":
            for name in auto_order("cpu" if host.runs_on_cpu() else None, live_modules=False):
                if name != first.name:
                    try:
                        out.append(self.backend(name))
                    except Exception:  # noqa: BLE001  (cannot run here)
                        continue
        return out

    # ---- engines

    def engines_changed(self) -> None:
        """Engines were built or deleted: reload on next use."""
        with self._lock:
            self.generation += 1
            for engines in self._engines.values():
                if engines is not None:
                    engines.close()
            self._engines.clear()
            self.refits.close()

    def loaded(self, wid: str, component: str = UNET) -> bool:
        """``wid``'s ``component`` engines are loaded now (found by :meth:`engines_for` since the
        last change), not merely known to be missing."""
        key = (wid, component, self.backend_name(), str(self.cache().root), self.generation)
        with self._lock:
            return self._engines.get(key) is not None

    def engines_for(self, wid: str, component: str = UNET):
        """Usable engines of weights id ``wid`` (the backend's, else with auto another's that runs
        here), or None when there are none."""
        from sd_accel.runtime import engines_for

        cache = self.cache()
        key = (wid, component, self.backend_name(), str(cache.root), self.generation)
        with self._lock:
            self._touch(checkpoint_of(wid))
            if key not in self._engines:
                found = None
                for backend in self.backends_here():
                    found = engines_for(cache, backend, wid, component, fallback=True,
                                        on_refused=lambda why: self.say_once(f"not loading engine {why}"))
                    if found.handles:
                        break
                if found is None or not found.handles:
                    self._engines[key] = None
                else:
                    self._engines[key] = LdmEngines(wid, found) if component in (UNET, CONTROL_UNET) else found
            return self._engines[key]

    def _touch(self, ckpt: str) -> None:
        """Mark ``ckpt``'s engines used; close those of checkpoints used longer ago than the
        KEPT_CHECKPOINTS most recent (ComfyUI unloads a checkpoint it moved away from too: engines
        of every checkpoint of a session, with their refits, outgrew RAM in a real ComfyUI)."""
        self._recent[ckpt] = None
        self._recent.move_to_end(ckpt)
        while len(self._recent) > KEPT_CHECKPOINTS:
            old, _ = self._recent.popitem(last=False)
            for key in [k for k in self._engines if checkpoint_of(k[0]) == old]:
                engines = self._engines.pop(key)
                if engines is not None:
                    engines.close()
            self.refits.drop(lambda where, old=old: checkpoint_of(str(where[0])) == old)
            log.info("sd-accel: closed the engines of %s (those of the %d most recently used checkpoints stay "
                     "loaded)", old, KEPT_CHECKPOINTS)

    def engines_or_reason(self, wid: str | None, component: str = UNET) -> tuple[Any, str | None]:
        """(engines, None), or (None, why not): never raises (it runs inside a model call)."""
        if wid is None:
            return None, "the weights are not known"
        try:
            return self.engines_for(wid, component), None
        except Exception as exc:  # noqa: BLE001  (an unusable backend, an unreadable folder)
            reason = f"engines cannot be loaded: {type(exc).__name__}: {exc}"
            self.say_once(reason)
            return None, reason

    def weights_for(self, component: str) -> str | None:
        """The weights id a VAE stand-in computes with for the running node (set by :mod:`.vae`)."""
        return self.weights.get(component)

    def say_once(self, text: str) -> None:
        """A warning printed once per process."""
        if text not in self._said:
            self._said.add(text)
            log.warning("sd-accel: %s", text)


_STATE: State | None = None


def state() -> State:
    """The process's state (created on first use)."""
    global _STATE
    if _STATE is None:
        _STATE = State()
    return _STATE


def reset_state(engine_dir: Path | None = None, backend: str | None = None) -> State:
    """A fresh state (tests; a changed engine folder)."""
    global _STATE
    if _STATE is not None:
        _STATE.engines_changed()
    _STATE = State(engine_dir, backend)
    return _STATE
