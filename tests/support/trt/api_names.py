"""Every TensorRT name the backend uses, per TensorRT version, and the real name lists to check them.

TensorRT never runs on our CI machines, so nothing else would notice a misspelled method or an
API a new TensorRT removed. Names here are dotted paths below the ``tensorrt`` module
(``"DataType.HALF"``) or ``"<Class>.<member>"`` for members of the objects the backend holds
(``"ICudaEngine.get_tensor_name"``), for the backend in ``sd_accel/backends/tensorrt/``.
``tests/test_trt_names.py`` checks three things:

* every name :func:`used_names` gives for a version exists in that version's real binding module
  (the lists in ``names/``, regenerated from the wheels by ``scripts/trt_names.py``);
* every ``trt.<Name>`` chain and every attribute of a TensorRT object in the backend's source is
  declared below (an ``ast`` scan, using :data:`TRT_OBJECTS` to know which variables hold them);
* a dry run of the whole build and load path on a stand-in ``tensorrt`` module that knows only the
  version's names (``dryrun.py``) completes, and touches the names declared below.

Names are grouped by where the version-dependent branches are (the backend's ``versions.features``): a name that
only one TensorRT major has goes into that major's group, never into the common ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from sd_accel.backends.tensorrt.versions import features

NAMES_DIR = Path(__file__).with_name("names")

# Variables (locals, or ``self.`` attributes) in the backend's source that hold TensorRT objects,
# and the TensorRT class of each; the source scan reads ``engine.get_tensor_name`` as
# ``ICudaEngine.get_tensor_name``.
TRT_OBJECTS: dict[str, str] = {
    "logger": "Logger",
    "_runtime": "Runtime",
    "engine": "ICudaEngine",
    "context": "IExecutionContext",
    "runtime": "Runtime",
    "refitter": "Refitter",
    "prototype": "Weights",
}

# ---- used directly by builder.py / runner.py, on every version --------------------------------

RUNTIME: frozenset[str] = frozenset({
    "__version__",
    "Logger",
    "Logger.WARNING",
    "Runtime",
    "Runtime.deserialize_cuda_engine",
    "ICudaEngine.create_execution_context",
    "ICudaEngine.num_io_tensors",
    "ICudaEngine.get_tensor_name",
    "ICudaEngine.get_tensor_mode",
    "ICudaEngine.get_tensor_dtype",
    "TensorIOMode.INPUT",
    "DataType.FLOAT",
    "DataType.HALF",
    "DataType.BF16",
    "DataType.INT8",
    "DataType.UINT8",
    "DataType.INT32",
    "DataType.INT64",
    "DataType.BOOL",
    "IExecutionContext.set_input_shape",
    "IExecutionContext.get_tensor_shape",
    "IExecutionContext.set_tensor_address",
    "IExecutionContext.execute_async_v3",
})

BUILD: frozenset[str] = frozenset({
    "IProgressMonitor",
    "IProgressMonitor.phase_start",  # overridden: TensorRT calls them, a typo would be silent
    "IProgressMonitor.step_complete",
    "IProgressMonitor.phase_finish",
    "MemoryPoolType.WORKSPACE",
    "OnnxParserFlag.NATIVE_INSTANCENORM",
})

# ---- used directly by refit.py (engines refitted with new weights), on every version ----------

# Signatures, from the TensorRT 10 Python API reference (Refitter, Weights):
#   Refitter(engine: ICudaEngine, logger: ILogger); get_all_weights() -> List[str];
#   get_weights_prototype(weights_name: str) -> Weights (its dtype and size: the count and type
#   set_named_weights accepts); set_named_weights(name: str, weights: Weights) -> bool;
#   get_missing_weights() -> List[str]; refit_cuda_engine() -> bool;
#   Weights(a: numpy.ndarray) (no copy: the array must outlive the refit); .dtype, .size.
REFIT: frozenset[str] = frozenset({
    "Refitter",
    "Refitter.get_all_weights",
    "Refitter.get_weights_prototype",
    "Refitter.set_named_weights",
    "Refitter.get_missing_weights",
    "Refitter.refit_cuda_engine",
    "Weights",
    "Weights.dtype",
    "Weights.size",
    "ICudaEngine.serialize",
})

# ---- touched by polygraphy because of the arguments the backend passes (see builder.py) ------

POLYGRAPHY: frozenset[str] = frozenset({
    # network_from_onnx_path(path, flags=[...], strongly_typed=...)
    "Builder",
    "Builder.create_network",
    "ILogger",
    "ILogger.log",
    "init_libnvinfer_plugins",
    "OnnxParser",
    "OnnxParser.flags",
    "OnnxParser.parse_from_file",
    "OnnxParser.num_errors",
    # CreateConfig(profiles=, builder_optimization_level=, tactic_sources=[], load_timing_cache=,
    #              memory_pool_limits=, progress_monitor=)
    "Builder.create_builder_config",
    "Builder.create_optimization_profile",
    "IOptimizationProfile.set_shape",
    "IBuilderConfig.add_optimization_profile",
    "IBuilderConfig.builder_optimization_level",
    "IBuilderConfig.set_tactic_sources",
    "IBuilderConfig.set_memory_pool_limit",
    "IBuilderConfig.create_timing_cache",
    "IBuilderConfig.set_timing_cache",
    "IBuilderConfig.progress_monitor",
    "IBuilderConfig.profiling_verbosity",
    "ProfilingVerbosity.DETAILED",
    "IBuilderConfig.clear_flag",
    "BuilderFlag.TF32",  # polygraphy clears it unless tf32=True
    "IBuilderConfig.set_flag",  # refittable=True
    "BuilderFlag.REFIT",
    # engine_from_network(network, config=, save_timing_cache=), save_engine(engine, path)
    "Builder.build_serialized_network",
    "IBuilderConfig.get_timing_cache",
    "ITimingCache.combine",
    "ITimingCache.serialize",
    "Runtime.deserialize_cuda_engine",
    "ICudaEngine.serialize",
})

# ---- one TensorRT major only ------------------------------------------------------------------

# 10.x, fp16: an fp32 ONNX and the FP16 builder flag (polygraphy's CreateConfig(fp16=True)).
# TensorRT 11 removed weak typing: these names are gone there.
ONLY_10_FP16: frozenset[str] = frozenset({"BuilderFlag.FP16"})
# 11.x: strongly typed networks (polygraphy's network_from_onnx_path(strongly_typed=True));
# precision comes from the ONNX dtypes (an fp16 ONNX for fp16 engines).
ONLY_11: frozenset[str] = frozenset({"NetworkDefinitionCreationFlag.STRONGLY_TYPED"})
# 10.1 and later, engines whose weights take most of the card (builder.wants_streaming): built with
# CreateConfig(weight_streaming=True) on a strongly typed network, loaded with TensorRT's automatic
# budget (10.0 has only the v1 budget: not used, such engines are built without streaming there).
STREAMING: frozenset[str] = frozenset({
    "BuilderFlag.WEIGHT_STREAMING",
    "NetworkDefinitionCreationFlag.STRONGLY_TYPED",
    "ICudaEngine.get_weight_streaming_automatic_budget",
    "ICudaEngine.weight_streaming_budget_v2",
    "ICudaEngine.streamable_weights_size",
})


def used_names(version: str, precision: str = "fp16", streaming: bool = False) -> frozenset[str]:
    """The names the backend's code path for ``version`` and ``precision`` uses (``streaming``:
    for an engine built with weight streaming, where the version has it)."""
    feats = features(version)
    names = set(RUNTIME | BUILD | REFIT | POLYGRAPHY)
    streams = streaming and feats.weight_streaming
    if feats.precision_flags and precision == "fp16" and not streams:
        names |= ONLY_10_FP16
    if feats.strongly_typed_only:
        names |= ONLY_11
    if streams:
        names |= STREAMING
    return frozenset(names)


def declared_names() -> frozenset[str]:
    """Every name declared above, whatever the version."""
    return RUNTIME | BUILD | REFIT | POLYGRAPHY | ONLY_10_FP16 | ONLY_11 | STREAMING


# ---- the real name lists -------------------------------------------------------------------------


@dataclass(frozen=True)
class NameList:
    """The names one TensorRT version's binding module holds (a ``names/trt-<version>.txt``)."""

    version: str
    names: frozenset[str]
    wheels: tuple[str, ...]  # "file sha256=..." lines from the header

    @property
    def _suffixes(self) -> frozenset[str]:
        return _suffixes(self.names)

    def has(self, name: str) -> bool:
        """Whether one identifier is in the module: equal to, or a tail of, a stored string."""
        return name in self._suffixes

    def missing(self, dotted: str) -> list[str]:
        """The parts of a dotted name (``"DataType.BF16"``) the module lacks; dunders are skipped
        except ``__version__`` (defined in the package's ``__init__.py``)."""
        parts = [p for p in dotted.split(".") if not (p.startswith("__") and p != "__version__")]
        return [p for p in parts if not self.has(p)]


@cache
def _suffixes(names: frozenset[str]) -> frozenset[str]:
    return frozenset(n[i:] for n in names for i in range(len(n)))


def list_path(version: str) -> Path:
    return NAMES_DIR / f"trt-{version}.txt"


def available_versions() -> list[str]:
    """Versions with a committed list, oldest first."""
    found = [p.name[len("trt-"):-len(".txt")] for p in NAMES_DIR.glob("trt-*.txt")]
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".") if x.isdigit()))


@cache
def load_list(version: str) -> NameList:
    path = list_path(version)
    if not path.exists():
        raise FileNotFoundError(f"no name list for TensorRT {version}; run scripts/trt_names.py {version}")
    names, wheels, header_version = set(), [], None
    for line in path.read_text().splitlines():
        if line.startswith("# version:"):
            header_version = line.split(":", 1)[1].strip()
        elif line.startswith("# wheel:"):
            wheels.append(line.split(":", 1)[1].strip())
        elif line and not line.startswith("#"):
            names.add(line.strip())
    if header_version != version:
        raise ValueError(f"{path.name} says it lists TensorRT {header_version}, not {version}")
    return NameList(version, frozenset(names), tuple(wheels))
