"""The compiled PyTorch backend: ``torch.compile`` (Inductor) of a component's own module, with
CUDA graphs per fixed shape on NVIDIA GPUs. For GPUs without TensorRT; on a CPU it is opt-in
(OpenVINO is faster there: scripts/BENCHMARKS-compile.md).

How it keeps the contract of ``base.py`` without ONNX (:attr:`takes_torch_module`):

- **build** gets the component spec, not an ONNX file (build.py skips the export for it). It
  compiles the spec's export wrapper (positional inputs in ``inputs()`` order, a tuple out),
  runs it at the profile's fixed shapes so Inductor compiles them, and writes the "engine": a
  small ``manifest.json`` and ``inductor.bin``, Inductor's compiled kernels as
  ``torch.compiler.save_cache_artifacts()`` gives them. Keyed like every engine (arch, torch
  version as the backend version, precision, profile), so a second process loads them
  (``load_cache_artifacts``) and its first call compiles from cache hits: a warm start.
- **model id**: the compiled graph takes the weights as inputs (Dynamo lifts parameters), so an
  artifact depends on the architecture and the shapes, not on the weight values: its key's model
  field is an architecture fingerprint (:func:`architecture_id`). A LoRA or a fine-tune of the
  same architecture reuses the compiled kernels.
- **weights** are read live on every call (:attr:`reads_live_weights`): a LoRA, ``load_state_dict``
  or any in-place change shows in the next call with no recompile and no refit, never stale. A
  CUDA graph bakes weight addresses in: it is dropped and captured again when one moves
  (graphs.py). What changes the module's code (LoRA layers added by PEFT) makes Dynamo's guards
  fail and it compiles again: slower once, still never stale.
- **load** needs the live module, which the runtime hands over before any call
  (:meth:`CompileBackend.attach`); a runner loaded without it refuses its calls (they run torch).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sd_accel.backends.base import Backend, BackendInfo
from sd_accel.backends.compile.settings import DTYPES, Attached, CompileSettings
from sd_accel.core import EngineError, EngineFault, InvalidValue, Progress, ShapeRanges

if TYPE_CHECKING:
    from sd_accel.backends.compile.graphs import GraphCapturer
    from sd_accel.backends.compile.runner import CompiledRunner
    from sd_accel.core import CalibrationSet

__all__ = ["DTYPES", "CompileBackend", "CompileFailed", "CompileSettings", "architecture_id"]

log = logging.getLogger("sd_accel")

MANIFEST = "manifest.json"
ARTIFACTS = "inductor.bin"
MANIFEST_VERSION = 1


class CompileFailed(EngineError):
    """torch.compile could not compile a component (a graph break under ``fullgraph=True``, an
    Inductor error): the message says where, and that the other backends or eager torch serve it."""


def architecture_id(module: torch.nn.Module) -> str:
    """What a compiled artifact depends on besides shapes: the class, its config and every weight's
    name, shape and dtype (not values: the compiled graph takes the weights as inputs).

    >>> a, b = torch.nn.Linear(2, 3), torch.nn.Linear(2, 3)
    >>> architecture_id(a) == architecture_id(b) != architecture_id(torch.nn.Linear(2, 4))
    True
    """
    from sd_accel.onnx.fingerprint import _config_blob

    digest = hashlib.sha256(b"arch1:")
    digest.update(type(module).__name__.encode())
    digest.update(_config_blob(module))
    for name, t in module.state_dict(keep_vars=True).items():
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
    return "arch-" + digest.hexdigest()[:40]




def _user_chose_cache_dir() -> bool:
    """Whether the user chose Inductor's cache folder: if not, the backend keeps Inductor's caches
    beside the engines (INDUCTOR_DIR). torch's first compile sets the variable to its default, and
    that may come before this module is imported (a host or a test compiled something first): the
    default is not a choice."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not chosen:
        return False
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # an older torch: take the variable as the user's
        return True
    return os.path.abspath(chosen) != os.path.abspath(default_cache_dir())


# read once, at import: use_inductor_dir() sets the variable to an engine folder later
_USER_CACHE_DIR = _user_chose_cache_dir()
INDUCTOR_DIR = "inductor"
_LOADED_ARTIFACTS: set[str] = set()  # digests of inductor.bin files already given to Inductor (this process)


def load_artifacts(path: Path) -> bool:
    """Hand an engine's Inductor artifacts to this process's caches (once per file content)."""
    if not path.is_file():
        return False
    blob = path.read_bytes()
    digest = hashlib.sha256(blob).hexdigest()
    if digest in _LOADED_ARTIFACTS:
        return True
    try:
        torch.compiler.load_cache_artifacts(blob)
    except Exception as exc:  # an unreadable cache costs a cold compile, never the call
        log.warning("compiled engine %s: its Inductor cache could not be loaded (%s); compiling cold",
                    path.parent.name, exc)
        return False
    _LOADED_ARTIFACTS.add(digest)
    return True


class CompileBackend(Backend):
    """``backend="compile"``: torch.compile + CUDA graphs, on the device torch runs the pipeline."""

    name = "compile"
    takes_torch_module = True
    reads_live_weights = True

    def __init__(self, device: str = "cpu", settings: CompileSettings | None = None,
                 cache_root: Path | None = None) -> None:
        self.torch_device = device
        # Inductor's on-disk caches (FX graphs, AOTAutograd, the compiled C++ / Triton kernels) in the
        # engine folder, so a second process with the same engines starts warm. ``inductor.bin`` alone
        # is not enough on a CPU: its C++ kernels are not in torch's portable artifacts and a fresh
        # cache folder compiles them again with g++ (65 s instead of 6 s for the tiny UNet, measured).
        self.inductor_dir = None if cache_root is None or _USER_CACHE_DIR else Path(cache_root) / INDUCTOR_DIR
        self.settings = settings or CompileSettings.from_env()
        # component and model id -> the live module (attach); the runtime hands it over at swap time
        self._attached: dict[tuple[str, str], Attached] = {}
        # where CUDA graphs come from; the tests put a CPU stand-in here (graphs.GraphCapturer)
        self.new_capturer: Callable[[], GraphCapturer] | None = None

    @property
    def cuda(self) -> bool:
        return self.torch_device.startswith("cuda")

    def info(self) -> BackendInfo:
        version = f"torch-{torch.__version__}"
        if self.settings.compiler != "inductor":  # a traced-only build must never pass for a compiled one
            version += f"-{self.settings.compiler}"
        if self.cuda:
            try:
                import triton

                version += f"-triton-{triton.__version__}"
            except ImportError:
                return BackendInfo(self.name, version, "", False,
                                   "torch.compile on CUDA needs Triton: pip install triton (it comes with "
                                   "CUDA builds of torch on Linux)")
            from sd_accel.device import gpu_arch

            return BackendInfo(self.name, version, gpu_arch(), True)
        if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
            return BackendInfo(self.name, version, "", False,
                               "torch.compile on a CPU needs a C++ compiler: install g++ (apt install g++)")
        from sd_accel.device import cpu_class

        return BackendInfo(self.name, version, cpu_class(), True)

    def missing(self, precision: str) -> str | None:
        if precision == "fp16" and not self.cuda:
            return "fp16 on a CPU is slower than fp32 in torch; use bf16 (or fp32)"
        return None

    def default_precision(self) -> str:
        return "fp16" if self.cuda else "fp32"

    def summary(self) -> str | None:
        where = "CUDA graphs per fixed shape" if self.cuda and self.settings.cuda_graphs else "no CUDA graphs"
        return f"torch.compile (Inductor, mode={self.settings.mode}), {where}; weights read live (LoRA without refit)"

    def install_packages(self) -> tuple[str, ...]:
        return ("triton",) if self.cuda else ()

    def model_id(self, module: torch.nn.Module) -> str | None:
        return architecture_id(module)

    # ---- the live module ---------------------------------------------------------------------

    def attach(self, model: str, spec: Any) -> None:
        """Give the runners of ``spec.name`` engines keyed by ``model`` the live module. Called
        while the pipeline holds its torch modules (the export wrapper wraps them)."""
        module = spec.torch_module()
        held = self._attached.get((spec.name, model))
        if held is not None and held.module is module:
            # the same module again (a build, then the swap): keep its wrapper. (A new wrapper of the
            # same class would not be traced again either: Dynamo guards on the modules' structure, not
            # on their identity; twelve wrappers of one class made one graph, measured with torch 2.13.)
            return
        self._attached[(spec.name, model)] = Attached(
            spec.export_module().eval(), module, tuple(t.name for t in spec.inputs()),
            tuple(t.name for t in spec.outputs()), tuple(t.dtype for t in spec.inputs()))

    def attached(self, component: str, model: str) -> Attached | None:
        return self._attached.get((component, model))

    def use_inductor_dir(self) -> None:
        """Point Inductor at the engine folder's cache (see ``__init__``); read on each compile."""
        if self.inductor_dir is not None:
            self.inductor_dir.mkdir(parents=True, exist_ok=True)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.inductor_dir)

    # ---- build and load ------------------------------------------------------------------------

    def build(self, onnx_path: Path, shapes: ShapeRanges, precision: str, out_dir: Path, progress: Progress,
              calibration: CalibrationSet | None = None, int8_scope: str | None = None) -> list[str]:
        raise EngineError("the compile backend builds from the torch module, not from ONNX: call "
                          "build_module(spec, ...) (build_engines does)")

    def build_module(self, spec: Any, model: str, shapes: ShapeRanges, precision: str, out_dir: Path,
                     progress: Progress) -> list[str]:
        """Compile ``spec``'s module for ``shapes`` in ``precision``; write the manifest and
        Inductor's artifacts into ``out_dir``; return their names."""
        if precision not in DTYPES:
            raise InvalidValue(f"precision={precision!r}: the compile backend runs fp16, bf16 or fp32")
        self.attach(model, spec)
        self.use_inductor_dir()
        static = all(lo == hi for lo, _, hi in shapes.values())
        manifest = {"version": MANIFEST_VERSION, "component": spec.name, "model": model, "precision": precision,
                    "static": static, "shapes": {k: [list(s) for s in v] for k, v in shapes.items()},
                    "settings": asdict(self.settings), "torch": torch.__version__}
        start = time.perf_counter()
        try:
            self._compile_points(spec, manifest, shapes, static, progress)
        except CompileFailed as exc:
            if not self.settings.fullgraph:
                raise
            # A graph break: compile the pieces between breaks (no CUDA graphs for this one), and say so.
            log.warning("%s: %s; compiling it in pieces between graph breaks, without CUDA graphs", spec.name, exc)
            manifest.update(fullgraph=False, graph_break=str(exc)[:500])
            self._compile_points(spec, manifest, shapes, static, progress)
        (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
        log.info("compiled %s (%s, %s) in %.1f s", spec.name, precision, "static" if static else "dynamic",
                 time.perf_counter() - start)
        files = [MANIFEST]
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None and saved[0]:
            (out_dir / ARTIFACTS).write_bytes(saved[0])
            files.append(ARTIFACTS)
        progress(1.0, "compiled")
        return files

    def _compile_points(self, spec: Any, manifest: dict, shapes: ShapeRanges, static: bool,
                        progress: Progress) -> None:
        """Compile at the profile's fixed shapes (a dynamic profile: opt, then max, which makes
        Dynamo mark the varying sizes dynamic); ``CompileFailed`` at a graph break."""
        from sd_accel.backends.compile.runner import CompiledRunner

        runner = CompiledRunner(self, manifest, shapes)
        points = ("opt",) if static else ("opt", "max")
        try:
            for i, point in enumerate(points):
                progress(0.1 + 0.8 * i / len(points), f"compiling {spec.name} at its {point} shapes (Inductor)")
                try:
                    runner.infer(_feed_at(spec, shapes, point, self.torch_device))
                except EngineError as exc:
                    raise CompileFailed(f"torch.compile of {spec.name} failed: {exc}. Use another backend for it "
                                        f"(components=... without {spec.name!r}) or eager torch") from exc
        finally:
            runner.close()

    def load(self, engine_dir: Path, files: list[str], shapes: ShapeRanges) -> CompiledRunner:
        from sd_accel.backends.compile.runner import CompiledRunner

        try:
            manifest = json.loads((engine_dir / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise EngineFault(f"compiled engine {engine_dir.name}: its manifest is unreadable ({exc})") from exc
        if manifest.get("version") != MANIFEST_VERSION:
            raise EngineFault(f"compiled engine {engine_dir.name}: manifest version {manifest.get('version')}, "
                              f"this sd-accel reads {MANIFEST_VERSION}: rebuild it")
        self.use_inductor_dir()
        if ARTIFACTS in files:
            load_artifacts(engine_dir / ARTIFACTS)
        return CompiledRunner(self, manifest, shapes)


def _feed_at(spec: Any, shapes: ShapeRanges, point: str, device: str) -> dict[str, torch.Tensor]:
    """A sample feed at the profile's ``opt`` or ``max`` shapes (the spec's own value ranges)."""
    index = {"min": 0, "opt": 1, "max": 2}[point]
    g = torch.Generator("cpu").manual_seed(0)
    feed = {}
    for t in spec.inputs():
        shape = shapes[t.name][index]
        if t.dtype in (torch.int32, torch.int64):
            feed[t.name] = torch.randint(0, spec.int_high(t.name), shape, generator=g, dtype=t.dtype)
        else:
            feed[t.name] = (torch.randn(shape, generator=g) * spec.scale(t.name)).to(t.dtype)
    return {k: v.to(device) for k, v in feed.items()}
