"""The standalone sd-accel app: the panel in its own Gradio server.

Local by default (127.0.0.1); ``listen=True`` serves the network (0.0.0.0). One build or
generation runs at a time: the queue is limited to one (spelled per Gradio version), and
:class:`~sd_accel.ui.state.PanelState` holds a lock as well.

    python -m sd_accel.ui.app --port 7860 [--listen] [--engine-dir DIR] [--model PATH]
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

# Gradio reports usage to its servers unless told not to; sd-accel does not phone home.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402  (after the environment default above)

from sd_accel.ui.panel import build_panel  # noqa: E402
from sd_accel.ui.state import DEFAULT_MODEL, PanelState  # noqa: E402


def enable_queue(demo: gr.Blocks) -> gr.Blocks:
    """Queue events, one at a time: ``default_concurrency_limit`` on Gradio >= 4, else
    ``concurrency_count`` (3.x; 4.x still accepts that name but raises on it)."""
    params = inspect.signature(demo.queue).parameters
    if "default_concurrency_limit" in params:
        return demo.queue(default_concurrency_limit=1)
    return demo.queue(concurrency_count=1)


def create_app(engine_dir: str | None = None, model: str | None = None,
               state: PanelState | None = None) -> gr.Blocks:
    """The panel with its queue enabled, ready to ``launch``; the built-in tiny model by default."""
    if state is None:
        state = PanelState(engine_dir=engine_dir, model=model or DEFAULT_MODEL)
    return enable_queue(build_panel(state))


def launch(host: str = "127.0.0.1", port: int | None = None, listen: bool = False,
           engine_dir: str | None = None, model: str | None = None, block: bool = True) -> gr.Blocks:
    """Serve the app on ``host:port`` (0.0.0.0 with ``listen``); ``port`` None lets Gradio pick.

    ``block=False`` returns once the server is up (for tests and notebooks).
    """
    demo = create_app(engine_dir=engine_dir, model=model)
    demo.launch(server_name="0.0.0.0" if listen else host, server_port=port, share=False, inbrowser=False,
                prevent_thread_lock=not block)
    return demo


def main(argv: list[str] | None = None) -> int:
    """``python -m sd_accel.ui.app``: the same options as ``launch``."""
    parser = argparse.ArgumentParser(prog="python -m sd_accel.ui.app", description="The sd-accel Gradio app.")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: Gradio picks, from 7860)")
    parser.add_argument("--listen", action="store_true", help="serve the network (0.0.0.0), not just this machine")
    parser.add_argument("--engine-dir", default=None, help="engine cache (default $SD_ACCEL_ENGINE_DIR or ./engines)")
    parser.add_argument("--model", default=None, help=f"model to start with (default {DEFAULT_MODEL})")
    args = parser.parse_args(argv)
    launch(host=args.host, port=args.port, listen=args.listen, engine_dir=args.engine_dir, model=args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
