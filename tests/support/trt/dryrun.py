"""A stand-in ``tensorrt`` module that has exactly one real TensorRT version's names, for tests.

TensorRT cannot run without an NVIDIA GPU, so the backend's build and load paths would never
execute on CI. Inside ``with dry_run("11.4.0.106") as run:`` an ``import tensorrt`` (ours and
polygraphy's) gets a module on which every class, method, property and enum value exists when,
and only when, the name is in that version's real binding module (``names/trt-<version>.txt``):
anything else raises ``AttributeError`` as the real module would. The whole build path (our code,
and polygraphy's ``network_from_onnx_path`` / ``CreateConfig`` / ``engine_from_network`` /
``save_engine`` with the arguments we pass) and the runner then execute, and ``run.used`` holds
every ``"Class.member"`` they touched.

The stand-ins do what the tests need and no more: the ONNX parser reads the model's inputs (so
polygraphy checks the optimization profile against the real input names), the builder returns a
placeholder plan, and an engine deserialized from a JSON description (:func:`engine_plan`) runs
on the CPU through raw tensor addresses, scaling one input per output, so the runner's shape,
address, dtype and buffer handling run for real.

Subclasses of TensorRT classes (``IProgressMonitor``, ``ILogger``) have each public method they
define checked against the version's names: a misspelled override would never be called by
TensorRT. Helpers on such subclasses must be private (``_name``).

The backend also asks torch about the GPU (is CUDA there, its arch, the current stream):
:func:`pretend_gpu` answers as a machine with one would, and :func:`on_cpu` points a runner at the
CPU, where the stand-in engines compute.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import sys
import types
from collections.abc import Iterator

import numpy as np
import torch

from support.trt.api_names import NameList, load_list

# Methods whose results are TensorRT objects of a known class: lets the run record
# "IBuilderConfig.set_flag" rather than "Builder.create_builder_config().set_flag".
RETURNS = {
    "create_builder_config": "IBuilderConfig",
    "create_network": "INetworkDefinition",
    "create_optimization_profile": "IOptimizationProfile",
    "create_timing_cache": "ITimingCache",
    "get_timing_cache": "ITimingCache",
    "deserialize_cuda_engine": "ICudaEngine",
    "create_execution_context": "IExecutionContext",
    "build_serialized_network": "IHostMemory",
    "serialize": "IHostMemory",
}
NUMPY = {"FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "UINT8": np.uint8, "INT32": np.int32,
         "INT64": np.int64, "BOOL": np.bool_}
ONNX_TYPES = {1: "FLOAT", 10: "HALF", 16: "BF16", 3: "INT8", 2: "UINT8", 6: "INT32", 7: "INT64", 9: "BOOL"}


class DryRun:
    """What one dry run touched: ``used`` names that exist, ``missing`` names looked up in vain
    (the code may have handled the ``AttributeError``, as polygraphy does for optional features)."""

    def __init__(self, names: NameList) -> None:
        self.names = names
        self.version = names.version
        self.used: set[str] = set()
        self.missing: set[str] = set()

    def need(self, owner: str, name: str) -> None:
        key = f"{owner}.{name}" if owner else name
        if self.names.has(name):
            self.used.add(key)
            return
        self.missing.add(key)
        raise AttributeError(f"TensorRT {self.version} has no {key!r}")


_RUN: DryRun | None = None


def _need(owner: str, name: str) -> None:
    if _RUN is None:
        raise AttributeError(f"{owner}.{name}: a dry-run TensorRT object used outside its dry run")
    _RUN.need(owner, name)


class HostMemory(bytes):
    """``trt.IHostMemory``: a buffer, usable in ``with``."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


class Value:
    """A TensorRT object or enum value the stand-ins do not model. Not callable: polygraphy calls
    whatever is callable as a loader, and real engines or configs are not callable."""

    __slots__ = ("_path", "_returns", "_set", "_type")

    def __init__(self, type_name: str, path: str, returns: str | None = None) -> None:
        object.__setattr__(self, "_type", type_name)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_returns", returns)
        object.__setattr__(self, "_set", {})  # properties set on it (config.progress_monitor = ...)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            if name == "__members__":
                return {}
            raise AttributeError(name)
        _need(self._type, name)
        return Member(f"{self._type}.{name}", f"{self._path}.{name}", RETURNS.get(name))

    def __setattr__(self, name: str, value) -> None:
        _need(self._type, name)
        self._set[name] = value

    def __eq__(self, other) -> bool:
        return isinstance(other, Value) and other._path == self._path

    def __hash__(self) -> int:
        return hash(self._path)

    def __lt__(self, other) -> bool:
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def __int__(self) -> int:
        return 0

    __index__ = __int__

    def __bool__(self) -> bool:
        return True

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def __repr__(self) -> str:
        return f"trt.{self._path}"

    __str__ = __repr__


class Member(Value):
    """An attribute the stand-ins do not model: maybe a method, so calling it gives a ``Value``
    (of the class in :data:`RETURNS` where known)."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        if self._returns == "IHostMemory":
            return HostMemory(b"sd-accel dry-run plan")
        if self._returns:
            return Value(self._returns, f"{self._path}()")
        return Value(f"{self._type}()", f"{self._path}()")


class _Meta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            if name == "__members__":
                return {}
            raise AttributeError(name)
        _need(cls._trt_type, name)
        return Member(f"{cls._trt_type}.{name}", f"{cls._trt_type}.{name}")


class FakeObject(metaclass=_Meta):
    """Base of every stand-in class. Attributes of the stand-ins (classes with ``_dry`` in their
    own body) are checked against the version's names; a subclass someone else defines (a
    progress monitor, polygraphy's logger) has its public methods checked once, when defined."""

    _trt_type = "object"
    _dry = True

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "_dry" in cls.__dict__:
            return
        for name, value in cls.__dict__.items():
            if callable(value) and not name.startswith("_"):
                _need(cls._trt_type, name)

    def __getattribute__(self, name: str):
        cls = type(self)
        if name[:1] != "_" and "_dry" in cls.__dict__:
            _need(cls._trt_type, name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(self)
        _need(cls._trt_type, name)
        return Member(f"{cls._trt_type}.{name}", f"{cls._trt_type}().{name}", RETURNS.get(name))

    def __setattr__(self, name: str, value) -> None:
        cls = type(self)
        if name[:1] != "_" and "_dry" in cls.__dict__:
            _need(cls._trt_type, name)
        object.__setattr__(self, name, value)


def _stand_in(name: str) -> type:
    return type(name, (FakeObject,), {"_trt_type": name, "_dry": True})


def _enum(cls: str, value: str) -> Value:
    return Member(f"{cls}.{value}", f"{cls}.{value}")


# ---- the build side -------------------------------------------------------------------------------


class FakeTensor(FakeObject):
    _trt_type = "ITensor"
    _dry = True

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", _enum("DataType", dtype))
        object.__setattr__(self, "is_shape_tensor", False)


class FakeNetwork(FakeObject):
    _trt_type = "INetworkDefinition"
    _dry = True

    def __init__(self, flags: int = 0) -> None:
        object.__setattr__(self, "_flags", flags)
        object.__setattr__(self, "_inputs", [])

    @property
    def num_inputs(self) -> int:
        return len(self._inputs)

    def get_input(self, index: int) -> FakeTensor:
        return self._inputs[index]

    def __iter__(self):  # the layers
        return iter(())

    def __len__(self) -> int:
        return 0


class FakeBuilder(FakeObject):
    _trt_type = "Builder"
    _dry = True

    def create_network(self, flags: int = 0) -> FakeNetwork:
        return FakeNetwork(flags)

    def create_builder_config(self):
        return Value("IBuilderConfig", "Builder().create_builder_config()")

    def create_optimization_profile(self):
        return Value("IOptimizationProfile", "Builder().create_optimization_profile()")

    def build_serialized_network(self, network, config) -> HostMemory | None:
        """Drives the config's progress monitor as TensorRT does; None when it cancels."""
        monitor = config._set.get("progress_monitor") if isinstance(config, Value) else None
        if monitor is not None:
            monitor.phase_start("Building engine", None, 2)
            for step, inner in enumerate(("Graph optimization", "Tactic selection")):
                monitor.phase_start(inner, "Building engine", 3)
                for i in range(3):
                    if not monitor.step_complete(inner, i):
                        return None
                monitor.phase_finish(inner)
                if not monitor.step_complete("Building engine", step):
                    return None
            monitor.phase_finish("Building engine")
        return HostMemory(b"sd-accel dry-run plan")


class FakeParser(FakeObject):
    _trt_type = "OnnxParser"
    _dry = True
    num_errors = 0

    def __init__(self, network: FakeNetwork, logger) -> None:
        object.__setattr__(self, "_network", network)

    def parse_from_file(self, path: str) -> bool:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
        weights = {t.name for t in model.graph.initializer}
        for value in model.graph.input:
            if value.name in weights:
                continue
            tensor_type = value.type.tensor_type
            shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
            self._network._inputs.append(FakeTensor(value.name, shape, ONNX_TYPES.get(tensor_type.elem_type, "FLOAT")))
        return True

    def get_error(self, index: int):
        return Value("IParserError", f"OnnxParser().get_error({index})")


# ---- the runtime side -----------------------------------------------------------------------------


def engine_plan(inputs: dict[str, dict], outputs: dict[str, dict]) -> bytes:
    """The bytes of a stand-in engine the dry-run ``Runtime`` deserializes.

    ``inputs``: name -> {"dtype": "FLOAT", "min": [...], "max": [...]} (the profile's range).
    ``outputs``: name -> {"dtype": "HALF", "like": <input name>, "scale": 2.0}: the output has the
    input's shape and holds ``input * scale``.
    """
    return json.dumps({"inputs": inputs, "outputs": outputs}).encode()


def _array(address: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    np_dtype = np.dtype(NUMPY[dtype])
    count = int(np.prod(shape)) if shape else 1
    raw = (ctypes.c_byte * (count * np_dtype.itemsize)).from_address(address)
    return np.frombuffer(raw, dtype=np_dtype).reshape(shape)


class FakeContext(FakeObject):
    _trt_type = "IExecutionContext"
    _dry = True

    def __init__(self, engine: FakeEngine) -> None:
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_shapes", {})
        object.__setattr__(self, "_addresses", {})
        object.__setattr__(self, "_launches", 0)

    def set_input_shape(self, name: str, shape) -> bool:
        spec = self._engine._spec["inputs"].get(name)
        shape = tuple(int(d) for d in shape)
        if spec is None or len(shape) != len(spec["min"]):
            return False
        if any(not (lo <= d <= hi) for lo, d, hi in zip(spec["min"], shape, spec["max"], strict=True)):
            return False
        self._shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        spec = self._engine._spec
        if name in spec["inputs"]:
            return self._shapes.get(name, tuple(-1 for _ in spec["inputs"][name]["min"]))
        like = spec["outputs"][name]["like"]
        return self._shapes.get(like, tuple(-1 for _ in spec["inputs"][like]["min"]))

    def set_tensor_address(self, name: str, address: int) -> bool:
        if not isinstance(address, int) or address == 0:
            return False
        self._addresses[name] = address
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        if not isinstance(stream_handle, int):
            raise TypeError(f"execute_async_v3 takes an int stream handle, got {type(stream_handle).__name__}")
        spec = self._engine._spec
        names = [*spec["inputs"], *spec["outputs"]]
        if set(names) - set(self._addresses) or set(spec["inputs"]) - set(self._shapes):
            return False
        for name, out in spec["outputs"].items():
            src = _array(self._addresses[out["like"]], self._shapes[out["like"]], spec["inputs"][out["like"]]["dtype"])
            dst = _array(self._addresses[name], self._shapes[out["like"]], out["dtype"])
            dst[...] = (src.astype(np.float64) * out.get("scale", 1.0)).astype(dst.dtype)
        object.__setattr__(self, "_launches", self._launches + 1)
        return True


class FakeEngine(FakeObject):
    _trt_type = "ICudaEngine"
    _dry = True

    def __init__(self, spec: dict) -> None:
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "_names", [*spec["inputs"], *spec["outputs"]])

    @property
    def num_io_tensors(self) -> int:
        return len(self._names)

    def get_tensor_name(self, index: int) -> str:
        return self._names[index]

    def get_tensor_mode(self, name: str) -> Value:
        return _enum("TensorIOMode", "INPUT" if name in self._spec["inputs"] else "OUTPUT")

    def get_tensor_dtype(self, name: str) -> Value:
        table = self._spec["inputs"] if name in self._spec["inputs"] else self._spec["outputs"]
        return _enum("DataType", table[name]["dtype"])

    def create_execution_context(self) -> FakeContext:
        return FakeContext(self)

    def serialize(self) -> HostMemory:
        return HostMemory(json.dumps(self._spec).encode())


class FakeRuntime(FakeObject):
    _trt_type = "Runtime"
    _dry = True

    def deserialize_cuda_engine(self, data):
        data = bytes(data)
        if data.startswith(b"{"):
            return FakeEngine(json.loads(data))
        if data == b"corrupt":
            return None  # what TensorRT returns for a plan of another version or GPU
        return Value("ICudaEngine", "Runtime().deserialize_cuda_engine()")


STAND_INS: dict[str, type] = {
    "Builder": FakeBuilder,
    "OnnxParser": FakeParser,
    "Runtime": FakeRuntime,
}


class FakeTensorRT(types.ModuleType):
    """The stand-in ``tensorrt`` module of one dry run."""

    def __init__(self, run: DryRun) -> None:
        super().__init__("tensorrt", f"sd-accel dry run of TensorRT {run.version}")
        self.__version__ = run.version
        self.__file__ = "<sd-accel dry run>"
        object.__setattr__(self, "_classes", {})

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        _need("", name)
        classes = self.__dict__["_classes"]
        if name not in classes:
            classes[name] = STAND_INS.get(name) or _stand_in(name)
        return classes[name]


def _polygraphy_lazy_trt() -> list:
    """polygraphy's lazily imported ``trt`` modules, which cache the module once imported."""
    out = []
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("polygraphy") and module is not None:
            lazy = vars(module).get("trt")
            if lazy is not None and type(lazy).__name__ == "LazyModule":
                out.append(lazy)
    return out


@contextlib.contextmanager
def dry_run(version: str, names: NameList | None = None) -> Iterator[DryRun]:
    """``import tensorrt`` gives a stand-in with ``version``'s names for the block."""
    global _RUN
    run = DryRun(names or load_list(version))
    saved_module = sys.modules.get("tensorrt")
    saved_lazy = {id(lz): (lz, lz.module) for lz in _polygraphy_lazy_trt()}
    trt_util = sys.modules.get("polygraphy.backend.trt.util")
    saved_logger = getattr(trt_util, "TRT_LOGGER", None)
    previous, _RUN = _RUN, run
    sys.modules["tensorrt"] = FakeTensorRT(run)
    for lz, _ in saved_lazy.values():
        object.__setattr__(lz, "module", None)
    if trt_util is not None:
        trt_util.TRT_LOGGER = None
    try:
        yield run
    finally:
        _RUN = previous
        if saved_module is None:
            sys.modules.pop("tensorrt", None)
        else:
            sys.modules["tensorrt"] = saved_module
        for lz in _polygraphy_lazy_trt():  # modules first imported inside the block too
            object.__setattr__(lz, "module", saved_lazy.get(id(lz), (lz, None))[1])
        trt_util = sys.modules.get("polygraphy.backend.trt.util")
        if trt_util is not None:
            trt_util.TRT_LOGGER = saved_logger


# ---- the GPU, as torch describes it -------------------------------------------------------------


def pretend_gpu(monkeypatch, arch: str = "sm89") -> None:
    """Answer the backend's questions to torch as on a machine with an NVIDIA GPU of ``arch``: CUDA
    is available (``trt_status``), the GPU's arch (timing cache names), and torch's current CUDA
    stream is the null handle (the stream a runner launches on)."""
    import sd_accel.device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sd_accel.device, "gpu_arch", lambda index=0: arch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))


def on_cpu(runner):
    """A ``TensorRTRunner`` made in a dry run, with its buffers on the CPU, where the stand-in
    engines read and write them through raw addresses (with :func:`pretend_gpu` for its stream)."""
    runner.device = torch.device("cpu")
    return runner
