"""The one table of backends that every face reads (config, CLI, build, doctor, bench, panel).

A backend is one folder under ``sd_accel/backends/`` whose ``__init__`` has ``create(cache_root)``
returning an object that keeps the contract in ``base.py``, plus one entry below. Importing this
module is cheap: a backend's folder (and its library) is imported only when it is used.

>>> [entry.name for entry in TABLE]
['tensorrt', 'openvino', 'onnxruntime']
>>> entry("openvino").torch_device
'cpu'
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sd_accel.core import DeviceError, InvalidValue


@dataclass(frozen=True)
class BackendEntry:
    """What sd-accel knows of a backend before importing it."""

    name: str
    module: str  # its folder, imported on first use (soft dependencies stay soft)
    torch_device: str  # where its runner's feeds and the torch reference live ("cpu" or "cuda")
    runs_on: str  # for doctor and errors
    install: str  # how a user gets it


TABLE: tuple[BackendEntry, ...] = (
    BackendEntry("tensorrt", "sd_accel.backends.tensorrt", "cuda", "NVIDIA GPUs",
                 "pip install 'sd-accel[tensorrt]' with a CUDA build of torch (see README, GPU)"),
    BackendEntry("openvino", "sd_accel.backends.openvino", "cpu", "CPUs (bf16 with AVX512-BF16 or AMX, int8 with NNCF)",
                 "pip install 'sd-accel[openvino]'"),
    BackendEntry("onnxruntime", "sd_accel.backends.onnxruntime", "cpu", "CPUs, and NVIDIA GPUs with onnxruntime-gpu",
                 "pip install onnxruntime"),
)
# ``auto`` takes the first of these that is usable here.
AUTO_ORDER: tuple[str, ...] = ("tensorrt", "onnxruntime")


def names() -> tuple[str, ...]:
    return tuple(e.name for e in TABLE)


def choices() -> tuple[str, ...]:
    """What a ``backend=`` argument accepts: ``auto`` and every name in the table."""
    return ("auto", *names())


def entry(name: str) -> BackendEntry:
    """The table's entry for ``name``; ``InvalidValue`` naming the choices for anything else."""
    for e in TABLE:
        if e.name == name:
            return e
    raise InvalidValue(f"backend={name!r} is not valid; allowed: {', '.join(choices())}")


def create(name: str, cache_root: Path | None = None):
    """The backend object for ``name`` (not checked for usability; see :func:`get_backend`)."""
    return importlib.import_module(entry(name).module).create(cache_root)


def get_backend(name: str = "auto", cache_root: Path | None = None):
    """A usable backend: ``name``, or for ``auto`` the first usable one of ``AUTO_ORDER``.

    A named backend that cannot run here raises ``DeviceError`` saying why and how to get it.
    """
    if name == "auto":
        for candidate in AUTO_ORDER:
            backend = create(candidate, cache_root)
            if backend.info().usable:
                return backend
        raise DeviceError(f"no backend of {', '.join(AUTO_ORDER)} can run here; `sd-accel doctor` says why")
    backend = create(name, cache_root)
    info = backend.info()
    if not info.usable:
        raise DeviceError(f"backend={name!r} cannot run here: {info.why_not}")
    return backend


def describe(cache_root: Path | None = None) -> list[dict[str, Any]]:
    """Every backend in the table with what it can do on this machine (``sd-accel doctor``)."""
    rows = []
    auto = None
    for e in TABLE:
        backend = create(e.name, cache_root)
        info = backend.info()
        if info.usable and auto is None and e.name in AUTO_ORDER:
            auto = e.name
        rows.append({
            "name": e.name, "usable": info.usable, "version": info.version or None, "arch": info.arch,
            "runs_on": e.runs_on, "precisions": list(backend.precisions()) if info.usable else [],
            "default_precision": backend.default_precision() if info.usable else None,
            "why_not": info.why_not or None, "install": None if info.usable else e.install,
        })
    for row in rows:
        row["auto"] = row["name"] == auto
    return rows
