"""What the Gradio panel does, without Gradio: loaded pipelines, builds with cancel, engine rows.

Kept apart from :mod:`sd_accel.ui.panel` so that it is tested without a browser, and so that
the panel stays a thin layout. Everything here calls the api layer (``load_pipeline``,
``accelerate``, ``build_engines``, ``EngineCache``, ``stats``, ``generate``).

(Skipped in the test suite: it builds engines into /tmp/engines; tests/test_ui.py runs the same
steps in a temporary folder.)

>>> state = PanelState(engine_dir="/tmp/engines")                                    # doctest: +SKIP
>>> for update in state.build(BuildRequest(profile=profile_from_fields("1", "64", "64", "77"))):
...     print(update.text)                                                               # doctest: +SKIP
>>> engine_rows(state.cache())                                                       # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sd_accel.config import BACKENDS, ENGINE_PRECISIONS, PRECISION
from sd_accel.core import COMPONENTS, DEFAULT_COMPONENTS, Busy, InvalidValue
from sd_accel.generate import GenerationParams
from sd_accel.preview import PREVIEW_MODES, Preview
from sd_accel.profiles import PRESETS, Profile, format_range, parse_range

log = logging.getLogger("sd_accel")

DEFAULT_MODEL = "builtin:tiny-sd15"
COMPONENT_CHOICES = COMPONENTS  # the one vocabulary (core.py), with its defaults
# what build_engines takes; a backend that cannot build one says so in the panel's status line
BUILD_PRECISIONS = ("auto", *ENGINE_PRECISIONS)
# The Generate tab's engine choices -> AccelConfig.engines: build on first use, cached only, off.
ENGINE_MODES = {"auto": "auto", "cached": True, "off": False}
ENGINE_HEADERS = ["component", "profile", "precision", "backend", "size", "rel_l2", "status", "last used",
                  "model", "name"]
_POLL_S = 0.25  # how often a waiting build generator wakes to yield (keeps the page live)
TINY_VAE_HINT = ("Give the path of a taesd_decoder.safetensors (taesdxl_decoder.safetensors for SDXL) or of a "
                 "diffusers TAESD folder, or empty the field to decode with the model's own VAE.")


# --------------------------------------------------------------------------- the tiny VAE field


def tiny_vae_choice(path: str | None) -> str | None:
    """``AccelConfig.vae`` for the panel's Tiny VAE (TAESD) field: None when it is empty.

    Quotes around the path go (Windows' "Copy as path" adds them).

    >>> tiny_vae_choice("  "), tiny_vae_choice('"/m/taesd_decoder.safetensors"')
    (None, 'tiny:/m/taesd_decoder.safetensors')
    """
    text = (path or "").strip().strip('"').strip("'").strip()
    return f"tiny:{text}" if text else None


def check_tiny_vae(path: str | None) -> None:
    """:class:`InvalidValue` saying what was wrong and what to do, unless ``path`` loads as a tiny
    autoencoder. Run before a pipeline is loaded for it: the panel's pipeline cache drops the last
    pipeline first, and a bad path must cost nothing."""
    from sd_accel.api import load_tiny_vae

    choice = tiny_vae_choice(path)
    if choice is None:
        return
    try:
        load_tiny_vae(choice[len("tiny:"):])
    except Exception as exc:  # whatever the file is, the field is what the user has to change
        raise InvalidValue(f"The Tiny VAE (TAESD) field: {exc}. {TINY_VAE_HINT}") from exc


# --------------------------------------------------------------------------- profiles from fields


def profile_from_fields(batch: str, height: str, width: str, tokens: str) -> Profile:
    """A :class:`Profile` from the panel's four range boxes, each in the one range grammar
    (:func:`sd_accel.profiles.parse_range`: ``512``, ``512-768`` or ``256-512-768``); Profile
    validates the values."""
    return Profile(
        batch=parse_range("batch", batch),
        height=parse_range("height", height),
        width=parse_range("width", width),
        tokens=parse_range("tokens", tokens),
    )


def preset_fields(name: str) -> tuple[str, str, str, str]:
    """The four range boxes for a preset: batch, height, width, tokens."""
    p = PRESETS[name]
    return format_range(p.batch), format_range(p.height), format_range(p.width), format_range(p.tokens)


# --------------------------------------------------------------------------- engine table


def engine_rows(cache) -> list[list[str]]:
    """One row per engine in ``cache`` (an :class:`EngineCache`), columns :data:`ENGINE_HEADERS`;
    then one per intermediate kept beside them (ONNX export, calibration data), which the disk
    line counts too."""
    from sd_accel.units import format_size

    rows = []
    records = cache.list()
    for r in records:
        rel = (r.validation or {}).get("rel_l2")
        status = r.status if r.status == "ok" else f"{r.status}: {r.bad_reason or ''}".strip()
        rows.append([
            r.key.component,
            r.key.profile,
            r.key.precision,
            f"{r.key.backend} {r.key.backend_version}",
            format_size(r.size_bytes),
            "-" if rel is None else f"{rel:.2e}",
            status,
            time.strftime("%Y-%m-%d %H:%M", time.localtime(r.last_used)) if r.last_used else "never",
            r.key.model[:12],
            r.name,
        ])
    for i in cache.intermediates():
        rows.append([i.component or "-", "-", "-", i.label, format_size(i.size_bytes), "-", i.status, "-",
                     i.weights[:12] or "-", i.name])
    return rows


def engine_names(cache) -> list[str]:
    """Engine names for the Delete / Rebuild picker."""
    return [r.name for r in cache.list()]


CUSTOM_PRESET = "custom"  # the Preset picker's value once the ranges are edited by hand


def disk_usage(cache) -> str:
    """One line: how many engines, how much disk with the intermediates kept beside them, where."""
    return f"{cache.disk_usage().describe()} on disk in `{cache.root}`"


# --------------------------------------------------------------------------- requests and results


@dataclass
class BuildRequest:
    """What the Build button asks for; ``backend``/``precision`` None means the Settings default."""

    profile: Profile
    model: str = DEFAULT_MODEL
    components: tuple[str, ...] = DEFAULT_COMPONENTS
    backend: str | None = None
    precision: str | None = None
    vae: str | None = None  # the Tiny VAE (TAESD) field: its vae_decoder / vae_encoder are built; None: the model's


@dataclass
class BuildUpdate:
    """One progress report for the panel: text to show, overall fraction, and how it ended."""

    text: str
    fraction: float
    done: bool = False
    ok: bool = True
    records: list = field(default_factory=list)


# The names of sd_accel.models.hints.PREPROCESSORS (tests/test_ui.py keeps them in step): the panel is
# built in the WebUIs' Gradio 3.41 environments, whose numpy cannot import onnx (which the api does).
CONTROL_PREPROCESSORS = ("none", "canny")


@dataclass
class ControlUnit:
    """One ControlNet unit of the Generate tab: a ControlNet (a ``.safetensors`` file of the
    original layout or a diffusers folder), its hint image (a PIL image or a path), made from the
    image by ``preprocess`` (``none``: the image is the hint; ``canny``: built in), its weight and
    the part of the steps it acts in (``start``..``end``, fractions as the WebUI's "Guidance")."""

    model: str
    image: Any
    scale: float = 1.0
    preprocess: str = "none"
    start: float = 0.0
    end: float = 1.0

    def describe(self) -> str:
        """``cn.safetensors`` (canny, weight 0.8, steps 0-0.5): for the report."""
        from pathlib import Path

        return (f"`{Path(str(self.model)).name}` ({self.preprocess}, weight {float(self.scale):g}, "
                f"steps {float(self.start):g}-{float(self.end):g})")

    def check(self, index: int) -> None:
        """InvalidValue naming the unit and the field, before anything is loaded."""
        name = f"ControlNet unit {index + 1}"
        if not str(self.model or "").strip():
            raise InvalidValue(f"{name} has a control image but no ControlNet: give its file or folder, or clear the "
                               "image")
        if self.image is None:
            raise InvalidValue(f"{name} ({self.model}) has no control image: upload one (or clear the ControlNet)")
        if self.preprocess not in CONTROL_PREPROCESSORS:
            raise InvalidValue(f"{name}: preprocessor {self.preprocess!r} is not one of {', '.join(CONTROL_PREPROCESSORS)}")
        for label, value, lo, hi in (("weight", self.scale, 0.0, 2.0), ("start", self.start, 0.0, 1.0),
                                     ("end", self.end, 0.0, 1.0)):
            if not isinstance(value, int | float) or not lo <= float(value) <= hi:
                raise InvalidValue(f"{name}: {label} {value!r} must be a number from {lo:g} to {hi:g}")
        if float(self.start) >= float(self.end):
            raise InvalidValue(f"{name}: start {self.start:g} must be below end {self.end:g}")


def control_arguments(units: tuple[ControlUnit, ...]) -> dict[str, Any]:
    """The ControlNet pipeline's call arguments for ``units`` (one net: plain values, several: lists)."""
    from PIL import Image

    from sd_accel.api import control_arguments, control_hint

    hints = [control_hint(u.image if isinstance(u.image, Image.Image) else Image.open(u.image), u.preprocess)
             for u in units]
    return control_arguments(hints, [float(u.scale) for u in units], [float(u.start) for u in units],
                             [float(u.end) for u in units])


@dataclass
class GenerateRequest:
    """What the Generate button asks for; ``sampler`` None keeps the model's scheduler.

    The generation numbers are checked by :meth:`params` (GenerationParams), the rest by
    ``AccelConfig``; :meth:`PanelState.generate` does both before it loads anything.
    """

    prompt: str
    negative_prompt: str = ""
    model: str = DEFAULT_MODEL
    sampler: str | None = None
    steps: int = 20
    cfg: float = 7.0
    width: int = 512
    height: int = 512
    batch: int = 1
    seed: int = 0
    attention: str = "auto"
    precision: str | None = None
    offload: str = "none"
    engines: bool | str = True  # True / "cached", "auto", False / "off" (see ENGINE_MODES)
    tiny_vae: str | None = None  # a TAESD path (see tiny_vae_choice); None or "": the model's own VAE
    preview: str = "auto"  # live previews of generate_stream: one of PREVIEW_MODES
    controlnets: tuple[ControlUnit, ...] = ()  # the ControlNet units in use (empty ones left out)

    def params(self) -> GenerationParams:
        """The request as a :class:`~sd_accel.generate.GenerationParams`, which checks every value.

        Widgets give whole numbers as floats (``20.0``); those become ints, anything else is
        left for GenerationParams to refuse with its message (``steps=2.5``, ``cfg=nan``, ...).
        """
        return GenerationParams(
            prompt=self.prompt, negative_prompt=self.negative_prompt or None, steps=_whole(self.steps),
            cfg=self.cfg, width=_whole(self.width), height=_whole(self.height), batch=_whole(self.batch),
            seed=_whole(self.seed), sampler=self.sampler or None,
        )


def engines_setting(value: bool | str) -> bool | str:
    """``AccelConfig.engines`` for a request's ``engines``: a bool or one of :data:`ENGINE_MODES`.

    >>> engines_setting("cached"), engines_setting("auto"), engines_setting(False)
    (True, 'auto', False)
    """
    if isinstance(value, bool):
        return value
    if value not in ENGINE_MODES:
        raise InvalidValue(f"engines {value!r} is not one of {', '.join(ENGINE_MODES)}")
    return ENGINE_MODES[value]


def _whole(value: Any) -> Any:
    """``20.0`` -> 20; any other value unchanged (GenerationParams judges it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


@dataclass
class GenerateOutcome:
    """Images, timings and where each component ran (``usage``: component -> text)."""

    images: list
    seconds: float
    it_per_s: float
    steps: int
    unet_calls: int
    usage: dict[str, str]
    summary: dict[str, Any]
    seed: int = 0  # the seed used (a drawn one when the request said -1)
    vae: str | None = None  # AccelConfig.vae of the run ("tiny:PATH"), None: the model's own
    controlnets: tuple[str, ...] = ()  # one line per ControlNet unit used

    def report(self) -> str:
        """Markdown for the panel: time, it/s, then one row per component, "engine" or "torch"."""
        head = (f"**{self.seconds:.2f} s**, {self.it_per_s:.2f} it/s, {self.steps} steps, "
                f"{self.unet_calls} UNet calls, {len(self.images)} image(s), seed {self.seed}")
        if self.vae:
            head += f"\n\nDecoded with the tiny VAE (TAESD) `{self.vae[len('tiny:'):]}`"
        for line in self.controlnets:
            head += f"\n\nControlNet {line}"
        rows = "\n".join(f"| {c} | {u} |" for c, u in self.usage.items())
        return f"{head}\n\n| component | ran on |\n|---|---|\n{rows}"


def _calls(n: int) -> str:
    return f"{n} call{'s' if n != 1 else ''}"


def usage_text(before: dict[str, dict], after: dict[str, dict], engines_found: dict[str, int],
               engines_on: bool) -> dict[str, str]:
    """Per component, where this run's calls went: ``engine (2 calls)``, ``torch (...)``.

    ``before``/``after`` are ``stats(pipe)`` around the run (counters accumulate over runs, so
    the difference is this run's). A component without a stand-in module ran torch.
    """
    from sd_accel.api import SHARED_COMPONENTS

    if not engines_on:
        return {"all": "torch (engines off)"}
    out: dict[str, str] = {}
    for comp in sorted(set(engines_found) | set(after)):
        if comp in SHARED_COMPONENTS and comp not in after:
            continue  # the WebUI's / ComfyUI's engines of the checkpoint: their calls count as unet's, clip's ...
        now, old = after.get(comp), before.get(comp, {})
        if now is None:
            out[comp] = "torch (no engine for this model; build one in the Engines tab)"
            continue
        eng = now["engine_calls"] - old.get("engine_calls", 0)
        tor = now["torch_calls"] - old.get("torch_calls", 0)
        reasons = {k: v - old.get("fallbacks", {}).get(k, 0) for k, v in now["fallbacks"].items()}
        why = "; ".join(k for k, v in reasons.items() if v > 0)
        built = len(now.get("builds", ())) - len(old.get("builds", ()))
        if eng == 0 and tor == 0:
            out[comp] = "not called"
        elif tor == 0:
            out[comp] = f"engine ({_calls(eng)})"
        elif eng == 0:
            out[comp] = f"torch ({_calls(tor)}: {why})"
        else:
            out[comp] = f"engine ({_calls(eng)}) + torch ({_calls(tor)}: {why})"
        if built > 0:
            out[comp] += f", {built} engine{'s' if built != 1 else ''} built first"
    return out


# --------------------------------------------------------------------------- the state


def _config_key(config) -> str | None:
    # AccelConfig is a mutable dataclass (unhashable): its JSON is the cache key.
    return None if config is None else json.dumps(config.to_dict(), sort_keys=True)


@dataclass
class PanelState:
    """Settings plus what the panel keeps between clicks. One per app (shared by its users).

    ``max_pipelines`` bounds the loaded-pipeline cache: a real SD model is GBs, so by default
    only the last (model, config) stays loaded. ``_lock`` lets one build or generation run at a
    time in this process, whatever queue settings the host app (the WebUI) uses.
    """

    engine_dir: str | None = None
    backend: str = "auto"
    precision: str = "auto"
    model: str = DEFAULT_MODEL
    max_pipelines: int = 1
    # What the panel shows; a host (the WebUI tab) narrows it to what it builds and runs.
    show_generate: bool = field(default=True, init=False, repr=False)
    show_model: bool = field(default=True, init=False, repr=False)
    component_choices: tuple[str, ...] = field(default=COMPONENT_CHOICES, init=False, repr=False)
    default_components: tuple[str, ...] = field(default=DEFAULT_COMPONENTS, init=False, repr=False)
    components_label: str = field(default="Components (those the model lacks are skipped)", init=False,
                                  repr=False)
    _pipes: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _cancel: threading.Event | None = field(default=None, init=False, repr=False)
    _engines_version: int = field(default=0, init=False, repr=False)

    # ---- settings

    def cache(self):
        """The :class:`EngineCache` at the configured engine directory."""
        from sd_accel import EngineCache

        return EngineCache(self.engine_dir or None)

    def engine_rows(self) -> list[list[str]]:
        """The engine table's rows (:func:`engine_rows`); a host may show its own ids."""
        return engine_rows(self.cache())

    def disk_usage(self) -> str:
        """The disk line under the engine table (:func:`disk_usage`)."""
        return disk_usage(self.cache())

    def status(self) -> str | None:
        """A status box over the panel's tabs, recomputed on every page load, refresh, build and
        delete; None (the default): no box."""
        return None

    def apply_settings(self, engine_dir: str | None, backend: str, precision: str) -> str:
        """Validate and keep the Settings tab's values; returns a line for the user."""
        if backend not in BACKENDS:
            raise InvalidValue(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if precision not in PRECISION:
            raise InvalidValue(f"precision {precision!r} is not one of {', '.join(PRECISION)}")
        self.engine_dir = (engine_dir or "").strip() or None
        self.backend, self.precision = backend, precision
        self.engines_changed()  # another engine dir means other engines
        return f"Saved: engines in `{self.cache().root}`, backend {backend}, precision {precision}."

    def build_precision(self, requested: str | None = None) -> str:
        """The precision a build uses: the request, else Settings' when a build can use it, else auto."""
        if requested:
            return requested if requested in BUILD_PRECISIONS else "auto"
        # Settings hold a torch precision; only these mean the same for every engine backend
        return self.precision if self.precision in ("fp32", "fp16") else "auto"

    # ---- pipelines

    def engines_changed(self) -> None:
        """Engines were built or deleted: engine-backed pipelines re-swap before their next run."""
        self._engines_version += 1

    def pipeline(self, model: str, config=None, controlnets: tuple[str, ...] = ()):
        """A loaded pipeline for ``(model, config)``, from the cache when there (LRU, see class doc);
        with ``controlnets`` (paths), the model's ControlNet pipeline with those nets.

        ``config`` None is the plain loaded pipeline (what builds export from). A cached
        engine-backed pipeline is accelerated again when engines changed since, so that it
        picks up new engines and drops deleted ones.
        """
        from sd_accel import accelerate, load_pipeline

        key = (model, _config_key(config), *controlnets)
        entry = self._pipes.get(key)
        if entry is None:
            while len(self._pipes) >= max(1, self.max_pipelines):
                self._pipes.popitem(last=False)  # drop first: two big models may not fit together
            pipe = load_pipeline(model)
            if controlnets:
                from sd_accel import with_controlnets

                pipe = with_controlnets(pipe, list(controlnets))  # (a family mismatch: InvalidValue, shown)
            if config is not None:
                pipe = accelerate(pipe, config)
            entry = self._pipes[key] = [pipe, self._engines_version]
        elif config is not None and config.engines and entry[1] != self._engines_version:
            entry[0] = accelerate(entry[0], config)
            entry[1] = self._engines_version
        self._pipes.move_to_end(key)
        return entry[0]

    # ---- generation

    def generate(self, req: GenerateRequest) -> GenerateOutcome:
        """Run one generation (no previews); raises :class:`Busy` while a build runs."""
        params, config = self._generation_config(req)
        with self._lock:
            return self._generate(req, params, config)

    def generate_stream(self, req: GenerateRequest) -> Iterator[Preview | GenerateOutcome]:
        """Run one generation in a worker thread: yields a :class:`~sd_accel.preview.Preview` every
        few steps (``req.preview``; none when ``off``), then the :class:`GenerateOutcome`.

        The request is checked here, before the first ``next``: a bad value raises at once. An
        error of the run is raised by the iterator. Closing it early (the page went away) makes
        the pipeline skip its remaining steps, so the lock is soon free again.
        """
        params, config = self._generation_config(req)
        return self._stream(req, params, config)

    def _generation_config(self, req: GenerateRequest):
        """(GenerationParams, AccelConfig) of a request, every value checked, nothing loaded yet."""
        from sd_accel import AccelConfig

        params = req.params()  # InvalidValue for a bad number, before any model is loaded
        if req.preview not in PREVIEW_MODES:
            raise InvalidValue(f"preview {req.preview!r} is not one of {', '.join(PREVIEW_MODES)}")
        for i, unit in enumerate(req.controlnets):
            unit.check(i)
        if self.building:
            raise Busy("Engines are being built; generate when the build ends, or cancel it.")
        config = AccelConfig(
            precision=req.precision or self.precision, attention=req.attention, offload=req.offload,
            sampler=params.sampler, engines=engines_setting(req.engines), engine_dir=self.engine_dir,
            backend=self.backend, vae=tiny_vae_choice(req.tiny_vae),
        )
        if config.vae is not None and (req.model, _config_key(config)) not in self._pipes:
            check_tiny_vae(req.tiny_vae)  # before pipeline() drops the last pipeline to make room
        return params, config

    def _generate(self, req: GenerateRequest, params: GenerationParams, config, on_preview=None,
                  stop: threading.Event | None = None) -> GenerateOutcome:
        """The run itself; the caller holds the lock. ``on_preview`` takes each Preview."""
        from sd_accel import stats
        from sd_accel.generate import generate
        from sd_accel.preview import preview_callback, takes_step_callback

        nets = tuple(str(u.model).strip() for u in req.controlnets)
        extra = control_arguments(req.controlnets) if nets else {}  # (a bad image: raised before any load)
        pipe = self.pipeline(req.model, config, nets)
        if on_preview is not None and takes_step_callback(pipe):
            size = (params.width, params.height) if params.width and params.height else None
            extra["callback_on_step_end"] = preview_callback(on_preview, mode=req.preview, steps=params.steps,
                                                             size=size, stop=stop)
        before = stats(pipe)
        result = generate(pipe, params, extra)
        after = stats(pipe)
        found = pipe.sd_accel.engines if config.engines else {}
        return GenerateOutcome(
            images=result.images, seconds=result.seconds, it_per_s=result.it_per_s, steps=result.steps,
            unet_calls=result.unet_calls, usage=usage_text(before, after, found, config.engines is not False),
            summary=pipe.sd_accel.summary(), seed=result.seed, vae=config.vae,
            controlnets=tuple(u.describe() for u in req.controlnets),
        )

    def _stream(self, req: GenerateRequest, params: GenerationParams, config) -> Iterator[Preview | GenerateOutcome]:
        events: queue.Queue = queue.Queue()
        stop = threading.Event()

        def work() -> None:  # owns the lock it was handed and releases it at the end
            try:
                events.put(("done", self._generate(req, params, config, events.put, stop)))
            except BaseException as exc:  # raised again in the caller's thread, where the panel shows it
                events.put(("error", exc))
            finally:
                self._lock.release()

        self._lock.acquire()  # waits for a running generation, as generate() does
        worker = threading.Thread(target=work, name="sd-accel-generate", daemon=True)
        try:
            worker.start()
        except BaseException:
            self._lock.release()
            raise
        try:
            while True:
                try:
                    item = events.get(timeout=_POLL_S)
                except queue.Empty:
                    if not worker.is_alive() and events.empty():  # died without a word (interpreter exit)
                        raise RuntimeError("the generation stopped without a result; see the server log") from None
                    continue
                if isinstance(item, Preview):
                    yield item
                    continue
                kind, payload = item
                if kind == "error":
                    raise payload
                yield payload
                return
        finally:
            if worker.is_alive():
                stop.set()

    # ---- engines

    def delete(self, name: str) -> str:
        """Delete one engine by name; returns a line for the user."""
        name = (name or "").strip()
        if not name:
            return "Pick an engine to delete first."
        if not self.cache().delete(name):
            return f"No engine named `{name}` (already deleted?)."
        self.engines_changed()
        return f"Deleted `{name}`."

    # ---- builds

    @property
    def building(self) -> bool:
        """True while a build runs (its cancel Event is set up and not yet cleared)."""
        return self._cancel is not None

    def cancel_build(self) -> str:
        """Ask the running build to stop at its next progress tick; nothing partial is kept."""
        cancel = self._cancel
        if cancel is None:
            return "No build is running."
        cancel.set()
        return "Cancelling: the build stops at its next step and keeps nothing partial."

    def build(self, req: BuildRequest) -> Iterator[BuildUpdate]:
        """Build engines in a worker thread, yielding progress until it ends (last update: done).

        With ``req.vae`` (a TAESD path) the VAE components are the tiny autoencoder's, the
        engines that a generation with the same Tiny VAE field uses."""
        try:
            check_tiny_vae(req.vae)
        except InvalidValue as exc:
            return iter([BuildUpdate(f"**Cannot build**: {exc}", 0.0, True, False)])
        return self._run_build(req, None)

    def rebuild(self, name: str, model: str, vae: str | None = None) -> Iterator[BuildUpdate]:
        """Delete engine ``name`` and build it again (same component, profile, precision, backend),
        from ``model`` with the tiny VAE ``vae`` (a TAESD path) when given.

        Refuses (one update, ok=False) when the engine is not the given model's: rebuilding it
        from another model would silently replace it with a different one.
        """
        record = next((r for r in self.cache().list() if r.name == name), None)
        if record is None:
            return iter([BuildUpdate(f"No engine named `{name}`; refresh the table.", 0.0, True, False)])
        try:
            check_tiny_vae(vae)
            req = self.rebuild_request(record, model)
        except ValueError as exc:
            return iter([BuildUpdate(f"Cannot rebuild: {exc}", 0.0, True, False)])
        req.vae = req.vae or vae
        return self._run_build(req, record)

    def rebuild_request(self, record, model: str) -> BuildRequest:
        """What a Rebuild of ``record`` (an ``EngineRecord``) asks :meth:`build_records` for: its
        component, profile, backend and precision, from ``model``. An extension point: a host
        (the WebUI tab) overrides it to rebuild its own engines from its own model."""
        key = record.key
        return BuildRequest(profile=Profile.from_tag(key.profile), model=model, components=(key.component,),
                            backend=key.backend, precision=key.precision)

    def _run_build(self, req: BuildRequest, replace) -> Iterator[BuildUpdate]:
        if not self._lock.acquire(blocking=False):
            yield BuildUpdate("Another build or generation is running; try again when it ends.", 0.0, True, False)
            return
        cancel = self._cancel = threading.Event()
        events: queue.Queue = queue.Queue()
        worker = threading.Thread(target=self._build_worker, args=(req, replace, cancel, events),
                                  name="sd-accel-build", daemon=True)
        try:
            worker.start()
        except BaseException:
            self._cancel = None
            self._lock.release()
            raise
        try:
            yield from _follow(events, worker, time.perf_counter())
        finally:
            # A generator closed early (the page went away) cancels its build rather than leave
            # it holding the lock with nobody watching.
            if worker.is_alive():
                cancel.set()

    def _build_worker(self, req: BuildRequest, replace, cancel: threading.Event, events: queue.Queue) -> None:
        """Runs in the worker thread; owns the lock it was handed and releases it at the end."""
        from sd_accel.build import BuildCancelled

        try:
            records, skipped = self.build_records(req, replace, cancel, events.put)
            events.put(("done", records, skipped))
        except BuildCancelled:
            events.put(("cancelled", None, None))
        except Exception as exc:  # shown to the user; the panel must survive any build failure
            log.exception("build failed")
            events.put(("error", exc, None))
        finally:
            self.engines_changed()
            self._cancel = None
            self._lock.release()

    def build_records(self, req: BuildRequest, replace, cancel: threading.Event, progress) -> tuple[list, list[str]]:
        """The build itself, run in the build's worker thread: returns the records and the ticked
        components this model lacks. ``replace``: the engine a rebuild deletes first (None for a
        build); ``cancel``: set when the user cancels; ``progress``: takes each ``BuildEvent``.

        An extension point: a host overrides this (the WebUI tab exports its loaded UNet here)
        and keeps the panel's locking, progress and cancel, which live around it."""
        from sd_accel import build_engines
        from sd_accel.api import use_vae

        pipe = self.pipeline(req.model, None)
        # The plain pipeline (what builds export from) gets the VAE this build asks for, and its own
        # back for a build without one: the swap accelerate makes first, without its torch options,
        # so the other components' weights (and fingerprints) stay those of every other build.
        use_vae(pipe, tiny_vae_choice(req.vae))
        components, skipped = _components_of(pipe, req.components)
        if replace is not None:
            _check_same_model(pipe, replace)
            self.cache().delete(replace.name)
            self.engines_changed()
        records = build_engines(
            pipe, profiles=[req.profile], backend=req.backend or self.backend,
            precision=self.build_precision(req.precision), components=components,
            engine_dir=self.engine_dir, progress=progress, cancel=cancel, validate=True,
        )
        return records, skipped


def _follow(events: queue.Queue, worker: threading.Thread, start: float) -> Iterator[BuildUpdate]:
    """Turn the worker's BuildEvents and its final message into :class:`BuildUpdate` s."""
    finished: list[str] = []
    yield BuildUpdate("Starting: loading the model...", 0.0)
    while True:
        try:
            item = events.get(timeout=_POLL_S)
        except queue.Empty:
            if not worker.is_alive() and events.empty():  # died without a final word (SystemExit...)
                yield BuildUpdate("**Build stopped** without a result; see the server log.", 0.0, True, False)
                return
            continue
        if isinstance(item, tuple):
            yield _final(item, finished, time.perf_counter() - start)
            return
        if item.fraction >= 1.0 and item.stage in ("done", "cached", "built by another process"):
            finished.append(f"{item.component} `{item.profile}`: {item.stage}")
        overall = (item.index + item.fraction) / max(1, item.total)
        text = (f"Engine {item.index + 1} of {item.total}: **{item.component}** `{item.profile}` — "
                f"{item.stage}")
        yield BuildUpdate("\n".join([text, *(f"- {f}" for f in finished)]), overall)


def _final(item: tuple, finished: list[str], seconds: float) -> BuildUpdate:
    kind, payload, skipped = item
    done = "\n".join(f"- {f}" for f in finished)
    if kind == "done":
        note = f"\n\nNot built: {'; '.join(skipped)}" if skipped else ""
        return BuildUpdate(f"**Done**: {len(payload)} engine(s) ready in {seconds:.1f} s.\n{done}{note}",
                           1.0, True, True, payload)
    if kind == "cancelled":
        kept = f"\nFinished before the cancel, and kept:\n{done}" if finished else ""
        return BuildUpdate(f"**Cancelled**: nothing partial was kept.{kept}", 0.0, True, False)
    return BuildUpdate(f"**Build failed**: {payload}", 0.0, True, False)


def _components_of(pipe, wanted: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Split the ticked components into those the pipeline has and those it lacks (clip2 on SD 1.x)."""
    from sd_accel.build import engine_components

    have = engine_components(pipe)
    if not wanted:
        raise InvalidValue("tick at least one component to build")
    return [c for c in wanted if c in have], [f"{c} (not in this model)" for c in wanted if c not in have]


def _check_same_model(pipe, record) -> None:
    """ValueError unless ``record`` was built from this pipeline's weights (see ``rebuild``)."""
    from sd_accel.api import SHARED_COMPONENTS
    from sd_accel.build import built_from

    if record.key.component in SHARED_COMPONENTS or record.key.component.startswith("ldm_"):
        raise InvalidValue(f"engine {record.name} was built by the WebUI or ComfyUI from their own modules: rebuild "
                           "it there (here it serves a pipeline loaded from the same checkpoint file)")
    if not built_from(pipe, record):
        raise InvalidValue(
            f"engine {record.name} was built from another model than the one picked; pick that model "
            "first (its fingerprint starts " + record.key.model[:12] + ")"
        )
