"""OpenVINO backend (CPU): the engine is OpenVINO's compiled model, exported per profile.

A soft dependency: ``openvino`` is imported only inside functions, and ``info()`` says why the
backend is not usable when it is missing (``pip install 'sd-accel[openvino]'``).
"""

from sd_accel.backends.openvino.builder import OpenVinoBackend

__all__ = ["OpenVinoBackend"]
