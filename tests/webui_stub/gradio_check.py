"""Build the sd-accel panel and the extension's WebUI tab on the Gradio this Python has.

Run by ``scripts/test_gradio_versions.sh`` in venvs with Gradio 3.41 (A1111 1.x) and 4.44
(Forge), and with the project's own Gradio. For A1111 and Forge in turn: start the stand-in
WebUI (the extension's callbacks, ``ui.create_ui`` rendering the tab and the settings), build the
standalone panel, and serve each ``gr.Blocks`` config through Gradio's own app (``/config``):
what a browser would load. Exit status 0 when everything built; one line per check.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("SD_ACCEL_ORT_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gradio as gr  # noqa: E402
import harness  # noqa: E402


def served_config(demo) -> str:
    """The ``/config`` a browser loads, from Gradio's own FastAPI app for ``demo``."""
    from fastapi.testclient import TestClient

    app = gr.routes.App.create_app(demo)
    with TestClient(app) as client:
        response = client.get("/config")
    assert response.status_code == 200, f"/config answered {response.status_code}"
    return response.text


def check_webui(forge: bool) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="sd-accel-gradio-"))
    webui = harness.start(tmp, forge=forge)
    try:
        assert ("sd-accel", "sd_accel") in webui.demo.sd_stub_tabs, webui.demo.sd_stub_tabs
        settings = webui.demo.sd_stub_settings
        assert {"sd_accel_engine_dir", "sd_accel_default_preset", "sd_accel_backend"} <= set(settings), settings
        config = served_config(webui.demo)
        for elem_id in ("sd-accel-status", "sd-accel-build", "sd-accel-engines", "setting_sd_accel_backend"):
            assert elem_id in config, f"{elem_id} missing from the served config"
        assert "sd-accel-tab-generate" not in config  # the WebUI has its own txt2img
        # The status box is filled by the page's load event, never while the UI is built.
        import gradio_events

        loads = gradio_events.find(webui.demo, "load", output="sd-accel-status")
        assert loads, "no load event fills the status box"
        out = loads[0].fn()
        status = dict(zip(loads[0].outputs, out, strict=True))["sd-accel-status"]
        assert status.startswith("**sd-accel "), status[:200]
        return f"{len(config)} bytes of config, {len(settings)} settings, status on load"
    finally:
        harness.purge()


def check_panel() -> str:
    from sd_accel.ui.panel import build_panel
    from sd_accel.ui.state import PanelState

    demo = build_panel(PanelState(engine_dir=tempfile.mkdtemp(prefix="sd-accel-gradio-engines-")))
    config = served_config(demo)
    assert "sd-accel-generate" in config
    return f"{len(config)} bytes of config"


def main() -> int:
    failures = 0
    print(f"gradio {gr.__version__}, python {sys.version.split()[0]}")
    for name, check in (("panel", check_panel), ("A1111 tab", lambda: check_webui(False)),
                        ("Forge tab", lambda: check_webui(True))):
        start = time.perf_counter()
        try:
            detail = check()
            print(f"PASS {name} ({time.perf_counter() - start:.1f} s): {detail}")
        except Exception:
            failures += 1
            print(f"FAIL {name} ({time.perf_counter() - start:.1f} s):\n{traceback.format_exc()}")
    print(f"{3 - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
