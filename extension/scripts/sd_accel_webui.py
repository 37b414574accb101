"""sd-accel for AUTOMATIC1111's and Forge's Stable Diffusion WebUI.

The WebUI loads this file from the extension's ``scripts/`` folder at start-up. It stays thin:
it finds the ``sd_accel`` package (installed by ``install.py``; else the checkout this folder
lives in), registers the callbacks (tab, settings, SD-UNet list, HTTP routes) and defines the
always-on script whose hooks follow each job. If sd-accel cannot be imported, the WebUI still
gets an sd-accel tab that says why and how to fix it, and nothing else changes.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from modules import script_callbacks, scripts

_EXTENSION_DIR = Path(__file__).resolve().parents[1]


def _import_sd_accel():
    """(sd_accel.webui.callbacks, sd_accel.webui.jobs, None), or (None, None, the error text)."""
    try:
        from sd_accel.webui import callbacks, jobs

        return callbacks, jobs, None
    except Exception:
        first = traceback.format_exc()
    # install.py did not run (--skip-install) or failed: use the checkout this folder is part of.
    root = _EXTENSION_DIR.parent
    if (root / "sd_accel" / "__init__.py").is_file() and str(root) not in sys.path:
        sys.path.append(str(root))
        for name in [m for m in sys.modules if m == "sd_accel" or m.startswith("sd_accel.")]:
            del sys.modules[name]  # a half-imported package from the first try
        try:
            from sd_accel.webui import callbacks, jobs

            print(f"sd-accel: running from the checkout at {root} (not installed; restart without "
                  "--skip-install to install it)")
            return callbacks, jobs, None
        except Exception:
            first += "\n" + traceback.format_exc()
    return None, None, first


_callbacks, _jobs, _error = _import_sd_accel()

if _callbacks is None:
    print(f"sd-accel: could not load, the WebUI runs without it:\n{_error}")

    def _error_tab():
        import gradio as gr

        with gr.Blocks(analytics_enabled=False) as tab:
            gr.Markdown(
                "## sd-accel is not installed correctly\n\nThe WebUI works as before; sd-accel is off. "
                "Restart the WebUI once without `--skip-install` (the extension's `install.py` installs "
                "sd-accel into the WebUI's Python), or run\n\n"
                f"`\"{sys.executable}\" -m pip install --no-deps \"{_EXTENSION_DIR.parent}\"`\n\n"
                f"```\n{_error}\n```",
                elem_id="sd-accel-webui-error",
            )
        return [(tab, "sd-accel", "sd_accel")]

    script_callbacks.on_ui_tabs(_error_tab)
else:
    for _register, _callback in _callbacks.callbacks():
        getattr(script_callbacks, _register)(_callback)  # from this file: the WebUI names them after it

    class SdAccelScript(scripts.Script):
        """Always on, no UI: follows each job so engines match its real calls and LoRAs."""

        sorting_priority = 10  # Forge: after extensions that patch the UNet's inputs

        def title(self):
            return "sd-accel"

        def show(self, is_img2img):
            return scripts.AlwaysVisible

        def process(self, p, *args):
            _jobs.job_started(p)

        def process_batch(self, p, *args, **kwargs):
            _jobs.batch_started(p, **kwargs)

        def process_before_every_sampling(self, p, *args, **kwargs):
            _jobs.before_sampling(p, **kwargs)

        def postprocess(self, p, processed, *args):
            _jobs.job_finished(p)
