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
polygraphy checks the optimization profile against the real input names), and the builder makes
a plan that holds the ONNX graph's path, the profile's ranges, whether ``BuilderFlag.REFIT`` was
set, and the weights TensorRT would name after the parser (every initializer, by its name, in
its ONNX dtype; one weight per ``Constant`` / ``ConstantOfShape`` node). Deserialized, that
engine computes the graph with onnxruntime on the CPU, with *its* weights in place of the
graph's initializers, so a ``Refitter`` (same names, signatures and checks as TensorRT 10's:
``get_all_weights``, ``get_weights_prototype``, ``set_named_weights`` refusing a wrong name,
count or dtype, ``get_missing_weights``, ``refit_cuda_engine``; ``Weights`` over a numpy array,
without a copy) changes what it computes. An engine deserialized from a JSON description
(:func:`engine_plan`) runs on the CPU too, scaling one input per output. Both read and write
their tensors through raw addresses, so the runner's shape, address, dtype and buffer handling
run for real.

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
        object.__setattr__(self, "_onnx", None)  # the parsed model's path

    @property
    def num_inputs(self) -> int:
        return len(self._inputs)

    def get_input(self, index: int) -> FakeTensor:
        return self._inputs[index]

    def __iter__(self):  # the layers
        return iter(())

    def __len__(self) -> int:
        return 0


class FakeProfile(Value):
    """``IOptimizationProfile``: keeps the ranges ``set_shape`` gives (the plan's input ranges)."""

    __slots__ = ("_shapes",)

    def __init__(self) -> None:
        super().__init__("IOptimizationProfile", "Builder().create_optimization_profile()")
        object.__setattr__(self, "_shapes", {})

    def set_shape(self, name: str, lo, opt, hi) -> None:
        _need("IOptimizationProfile", "set_shape")
        self._shapes[name] = ([int(d) for d in lo], [int(d) for d in hi])


class FakeConfig(Value):
    """``IBuilderConfig``: keeps the builder flags set and the profiles added; anything else is a
    plain :class:`Value` (properties set on it land in ``_set``)."""

    __slots__ = ("_flags", "_profiles")

    def __init__(self) -> None:
        super().__init__("IBuilderConfig", "Builder().create_builder_config()")
        object.__setattr__(self, "_flags", set())
        object.__setattr__(self, "_profiles", [])

    def set_flag(self, flag) -> None:
        _need("IBuilderConfig", "set_flag")
        self._flags.add(repr(flag))

    def clear_flag(self, flag) -> None:
        _need("IBuilderConfig", "clear_flag")
        self._flags.discard(repr(flag))

    def add_optimization_profile(self, profile) -> int:
        _need("IBuilderConfig", "add_optimization_profile")
        self._profiles.append(profile)
        return len(self._profiles) - 1


class FakeBuilder(FakeObject):
    _trt_type = "Builder"
    _dry = True

    def create_network(self, flags: int = 0) -> FakeNetwork:
        return FakeNetwork(flags)

    def create_builder_config(self) -> FakeConfig:
        return FakeConfig()

    def create_optimization_profile(self) -> FakeProfile:
        return FakeProfile()

    def build_serialized_network(self, network, config) -> HostMemory | None:
        """Drives the config's progress monitor as TensorRT does; None when it cancels. The plan
        of a parsed ONNX model computes it (:func:`onnx_plan`), refittable when REFIT was set."""
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
        source = getattr(network, "_onnx", None)
        if source is not None and isinstance(config, FakeConfig) and config._profiles:
            ranges = config._profiles[0]._shapes
            return HostMemory(onnx_plan(source, ranges, refittable="trt.BuilderFlag.REFIT" in config._flags,
                                        streaming="trt.BuilderFlag.WEIGHT_STREAMING" in config._flags))
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
        object.__setattr__(self._network, "_onnx", str(path))
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

    @property
    def streamable_weights_size(self) -> int:
        """The weights a streamed engine can leave in host memory (0: built without streaming)."""
        return int(self._spec.get("streamable", 0))

    def get_weight_streaming_automatic_budget(self) -> int:
        return self.streamable_weights_size // 2  # as if half of them fit beside the activations

    def serialize(self) -> HostMemory:
        return HostMemory(json.dumps(self._spec).encode())


# ---- engines that compute an ONNX graph, and their refits --------------------------------------

PLAN_MAGIC = b"sd-accel dry-run onnx plan\n"
DTYPES = {np.dtype(v): k for k, v in NUMPY.items()}


def _constant_value(node) -> np.ndarray:
    from onnx import numpy_helper

    for attr in node.attribute:
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
    if node.op_type == "ConstantOfShape":
        return np.zeros(1, np.float32)
    raise ValueError(f"the stand-in parser does not model {node.op_type} {node.name!r}'s attributes")


def onnx_plan(onnx_path: str, ranges: dict[str, tuple[list[int], list[int]]], refittable: bool,
              streaming: bool = False) -> bytes:
    """The plan the stand-in builder makes from a parsed ONNX model: the graph (without its
    weights), the profile's ranges, and the weights the ONNX parser names: each initializer by its
    name, and, like the parser, a ``Constant`` node's value by its output's name and a
    ``ConstantOfShape``'s value by a name of its own (those two are kept and refittable, but the
    graph computes with its own attributes). Self-contained, as a real plan: the ONNX file may
    change or go after the build."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(onnx_path)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for i, node in enumerate(n for n in model.graph.node if n.op_type in ("Constant", "ConstantOfShape")):
        name = node.output[0] if node.op_type == "Constant" else f"sd-accel dry-run temp weights {i}"
        weights[name] = _constant_value(node)
    inits = {t.name for t in model.graph.initializer}

    def dtype(value) -> str:
        return ONNX_TYPES.get(value.type.tensor_type.elem_type, "FLOAT")

    inputs = {}
    for value in model.graph.input:
        if value.name not in inits:
            static = [d.dim_value for d in value.type.tensor_type.shape.dim]
            lo, hi = ranges.get(value.name, (static, static))
            inputs[value.name] = {"dtype": dtype(value), "min": lo, "max": hi}
    streamable = sum(w.nbytes for w in weights.values()) if streaming else 0  # all of them, as TensorRT's
    header = {"inputs": inputs, "refittable": refittable, "weights": list(weights), "initializers": sorted(inits),
              "streamable": streamable,
              "outputs": {value.name: {"dtype": dtype(value)} for value in model.graph.output}}
    del model.graph.initializer[:]
    return bytes(FakeOnnxEngine(header, weights, model.SerializeToString()).serialize())


class FakeOnnxContext(FakeContext):
    """Runs the engine's graph with onnxruntime, on the tensors at the bound addresses."""

    _trt_type = "IExecutionContext"
    _dry = True

    def _feed(self, zeros: bool) -> dict[str, np.ndarray]:
        spec = self._engine._spec["inputs"]
        if zeros:
            return {n: np.zeros(self._shapes[n], NUMPY[s["dtype"]]) for n, s in spec.items()}
        return {n: _array(self._addresses[n], self._shapes[n], s["dtype"]).copy() for n, s in spec.items()}

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        spec = self._engine._spec
        if name in spec["inputs"]:
            return self._shapes.get(name, tuple(-1 for _ in spec["inputs"][name]["min"]))
        if set(spec["inputs"]) - set(self._shapes):
            return (-1,)
        key = tuple(self._shapes[n] for n in spec["inputs"])
        shapes = self._engine._output_shapes
        if key not in shapes:  # TensorRT infers them from the input shapes alone: zeros will do here
            outs = self._engine._session().run(None, self._feed(zeros=True))
            shapes[key] = {n: tuple(o.shape) for n, o in zip(spec["outputs"], outs, strict=True)}
        return shapes[key][name]

    def execute_async_v3(self, stream_handle: int) -> bool:
        if not isinstance(stream_handle, int):
            raise TypeError(f"execute_async_v3 takes an int stream handle, got {type(stream_handle).__name__}")
        spec = self._engine._spec
        if {*spec["inputs"], *spec["outputs"]} - set(self._addresses) or set(spec["inputs"]) - set(self._shapes):
            return False
        outs = self._engine._session().run(None, self._feed(zeros=False))
        for (name, out), value in zip(spec["outputs"].items(), outs, strict=True):
            _array(self._addresses[name], value.shape, out["dtype"])[...] = value.astype(NUMPY[out["dtype"]])
        object.__setattr__(self, "_launches", self._launches + 1)
        return True


class FakeOnnxEngine(FakeEngine):
    """An engine made by the stand-in builder (:func:`onnx_plan`): computes its ONNX graph with
    its own weights, which a :class:`FakeRefitter` replaces."""

    _trt_type = "ICudaEngine"
    _dry = True

    def __init__(self, header: dict, weights: dict[str, np.ndarray], graph: bytes) -> None:
        super().__init__(header)
        object.__setattr__(self, "_weights", weights)
        object.__setattr__(self, "_graph", graph)  # the ONNX model without its initializers
        object.__setattr__(self, "_output_shapes", {})
        object.__setattr__(self, "_cached", None)

    def _session(self):
        if self._cached is None:
            import onnx
            import onnxruntime as ort
            from onnx import numpy_helper

            model = onnx.ModelProto.FromString(self._graph)
            model.graph.initializer.extend(numpy_helper.from_array(self._weights[n], n)
                                           for n in self._spec["initializers"])
            session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            object.__setattr__(self, "_cached", session)
        return self._cached

    def create_execution_context(self) -> FakeOnnxContext:
        return FakeOnnxContext(self)

    def serialize(self) -> HostMemory:
        import io

        buffer = io.BytesIO()
        header = np.frombuffer(json.dumps(self._spec).encode(), np.uint8)
        np.savez(buffer, *(self._weights[n] for n in self._spec["weights"]), header=header,
                 graph=np.frombuffer(self._graph, np.uint8))
        return HostMemory(PLAN_MAGIC + buffer.getvalue())


def _onnx_engine(data: bytes) -> FakeOnnxEngine:
    import io

    with np.load(io.BytesIO(data[len(PLAN_MAGIC):]), allow_pickle=False) as npz:
        header = json.loads(npz["header"].tobytes())
        weights = {name: npz[f"arr_{i}"] for i, name in enumerate(header["weights"])}
        graph = npz["graph"].tobytes()
    return FakeOnnxEngine(header, weights, graph)


class FakeWeights(FakeObject):
    """``trt.Weights``: over a numpy array, without a copy (as TensorRT's), or a prototype."""

    _trt_type = "Weights"
    _dry = True

    def __init__(self, a=None, *rest) -> None:
        if rest or not (a is None or isinstance(a, np.ndarray)):
            raise TypeError("the stand-in models Weights() and Weights(a: numpy.ndarray) only")
        object.__setattr__(self, "_array", a)
        object.__setattr__(self, "_proto", None)  # (dtype, count) of a prototype

    @classmethod
    def _prototype(cls, array: np.ndarray) -> FakeWeights:
        w = cls()
        object.__setattr__(w, "_proto", (DTYPES[array.dtype], int(array.size)))
        return w

    @property
    def dtype(self) -> Value:
        if self._array is None:
            return _enum("DataType", self._proto[0] if self._proto else "FLOAT")
        return _enum("DataType", DTYPES[self._array.dtype])

    @property
    def size(self) -> int:
        if self._array is None:
            return self._proto[1] if self._proto else 0
        return int(self._array.size)


class FakeRefitter(FakeObject):
    """``trt.Refitter(engine, logger)``: TensorRT 10's named-weights interface. Refuses what
    TensorRT refuses (an unknown name, another count or dtype than the engine's); an engine built
    without REFIT lists no weights and does not refit."""

    _trt_type = "Refitter"
    _dry = True

    def __init__(self, engine, logger) -> None:
        if not isinstance(engine, FakeOnnxEngine):
            raise TypeError(f"Refitter takes an ICudaEngine, got {type(engine).__name__}")
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_new", {})

    def _names(self) -> list[str]:
        return list(self._engine._spec["weights"]) if self._engine._spec["refittable"] else []

    def get_all_weights(self) -> list[str]:
        return self._names()

    def get_missing_weights(self) -> list[str]:
        return []  # the stand-in combines no weights: nothing set calls for another

    def get_weights_prototype(self, weights_name: str) -> FakeWeights:
        return FakeWeights._prototype(self._engine._weights[weights_name])

    def set_named_weights(self, name: str, weights: FakeWeights) -> bool:
        if not isinstance(weights, FakeWeights) or weights._array is None:
            raise TypeError("set_named_weights takes (name: str, weights: Weights)")
        old = self._engine._weights.get(name) if name in self._names() else None
        if old is None or weights._array.dtype != old.dtype or weights._array.size != old.size:
            return False
        self._new[name] = weights._array  # by reference, as TensorRT: read when refitting
        return True

    def refit_cuda_engine(self) -> bool:
        if not self._engine._spec["refittable"]:
            return False
        for name, array in self._new.items():
            old = self._engine._weights[name]
            self._engine._weights[name] = np.array(array, dtype=old.dtype).reshape(old.shape)
        self._new.clear()
        object.__setattr__(self._engine, "_cached", None)
        return True


class FakeRuntime(FakeObject):
    _trt_type = "Runtime"
    _dry = True

    def deserialize_cuda_engine(self, data):
        data = bytes(data)
        if data.startswith(PLAN_MAGIC):
            return _onnx_engine(data)
        if data.startswith(b"{"):
            return FakeEngine(json.loads(data))
        if data == b"corrupt":
            return None  # what TensorRT returns for a plan of another version or GPU
        return Value("ICudaEngine", "Runtime().deserialize_cuda_engine()")


STAND_INS: dict[str, type] = {
    "Builder": FakeBuilder,
    "OnnxParser": FakeParser,
    "Runtime": FakeRuntime,
    "Refitter": FakeRefitter,
    "Weights": FakeWeights,
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


def pretend_gpu(monkeypatch, arch: str = "sm89", memory: int = 24 * 2**30) -> None:
    """Answer the backend's questions to torch as on a machine with an NVIDIA GPU of ``arch``: CUDA
    is available (``trt_status``), the GPU's arch (timing cache names), its ``memory`` (whether an
    engine's weights are streamed), and torch's current CUDA stream is the null handle (the stream
    a runner launches on)."""
    import sd_accel.device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(total_memory=memory, name=f"pretend {arch}"))
    monkeypatch.setattr(sd_accel.device, "gpu_arch", lambda index=0: arch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))


def on_cpu(runner):
    """A ``TensorRTRunner`` made in a dry run, with its buffers on the CPU, where the stand-in
    engines read and write them through raw addresses (with :func:`pretend_gpu` for its stream)."""
    runner.device = torch.device("cpu")
    return runner
