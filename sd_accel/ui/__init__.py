"""The Gradio faces of sd-accel: the panel (:mod:`.panel`), its state (:mod:`.state`), the app (:mod:`.app`).

Names are imported on first use, so ``import sd_accel.ui`` does not import Gradio or torch.

(Skipped in the test suite: launch() serves the app until stopped; tests/test_ui.py and
tests/test_ui_browser.py drive it.)

>>> from sd_accel.ui import launch
>>> launch(port=7860)                # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_panel": "sd_accel.ui.panel",
    "create_app": "sd_accel.ui.app",
    "launch": "sd_accel.ui.app",
    "PanelState": "sd_accel.ui.state",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sd_accel.ui' has no attribute {name!r}")
