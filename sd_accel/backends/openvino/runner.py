"""Run an OpenVINO compiled model with torch tensors in and out.

**Fixed shapes** (opt-in: ``SD_ACCEL_OV_FIXED_SHAPES=1``). OpenVINO's CPU plugin runs a graph
compiled with dynamic (bounded) dimensions slower than the same graph compiled for one shape, the
more so at large shapes (the design notes: up to 3.5x). With the variable set, a dynamic engine
that kept its graph (``engine.xml``: engines built since this option) reads it, reshapes it to
each call's exact shapes and compiles it for them, once per shape; the last
:data:`FIXED_SHAPES_KEPT` compiled shapes are kept (each holds its own copy of the weights in the
plugin's buffers: SD 1.5's UNet in bf16, 1.7 GB), the oldest dropped first. The first call at a
new shape pays the compile (seconds for SD 1.5's UNet). Where the graph is missing or the compile
fails, the dynamic engine serves, said once.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from sd_accel.core import EngineError, ShapeRanges, covers
from sd_accel.pages import kept_released

log = logging.getLogger("sd_accel")

_NP = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i64": np.int64}
FIXED_SHAPES_ENV = "SD_ACCEL_OV_FIXED_SHAPES"
FIXED_SHAPES_KEPT = 2  # compiled shapes a runner keeps (one per image size: a hires fix's two passes)


def fixed_shapes_wanted() -> bool:
    """Whether ``SD_ACCEL_OV_FIXED_SHAPES`` asks dynamic engines to compile per call shape."""
    return os.environ.get(FIXED_SHAPES_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class OpenVinoRunner:
    """``infer(feed) -> outputs`` on one infer request. Feeds outside ``shapes`` are refused.

    ``mapped``: the engine folder whose ``engine.bin`` the weightless blob reads its weights from.
    The CPU plugin copies them into its own buffers during the first inference and never reads the
    mapped file again, yet its pages stay resident and counted in RSS: the int8 SD 1.5 UNet's
    0.84 GB at 256 px was the difference between 3.14 GB peak while generating and 2.3 GB. The
    first call runs with those pages handed back as it goes (data-safe: a page still needed is read
    again from the file)."""

    def __init__(self, compiled, shapes: ShapeRanges, mapped: Path | None = None, graph: Path | None = None,
                 config: dict[str, str] | None = None, weights_bytes: int = 0) -> None:
        self.compiled = compiled
        self.shapes = shapes
        self.mapped = mapped
        # the weights the plugin copies into its own buffers on the first call (engine.bin's size;
        # 0: unknown): what validation's memory estimate does not scale with the shape
        self.weights_bytes = weights_bytes
        # fixed shapes (see the module's notes): the engine's graph, its compile options, and the
        # compiled shapes kept, most recent last: shape key -> (compiled, request, output names)
        dynamic = any(lo != hi for lo, _, hi in shapes.values())
        self.graph = graph if dynamic else None
        self.config = dict(config or {})
        self.fixed: OrderedDict[tuple, tuple] = OrderedDict()
        self.fixed_compiles = 0
        self.request = compiled.create_infer_request()
        # A port can carry several tensor names after compilation ({"timestep", "/unet/Expand_output_0"}):
        # match the engine's input and output names against all of them.
        self.input_types = {
            name: _NP.get(p.get_element_type().get_type_name(), np.float32)
            for name in shapes
            for p in compiled.inputs
            if name in p.get_names()
        }
        if len(self.input_types) != len(shapes):
            raise EngineError(f"the engine's inputs {[sorted(p.get_names()) for p in compiled.inputs]} "
                              f"do not match {sorted(shapes)}")
        self.output_names = [self._public_name(p.get_names()) for p in compiled.outputs]

    @property
    def once_bytes(self) -> int:
        """Bytes the next call loads and keeps whatever its shape: the weights, before the first
        call (0 after it, or where unknown). See :func:`sd_accel.validate.max_point_need`."""
        return self.weights_bytes if (self.mapped is not None or (self.graph is not None and not self.fixed)) else 0

    @property
    def per_shape_bytes(self) -> int:
        """Bytes a call at a shape not compiled yet keeps besides its activations: with fixed
        shapes, another copy of the weights (the compile for that shape); else 0."""
        return self.weights_bytes if self.graph is not None else 0

    @staticmethod
    def _public_name(names: set[str]) -> str:
        """The ONNX output name among a port's names (internal ones start with ``/``)."""
        plain = sorted(n for n in names if not n.startswith("/"))
        return plain[0] if plain else sorted(names)[0]

    def infer(self, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not covers(self.shapes, feed):
            got = {k: tuple(v.shape) for k, v in feed.items()}
            raise EngineError(f"engine does not cover shapes {got}; its ranges are {self.shapes}")
        inputs = {
            name: np.ascontiguousarray(t.detach().to("cpu").numpy() if t.dtype != torch.bfloat16
                                       else t.detach().float().cpu().numpy(), dtype=self.input_types[name])
            for name, t in feed.items()
        }
        fixed = self._fixed(inputs) if self.graph is not None else None
        if fixed is not None:
            request, names, results = fixed
            if results is None:  # a shape compiled earlier (a new one ran in _fixed already)
                results = request.infer(inputs)
        elif self.mapped is not None:
            names = self.output_names
            with kept_released(self.mapped, every=0.1):
                results = self.request.infer(inputs)
            self.mapped = None
        else:
            names = self.output_names
            results = self.request.infer(inputs)
        return {name: torch.from_numpy(np.array(results[i], copy=True)) for i, name in enumerate(names)}

    def _fixed(self, inputs: dict[str, np.ndarray]) -> tuple | None:
        """(infer request, output names, results) of the graph compiled for exactly these input
        shapes: kept from an earlier call (results None: the caller infers), or compiled now and run
        on ``inputs`` (the oldest kept one dropped past :data:`FIXED_SHAPES_KEPT`). None where it
        cannot be compiled (the dynamic engine serves)."""
        key = tuple(sorted((name, a.shape) for name, a in inputs.items()))
        if key in self.fixed:
            self.fixed.move_to_end(key)
            _, request, names = self.fixed[key]
            return request, names, None
        try:
            import openvino as ov

            core = ov.Core()
            with kept_released(self.graph.parent, every=0.1):
                model = core.read_model(str(self.graph))
                model.reshape({port: ov.PartialShape(list(inputs[name].shape)) for port in model.inputs
                               for name in port.get_names() if name in inputs})
                compiled = core.compile_model(model, "CPU", self.config)
                del model
                request = compiled.create_infer_request()
                results = request.infer(inputs)  # it copies the weights: the mapped pages go back as it goes
        except Exception as exc:  # OpenVINO raises RuntimeError subclasses of its own
            log.warning("OpenVINO could not compile %s for the fixed shapes %s (%s); the dynamic engine serves "
                        "(%s=1 is ignored for this engine)", self.graph, dict(key), exc, FIXED_SHAPES_ENV)
            self.graph = None
            self.fixed.clear()
            return None
        self.fixed_compiles += 1
        names = [self._public_name(p.get_names()) for p in compiled.outputs]
        self.fixed[key] = (compiled, request, names)
        while len(self.fixed) > FIXED_SHAPES_KEPT:
            self.fixed.popitem(last=False)
        return request, names, results

    def close(self) -> None:
        self.request = None
        self.compiled = None
        self.fixed.clear()
