"""The sd-accel tab inside the WebUI: a status box over the panel (:func:`sd_accel.ui.panel.build_panel`).

The panel runs on the WebUI's own Gradio (3.41 on A1111 1.x, 4.x on Forge). Its Model box
starts at ``webui:loaded``: Build then exports the UNet the WebUI has loaded (its weights, LoRA
merged included) instead of loading a diffusers model, and the engines appear in the SD-UNet
list (A1111) or are used by the next generation (Forge). Any diffusers model path still works
as in the standalone app. The tab never fails to appear: an error while building it gives a tab
that shows the error and how to fix it (a vanished tab was the old extension's worst bug).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
import traceback
from dataclasses import dataclass

from sd_accel.components.ldm_unet import COMPONENT
from sd_accel.core import InvalidValue
from sd_accel.profiles import Profile
from sd_accel.ui.state import BuildRequest, GenerateRequest, PanelState
from sd_accel.webui import host
from sd_accel.webui.controller import OPT_BACKEND, OPT_ENGINE_DIR, controller

log = logging.getLogger("sd_accel")

WEBUI_MODEL = "webui:loaded"
TAB_TITLE, TAB_ID = "sd-accel", "sd_accel"


def is_webui_model(model: str | None) -> bool:
    return (model or "").strip().startswith("webui:")


@dataclass
class WebUIPanelState(PanelState):
    """The panel's state with the WebUI's loaded checkpoint as the default model."""

    model: str = WEBUI_MODEL

    def cache(self):
        return controller().cache()

    @property
    def default_preset(self) -> str:
        """The settings' default preset, else the loaded model family's (for the preset picker)."""
        from sd_accel.webui.export import export_source

        try:
            family = export_source().family
        except Exception:  # no model yet: the SD 1.x default
            family = "sd15"
        return controller().preset_for(family)

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

    def rebuild(self, name: str, model: str):
        record = next((r for r in self.cache().list() if r.name == name), None)
        if record is not None and record.key.component == COMPONENT:
            req = BuildRequest(profile=Profile.from_tag(record.key.profile), model=WEBUI_MODEL,
                               components=(COMPONENT,), backend=record.key.backend,
                               precision=record.key.precision)
            return self._run_build(req, record)
        return super().rebuild(name, model)

    def _build_records(self, req: BuildRequest, replace, cancel: threading.Event, progress) -> tuple[list, list[str]]:
        """The WebUI's model: export its UNet. Other models: the panel's diffusers path."""
        if not is_webui_model(req.model):
            if replace is not None and replace.key.component == COMPONENT:
                raise InvalidValue(f"that engine is the WebUI's UNet: set the Model box to {WEBUI_MODEL} to rebuild it")
            return super()._build_records(req, replace, cancel, progress)
        from sd_accel.webui.export import export_source
        from sd_accel.webui.jobs import build_for_checkpoint

        skipped = [c for c in req.components if c not in ("unet", COMPONENT)]
        if replace is not None:
            wid = export_source().weights_id
            if replace.key.model != wid:
                raise InvalidValue(f"engine {replace.name} is for other weights ({replace.key.model}); "
                                 f"the WebUI has {wid} loaded")
            self.cache().delete(replace.name)
        records = build_for_checkpoint(None, profile=req.profile, backend=req.backend or self.backend,
                                       precision=self.build_precision(req.precision), progress=progress,
                                       cancel=cancel)
        return records, (["the WebUI's text encoders and VAE stay in PyTorch"] if skipped else [])


# --------------------------------------------------------------------------- status


def _backend_lines() -> list[str]:
    ctl = controller()
    lines = []
    try:
        backend = ctl.backend()
        info = backend.info()
        lines.append(f"Engines run on **{info.name} {info.version}** ({info.arch}).")
        backend_ok = True
    except Exception as exc:  # the configured backend cannot run here
        lines.append(f"**The {ctl.backend_name()} backend cannot run here**: {exc}")
        backend_ok = False
        info = None
    if info is None or info.name != "tensorrt":
        try:
            from sd_accel.backends.tensorrt.builder import trt_status

            usable, version, why = trt_status()
        except Exception as exc:  # a broken TensorRT install must not hide the tab
            usable, version, why = False, "", f"{type(exc).__name__}: {exc}"
        if not usable:
            lines.append(f"TensorRT is not usable: {why}. To fix it, install it into the WebUI's Python "
                         f"(`\"{sys.executable}\" -m pip install tensorrt-cu12 polygraphy`, or restart with "
                         "`SD_ACCEL_INSTALL_TENSORRT=1` set) and restart the WebUI.")
        elif backend_ok:
            lines.append(f"TensorRT {version} is usable: set the backend to auto or tensorrt in Settings.")
    return lines


def _model_lines() -> list[str]:
    from sd_accel.webui.export import export_source

    ctl = controller()
    try:
        source = export_source()
    except host.NoModel as exc:
        return [str(exc)]
    records = ctl.records_for_checkpoint(source.ckpt_hash)
    mine = [r for r in records if r.key.model == source.weights_id]
    line = f"Loaded: **{source.describe()}** ({source.family}); {len(mine)} engine(s) for these weights"
    if len(records) > len(mine):
        line += f", {len(records) - len(mine)} for other LoRA sets"
    return [line + "."]


def _flag_lines() -> list[str]:
    lines = []
    if host.is_forge():
        lines.append("Forge: engines are patched into the UNet before each sampling pass (no SD-UNet entry).")
    else:
        lines.append("A1111: pick `Automatic` or `[sd-accel] <checkpoint>` as SD Unet (Settings, or quick settings).")
    if host.cmd_flag("medvram") or host.cmd_flag("lowvram"):
        lines.append("--medvram/--lowvram: exports lift the WebUI's offload hooks and trace on one device, then "
                     "put every block back where it was.")
    if host.cmd_flag("xformers"):
        lines.append("--xformers: attention is switched to plain for the export and back after.")
    if host.cmd_flag("no_half_vae"):
        lines.append("--no-half-vae: the VAE stays in PyTorch as the WebUI set it; only the UNet uses engines.")
    return lines


def status_markdown() -> str:
    """The status box: backend, TensorRT (why not, how to fix), loaded checkpoint, flags."""
    import sd_accel

    parts = [f"**sd-accel {sd_accel.__version__}**"]
    for section in (_backend_lines, _model_lines, _flag_lines):
        try:
            parts.extend(section())
        except Exception as exc:  # one failing line must not take the status (or the tab) down
            parts.append(f"({section.__name__[1:]} unavailable: {type(exc).__name__}: {exc})")
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- the tab


def make_tab():
    """The tab's ``gr.Blocks``: status box with a Refresh button, then the panel."""
    import gradio as gr

    from sd_accel.ui.panel import build_panel

    ctl = controller()
    state = WebUIPanelState(backend=ctl.backend_name())
    with gr.Blocks(analytics_enabled=False) as tab:
        status = gr.Markdown(status_markdown(), elem_id="sd-accel-webui-status")
        refresh = gr.Button("Refresh status", elem_id="sd-accel-webui-refresh")
        build_panel(state)
        refresh.click(status_markdown, None, status, queue=False)
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
