"""Run an ONNX Runtime session with torch tensors in and out, reusing output buffers."""

from __future__ import annotations

import numpy as np
import torch

from sd_accel.core import EngineError, EngineFault, ShapeRanges, covers

_NP = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
}
_MAX_SHAPES = 8
_TORCH = {np.float32: torch.float32, np.float16: torch.float16, np.int32: torch.int32, np.int64: torch.int64}


class OnnxRuntimeRunner:
    """``infer(feed) -> outputs``. Outputs live in buffers reused by the next call with the same
    input shapes: clone what you keep. Feeds outside ``shapes`` are refused, never padded."""

    def __init__(self, session, shapes: ShapeRanges) -> None:
        self.session = session
        self.shapes = shapes
        self.input_types = {i.name: _NP[i.type] for i in session.get_inputs()}
        if set(self.input_types) != set(shapes):  # the engine's fault: the runtime marks it bad
            raise EngineFault(f"the engine's inputs {sorted(self.input_types)} are not its record's {sorted(shapes)}")
        self.output_names = [o.name for o in session.get_outputs()]
        self._buffers: dict[tuple, dict[str, torch.Tensor]] = {}

    def infer(self, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not covers(self.shapes, feed):
            got = {k: tuple(v.shape) for k, v in feed.items()}
            raise EngineError(f"engine does not cover shapes {got}; its ranges are {self.shapes}")
        inputs = {
            name: t.detach().to("cpu", _TORCH[self.input_types[name]]).contiguous() for name, t in feed.items()
        }
        signature = tuple((k, tuple(v.shape)) for k, v in sorted(inputs.items()))
        buffers = self._buffers.get(signature)
        if buffers is None:
            # First call at these shapes: let ORT size the outputs, keep them as our buffers.
            arrays = self.session.run(None, {k: v.numpy() for k, v in inputs.items()})
            buffers = {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in zip(self.output_names, arrays, strict=True)}
            if len(self._buffers) >= _MAX_SHAPES:
                self._buffers.clear()  # a job uses a handful of shapes; don't grow without bound
            self._buffers[signature] = buffers
            return buffers
        binding = self.session.io_binding()
        for name, t in inputs.items():
            binding.bind_input(name, "cpu", 0, self.input_types[name], tuple(t.shape), t.data_ptr())
        for name, buf in buffers.items():
            binding.bind_output(name, "cpu", 0, buf.numpy().dtype.type, tuple(buf.shape), buf.data_ptr())
        self.session.run_with_iobinding(binding)
        return buffers

    def close(self) -> None:
        self._buffers.clear()
        self.session = None
