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

from sd_accel.components.ldm_control_unet import COMPONENT as CONTROL
from sd_accel.components.ldm_unet import COMPONENT
from sd_accel.profiles import PRESETS, default_preset
from sd_accel.webui import host
from sd_accel.webui.identity import LoraSet, checkpoint_hash, describe, weights_id
from sd_accel.webui.runner import LdmEngines

TRANSFORMER = "transformer"  # Forge's FLUX.1 / SD3.5 (sd_accel.webui.forge_transformer)

log = logging.getLogger("sd_accel")

# Settings page keys (registered by sd_accel.webui.settings).
OPT_ENGINE_DIR = "sd_accel_engine_dir"
OPT_FALLBACK = "sd_accel_fallback"
OPT_PRESET = "sd_accel_default_preset"
OPT_BACKEND = "sd_accel_backend"
OPT_FORGE = "sd_accel_forge_enabled"
OPT_VAE_CLIP = "sd_accel_vae_clip_enabled"
OPT_LORA_REFITS = "sd_accel_lora_refits"

def webui_backend(name: str, cache_root=None):
    """The runtime backend for ``name`` in the WebUI: ``auto`` on a WebUI that computes on the
    CPU (``--use-cpu all``, Forge's ``--always-cpu``, a CPU torch) takes the registry's CPU order
    (OpenVINO, then ONNX Runtime), even on a machine with a GPU; any other name as
    :func:`sd_accel.backends.registry.get_backend` (which raises with the reason when unusable)."""
    from sd_accel.backends.registry import get_backend

    device = "cpu" if name in (None, "", "auto") and host.runs_on_cpu() else None
    # (the compiled backend runs a diffusers pipeline's own modules: not the WebUI's UNet)
    return get_backend(name or "auto", cache_root=cache_root, device=device, live_modules=False)


AUTO_PRESET = "auto (by model family)"


@dataclass
class Job:
    """What the running job wants and what it got; reset by :meth:`Controller.job_started`."""

    loras: LoraSet | None = None  # None: not known (no script hook saw the job)
    te_loras: LoraSet | None = None  # the same LoRAs with their text-encoder strengths
    torch_only: str | None = None  # why the whole job runs in PyTorch (hypernetworks ...)
    notes: list[str] = field(default_factory=list)
    used: set = field(default_factory=set)  # weights ids whose engines served this job
    lora_line: Any = None  # () -> which LoRAs the UNet's engine carries (a refit), for the report
    parked: Any = None  # Forge: the torch UNet whose weights this job parked (released at its end)
    denoiser: str = COMPONENT  # the component the job's line leads with (Forge's FLUX.1 / SD3.5: "transformer")
    denoiser_label: str | None = None  # its name in the line, where not the component's ("FLUX.1 transformer")


class Controller:
    """Settings, engines per weights id, and the running job."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._engines: dict[tuple, Any] = {}  # (weights id, component, ...) -> engines or None
        self._generation = 0
        self._backend: dict[tuple, Any] = {}
        self._said: set[str] = set()
        self.job = Job()
        from sd_accel.webui.lora import LoraRefits

        self.refits = LoraRefits()

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

    def vae_clip_enabled(self) -> bool:
        return bool(host.opt(OPT_VAE_CLIP, True))

    def lora_refits_kept(self) -> int:
        """LoRA sets kept refitted per checkpoint (0: no refits; a LoRA set needs its own engine)."""
        from sd_accel.webui.lora import DEFAULT_KEPT

        try:
            return max(0, int(host.opt(OPT_LORA_REFITS, DEFAULT_KEPT)))
        except (TypeError, ValueError):
            return DEFAULT_KEPT

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
        cache = self.cache()
        key = (self.backend_name(), str(cache.root))
        with self._lock:
            if key not in self._backend:
                self._backend[key] = webui_backend(key[0], cache_root=cache.root)
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
            self.refits.close()

    def loaded(self, component: str | None = COMPONENT) -> list:
        """The engines loaded now, one entry per weights id (the running job's counters are on
        them): the UNet's (:class:`LdmEngines`) by default, another component's, or all (None)."""
        with self._lock:
            found = [e for k, e in self._engines.items() if e is not None and component in (None, k[1])]
            if component in (None, COMPONENT, CONTROL, TRANSFORMER):
                found.extend(self.refits.engines(component))
            return found

    def engines_for(self, wid: str, component: str = COMPONENT):
        """Usable engines of weights id ``wid`` for ``component`` on the runtime backend, or None.

        The UNet's (and the residual-taking UNet's) come as :class:`LdmEngines` (batch chunks, the fallback setting); the VAE's and
        the text encoder's as the runtime's ``ComponentEngines``, always falling back to PyTorch.
        """
        from sd_accel.runtime import engines_for

        backend = self.backend()
        cache = self.cache()
        key = (wid, component, backend.name, str(cache.root), self._generation)
        unet = component in (COMPONENT, CONTROL)
        denoiser = unet or component == TRANSFORMER  # the fallback setting is for the denoiser's calls
        with self._lock:
            if key not in self._engines:
                found = engines_for(cache, backend, wid, component, fallback=self.fallback() if denoiser else True,
                                    on_refused=lambda why: self.say_once(f"not loading engine {why}"))
                # backend "auto": the engines of another backend that runs here beat PyTorch (a
                # build with "backend": "onnxruntime" while the setting says auto).
                for other in self.other_backends(backend) if not found.handles else ():
                    found = engines_for(cache, other, wid, component, fallback=self.fallback() if denoiser else True,
                                        on_refused=lambda why: self.say_once(f"not loading engine {why}"))
                    if found.handles:
                        self.say_once(f"{wid} {component}: using its {other.name} engines (backend auto; "
                                      f"{backend.name}, its first choice here, has none for these weights)")
                        break
                if not found.handles:
                    self._engines[key] = None
                else:
                    self._engines[key] = LdmEngines(wid, found) if unet else found
            engines = self._engines[key]
            if engines is not None and denoiser:
                engines.set_fallback(self.fallback())  # the settings page may have changed it
            if engines is None and component == COMPONENT:
                why = self.other_backend_note(wid, component)
                if why:
                    self.note(why)  # in the job's report, every job it happens in
            return engines

    def other_backends(self, first) -> list:
        """With the backend setting at auto: the other backends that run here, in auto's order
        (their engines serve when ``first`` has none); a pinned backend: none."""
        if self.backend_name() != "auto":
            return []
        from sd_accel.backends.registry import auto_order

        cache = self.cache()
        out = []
        for name in auto_order("cpu" if host.runs_on_cpu() else None, live_modules=False):
            if name == first.name:
                continue
            key = (name, str(cache.root))
            with self._lock:
                if key not in self._backend:
                    try:
                        self._backend[key] = webui_backend(name, cache_root=cache.root)
                    except Exception:  # cannot run here: remembered as such
                        self._backend[key] = None
                if self._backend[key] is not None:
                    out.append(self._backend[key])
        return out

    def other_backend_note(self, wid: str, component: str = COMPONENT) -> str | None:
        """When the backend is pinned and ``wid``'s engines are all of other backends: what to do."""
        if self.backend_name() == "auto":
            return None
        pinned = self.backend_name()
        others = sorted({r.key.backend for r in self.cache().find(component=component)
                         if r.key.model == wid and r.key.backend != pinned})
        if not others:
            return None
        return (f"the engines of these weights are {' and '.join(others)} engines, but the backend setting is "
                f"{pinned}: they are not used. Set the backend (Settings > sd-accel) to auto or {others[0]}, "
                f"or build for {pinned}")

    def lora_engines(self, ckpt: str, loras, unet, merge=None, component: str = COMPONENT) -> tuple[Any, str | None]:
        """The checkpoint's UNet engines refitted to carry ``loras`` (:mod:`sd_accel.webui.lora`),
        or (None, why not); (None, None) when the checkpoint has no engine at all. ``unet``: the
        torch UNet, whose weights carry the LoRAs once ``merge()`` (None: already) returns None.
        ``component``: ``ldm_unet_control`` refits the residual-taking engines instead.
        Never raises (it runs inside a UNet call); a failed refit is not tried again for the set."""
        from sd_accel.refit import needs_rebuild
        from sd_accel.webui.lora import lora_text, refit_for

        if not loras:
            return None, None
        keep = self.lora_refits_kept()
        if keep <= 0:
            return None, f"refits are off (settings: {OPT_LORA_REFITS} = 0)"
        base, reason = self.engines_or_reason(f"ckpt-{ckpt}", component)
        if base is None:
            return None, reason
        usable = [h for h in base.handles if h.broken is None]
        refused = [why for why in map(needs_rebuild, usable) if why]
        if len(refused) == len(usable):  # INT8 only: its weights were quantized with calibrated scales
            return None, "; ".join(refused) or "the checkpoint's engines are set aside"
        with self._lock:
            where = (ckpt, self.backend_name(), str(self.cache().root), self._generation)
            if component != COMPONENT:
                where = (*where, component)  # (LoraRefits.engines tells them apart by it)
            spec = None
            if component == TRANSFORMER:  # Forge's FLUX.1 / SD3.5: refitted from its weights, converted as built
                from sd_accel.webui.forge_transformer import transformer_refit_for as refit_for
            elif component == CONTROL:
                from sd_accel.components.ldm_control_unet import LdmControlUNetSpec

                spec = LdmControlUNetSpec(unet)
            refit = self.refits.get(where, loras)
            made_now = refit is None
            if refit is None:
                failed = self.refits.failed(where, loras)
                if failed:
                    return None, failed
                why = merge() if merge is not None else None
                if why:  # not remembered: a LoRA file added, a set merged later, may change it
                    return None, why
                from sd_accel.webui.console import say

                which = {COMPONENT: "engine", TRANSFORMER: "transformer engine"}.get(component,
                                                                                         "residual-taking engine")
                say(f"refitting the {which} of {ckpt} for {lora_text(loras)} at its first call (LoRAs on the "
                    "engine without a rebuild; the base engine stays as it is)")
                for why in refused:  # the others carry the LoRAs; these are left out
                    say(f"not refitting {why}")
                self.refits.make_room(where, keep)  # the set that gives way leaves memory first
                self.release_idle(ckpt, component, keep)  # and the other kind's idle engines
                if component == TRANSFORMER:  # the base engine serves no call of a LoRA job: it leaves
                    base.close()  # memory before the refit (a job without LoRA loads it again, seconds)
                try:
                    refit = refit_for(base, loras, ckpt, unet, spec, merge)
                except Exception as exc:  # never stop the image: PyTorch, and say why once
                    why = f"the refit for {lora_text(loras)} failed: {type(exc).__name__}: {exc}"
                    self.refits.fail(where, loras, why)
                    log.warning("sd-accel: %s", why)
                    return None, why
                self.refits.add(where, refit, keep)
            else:
                refit.bind(unet, spec, merge)  # a profile first called in this job refits from this UNet
            refit.engines.set_fallback(self.fallback())
            # the job's line names the engine that carries the LoRAs: the residual-taking one's
            # too (a job whose calls all had ControlNet residuals refits only that one)
            if self.job.lora_line is None or made_now:
                self.job.lora_line = lambda: refit.line(made_now)
            return refit.engines, None

    def release_idle(self, ckpt: str, serving: str, keep: int) -> None:
        """Before a LoRA refit of ``serving``'s engines (``ldm_unet`` or ``ldm_unet_control``) of
        checkpoint ``ckpt`` is made, when the checkpoint already holds ``keep`` refitted sets
        (the setting counts both kinds together): the other kind's refits that made no engine call
        in this job are dropped (refitted again when their set comes back), and its base engines'
        loaded runners close (a later call loads them again from the cache, seconds). In a real
        Forge (SD 1.5, CPU, bf16) the first ControlNet job with a LoRA refitted the residual-taking
        engine while the plain UNet's refit of the same LoRA, which serves no ControlNet call, stayed
        loaded: 1.7 GiB more at the job's peak, above Forge's own PyTorch. What served this job
        stays (a ControlNet that starts or stops at a step: both kinds in one job), so a job never
        refits the same engine twice."""
        other = CONTROL if serving == COMPONENT else COMPONENT
        with self._lock:
            if self.refits.count(ckpt) < max(1, keep):
                return
            for loras in self.refits.drop_idle(ckpt, other):
                log.info("sd-accel: dropped the %s refit for %s (no call this job) before refitting the %s engines",
                         other, loras, serving)
        self.close_idle_bases(ckpt, serving)

    def close_idle_bases(self, ckpt: str, serving: str) -> None:
        """Before ``serving``'s engines (``ldm_unet`` or ``ldm_unet_control``) of checkpoint
        ``ckpt`` first serve in a sampling pass (Forge) or are refitted: close the loaded runners
        of the other kind's base engines that made no engine call in this job (a later call loads
        them again from the cache: seconds, no refit). In a real Forge a ControlNet job after a
        plain one otherwise held both base UNet engines (1.7 GiB each in bf16); with this its peak
        was 9.16 GiB against Forge's own PyTorch's 10.22."""
        other = CONTROL if serving == COMPONENT else COMPONENT
        with self._lock:
            for key, engines in self._engines.items():
                mine = key[0] == f"ckpt-{ckpt}" or key[0].startswith(f"ckpt-{ckpt}+")
                if engines is None or key[1] != other or not mine or engines.stats.engine_calls:
                    continue
                if any(h.runner is not None for h in engines.handles):
                    engines.close()
                    log.info("sd-accel: closed the %s engines of %s (no call this job) before the %s ones",
                             other, key[0], serving)

    def engines_or_reason(self, wid: str | None, component: str = COMPONENT) -> tuple[Any, str | None]:
        """(engines, None), or (None, why not): never raises, for use inside a model call."""
        if wid is None:
            return None, "the loaded checkpoint has no hash"
        try:
            return self.engines_for(wid, component), None
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

        out: dict[str, dict[str, str]] = {}
        for runner in (backend, *self.other_backends(backend)):
            info = runner.info()
            for record in self.cache().find(component=COMPONENT, backend=runner.name, arch=info.arch):
                if refusal(record, info) is not None:
                    continue
                meta = (record.extra or {}).get("webui") or {}
                ckpt = meta.get("hash") or record.key.model.split("+")[0].removeprefix("ckpt-")
                out.setdefault(ckpt, {"hash": ckpt, "model_name": meta.get("model_name") or ckpt,
                                      "title": meta.get("checkpoint") or ckpt})
        return sorted(out.values(), key=lambda c: c["model_name"])

    def records_for_checkpoint(self, ckpt: str, component: str | None = COMPONENT) -> list:
        """Engines built from checkpoint ``ckpt`` (any LoRA set): the UNet's, another component's,
        or all of them (None)."""
        return [r for r in self.cache().find(component=component)
                if r.key.model == f"ckpt-{ckpt}" or r.key.model.startswith(f"ckpt-{ckpt}+")]

    # ---- the running job

    def job_started(self) -> None:
        with self._lock:
            self.job = Job()
            for engines in self.loaded(None):
                engines.reset_stats()

    def weights_for(self, component: str, model=None, for_call: bool = True) -> str | None:
        """The weights id the VAE halves or the text encoder compute with right now; None also
        when engines for them are switched off (``for_call``: a call asks, not a build)."""
        from sd_accel.components.ldm_clip import COMPONENT as CLIP
        from sd_accel.webui.identity import clip_id, vae_id

        if for_call and not self.vae_clip_enabled():
            return None
        model = model if model is not None else host.loaded_model()
        if model is None:
            return None
        ckpt = checkpoint_hash(host.checkpoint_info(model))
        if ckpt is None:
            return None
        if component == CLIP:
            return clip_id(ckpt, self._text_loras(model), host.additional_modules())
        return vae_id(ckpt, host.loaded_vae_hash(), host.additional_modules())

    def wanted_weights(self, model=None) -> str | None:
        """The weights id the job samples with (checkpoint hash + the job's LoRAs)."""
        info = host.checkpoint_info(model)
        ckpt = checkpoint_hash(info)
        if ckpt is None:
            return None
        return weights_id(ckpt, self.job.loras or ())

    def _text_loras(self, model) -> LoraSet:
        """The LoRAs in the text encoder's weights now: Forge's CLIP patcher carries them (as its
        UNet patcher does for the UNet); on A1111 the job's tags say (text-encoder strengths)."""
        from sd_accel.webui.identity import forge_loras

        clip = getattr(getattr(model, "forge_objects", None), "clip", None)
        patcher = getattr(clip, "patcher", None)
        if patcher is not None:
            return forge_loras(patcher)
        return self.job.te_loras or ()

    def job_finished(self) -> str | None:
        """Print (and return) the job's report, when any call went through us: the UNet's line,
        then one per other component with engines (VAE decoder, text encoder ...)."""
        from sd_accel.webui.console import say
        from sd_accel.webui.stand_ins import LABELS

        try:
            # Pinned to a backend the checkpoint has no engines of, the SD-UNet list offers none
            # and no call comes through us: the report is where the user learns why.
            wid = self.wanted_weights()
            why = self.other_backend_note(wid) if wid else None
        except Exception:  # no checkpoint info, an unreadable cache: nothing to add
            why = None
        if why:
            self.note(why)
        lines = []
        lead = self.job.denoiser
        for component in (lead, *[c for c in LABELS if c != lead]):
            stats = [e.stats for e in self.loaded(component)]
            engine_calls = sum(s.engine_calls for s in stats)
            torch_calls = sum(s.torch_calls for s in stats)
            if not engine_calls and not torch_calls and not (component == lead and self.job.notes):
                continue
            reasons: dict[str, int] = {}
            for s in stats:
                for why, n in s.fallbacks.items():
                    reasons[why] = reasons.get(why, 0) + n
            label = self.job.denoiser_label if component == lead and self.job.denoiser_label else LABELS[component]
            line = f"sd-accel: {label} calls this job: {engine_calls} on engines, {torch_calls} in PyTorch"
            if reasons:
                line += " (" + "; ".join(f"{n}x {why}" for why, n in reasons.items()) + ")"
            lines.append(line)
        if not lines:
            return None
        if self.job.lora_line:
            lora = self.job.lora_line() if callable(self.job.lora_line) else self.job.lora_line
            lines.insert(1 if lines else 0, f"sd-accel: {lora}")
        lines.extend(f"sd-accel: {note}" for note in self.job.notes)
        text = "\n".join(lines)
        say(text)
        return text

    def note(self, text: str) -> None:
        """A fact about this job for the console, printed once (now and in the job's report)."""
        if text not in self.job.notes:
            self.job.notes.append(text)
            log.warning("%s", text)

    def say_once(self, text: str) -> None:
        """A warning printed once per process (engines of another GPU, for instance)."""
        if text not in self._said:
            self._said.add(text)
            log.warning("%s", text)

    def describe_job(self) -> str:
        return describe(self.job.loras or ())


_CONTROLLER: Controller | None = None


def controller() -> Controller:
    """The process's controller (created on first use)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        _CONTROLLER = Controller()
    return _CONTROLLER
