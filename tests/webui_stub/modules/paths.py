"""``modules/paths.py``: where the WebUI keeps models (a temporary folder here)."""

import os
import tempfile

script_path = os.path.join(tempfile.gettempdir(), f"webui-stub-{os.getpid()}")
models_path = os.path.join(script_path, "models")
