"""Build TensorRT engines through polygraphy: native instance norm, one optimization profile
per engine, a timing cache per GPU arch, a workspace limit and a progress monitor.

The arguments of every polygraphy call are made by small functions (:func:`parse_call`,
:func:`config_kwargs`, :func:`build_time_config_kwargs`, :func:`engine_call`), so the tests bind
them to the installed polygraphy's real signatures. The TensorRT names they lead to are declared
per version in ``tests/support/trt/api_names.py``, which the tests check against the real
binding modules of TensorRT 10.x and 11.x.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from sd_accel.backends.base import Backend, BackendInfo
from sd_accel.backends.tensorrt.refit import META_FILE, engine_meta, graph_facts, refit_plan
from sd_accel.backends.tensorrt.versions import TrtFeatures, features, onnx_precision
from sd_accel.core import CalibrationSet, EngineError, Progress, ShapeRanges
from sd_accel.onnx.fp16 import fp16_onnx

log = logging.getLogger("sd_accel")

ENGINE_FILE = "engine.plan"
DEFAULT_WORKSPACE = 4 * 2**30
BUILDER_OPTIMIZATION_LEVEL = 3
# Weight streaming: "auto" (the default) streams an engine whose weights take more than this share
# of the card's memory (the activations and the rest of the pipeline need the remainder); "1"
# streams every engine, "0" none.
STREAMING_ENV = "SD_ACCEL_TRT_WEIGHT_STREAMING"
STREAM_ABOVE = 0.5


def trt_status() -> tuple[bool, str, str]:
    """(usable, version, why not)."""
    import torch

    try:
        import tensorrt as trt
    except Exception as exc:
        if torch.version.cuda is None:
            return False, "", (
                f"TensorRT is not importable ({type(exc).__name__}: {exc}), and this torch "
                f"({torch.__version__}) is a CPU build: TensorRT needs an NVIDIA GPU and a CUDA build of torch"
            )
        # The plain `tensorrt` package picks CUDA 13 for TensorRT 11: name the build torch's CUDA needs.
        cuda = torch.version.cuda.split(".")[0]
        return False, "", (
            f"TensorRT is not importable ({type(exc).__name__}: {exc}); install the build for torch's "
            f"CUDA {cuda}: `pip install tensorrt-cu{cuda} polygraphy`"
        )

    if not torch.cuda.is_available():
        return False, trt.__version__, "TensorRT needs an NVIDIA GPU and a CUDA build of torch; none is visible"
    try:
        features(trt.__version__)
    except ValueError as exc:
        return False, trt.__version__, str(exc)
    return True, trt.__version__, ""


def timing_cache_path(cache_root: Path, arch: str, version: str) -> Path:
    """One timing cache per GPU arch and TensorRT version: caches do not travel across either."""
    return Path(cache_root) / "timing" / f"timing.{arch}.trt{version}.cache"


# ---- the exact polygraphy calls ---------------------------------------------------------------------


def profile_for(shapes: ShapeRanges):
    """polygraphy's ``Profile`` for one engine's ranges; refuses ranges TensorRT would refuse."""
    from polygraphy.backend.trt import Profile

    profile = Profile()
    for name, (lo, opt, hi) in shapes.items():
        lo, opt, hi = tuple(lo), tuple(opt), tuple(hi)
        if not len(lo) == len(opt) == len(hi):
            raise EngineError(f"input {name!r}: min/opt/max shapes differ in rank: {lo} {opt} {hi}")
        if any(not (0 < a <= b <= c) for a, b, c in zip(lo, opt, hi, strict=True)):
            raise EngineError(f"input {name!r}: needs 0 < min <= opt <= max per dimension, got {lo} {opt} {hi}")
        profile.add(name, min=lo, opt=opt, max=hi)
    return profile


def wants_streaming(weights_bytes: int, card_bytes: int, feats: TrtFeatures) -> bool:
    """Whether to build with weight streaming (:data:`STREAMING_ENV`; "auto": the engine's weights
    are more than :data:`STREAM_ABOVE` of the card's memory). TensorRT before 10.1 cannot.

    >>> from sd_accel.backends.tensorrt.versions import features
    >>> wants_streaming(22 * 2**30, 24 * 2**30, features("10.16.1")), wants_streaming(2 * 2**30, 24 * 2**30, features("11.4"))
    (True, False)
    """
    setting = os.environ.get(STREAMING_ENV, "auto").strip().lower()
    if setting in ("0", "off", "no", "false"):
        return False
    asked = setting in ("1", "on", "yes", "true")
    wanted = asked or weights_bytes > STREAM_ABOVE * card_bytes
    if wanted and not feats.weight_streaming:
        log.warning("this engine's weights (%.1f GB) %s, but TensorRT %d.0 cannot stream weights (10.1 and later "
                    "can): it is built to hold them on the card", weights_bytes / 1e9,
                    f"were to be streamed ({STREAMING_ENV})" if asked else "take most of the card", feats.major)
        return False
    return wanted


def engine_weight_bytes(onnx_path: Path, precision: str) -> int:
    """Bytes the engine's weights take on the card: the ONNX initializers (fp32 exports) at the
    engine's precision."""
    import onnx

    from sd_accel.onnx.optimize import initializer_bytes

    total = initializer_bytes(onnx.load(str(onnx_path), load_external_data=False))
    return total // 2 if precision in ("fp16", "bf16") else total


def card_bytes() -> int:
    """The current CUDA device's memory."""
    import torch

    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def config_kwargs(shapes: ShapeRanges, precision: str, feats: TrtFeatures, timing_cache: Path | None,
                  streaming: bool = False) -> dict:
    """``CreateConfig`` arguments that need no TensorRT: profile, precision flag, timing cache.

    ``tactic_sources=[]`` (no cuBLAS/cuDNN tactics) follows NVIDIA's demoDiffusion; 10.x builds fp16
    with the FP16 flag, 11.x has no flag (the ONNX is fp16, see :func:`fp16_onnx`).

    ``streaming``: the weights stay in host memory and stream to the card as layers run
    (:func:`wants_streaming`); the network is strongly typed then (no FP16 flag: an fp16 ONNX).

    ``refittable=True`` (``BuilderFlag.REFIT``): LoRAs and other weight changes are refitted into
    the engine (``refit.py``) instead of building it again. REFIT allows arbitrary new weights;
    REFIT_IDENTICAL builds as fast an engine as a plain one but leaves a refit with weights other
    than the build's undefined (it is meant for weight-stripped plans), and STRIP_PLAN would leave
    the plan without weights. (TensorRT 11.3 lists a known issue of REFIT engines dropping a GEMM
    bias: built engines are validated against torch, which would refuse such an engine.)
    """
    kwargs: dict[str, Any] = {
        "profiles": [profile_for(shapes)],
        "builder_optimization_level": BUILDER_OPTIMIZATION_LEVEL,
        "tactic_sources": [],
        "refittable": True,
    }
    if feats.precision_flags and precision == "fp16" and not streaming:  # 10.x: BuilderFlag.FP16 (ONLY_10_FP16)
        kwargs["fp16"] = True
    if streaming:  # BuilderFlag.WEIGHT_STREAMING (api_names.STREAMING in tests/): strongly typed, fp16 ONNX
        kwargs["weight_streaming"] = True
    if timing_cache is not None:
        kwargs["load_timing_cache"] = str(timing_cache)
    return kwargs


def build_time_config_kwargs(trt, workspace_bytes: int, monitor) -> dict:
    """``CreateConfig`` arguments made of TensorRT objects: the workspace limit and the monitor."""
    return {"memory_pool_limits": {trt.MemoryPoolType.WORKSPACE: int(workspace_bytes)}, "progress_monitor": monitor}


def parse_call(trt, source: Path, feats: TrtFeatures, streaming: bool = False) -> tuple[tuple, dict]:
    """``network_from_onnx_path`` arguments: native InstanceNormalization (no plugin), strongly
    typed on 11.x (api_names.ONLY_11) and for weight streaming (api_names.STREAMING)."""
    return (str(source),), {
        "flags": [trt.OnnxParserFlag.NATIVE_INSTANCENORM],
        "strongly_typed": feats.strongly_typed_only or streaming,
    }


def engine_call(network, config, timing_cache: Path | None) -> tuple[tuple, dict]:
    """``engine_from_network`` arguments; the timing cache is merged back into its file."""
    return (network,), {"config": config, "save_timing_cache": str(timing_cache) if timing_cache else None}


def progress_monitor(trt, progress: Progress):
    """A ``trt.IProgressMonitor`` that reports the outermost phase's progress.

    TensorRT calls these methods from C++: they never raise. When ``progress`` raises (a
    cancelled build), ``step_complete`` returns False, which makes TensorRT stop, and the
    exception is kept in ``.error`` for the builder to re-raise.
    """

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.error: BaseException | None = None
            self._phases: dict[str, list] = {}  # name -> [parent, steps, done]

        def phase_start(self, phase_name, parent_phase, num_steps):
            try:
                self._phases[phase_name] = [parent_phase, max(int(num_steps), 1), 0]
            except Exception:
                pass

        def step_complete(self, phase_name, step):
            if self.error is not None:
                return False
            try:
                if phase_name in self._phases:
                    self._phases[phase_name][2] = int(step) + 1
                progress(self._fraction(), f"TensorRT: {phase_name}")
            except BaseException as exc:  # noqa: B036 - KeyboardInterrupt too: it must not cross C++
                self.error = exc
                return False
            return True

        def phase_finish(self, phase_name):
            self._phases.pop(phase_name, None)

        def _fraction(self) -> float:
            roots = [n for n, (parent, _, _) in self._phases.items() if parent not in self._phases]
            if not roots:
                return 0.0

            def frac(name: str, depth: int = 0) -> float:
                _, steps, done = self._phases[name]
                kids = [n for n, v in self._phases.items() if v[0] == name and n != name]
                inner = frac(kids[-1], depth + 1) if kids and depth < 16 else 0.0
                return min((done + inner) / steps, 1.0)

            return frac(roots[0])

    return Monitor()


# ---- the backend --------------------------------------------------------------------------------


class TensorRTBackend(Backend):
    name = "tensorrt"
    torch_device = "cuda"
    patches_weights = True  # trt.Refitter, for engines built refittable
    # A chain's engines live on the card, not in the host memory by which a chain keeps its segments
    # loaded (sd_accel.backends.chain.chain_keeping); an engine larger than the card streams its
    # weights itself (weight streaming, runner.py)
    engines_in_host_memory = False

    def __init__(self, cache_root: Path | None = None, workspace_bytes: int = DEFAULT_WORKSPACE) -> None:
        self.cache_root = cache_root
        self.workspace_bytes = workspace_bytes

    def info(self) -> BackendInfo:
        from sd_accel.device import gpu_arch

        ok, version, why = trt_status()
        return BackendInfo(self.name, version, gpu_arch() if ok else "", ok, why)

    def default_precision(self) -> str:
        return "fp16"

    def install_packages(self) -> tuple[str, ...]:
        """The TensorRT build for torch's CUDA (the plain ``tensorrt`` package may pick another)."""
        import torch

        cuda = str(torch.version.cuda or "").split(".")[0]
        return (f"tensorrt-cu{cuda}" if cuda else "tensorrt", "polygraphy")

    def build(
        self, onnx_path: Path, shapes: ShapeRanges, precision: str, out_dir: Path, progress: Progress,
        calibration: CalibrationSet | None = None, int8_scope: str | None = None,
    ) -> list[str]:
        """Build a serialized engine into ``out_dir``; ``calibration`` and ``int8_scope`` are unused
        (no INT8 here)."""
        ok, version, why = trt_status()
        if not ok:
            raise EngineError(why)
        if precision not in self.precisions():
            raise EngineError(f"the TensorRT backend builds {', '.join(self.precisions())}, not {precision!r}")
        import tensorrt as trt
        from polygraphy.backend.trt import (
            CreateConfig,
            engine_from_network,
            network_from_onnx_path,
            save_engine,
        )
        from polygraphy.exception import PolygraphyException

        from sd_accel.device import gpu_arch

        timing = timing_cache_path(self.cache_root, gpu_arch(), version) if self.cache_root else None
        if timing is not None:
            timing.parent.mkdir(parents=True, exist_ok=True)
        feats = features(version)
        streaming = wants_streaming(engine_weight_bytes(Path(onnx_path), precision), card_bytes(), feats)
        kwargs = config_kwargs(shapes, precision, feats, timing, streaming)
        monitor = progress_monitor(trt, progress)
        kwargs.update(build_time_config_kwargs(trt, self.workspace_bytes, monitor))
        source = fp16_onnx(onnx_path) if onnx_precision(precision, feats, streaming) == "fp16" else Path(onnx_path)
        progress(0.0, "TensorRT: parsing ONNX" + (" (weights streamed from host memory)" if streaming else ""))
        try:
            args, kw = parse_call(trt, source, feats, streaming)
            network = network_from_onnx_path(*args, **kw)
            args, kw = engine_call(network, CreateConfig(**kwargs), timing)
            engine = engine_from_network(*args, **kw)
        except PolygraphyException as exc:
            if monitor.error is not None:  # cancelled: the caller's exception, not TensorRT's
                raise monitor.error from None
            raise EngineError(
                f"TensorRT {version} could not build an engine from {source.name} ({exc}); see the TensorRT "
                "log above. Out of GPU memory? Try a narrower profile."
            ) from exc
        if monitor.error is not None:
            raise monitor.error
        if engine is None:
            raise EngineError("TensorRT returned no engine (out of GPU memory, or the build was cancelled)")
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        save_engine(engine, str(Path(out_dir) / ENGINE_FILE))
        meta = {"refittable": kwargs["refittable"], "precision": precision, "weight_streaming": streaming,
                "onnx_precision": onnx_precision(precision, feats, streaming), **graph_facts(source)}
        (Path(out_dir) / META_FILE).write_text(json.dumps(meta))
        progress(1.0, "TensorRT: engine saved")
        return [ENGINE_FILE, META_FILE]

    def patch_weights(self, engine_dir: Path, files: list[str], value, out_dir: Path) -> list[str] | None:
        """A copy of a refittable engine in ``out_dir`` with every weight set to ``value(onnx_name)``
        (``trt.Refitter``; see ``refit.py``): its files, or None where it cannot (an engine built
        before refits, or one whose weights the graph's initializers do not all name)."""
        engine_dir, out_dir = Path(engine_dir), Path(out_dir)
        meta = engine_meta(engine_dir, files)
        if not meta.get("refittable") or not trt_status()[0]:
            return None
        plan = refit_plan((engine_dir / ENGINE_FILE).read_bytes(), value, meta, engine_dir.name)
        if plan is None:
            return None
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / ENGINE_FILE).write_bytes(plan)
        shutil.copyfile(engine_dir / META_FILE, out_dir / META_FILE)
        return [ENGINE_FILE, META_FILE]

    def load(self, engine_dir: Path, files: list[str], shapes: ShapeRanges):
        from sd_accel.backends.tensorrt.runner import TensorRTRunner

        if files and (ENGINE_FILE not in files or set(files) - {ENGINE_FILE, META_FILE}):
            raise EngineError(f"a TensorRT engine folder holds {ENGINE_FILE} (and {META_FILE}), not {files}")
        meta = engine_meta(Path(engine_dir), files)
        return TensorRTRunner(Path(engine_dir) / ENGINE_FILE, shapes, streaming=bool(meta.get("weight_streaming")))
