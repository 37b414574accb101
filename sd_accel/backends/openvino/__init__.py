"""OpenVINO backend (CPU): the engine is OpenVINO's compiled model, exported per profile.

A soft dependency: ``openvino`` is imported only inside functions, and ``info()`` says why the
backend is not usable when it is missing (``pip install 'sd-accel[openvino]'``).
"""

from pathlib import Path

from sd_accel.backends.openvino.builder import OpenVinoBackend

__all__ = ["OpenVinoBackend", "create"]


def create(cache_root: Path | None = None) -> OpenVinoBackend:
    """The registry's constructor (OpenVINO keeps nothing under the cache root)."""
    return OpenVinoBackend()
