"""Code only the tests use, kept out of the shipped package (``sd_accel`` never imports it).

* ``ldm_layout``: writes a diffusers pipeline as a WebUI-style single ``.safetensors`` file, so the
  loading tests have real single-file checkpoints without downloading any;
* ``trt``: the TensorRT names the backend uses per version, the real name lists of TensorRT's
  binding wheels, and a stand-in ``tensorrt`` module for dry runs of the build and load paths;
* ``fake_backend``: a backend that is not part of sd-accel (ONNX Runtime under another name), to
  show that one module and one registry entry make a backend;
* ``scripts``: the repository's scripts (the benchmark harness ``scripts/bench.py``) as modules.

The tests import it as ``support`` (pytest puts ``tests/`` on ``sys.path``).
"""
