"""State shared by the tab, the settings, the SD-UNet option, the Forge patch and the routes.

One :class:`Controller` per WebUI process (:func:`controller`). It reads the settings page on
every use (so a changed setting applies at once), keeps the engines of each weights id loaded
until the engine set changes, and tracks the running job: which weights it wants, what made
calls go to PyTorch, and the one-line report printed when the job ends.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from sd_accel.components.ldm_unet import COMPONENT
from sd_accel.profiles import PRESETS, default_preset
from sd_accel.webui import host
from sd_accel.webui.identity import LoraSet, checkpoint_hash, describe, weights_id
from sd_accel.webui.runner import LdmEngines

log = logging.getLogger("sd_accel")

# Settings page keys (registered by sd_accel.webui.settings).
OPT_ENGINE_DIR = "sd_accel_engine_dir"
OPT_FALLBACK = "sd_accel_fallback"
OPT_PRESET = "sd_accel_default_preset"
OPT_BACKEND = "sd_accel_backend"
OPT_FORGE = "sd_accel_forge_enabled"
AUTO_PRESET = "auto (by model family)"


@dataclass
class Job:
    """What the running job wants and what it got; reset by :meth:`Controller.job_started`."""

    loras: LoraSet | None = None  # None: not known (no script hook saw the job)
    torch_only: str | None = None  # why the whole job runs in PyTorch (hypernetworks ...)
    notes: list[str] = field(default_factory=list)
    used: set = field(default_factory=set)  # weights ids whose engines served this job


class Controller:
    """Settings, engines per weights id, and the running job."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._engines: dict[tuple, LdmEngines | None] = {}
        self._generation = 0
        self._backend: dict[tuple, Any] = {}
        self._said: set[str] = set()
        self.job = Job()

    # ---- settings

    def engine_dir(self):
        from pathlib import Path

        value = str(host.opt(OPT_ENGINE_DIR, "") or "").strip()
        return Path(value).expanduser() if value else host.default_engine_dir()

    def fallback(self) -> bool:
        return bool(host.opt(OPT_FALLBACK, True))

    def backend_name(self) -> str:
        return str(host.opt(OPT_BACKEND, "auto") or "auto")

    def forge_enabled(self) -> bool:
        return bool(host.opt(OPT_FORGE, True))

    def preset_for(self, family: str) -> str:
        """The settings' default preset, or the family's default (SDXL static 1024 ...)."""
        value = host.opt(OPT_PRESET, AUTO_PRESET)
        if value in PRESETS:
            return value
        return default_preset({"sd2": "sd2-v"}.get(family, family))

    def cache(self):
        from sd_accel import EngineCache

        return EngineCache(self.engine_dir())

    def backend(self):
        """The runtime backend for the settings' choice; raises with the reason when unusable."""
        from sd_accel.backends.registry import get_backend

        cache = self.cache()
        key = (self.backend_name(), str(cache.root))
        with self._lock:
            if key not in self._backend:
                self._backend[key] = get_backend(key[0], cache_root=cache.root)
            return self._backend[key]

    # ---- engines

    def engines_changed(self) -> None:
        """Engines were built or deleted: reload on next use, refresh the SD-UNet list."""
        with self._lock:
            self._generation += 1
            self.release()
        if not host.is_forge():
            try:
                host.module("sd_unet").list_unets()
            except Exception as exc:  # the list refreshes at the next start then
                log.debug("could not refresh the SD-UNet list: %s", exc)

    def release(self) -> None:
        """Close every loaded engine (a deactivated SD-UNet, a changed engine set)."""
        with self._lock:
            for engines in self.loaded():
                engines.close()
            self._engines.clear()

    def loaded(self) -> list[LdmEngines]:
        """The engines loaded now, one entry per weights id (the running job's counters are on them)."""
        with self._lock:
            return [e for e in self._engines.values() if e is not None]

    def engines_for(self, wid: str) -> LdmEngines | None:
        """Usable engines of weights id ``wid`` on the runtime backend, or None."""
        from sd_accel.runtime import engines_for

        backend = self.backend()
        cache = self.cache()
        key = (wid, backend.name, str(cache.root), self._generation)
        with self._lock:
            if key not in self._engines:
                found = engines_for(cache, backend, wid, COMPONENT, fallback=self.fallback(),
                                    on_refused=lambda why: self.say_once(f"not loading engine {why}"))
                self._engines[key] = LdmEngines(wid, found) if found.handles else None
            engines = self._engines[key]
            if engines is not None:
                engines.set_fallback(self.fallback())  # the settings page may have changed it
            return engines

    def engines_or_reason(self, wid: str | None) -> tuple[LdmEngines | None, str | None]:
        """(engines, None), or (None, why not): never raises, for use inside a UNet call."""
        if wid is None:
            return None, "the loaded checkpoint has no hash"
        try:
            return self.engines_for(wid), None
        except Exception as exc:  # an unusable backend, an unreadable engine folder ...
            reason = f"engines cannot be loaded: {type(exc).__name__}: {exc}"
            self.say_once(reason)
            return None, reason

    def checkpoints(self) -> list[dict[str, str]]:
        """One entry per checkpoint with usable engines here: hash, model_name, title."""
        try:
            backend = self.backend()
        except Exception:  # no usable backend: no options to offer
            return []
        from sd_accel.runtime import refusal

        info = backend.info()
        out: dict[str, dict[str, str]] = {}
        for record in self.cache().find(component=COMPONENT, backend=backend.name, arch=info.arch):
            if refusal(record, info) is not None:
                continue
            meta = (record.extra or {}).get("webui") or {}
            ckpt = meta.get("hash") or record.key.model.split("+")[0].removeprefix("ckpt-")
            out.setdefault(ckpt, {"hash": ckpt, "model_name": meta.get("model_name") or ckpt,
                                  "title": meta.get("checkpoint") or ckpt})
        return sorted(out.values(), key=lambda c: c["model_name"])

    def records_for_checkpoint(self, ckpt: str) -> list:
        return [r for r in self.cache().find(component=COMPONENT)
                if r.key.model == f"ckpt-{ckpt}" or r.key.model.startswith(f"ckpt-{ckpt}+")]

    # ---- the running job

    def job_started(self) -> None:
        with self._lock:
            self.job = Job()
            for engines in self.loaded():
                engines.reset_stats()

    def wanted_weights(self, model=None) -> str | None:
        """The weights id the job samples with (checkpoint hash + the job's LoRAs)."""
        info = host.checkpoint_info(model)
        ckpt = checkpoint_hash(info)
        if ckpt is None:
            return None
        return weights_id(ckpt, self.job.loras or ())

    def job_finished(self) -> str | None:
        """Print (and return) the job's one-line report, when any UNet call went through us."""
        stats = [e.stats for e in self.loaded()]
        engine_calls = sum(s.engine_calls for s in stats)
        torch_calls = sum(s.torch_calls for s in stats)
        if not engine_calls and not torch_calls and not self.job.notes:
            return None
        reasons: dict[str, int] = {}
        for s in stats:
            for why, n in s.fallbacks.items():
                reasons[why] = reasons.get(why, 0) + n
        line = f"sd-accel: UNet calls this job: {engine_calls} on engines, {torch_calls} in PyTorch"
        if reasons:
            line += " (" + "; ".join(f"{n}x {why}" for why, n in reasons.items()) + ")"
        for note in self.job.notes:
            line += f"\nsd-accel: {note}"
        print(line)
        return line

    def note(self, text: str) -> None:
        """A fact about this job for the console, printed once (now and in the job's report)."""
        if text not in self.job.notes:
            self.job.notes.append(text)
            log.warning("sd-accel: %s", text)

    def say_once(self, text: str) -> None:
        """A warning printed once per process (engines of another GPU, for instance)."""
        if text not in self._said:
            self._said.add(text)
            log.warning("sd-accel: %s", text)

    def describe_job(self) -> str:
        return describe(self.job.loras or ())


_CONTROLLER: Controller | None = None


def controller() -> Controller:
    """The process's controller (created on first use)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        _CONTROLLER = Controller()
    return _CONTROLLER
