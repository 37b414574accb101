"""Run an OpenVINO compiled model with torch tensors in and out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from sd_accel.core import EngineError, ShapeRanges, covers
from sd_accel.pages import kept_released

_NP = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i64": np.int64}


class OpenVinoRunner:
    """``infer(feed) -> outputs`` on one infer request. Feeds outside ``shapes`` are refused.

    ``mapped``: the engine folder whose ``engine.bin`` the weightless blob reads its weights from.
    The CPU plugin copies them into its own buffers during the first inference and never reads the
    mapped file again, yet its pages stay resident and counted in RSS: the int8 SD 1.5 UNet's
    0.84 GB at 256 px was the difference between 3.14 GB peak while generating and 2.3 GB. The
    first call runs with those pages handed back as it goes (data-safe: a page still needed is read
    again from the file)."""

    def __init__(self, compiled, shapes: ShapeRanges, mapped: Path | None = None) -> None:
        self.compiled = compiled
        self.shapes = shapes
        self.mapped = mapped
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
        if self.mapped is not None:
            with kept_released(self.mapped, every=0.1):
                results = self.request.infer(inputs)
            self.mapped = None
        else:
            results = self.request.infer(inputs)
        return {name: torch.from_numpy(np.array(results[i], copy=True)) for i, name in enumerate(self.output_names)}

    def close(self) -> None:
        self.request = None
        self.compiled = None
