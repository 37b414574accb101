"""Symbolic dimensions of an exported graph that a shape profile pins to one value."""

from __future__ import annotations

from pathlib import Path

import onnx

from sd_accel.core import ShapeRanges


def symbol_values(onnx_path: Path, shapes: ShapeRanges) -> dict[str, int]:
    """Symbolic input dims that the profile fixes (min == max), e.g. ``{"B2": 2, "H8": 64}``."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    fixed: dict[str, int] = {}
    for inp in model.graph.input:
        if inp.name not in shapes:
            continue
        lo, _, hi = shapes[inp.name]
        for i, dim in enumerate(inp.type.tensor_type.shape.dim):
            if dim.dim_param and lo[i] == hi[i]:
                fixed[dim.dim_param] = lo[i]
    return fixed
