"""Run a TensorRT engine with the name-based API (TensorRT 10/11): ``set_input_shape``,
``set_tensor_address``, ``execute_async_v3`` on torch's current stream, output buffers reused.

Output shapes come from the context after the input shapes are set (``get_tensor_shape``), so
dynamic engines size their outputs per call. Outputs live in buffers the next call overwrites:
callers copy what they keep (``runtime.modules`` does).
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import torch

from sd_accel.core import EngineError, ShapeRanges, covers

log = logging.getLogger("sd_accel")

# TensorRT keeps one logger per process: a second, different one draws a warning on every runtime.
# A logger belongs to the module that made it, so the map is keyed by the module.
_LOGGERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
ALIGNMENT = 256  # TensorRT wants tensor addresses 256-byte aligned


def _shared_logger(trt):
    logger = _LOGGERS.get(trt)
    if logger is None:
        logger = _LOGGERS[trt] = trt.Logger(trt.Logger.WARNING)
    return logger


def torch_dtype(trt, dtype) -> torch.dtype:
    """The torch dtype of a ``trt.DataType`` (FLOAT, HALF, BF16, INT8, UINT8, INT32, INT64, BOOL)."""
    table = {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.HALF: torch.float16,
        trt.DataType.BF16: torch.bfloat16,
        trt.DataType.INT8: torch.int8,
        trt.DataType.UINT8: torch.uint8,
        trt.DataType.INT32: torch.int32,
        trt.DataType.INT64: torch.int64,
        trt.DataType.BOOL: torch.bool,
    }
    try:
        return table[dtype]
    except KeyError:
        raise EngineError(f"engine tensor type {dtype} has no torch equivalent here") from None


class TensorRTRunner:
    def __init__(self, engine_path: Path, shapes: ShapeRanges, streaming: bool = False) -> None:
        import tensorrt as trt

        self.shapes = shapes
        self.device = torch.device("cuda")  # TensorRT runs on the current CUDA device
        # The runtime is kept: an engine must not outlive the runtime that deserialized it.
        self._runtime = trt.Runtime(_shared_logger(trt))
        self.engine = self._runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise EngineError(
                f"TensorRT {trt.__version__} could not deserialize {engine_path}: it was built by another "
                "TensorRT version or for another GPU. Delete it and build again."
            )
        if streaming:
            self._set_streaming_budget()
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise EngineError(f"TensorRT could not create an execution context for {engine_path} (out of GPU memory?)")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = {n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.inputs = [n for n in names if is_input[n]]
        self.outputs = [n for n in names if not is_input[n]]
        self.dtypes = {n: torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
        if set(self.inputs) != set(shapes):
            raise EngineError(f"engine {engine_path} has inputs {self.inputs}, the cache record says {sorted(shapes)}")
        self._buffers: dict[str, torch.Tensor] = {}

    def _set_streaming_budget(self) -> None:
        """A weight-streamed engine (built with ``BuilderFlag.WEIGHT_STREAMING``): TensorRT's own
        budget for the weights kept on the card, from the memory free now; the rest stream from
        host memory as the layers run (slower than holding them, faster than not fitting)."""
        budget = int(self.engine.get_weight_streaming_automatic_budget())
        self.engine.weight_streaming_budget_v2 = budget
        total = int(self.engine.streamable_weights_size)
        log.info("TensorRT weight streaming: %.1f of %.1f GB of weights kept on the card", budget / 1e9, total / 1e9)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        if not self.context.set_tensor_address(name, tensor.data_ptr()):
            raise EngineError(f"TensorRT refused the address of {name!r}; see the TensorRT log above")

    def infer(self, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.context is None:
            raise EngineError("this TensorRT runner is closed")
        if not covers(self.shapes, feed):
            got = {k: tuple(v.shape) for k, v in feed.items()}
            raise EngineError(f"engine does not cover shapes {got}; its ranges are {self.shapes}")
        keep = []  # converted inputs: alive until the launch is queued (the allocator is stream-ordered)
        for name in self.inputs:
            t = feed[name].to(self.device, self.dtypes[name]).contiguous()
            if t.data_ptr() % ALIGNMENT:
                t = t.clone()
            keep.append(t)
            if not self.context.set_input_shape(name, tuple(t.shape)):
                raise EngineError(f"TensorRT refused shape {tuple(t.shape)} for {name!r}; the engine's ranges are "
                                  f"{self.shapes[name]}")
            self._bind(name, t)
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise EngineError(f"TensorRT cannot tell the shape of output {name!r} ({shape}) from the inputs")
            buf = self._buffers.get(name)
            if buf is None or tuple(buf.shape) != shape:
                buf = torch.empty(shape, dtype=self.dtypes[name], device=self.device)
                self._buffers[name] = buf
            self._bind(name, buf)
        if not self.context.execute_async_v3(self._stream()):
            raise EngineError("TensorRT execute_async_v3 failed; see the TensorRT log above")
        return {name: self._buffers[name] for name in self.outputs}

    def close(self) -> None:
        self._buffers.clear()
        self.context = None  # context, then engine, then runtime
        self.engine = None
        self._runtime = None
