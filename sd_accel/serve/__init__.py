"""``sd-accel serve``: txt2img over HTTP on Ray Serve, with dynamic batching onto the engines.

(Skipped in the test suite: it starts a Ray cluster and an HTTP server; tests/test_serve_ray.py
does.)

>>> from sd_accel.serve import serve
>>> server = serve(model="builtin:tiny-sd15", engine_dir="engines", build_missing=True,
...                blocking=False)                                         # doctest: +SKIP

Ray is optional (``pip install -e '.[serve]'`` in the checkout): importing this package does not import it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "serve": "sd_accel.serve.deployment",
    "Server": "sd_accel.serve.deployment",
    "build_application": "sd_accel.serve.deployment",
    "ServeConfig": "sd_accel.serve.config",
    "make_config": "sd_accel.serve.config",
    "load_config_file": "sd_accel.serve.config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sd_accel.serve' has no attribute {name!r}")
