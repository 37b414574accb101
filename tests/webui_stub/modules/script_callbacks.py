"""``modules/script_callbacks.py`` (A1111 1.8): callback lists and their registration."""

from __future__ import annotations

import dataclasses
import inspect
import os
import traceback
from typing import Any


@dataclasses.dataclass
class ScriptCallback:
    script: str
    callback: Any
    name: str = None


def report_exception(c: ScriptCallback, job: str) -> None:
    print(f"Error executing callback {job} for {c.script}\n{traceback.format_exc()}")


callback_map = dict(
    callbacks_app_started=[],
    callbacks_model_loaded=[],
    callbacks_ui_tabs=[],
    callbacks_ui_train_tabs=[],
    callbacks_ui_settings=[],
    callbacks_before_image_saved=[],
    callbacks_image_saved=[],
    callbacks_extra_noise=[],
    callbacks_cfg_denoiser=[],
    callbacks_cfg_denoised=[],
    callbacks_cfg_after_cfg=[],
    callbacks_before_component=[],
    callbacks_after_component=[],
    callbacks_image_grid=[],
    callbacks_infotext_pasted=[],
    callbacks_script_unloaded=[],
    callbacks_before_ui=[],
    callbacks_on_reload=[],
    callbacks_list_optimizers=[],
    callbacks_list_unets=[],
    callbacks_before_token_counter=[],
)


def clear_callbacks():
    for callback_list in callback_map.values():
        callback_list.clear()


def add_callback(callbacks, fun, *, name=None, category="unknown", filename=None):
    if filename is None:
        stack = [x for x in inspect.stack() if x.filename != __file__]
        filename = stack[0].filename if stack else "unknown file"
    callback_name = f"{os.path.basename(os.path.dirname(os.path.dirname(filename)))}/{os.path.basename(filename)}/{category}"
    if name is not None:
        callback_name += f"/{name}"
    unique_callback_name = callback_name
    for index in range(1000):
        if not any(x.name == unique_callback_name for x in callbacks):
            break
        unique_callback_name = f"{callback_name}-{index + 1}"
    callbacks.append(ScriptCallback(filename, fun, unique_callback_name))


def app_started_callback(demo, app):
    for c in callback_map["callbacks_app_started"]:
        try:
            c.callback(demo, app)
        except Exception:
            report_exception(c, "app_started_callback")


def model_loaded_callback(sd_model):
    for c in callback_map["callbacks_model_loaded"]:
        try:
            c.callback(sd_model)
        except Exception:
            report_exception(c, "model_loaded_callback")


def ui_tabs_callback():
    res = []
    for c in callback_map["callbacks_ui_tabs"]:
        try:
            res += c.callback() or []
        except Exception:
            report_exception(c, "ui_tabs_callback")
    return res


def ui_settings_callback():
    for c in callback_map["callbacks_ui_settings"]:
        try:
            c.callback()
        except Exception:
            report_exception(c, "ui_settings_callback")


def script_unloaded_callback():
    for c in reversed(callback_map["callbacks_script_unloaded"]):
        try:
            c.callback()
        except Exception:
            report_exception(c, "script_unloaded")


def before_ui_callback():
    for c in reversed(callback_map["callbacks_before_ui"]):
        try:
            c.callback()
        except Exception:
            report_exception(c, "before_ui")


def list_optimizers_callback():
    res = []
    for c in callback_map["callbacks_list_optimizers"]:
        try:
            c.callback(res)
        except Exception:
            report_exception(c, "list_optimizers")
    return res


def list_unets_callback():
    res = []
    for c in callback_map["callbacks_list_unets"]:
        try:
            c.callback(res)
        except Exception:
            report_exception(c, "list_unets")
    return res


def on_app_started(callback, *, name=None):
    """register a function to be called when the webui started, the gradio `Block` component and
    fastapi `FastAPI` object are passed as the arguments"""
    add_callback(callback_map["callbacks_app_started"], callback, name=name, category="app_started")


def on_model_loaded(callback, *, name=None):
    add_callback(callback_map["callbacks_model_loaded"], callback, name=name, category="model_loaded")


def on_ui_tabs(callback, *, name=None):
    """register a function to be called when the UI is creating new tabs.
    The function must either return a None, which means no new tabs to be added, or a list, where
    each element is a tuple: (gradio_component, title, elem_id)"""
    add_callback(callback_map["callbacks_ui_tabs"], callback, name=name, category="ui_tabs")


def on_ui_settings(callback, *, name=None):
    add_callback(callback_map["callbacks_ui_settings"], callback, name=name, category="ui_settings")


def on_script_unloaded(callback, *, name=None):
    add_callback(callback_map["callbacks_script_unloaded"], callback, name=name, category="script_unloaded")


def on_before_ui(callback, *, name=None):
    add_callback(callback_map["callbacks_before_ui"], callback, name=name, category="before_ui")


def on_list_optimizers(callback, *, name=None):
    add_callback(callback_map["callbacks_list_optimizers"], callback, name=name, category="list_optimizers")


def on_list_unets(callback, *, name=None):
    """register a function to be called when the webui lists unets; the function receives a list
    to append ``sd_unet.SdUnetOption`` objects to"""
    add_callback(callback_map["callbacks_list_unets"], callback, name=name, category="list_unets")
