"""The one table of backends that every face reads (config, CLI, build, doctor, bench, panel).

A backend is one folder under ``sd_accel/backends/`` whose ``__init__`` has ``create(cache_root)``
returning an object that keeps the contract in ``base.py``, plus one entry below. Importing this
module is cheap: a backend's folder (and its library) is imported only when it is used.

``auto`` is the fastest usable backend for the device: on an NVIDIA GPU TensorRT where it imports,
else the compiled PyTorch backend (torch.compile + CUDA graphs), else ONNX Runtime; on a CPU OpenVINO (a regular dependency where its wheels exist: bf16 on CPUs
with AVX512-BF16 or AMX, fp32 elsewhere; int8 only when asked), else ONNX Runtime.

>>> [entry.name for entry in TABLE]
['tensorrt', 'compile', 'openvino', 'onnxruntime']
>>> entry("openvino").torch_device
'cpu'
>>> auto_order("cpu"), auto_order("cuda")
(('openvino', 'onnxruntime'), ('tensorrt', 'compile', 'onnxruntime'))
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
    # Every precision it builds on some machine: the one list (each backend's precisions() is this
    # less what the machine lacks, ENGINE_PRECISIONS the union). What a precision needs where it
    # depends on the machine or an optional package, the backend says (Backend.missing).
    builds: tuple[str, ...] = ()
    title: str = ""  # its name as a face prints it (default: ``name``)
    pitch: str = ""  # why a user would want it, for a face that says it is not installed
    # Its runners run the pipeline's live torch modules, handed over when engines are swapped into a
    # diffusers pipeline (Backend.attach): the WebUI and ComfyUI run their own UNet, so their ``auto``
    # leaves it out (``auto_order(..., live_modules=False)``).
    live_modules: bool = False

    @property
    def display(self) -> str:
        return self.title or self.name


TABLE: tuple[BackendEntry, ...] = (
    BackendEntry("tensorrt", "sd_accel.backends.tensorrt", "cuda", "NVIDIA GPUs",
                 "pip install 'sd-accel[tensorrt]' with a CUDA build of torch (see README, GPU)",
                 builds=("fp16", "fp32"), title="TensorRT"),
    BackendEntry("compile", "sd_accel.backends.compile", "cuda",
                 "NVIDIA GPUs without TensorRT (torch.compile + CUDA graphs); CPUs opt-in",
                 "a CUDA build of torch with Triton (Linux); on a CPU, a C++ compiler (g++)",
                 builds=("fp16", "bf16", "fp32"), title="torch.compile",
                 pitch="the fastest path on an NVIDIA GPU without TensorRT; LoRA changes need no rebuild",
                 live_modules=True),
    BackendEntry("openvino", "sd_accel.backends.openvino", "cpu", "CPUs (bf16 with AVX512-BF16 or AMX, int8 with NNCF)",
                 "pip install openvino (installed with sd-accel where OpenVINO has wheels: Linux x86_64 "
                 "and aarch64, Windows x86_64, macOS arm64)",
                 builds=("fp32", "bf16", "int8", "int4"), title="OpenVINO",
                 pitch="the fastest CPU backend (bf16 on CPUs with AMX / AVX512-BF16)"),
    BackendEntry("onnxruntime", "sd_accel.backends.onnxruntime", "cpu", "CPUs, and NVIDIA GPUs with onnxruntime-gpu",
                 "pip install onnxruntime", builds=("fp32", "int8", "int8-dynamic"), title="ONNX Runtime"),
)
# ``auto`` takes the first of these that is usable here, by device kind: OpenVINO is the fastest
# CPU backend measured (scripts/BENCHMARKS.md; Inductor against it on the same UNet:
# scripts/BENCHMARKS-compile.md, so ``compile`` is opt-in on CPUs), and its engines run on the CPU
# only, so a machine with CUDA but no TensorRT takes the compiled PyTorch backend (Triton comes
# with CUDA builds of torch), then ONNX Runtime (its CUDA provider when present).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("tensorrt", "compile", "onnxruntime"),
    "cpu": ("openvino", "onnxruntime"),
}


def names() -> tuple[str, ...]:
    return tuple(e.name for e in TABLE)


def _bits(precision: str) -> int:
    return int("".join(c for c in precision.split("-")[0] if c.isdigit()))


def engine_precisions() -> tuple[str, ...]:
    """Every precision some backend builds (the table's ``builds``), widest first.

    >>> engine_precisions()
    ('fp32', 'fp16', 'bf16', 'int8', 'int8-dynamic', 'int4')
    """
    union = dict.fromkeys(p for e in TABLE for p in e.builds)
    return tuple(sorted(union, key=_bits, reverse=True))  # stable: the table's order within a width


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


def weights_files(name: str) -> tuple[str, ...]:
    """The engine files of backend ``name`` that hold its weights (``Backend.weights_files``: the
    cache stores each once across engines); () for a backend that is not here or names none."""
    try:
        return tuple(create(name).weights_files)
    except Exception:  # noqa: BLE001  (a backend that does not import here: its engines are not shared)
        return ()


def auto_order(device: str | None = None, live_modules: bool = True) -> tuple[str, ...]:
    """The backends ``auto`` tries, in order, for ``device`` (``cuda``, ``cuda:1``, ``cpu``, ``mps``;
    default: CUDA when torch sees a GPU, else the CPU). Every non-CUDA device takes the CPU order:
    the CPU backends' engines run on the CPU whatever torch runs on. ``live_modules=False``: without
    the backends that run the pipeline's own torch modules (a host that runs its own UNet).

    >>> auto_order("cuda", live_modules=False)
    ('tensorrt', 'onnxruntime')
    """
    if device is None:
        import torch  # here, not at import: the registry stays cheap to import

        device = "cuda" if torch.cuda.is_available() else "cpu"
    order = AUTO_ORDER["cuda" if str(device).startswith("cuda") else "cpu"]
    return order if live_modules else tuple(n for n in order if not entry(n).live_modules)


def get_backend(name: str = "auto", cache_root: Path | None = None, device: str | None = None,
                live_modules: bool = True):
    """A usable backend: ``name``, or for ``auto`` the first usable one of :func:`auto_order`
    (``live_modules``: see there).

    A named backend that cannot run here raises ``DeviceError`` saying why and how to get it.
    """
    if name == "auto":
        order = auto_order(device, live_modules)
        for candidate in order:
            backend = create(candidate, cache_root)
            if backend.info().usable:
                return backend
        raise DeviceError(f"no backend of {', '.join(order)} can run here; `sd-accel doctor` says why")
    backend = create(name, cache_root)
    info = backend.info()
    if not info.usable:
        raise DeviceError(f"backend={name!r} cannot run here: {info.why_not}")
    return backend


def check_precision(backend, precision: str) -> None:
    """``InvalidValue`` unless ``backend`` builds ``precision`` here; the message says what that
    precision needs (a CPU feature, a package to install) or which backend builds it.

    >>> check_precision(create("onnxruntime"), "fp16")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sd_accel.core.InvalidValue: precision='fp16': the onnxruntime backend builds fp32, int8, int8-dynamic here; ...
    """
    built = tuple(backend.precisions())
    if precision in built:
        return
    why = backend.missing(precision)
    if why is None:
        others = [e.name for e in TABLE if precision in e.builds and e.name != backend.name]
        why = (f"{precision} engines come from the {' or '.join(others)} backend (backend=... / --backend)"
               if others else f"no backend builds {precision!r}")
    raise InvalidValue(f"precision={precision!r}: the {backend.name} backend builds {', '.join(built)} here; {why}")


def describe(cache_root: Path | None = None) -> list[dict[str, Any]]:
    """Every backend in the table with what it can do on this machine (``sd-accel doctor``)."""
    rows = []
    usable = set()
    for e in TABLE:
        backend = create(e.name, cache_root)
        info = backend.info()
        if info.usable:
            usable.add(e.name)
        rows.append({
            "name": e.name, "usable": info.usable, "version": info.version or None, "arch": info.arch,
            "runs_on": e.runs_on, "precisions": list(backend.precisions()) if info.usable else [],
            "default_precision": backend.default_precision() if info.usable else None,
            "why_not": info.why_not or None, "install": None if info.usable else e.install,
        })
    auto = next((n for n in auto_order() if n in usable), None)
    for row in rows:
        row["auto"] = row["name"] == auto
    return rows
