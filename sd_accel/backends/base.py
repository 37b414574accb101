"""The contract every backend keeps.

A **builder** turns an ONNX file plus per-input shape ranges into engine files in a folder.
A **runner** loads those files and maps a dict of torch tensors to a dict of torch tensors. A
runner never pads, truncates or reshapes: a feed outside its shapes is refused (``covers``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch is only needed for hints here; the cache imports this module cheaply
    import torch

Shape = tuple[int, ...]
# Per input name: (min, opt, max) shapes. Static engines have min == opt == max.
ShapeRanges = dict[str, tuple[Shape, Shape, Shape]]
# progress(fraction 0..1, message); a builder calls it as it goes and stops when it raises.
Progress = Callable[[float, str], None]


class EngineError(RuntimeError):
    """An engine that cannot be built, loaded or run. The message says why and what to do."""


def covers(shapes: ShapeRanges, feed: dict[str, torch.Tensor]) -> bool:
    """Whether every input of ``feed`` lies inside the (min, max) ranges, dimension by dimension."""
    if set(feed) != set(shapes):
        return False
    for name, tensor in feed.items():
        lo, _, hi = shapes[name]
        if tensor.dim() != len(lo):
            return False
        if any(not (a <= d <= b) for a, d, b in zip(lo, tensor.shape, hi, strict=True)):
            return False
    return True


def distance(shapes: ShapeRanges, feed: dict[str, torch.Tensor]) -> float:
    """How far a feed is from the engine's opt shapes; the runtime prefers the nearest engine."""
    total = 0.0
    for name, tensor in feed.items():
        opt = shapes[name][1]
        total += sum(abs(d - o) / max(o, 1) for d, o in zip(tensor.shape, opt, strict=True))
    return total


@dataclass(frozen=True)
class BackendInfo:
    name: str  # "onnxruntime" | "tensorrt"
    version: str  # the library version: engines never cross versions
    arch: str  # device arch key the engines are tied to: "sm89", or a CPU class
    usable: bool
    why_not: str = ""


class Runner(Protocol):
    shapes: ShapeRanges

    def infer(self, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """One backend: what it is on this machine, how to build, how to load."""

    name: str

    def info(self) -> BackendInfo: ...

    def precisions(self) -> tuple[str, ...]: ...

    def build(
        self, onnx_path: Path, shapes: ShapeRanges, precision: str, out_dir: Path, progress: Progress
    ) -> list[Path]: ...

    def load(self, engine_dir: Path, files: list[str], shapes: ShapeRanges) -> Runner: ...
