"""The contract every backend keeps.

A **builder** turns an ONNX file plus per-input shape ranges into engine files in a folder.
A **runner** loads those files and maps a dict of torch tensors to a dict of torch tensors. A
runner never pads, truncates or reshapes: a feed outside its shapes is refused (``covers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sd_accel.core import CalibrationSet, Progress, ShapeRanges

if TYPE_CHECKING:  # torch is only needed for hints here; the registry imports this module cheaply
    import torch


@dataclass(frozen=True)
class BackendInfo:
    name: str  # a name in registry.TABLE
    version: str  # the library version: engines never cross versions
    arch: str  # device arch key the engines are tied to: "sm89", or a CPU class
    usable: bool
    why_not: str = ""


class Runner(Protocol):
    shapes: ShapeRanges

    def infer(self, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """One backend: what it is on this machine, how to build, how to load.

    ``build`` writes engine files into ``out_dir`` and returns their names relative to it;
    ``calibration`` carries the real input feeds static INT8 needs (other precisions ignore it).
    """

    name: str
    torch_device: str  # where the runner's feeds and outputs live, and validation runs torch

    def info(self) -> BackendInfo: ...

    def precisions(self) -> tuple[str, ...]: ...

    def default_precision(self) -> str: ...

    def build(
        self, onnx_path: Path, shapes: ShapeRanges, precision: str, out_dir: Path, progress: Progress,
        calibration: CalibrationSet | None = None,
    ) -> list[str]: ...

    def load(self, engine_dir: Path, files: list[str], shapes: ShapeRanges) -> Runner: ...
