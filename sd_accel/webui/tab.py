"""The sd-accel tab inside the WebUI: the panel (:func:`sd_accel.ui.panel.build_panel`) as the
WebUI needs it.

The panel runs on the WebUI's own Gradio (3.41 on A1111 1.x, 4.x on Forge). In the WebUI it opens
on Engines (the WebUI has its own txt2img, so there is no Generate tab), and Build exports the
modules the WebUI has loaded (UNet, VAE decoder / encoder, CLIP text encoder; LoRA merges
included): the engines appear in the SD-UNet list (A1111) or are used by the next generation
(Forge), the VAE and text encoder on every call. The status box over the tabs is computed on
each page load, Refresh, build and delete, never while the UI is built (that would load the
model). The tab never fails to appear: an error while building it gives a tab that shows the
error and how to fix it (a vanished tab was the old extension's worst bug).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
import traceback
from dataclasses import dataclass, field

from sd_accel.core import InvalidValue
from sd_accel.ui.state import BuildRequest, GenerateRequest, PanelState
from sd_accel.webui import host
from sd_accel.webui.controller import OPT_BACKEND, OPT_ENGINE_DIR, controller
from sd_accel.webui.jobs import DEFAULT_COMPONENTS
from sd_accel.webui.stand_ins import COMPONENTS

WEBUI_COMPONENTS = tuple(COMPONENTS)  # unet, vae_decoder, vae_encoder, clip, unet_control


def webui_components() -> tuple[str, ...]:
    """The components this WebUI can use: ``unet_control`` on Forge only (A1111's ControlNet
    extension runs the UNet's blocks itself, so no call would reach that engine)."""
    return WEBUI_COMPONENTS if host.is_forge() else tuple(c for c in WEBUI_COMPONENTS if c != "unet_control")

log = logging.getLogger("sd_accel")

WEBUI_MODEL = "webui:loaded"
TAB_TITLE, TAB_ID = "sd-accel", "sd_accel"


def is_webui_model(model: str | None) -> bool:
    return (model or "").strip().startswith("webui:")


@dataclass
class WebUIPanelState(PanelState):
    """The panel as the WebUI shows it: no Generate tab (the WebUI has txt2img), no Model box
    (builds export the WebUI's loaded checkpoint), the components the WebUI path builds, the
    status box over the tabs, full weights ids in the table, and the ONNX exports in the disk line."""

    model: str = WEBUI_MODEL
    show_generate: bool = field(default=False, init=False, repr=False)
    show_model: bool = field(default=False, init=False, repr=False)
    component_choices: tuple[str, ...] = field(default_factory=webui_components, init=False, repr=False)
    default_components: tuple[str, ...] = field(default=DEFAULT_COMPONENTS, init=False, repr=False)
    components_label: str = field(
        default="Components (the WebUI's UNet, VAE decoder / encoder (img2img) and CLIP text encoder)",
        init=False, repr=False)

    def cache(self):
        return controller().cache()

    @property
    def default_preset(self) -> str:
        """The settings' default preset, else the loaded model family's (never loads a model)."""
        from sd_accel.webui.export import export_source

        family = "sd15"
        if host.loaded_model() is not None:
            try:
                family = export_source().family
            except Exception:  # an unusual model: the SD 1.x default
                family = "sd15"
        return controller().preset_for(family)

    def status(self) -> str:
        return status_markdown()

    def engine_rows(self) -> list[list[str]]:
        """As the panel's, with the whole weights id (``ckpt-<10 hex>[+lora-<8 hex>]``)."""
        from sd_accel.ui.state import ENGINE_HEADERS, engine_rows

        column = ENGINE_HEADERS.index("model")
        records = {r.name: r for r in self.cache().list()}
        rows = engine_rows(self.cache())
        for row in rows:
            record = records.get(row[-1])
            if record is not None:
                row[column] = record.key.model
        return rows

    def disk_usage(self) -> str:
        from sd_accel.webui.disk import disk_line

        return disk_line(self.cache())

    def delete(self, name: str) -> str:
        """As the panel's, and the ONNX export no engine needs any more goes with it."""
        from sd_accel.webui.disk import delete_engine

        name = (name or "").strip()
        if not name:
            return "Pick an engine to delete first."
        if not any(r.name == name for r in self.cache().list()):
            return f"No engine named `{name}` (already deleted?)."
        removed = delete_engine(self.cache(), name)
        self.engines_changed()
        return f"Deleted `{name}`." + (f" Removed its ONNX export ({', '.join(removed)})." if removed else "")

    def engines_changed(self) -> None:
        super().engines_changed()
        controller().engines_changed()

    def apply_settings(self, engine_dir: str | None, backend: str, precision: str) -> str:
        """As the panel's, and written to the WebUI's settings (they are the same settings)."""
        message = super().apply_settings(engine_dir, backend, precision)
        opts = host.shared().opts
        for key, value in ((OPT_ENGINE_DIR, self.engine_dir or ""), (OPT_BACKEND, backend)):
            if callable(getattr(opts, "set", None)):
                opts.set(key, value)
            else:
                opts.data[key] = value
        config = getattr(host.shared(), "config_filename", None)
        if config and callable(getattr(opts, "save", None)):
            opts.save(config)
        return message

    def generate(self, req: GenerateRequest):
        if is_webui_model(req.model):
            raise InvalidValue("The WebUI's checkpoint generates in txt2img / img2img, where its engines are "
                             "used; this Generate tab runs diffusers models (a path or builtin:tiny-sd15).")
        if importlib.util.find_spec("diffusers") is None:
            raise InvalidValue("The Generate tab needs diffusers, which this WebUI does not ship; "
                             "txt2img / img2img use the engines without it.")
        return super().generate(req)

    def rebuild_request(self, record, model: str) -> BuildRequest:
        """The WebUI's engines are rebuilt from the loaded checkpoint, whatever the Model box says."""
        req = super().rebuild_request(record, model)
        user_name = {v: k for k, v in COMPONENTS.items()}.get(record.key.component)
        if user_name is not None:
            req.model = WEBUI_MODEL
            req.components = (user_name,)
        return req

    def build_records(self, req: BuildRequest, replace, cancel: threading.Event, progress) -> tuple[list, list[str]]:
        """The WebUI's model: export its modules. Other models: the panel's diffusers path."""
        if not is_webui_model(req.model):
            if replace is not None and replace.key.component in COMPONENTS.values():
                raise InvalidValue(f"that engine is the WebUI's: set the Model box to {WEBUI_MODEL} to rebuild it")
            return super().build_records(req, replace, cancel, progress)
        from sd_accel.webui.console import console_progress
        from sd_accel.webui.jobs import build_for_checkpoint

        wanted = tuple(c for c in req.components if c in COMPONENTS)
        skipped = [f"{c} (not a component of the WebUI's model)" for c in req.components if c not in COMPONENTS]
        if replace is not None:
            self.cache().delete(replace.name)
        not_built: list[str] = []
        records = build_for_checkpoint(None, profile=req.profile, backend=req.backend or self.backend,
                                       precision=self.build_precision(req.precision), cancel=cancel,
                                       progress=console_progress("tab build", progress), components=wanted,
                                       skipped=not_built)
        return records, skipped + not_built


# --------------------------------------------------------------------------- status


def _backend_lines() -> list[str]:
    ctl = controller()
    try:
        backend = ctl.backend()
        info = backend.info()
        default = backend.default_precision()
    except Exception as exc:  # the configured backend cannot run here
        return [f"**The {ctl.backend_name()} backend cannot run here**: {exc}"]
    return [f"Engines run on **{info.name} {info.version}** ({info.arch}); builds default to {default}."]


def _install_hint(packages: tuple[str, ...]) -> str:
    return (f"restart the WebUI (the extension's install.py installs it) or run "
            f"`\"{sys.executable}\" -m pip install {' '.join(packages)}`")


def _cpu_backends_line() -> str:
    """What the CPU backends give, and which are installed (each backend's own words: its table
    entry and ``summary``; the WebUI does not build static int8, so it is not listed)."""
    from sd_accel.backends.registry import AUTO_ORDER, create, entry
    from sd_accel.webui.export import NOT_IN_WEBUI

    parts = []
    for name in AUTO_ORDER["cpu"]:
        e, backend = entry(name), create(name)
        if backend.info().usable:
            summary = backend.summary() or ", ".join(p for p in backend.precisions() if p not in NOT_IN_WEBUI)
            parts.append(f"**{e.display}** ({summary})")
        else:
            parts.append(f"{e.display}{', ' + e.pitch + ',' if e.pitch else ''} is not installed: "
                         + _install_hint(backend.install_packages()))
    gpu = entry(AUTO_ORDER["cuda"][0])
    return "This WebUI computes on the CPU; its engine backends: " + "; ".join(parts) + f". {gpu.display} runs on {gpu.runs_on}."


def _advice_lines() -> list[str]:
    """What would make engines faster here, and only what can work here (issue: TensorRT advice
    on a CPU build of torch). CPU: the CPU backends. An NVIDIA GPU: the GPU backend's package
    for torch's CUDA, when it is not usable."""
    import torch

    from sd_accel.backends.registry import AUTO_ORDER, create, entry

    if host.runs_on_cpu():
        return [_cpu_backends_line()]
    e = entry(AUTO_ORDER["cuda"][0])
    try:
        backend = create(e.name)
        info = backend.info()
        usable, version, why = info.usable, info.version, info.why_not
        packages = backend.install_packages()
    except Exception as exc:  # a broken install must not hide the tab
        usable, version, why, packages = False, "", f"{type(exc).__name__}: {exc}", ()
    if usable:
        return [f"{e.display} {version} is usable: the `auto` backend uses it."]
    reason = why.split(";")[0].split(": `pip")[0]
    if not packages:
        return [f"{e.display} is not usable ({reason})."]
    return [f"{e.display} is not usable ({reason}). For torch's CUDA {torch.version.cuda}, install `{packages[0]}`: "
            + _install_hint(packages) + ", then restart."]


def _model_lines() -> list[str]:
    from sd_accel.webui.export import export_source

    ctl = controller()
    model = host.loaded_model()
    if model is None:
        return [host.NO_MODEL_FORGE if host.is_forge() else host.NO_MODEL_A1111]
    try:
        source = export_source(model)
    except host.NotOnEngines as exc:
        return [str(exc)]
    records = ctl.records_for_checkpoint(source.ckpt_hash, component=None)
    unet = [r for r in records if r.key.model == source.weights_id and r.key.component == "ldm_unet"]
    others = {}
    for r in records:
        if r.key.component != "ldm_unet" and r.status == "ok":
            others[r.key.component] = others.get(r.key.component, 0) + 1
    line = f"Loaded: **{source.describe()}** ({source.family}); {len(unet)} UNet engine(s) for these weights"
    lora_sets = len([r for r in records if r.key.component == "ldm_unet"]) - len(unet)
    if lora_sets:
        line += f", {lora_sets} for other LoRA sets"
    if others:
        from sd_accel.webui.stand_ins import LABELS

        line += "; " + ", ".join(f"{n} {LABELS.get(c, c)}" for c, n in sorted(others.items()))
    lines = [line + "."]
    why = ctl.other_backend_note(source.weights_id)
    if why:
        lines.append(f"**Engines not used**: {why}.")
    elif unet and ctl.backend_name() == "auto":
        backends = {r.key.backend for r in unet}
        try:
            first = ctl.backend()
            runs = [b.name for b in ctl.other_backends(first) if b.name in backends]
        except Exception:  # the tab's backend line says why
            first, runs = None, []
        if first is not None and first.name not in backends and runs:
            lines.append(f"Backend auto: these weights have no {first.name} engines; jobs run on their "
                         f"{runs[0]} engines.")
    return lines


def _flag_lines() -> list[str]:
    lines = []
    if host.is_forge():
        lines.append("Forge: engines are patched into the UNet before each sampling pass (no SD-UNet entry); "
                     "the VAE and text encoder use theirs on every call.")
    else:
        lines.append("A1111: pick `Automatic` or `[sd-accel] <checkpoint>` as SD Unet (Settings, or quick "
                     "settings); the VAE and text encoder use their engines on every call.")
    if host.cmd_flag("medvram") or host.cmd_flag("lowvram"):
        lines.append("--medvram/--lowvram: exports lift the WebUI's offload hooks and trace on one device, then "
                     "put every block back where it was.")
    if host.cmd_flag("xformers"):
        lines.append("--xformers: attention is switched to plain for the export and back after.")
    if host.cmd_flag("no_half_vae"):
        lines.append("--no-half-vae: VAE engines are built in fp32, whatever precision the others use.")
    return lines


def status_markdown() -> str:
    """The status box: backend, what would be faster here, loaded checkpoint, flags. Never loads
    or waits for a model: computed on page load, Refresh, and after builds and deletes."""
    import sd_accel

    parts = [f"**sd-accel {sd_accel.__version__}**"]
    for section in (_backend_lines, _advice_lines, _model_lines, _flag_lines):
        try:
            parts.extend(section())
        except Exception as exc:  # one failing line must not take the status (or the tab) down
            parts.append(f"({section.__name__[1:]} unavailable: {type(exc).__name__}: {exc})")
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- the tab


def make_tab():
    """The tab's ``gr.Blocks``: the panel with its status box, opening on Engines.

    Nothing here reads the model: the status and the engine table are filled by the page's load
    event (and by Refresh, builds and deletes), so building the UI never loads or waits for a
    checkpoint (``--skip-load-model-at-start`` keeps working)."""
    import gradio as gr

    from sd_accel.ui.panel import build_panel

    state = WebUIPanelState(backend=controller().backend_name())
    with gr.Blocks(analytics_enabled=False) as tab:
        build_panel(state)
    return tab


def error_tab(error: BaseException | str):
    """A tab that says what went wrong and how to fix it (used when anything else fails)."""
    import gradio as gr

    text = error if isinstance(error, str) else "".join(traceback.format_exception(error))
    with gr.Blocks(analytics_enabled=False) as tab:
        gr.Markdown("## sd-accel could not start\n\nThe WebUI itself is fine; sd-accel's engines are off. "
                    "Restart the WebUI once (its `install.py` installs what is missing); if this stays, "
                    "report the text below.\n\n```\n" + text + "\n```", elem_id="sd-accel-webui-error")
    return tab


def on_ui_tabs() -> list[tuple]:
    """``script_callbacks.on_ui_tabs`` callback: always returns a tab, never raises."""
    try:
        return [(make_tab(), TAB_TITLE, TAB_ID)]
    except Exception as exc:
        log.exception("sd-accel: building the tab failed")
        return [(error_tab(exc), TAB_TITLE, TAB_ID)]
