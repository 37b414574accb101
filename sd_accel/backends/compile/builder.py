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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sd_accel.backends.base import Backend, BackendInfo
from sd_accel.core import EngineError, EngineFault, InvalidValue, Progress, ShapeRanges

if TYPE_CHECKING:
    from sd_accel.backends.compile.graphs import GraphCapturer
    from sd_accel.backends.compile.runner import CompiledRunner
    from sd_accel.core import CalibrationSet

log = logging.getLogger("sd_accel")

MANIFEST = "manifest.json"
ARTIFACTS = "inductor.bin"
MANIFEST_VERSION = 1
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class CompileFailed(EngineError):
    """torch.compile could not compile a component (a graph break under ``fullgraph=True``, an
    Inductor error): the message says where, and that the other backends or eager torch serve it."""


@dataclass(frozen=True)
class CompileSettings:
    """How a component is compiled. The defaults are what pays (see docs/guides/gpu-compile.md):

    ``mode``: Inductor's mode. ``"default"`` on both devices: ``"max-autotune-no-cudagraphs"``
    autotunes GEMMs for minutes per shape for a few percent; ``"reduce-overhead"`` would add
    Inductor's own CUDA graphs, which :class:`~sd_accel.backends.compile.graphs.GraphBook` does
    here with the profile's bookkeeping and the weight-address check. ``cuda_graphs``: capture
    one graph per shape on CUDA (never on a CPU: there are none). ``channels_last``: convolution
    weights in NHWC on CUDA (Tensor Cores' layout; on CPUs Inductor picks layouts itself).
    ``fullgraph``: a graph break is an error at build (the call then runs torch, with the reason)
    rather than a silent split into eager pieces. Fused QKV projections are left off on purpose:
    diffusers' ``fuse_qkv_projections`` copies the weights into new ones, which a LoRA loaded
    later would not reach (stale), and Inductor already fuses the bias and activation work.
    """

    mode: str = "default"
    cuda_graphs: bool = True
    max_graphs: int = 8
    channels_last: bool = True
    fullgraph: bool = True

    @classmethod
    def from_env(cls) -> CompileSettings:
        """``SD_ACCEL_COMPILE_MODE`` / ``SD_ACCEL_COMPILE_GRAPHS=0`` override the defaults (the GPU
        script and users try modes without code)."""
        mode = os.environ.get("SD_ACCEL_COMPILE_MODE", cls.mode)
        modes = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")
        if mode not in modes:
            raise InvalidValue(f"SD_ACCEL_COMPILE_MODE={mode!r}: use one of {', '.join(modes)}")
        graphs = os.environ.get("SD_ACCEL_COMPILE_GRAPHS", "1") not in ("0", "false", "no")
        return cls(mode=mode, cuda_graphs=graphs)


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


@dataclass
class _Attached:
    export: torch.nn.Module  # the spec's export wrapper around the live module
    module: torch.nn.Module  # the pipeline's module (weights, dtype, device)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]  # the spec's input dtypes (ints stay ints)


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

    def __init__(self, device: str = "cpu", settings: CompileSettings | None = None) -> None:
        self.torch_device = device
        self.settings = settings or CompileSettings.from_env()
        # component and model id -> the live module (attach); the runtime hands it over at swap time
        self._attached: dict[tuple[str, str], _Attached] = {}
        # where CUDA graphs come from; the tests put a CPU stand-in here (graphs.GraphCapturer)
        self.new_capturer: Callable[[], GraphCapturer] | None = None

    @property
    def cuda(self) -> bool:
        return self.torch_device.startswith("cuda")

    def info(self) -> BackendInfo:
        version = f"torch-{torch.__version__}"
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
        self._attached[(spec.name, model)] = _Attached(
            spec.export_module().eval(), module, tuple(t.name for t in spec.inputs()),
            tuple(t.name for t in spec.outputs()), tuple(t.dtype for t in spec.inputs()))

    def attached(self, component: str, model: str) -> _Attached | None:
        return self._attached.get((component, model))

    # ---- build and load ------------------------------------------------------------------------

    def build(self, onnx_path: Path, shapes: ShapeRanges, precision: str, out_dir: Path, progress: Progress,
              calibration: CalibrationSet | None = None, int8_scope: str | None = None) -> list[str]:
        raise EngineError("the compile backend builds from the torch module, not from ONNX: call "
                          "build_module(spec, ...) (build_engines does)")

    def build_module(self, spec: Any, model: str, shapes: ShapeRanges, precision: str, out_dir: Path,
                     progress: Progress) -> list[str]:
        """Compile ``spec``'s module for ``shapes`` in ``precision``; write the manifest and
        Inductor's artifacts into ``out_dir``; return their names."""
        from sd_accel.backends.compile.runner import CompiledRunner

        if precision not in DTYPES:
            raise InvalidValue(f"precision={precision!r}: the compile backend runs fp16, bf16 or fp32")
        self.attach(model, spec)
        static = all(lo == hi for lo, _, hi in shapes.values())
        manifest = {"version": MANIFEST_VERSION, "component": spec.name, "model": model, "precision": precision,
                    "static": static, "shapes": {k: [list(s) for s in v] for k, v in shapes.items()},
                    "settings": asdict(self.settings), "torch": torch.__version__}
        (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
        runner = CompiledRunner(self, manifest, shapes)
        points = ("opt",) if static else ("opt", "max")  # a dynamic profile: the second shape marks it dynamic
        start = time.perf_counter()
        for i, point in enumerate(points):
            progress(0.1 + 0.8 * i / len(points), f"compiling {spec.name} at its {point} shapes (Inductor)")
            feed = _feed_at(spec, shapes, point, self.torch_device)
            try:
                runner.infer(feed)
            except EngineError as exc:
                raise CompileFailed(f"torch.compile of {spec.name} failed: {exc}. Use another backend for it "
                                    f"(components=... without {spec.name!r}) or eager torch") from exc
        log.info("compiled %s (%s, %s) in %.1f s", spec.name, precision, "static" if static else "dynamic",
                 time.perf_counter() - start)
        runner.close()
        files = [MANIFEST]
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None and saved[0]:
            (out_dir / ARTIFACTS).write_bytes(saved[0])
            files.append(ARTIFACTS)
        progress(1.0, "compiled")
        return files

    def load(self, engine_dir: Path, files: list[str], shapes: ShapeRanges) -> CompiledRunner:
        from sd_accel.backends.compile.runner import CompiledRunner

        try:
            manifest = json.loads((engine_dir / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise EngineFault(f"compiled engine {engine_dir.name}: its manifest is unreadable ({exc})") from exc
        if manifest.get("version") != MANIFEST_VERSION:
            raise EngineFault(f"compiled engine {engine_dir.name}: manifest version {manifest.get('version')}, "
                              f"this sd-accel reads {MANIFEST_VERSION}: rebuild it")
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
