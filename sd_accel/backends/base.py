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


class Backend:
    """One backend: what it is on this machine, how to build, how to load. A backend subclasses
    this; the methods without a default are the contract, the rest are optional capabilities
    whose defaults say "not here" (so no caller has to probe for them).

    ``build`` writes engine files into ``out_dir`` and returns their names relative to it;
    ``calibration`` carries the real input feeds static INT8 needs (other precisions ignore it);
    ``int8_scope`` is one of :attr:`int8_scopes` (None: the backend's safest).
    """

    name: str  # its name in registry.TABLE
    torch_device: str  # where the runner's feeds and outputs live, and validation runs torch
    # The int8 scopes (which layers stay in float) widest first: a validated int8 build tries
    # them in turn while the check turns the wider ones down. Empty: one int8 build, no choice.
    int8_scopes: tuple[str, ...] = ()
    # The ``int8_scope`` that asks :meth:`build` for int8 weights only (activations in float, no
    # calibration): how int8 builds a module in segments. None: it has no such build, and int8
    # builds a module whole.
    int8_weights_only: str | None = None
    # Whether :meth:`patch_weights` can write new weights into a copy of an engine (a LoRA refit
    # without a build); False: a refit always rebuilds from the exported graph.
    patches_weights: bool = False
    # Whether it builds from the component's torch module (:meth:`build_module`) instead of an ONNX
    # export (:meth:`build`): build.py then exports nothing for it.
    takes_torch_module: bool = False
    # Whether a loaded engine's weights and buffers live in host memory: a chained engine then keeps
    # loaded the segments that fit there (sd_accel.backends.chain.chain_keeping). False: on the card.
    engines_in_host_memory: bool = True
    # Whether its runners read the pipeline's live torch weights on every call (a compiled module):
    # a weight change then needs no refit and is never stale, and the weights stay where they are.
    reads_live_weights: bool = False
    # The engine files that hold its weights and nothing tied to the profile (OpenVINO's
    # ``engine.bin``): the cache stores each once by content and hard-links it into every engine
    # folder with the same bytes (sd_accel.cache.shared). Empty: every engine keeps its own files.
    weights_files: tuple[str, ...] = ()

    def info(self) -> BackendInfo:
        raise NotImplementedError

    def precisions(self) -> tuple[str, ...]:
        """What it builds here: the table's ``builds`` (registry.py, the one list), less those
        :meth:`missing` says this machine lacks something for."""
        from sd_accel.backends.registry import entry  # the table imports no backend; no cycle at import

        return tuple(p for p in entry(self.name).builds if self.missing(p) is None)

    def missing(self, precision: str) -> str | None:
        """What ``precision`` needs that this machine lacks (a CPU feature, a package to install), in
        words a user can act on; None when nothing is missing (or the backend never builds it)."""
        return None

    def default_precision(self) -> str:
        raise NotImplementedError

    def summary(self) -> str | None:
        """What it gives on this machine, for a face's status line (None: the face lists
        :meth:`precisions`)."""
        return None

    def install_packages(self) -> tuple[str, ...]:
        """The pip packages that make it usable here (for a face's install hint)."""
        return ()

    def build(
        self, onnx_path: Path, shapes: ShapeRanges, precision: str, out_dir: Path, progress: Progress,
        calibration: CalibrationSet | None = None, int8_scope: str | None = None,
    ) -> list[str]:
        raise NotImplementedError

    def load(self, engine_dir: Path, files: list[str], shapes: ShapeRanges) -> Runner:
        raise NotImplementedError

    def model_id(self, module: torch.nn.Module) -> str | None:
        """The model field of its engine keys for ``module``; None: the weights' fingerprint (an
        engine holds the weights). A backend whose engines read live weights keys by architecture."""
        return None

    def attach(self, model: str, spec: object) -> None:
        """Hand the live module of ``spec`` (engines keyed by ``model``) to runners that read it
        (:attr:`reads_live_weights`); the runtime calls it while the pipeline holds its torch modules."""

    def build_module(self, spec: object, model: str, shapes: ShapeRanges, precision: str, out_dir: Path,
                     progress: Progress) -> list[str]:
        """Engine files built from ``spec``'s torch module (:attr:`takes_torch_module`)."""
        raise NotImplementedError

    def refit_runner(self, engine_dir: Path, files: list[str], value: Callable[[str], object],
                     shapes: ShapeRanges) -> Runner | None:
        """A runner of the engine in ``engine_dir`` with every weight set to ``value(onnx_name)``,
        made in memory (no copy of the engine on disk), or None where this backend or engine cannot
        (then :meth:`patch_weights` writes a copy). Only called where :attr:`patches_weights`."""
        return None

    def patch_weights(self, engine_dir: Path, files: list[str], value: Callable[[str], object],
                      out_dir: Path) -> list[str] | None:
        """A copy of an engine in ``out_dir`` with every weight set to ``value(onnx_name)``: its
        files, or None where the change needs a build. Only called where :attr:`patches_weights`."""
        return None
