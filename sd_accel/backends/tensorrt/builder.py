"""Build TensorRT engines through polygraphy: native instance norm, one optimization profile
per engine, a timing cache per GPU arch, a workspace limit and a progress monitor.

The arguments of every polygraphy call are made by small functions (:func:`parse_call`,
:func:`config_kwargs`, :func:`build_time_config_kwargs`, :func:`engine_call`), so the tests bind
them to the installed polygraphy's real signatures. The TensorRT names they lead to are declared
per version in ``api_names``.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from sd_accel.backends.base import BackendInfo, EngineError, Progress, ShapeRanges
from sd_accel.backends.tensorrt.versions import TrtFeatures, features, onnx_precision

ENGINE_FILE = "engine.plan"
FP16_ONNX_FILE = "model.fp16.onnx"
DEFAULT_WORKSPACE = 4 * 2**30
BUILDER_OPTIMIZATION_LEVEL = 3


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


# ---- the fp16 ONNX for strongly typed (11.x) builds -----------------------------------------------


def fp32_island(model) -> list[str]:
    """Names of the nodes that must stay fp32 in an fp16 copy: every Sin/Cos and the nodes that
    feed them (the timestep embedding). diffusers computes it in fp32 even in fp16 models: in
    fp16, ``999 * freq`` is off by up to 0.25 rad before the sine."""
    producer = {out: node for node in model.graph.node for out in node.output}
    keep: dict[str, None] = {}
    todo = [n for n in model.graph.node if n.op_type in ("Sin", "Cos")]
    while todo:
        node = todo.pop()
        if node.name in keep:
            continue
        keep[node.name] = None
        todo.extend(producer[i] for i in node.input if i in producer)
    return list(keep)


def _drop_round_trips(model) -> int:
    """Remove the fp32 -> fp16 -> fp32 Cast pairs onnxruntime's converter puts between two fp32
    (blocked) nodes, or between an fp32 graph input and a blocked node: they would round the
    island's values to fp16 after all. Only pairs the converter made are touched."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    rename: dict[str, str] = {}
    dropped = []
    for node in graph.node:
        if node.op_type != "Cast" or not node.name.endswith("_cast_to_fp32_node"):
            continue
        first = producer.get(node.input[0])
        if first is None or first.op_type != "Cast":
            continue
        if first.name.endswith("_cast_to_fp16_node") or first.name.startswith("graph_input_cast"):
            rename[node.output[0]] = first.input[0]
            dropped.append(node)
    if not dropped:
        return 0
    outputs = {o.name for o in graph.output}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    for node in dropped:
        if node.output[0] not in outputs:
            graph.node.remove(node)
    used = {i for n in graph.node for i in n.input} | outputs
    for node in [n for n in graph.node if n.op_type == "Cast" and n.output[0] not in used]:
        graph.node.remove(node)
    return len(dropped)


def _name_nodes(model) -> None:
    for i, node in enumerate(model.graph.node):  # the block list goes by node name
        if not node.name:
            node.name = f"sd_accel_node_{i}"


def _typed(model):
    """``model`` with value_info for its intermediate tensors, or as it was where inference fails."""
    import onnx

    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:
        return model


def fp16_model(model, infer: bool = True):
    """An fp16 copy of an fp32 ONNX model: I/O stay fp32, the timestep embedding stays fp32.

    The converter casts around fp32 nodes only where it knows the tensor types, so the island is
    kept only when shape inference typed the graph (``infer=False``: the caller already did)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    _name_nodes(model)
    if infer:
        model = _typed(model)
    island = fp32_island(model) if len(model.graph.value_info) else []
    model = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True, node_block_list=island)
    _drop_round_trips(model)
    return model


def fp16_onnx(onnx_path: Path) -> Path:
    """An fp16 copy of an ONNX model next to it (see :func:`fp16_model`), for strongly typed
    builds. Written under a lock and renamed into place, so a crash or a concurrent build never
    leaves a half file that later builds would trust."""
    import onnx
    from filelock import FileLock
    from onnx.external_data_helper import load_external_data_for_model

    from sd_accel.onnx.optimize import EXTERNAL_DATA_THRESHOLD

    onnx_path = Path(onnx_path)
    out = onnx_path.with_name(FP16_ONNX_FILE)
    with FileLock(str(out) + ".lock"):
        if out.exists():
            return out
        # Shape inference before the weights are loaded: an in-memory model must stay under 2 GiB.
        model = onnx.load(str(onnx_path), load_external_data=False)
        _name_nodes(model)
        model = _typed(model)
        load_external_data_for_model(model, str(onnx_path.parent))
        model = fp16_model(model, infer=False)
        weights = sum(len(t.raw_data) for t in model.graph.initializer)
        big = weights > EXTERNAL_DATA_THRESHOLD
        tmp = onnx_path.parent / f".fp16-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            onnx.save_model(model, str(tmp / out.name), save_as_external_data=big,
                            all_tensors_to_one_file=True, location=out.name + ".data")
            if big:
                os.replace(tmp / (out.name + ".data"), out.with_name(out.name + ".data"))
            os.replace(tmp / out.name, out)  # the model file last: its presence means "complete"
        finally:
            for leftover in tmp.iterdir():
                leftover.unlink()
            tmp.rmdir()
    return out


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


def config_kwargs(shapes: ShapeRanges, precision: str, feats: TrtFeatures, timing_cache: Path | None) -> dict:
    """``CreateConfig`` arguments that need no TensorRT: profile, precision flag, timing cache.

    ``tactic_sources=[]`` (no cuBLAS/cuDNN tactics) follows NVIDIA's demoDiffusion; 10.x builds fp16
    with the FP16 flag, 11.x has no flag (the ONNX is fp16, see :func:`fp16_onnx`).
    """
    kwargs: dict[str, Any] = {
        "profiles": [profile_for(shapes)],
        "builder_optimization_level": BUILDER_OPTIMIZATION_LEVEL,
        "tactic_sources": [],
    }
    if feats.precision_flags and precision == "fp16":  # 10.x: BuilderFlag.FP16 (api_names.ONLY_10_FP16)
        kwargs["fp16"] = True
    if timing_cache is not None:
        kwargs["load_timing_cache"] = str(timing_cache)
    return kwargs


def build_time_config_kwargs(trt, workspace_bytes: int, monitor) -> dict:
    """``CreateConfig`` arguments made of TensorRT objects: the workspace limit and the monitor."""
    return {"memory_pool_limits": {trt.MemoryPoolType.WORKSPACE: int(workspace_bytes)}, "progress_monitor": monitor}


def parse_call(trt, source: Path, feats: TrtFeatures) -> tuple[tuple, dict]:
    """``network_from_onnx_path`` arguments: native InstanceNormalization (no plugin), strongly
    typed on 11.x (api_names.ONLY_11)."""
    return (str(source),), {
        "flags": [trt.OnnxParserFlag.NATIVE_INSTANCENORM],
        "strongly_typed": feats.strongly_typed_only,
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


class TensorRTBackend:
    name = "tensorrt"

    def __init__(self, cache_root: Path | None = None, workspace_bytes: int = DEFAULT_WORKSPACE) -> None:
        self.cache_root = cache_root
        self.workspace_bytes = workspace_bytes

    def info(self) -> BackendInfo:
        from sd_accel.device import gpu_arch

        ok, version, why = trt_status()
        return BackendInfo(self.name, version, gpu_arch() if ok else "", ok, why)

    def precisions(self) -> tuple[str, ...]:
        return ("fp16", "fp32")

    def build_config_kwargs(self, shapes: ShapeRanges, precision: str, version: str, timing_cache: Path | None):
        """Arguments for polygraphy's ``CreateConfig`` that need no TensorRT, and the version's features."""
        feats = features(version)
        return config_kwargs(shapes, precision, feats, timing_cache), feats

    def build(
        self, onnx_path: Path, shapes: ShapeRanges, precision: str, out_dir: Path, progress: Progress
    ) -> list[str]:
        ok, version, why = trt_status()
        if not ok:
            raise EngineError(why)
        from sd_accel.device import gpu_arch

        return self.build_with(onnx_path, shapes, precision, out_dir, progress, version=version, arch=gpu_arch())

    def build_with(
        self, onnx_path: Path, shapes: ShapeRanges, precision: str, out_dir: Path, progress: Progress,
        *, version: str, arch: str,
    ) -> list[str]:
        """:meth:`build` once TensorRT's version and the GPU arch are known (tests run it on a
        stand-in ``tensorrt`` module, see ``dryrun``)."""
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

        timing = timing_cache_path(self.cache_root, arch, version) if self.cache_root else None
        if timing is not None:
            timing.parent.mkdir(parents=True, exist_ok=True)
        kwargs, feats = self.build_config_kwargs(shapes, precision, version, timing)
        monitor = progress_monitor(trt, progress)
        kwargs.update(build_time_config_kwargs(trt, self.workspace_bytes, monitor))
        source = fp16_onnx(onnx_path) if onnx_precision(precision, feats) == "fp16" else Path(onnx_path)
        progress(0.0, "TensorRT: parsing ONNX")
        try:
            args, kw = parse_call(trt, source, feats)
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
        progress(1.0, "TensorRT: engine saved")
        return [ENGINE_FILE]

    def load(self, engine_dir: Path, files: list[str], shapes: ShapeRanges):
        from sd_accel.backends.tensorrt.runner import TensorRTRunner

        if files and list(files) != [ENGINE_FILE]:
            raise EngineError(f"a TensorRT engine folder holds {ENGINE_FILE}, not {files}")
        return TensorRTRunner(Path(engine_dir) / ENGINE_FILE, shapes)
