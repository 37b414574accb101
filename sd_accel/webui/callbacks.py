"""Registration with the WebUI's ``modules.script_callbacks``; called once by the extension's script.

A1111 and Forge get the same tab, settings and routes. The SD-UNet list entry is A1111's way in
(Forge never dispatches to ``sd_unet.current_unet``, and offering the entry there would only move
its UNet around); Forge's way in is the script's ``process_before_every_sampling``.
"""

from __future__ import annotations

import logging

from sd_accel.webui import host

log = logging.getLogger("sd_accel")


def on_app_started(demo, app) -> None:
    """``on_app_started(demo, app)``: the HTTP routes on the WebUI's FastAPI app."""
    from sd_accel.webui.api import register

    register(app)


def on_model_loaded(sd_model) -> None:
    """Another checkpoint: engines of the old one are closed (they hold GPU memory)."""
    from sd_accel.webui.controller import controller

    controller().release()


def on_script_unloaded() -> None:
    """Scripts reload (Apply and restart UI): close engines before the module objects go."""
    from sd_accel.webui.controller import controller

    controller().release()


def callbacks() -> list[tuple[str, object]]:
    """(``script_callbacks`` registration function, callback) pairs sd-accel uses.

    The extension's script makes the calls itself: the WebUI names each callback after the
    file that registered it (``add_callback`` reads the caller's file name), and it should be
    the extension's script, not a file in site-packages.
    """
    from sd_accel.webui.console import setup
    from sd_accel.webui.settings import on_ui_settings
    from sd_accel.webui.tab import on_ui_tabs

    setup()  # sd-accel's INFO lines (build stages) in the WebUI's console, never glued onto a bar

    out = [
        ("on_ui_tabs", on_ui_tabs),
        ("on_ui_settings", on_ui_settings),
        ("on_app_started", on_app_started),
        ("on_model_loaded", on_model_loaded),
        ("on_script_unloaded", on_script_unloaded),
    ]
    if not host.is_forge():
        from sd_accel.webui.a1111 import list_unets

        out.append(("on_list_unets", list_unets))
    return out
