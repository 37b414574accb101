"""The contract of one exportable component (after NVIDIA demoDiffusion's model classes).

A spec knows, for one torch module of a pipeline: its engine input/output names and dtypes,
its dimensions as symbols (``B``, ``H8``, ``T`` ...), how a user-level :class:`Profile` maps to
(min, opt, max) values of those symbols, a wrapper module with positional inputs for export,
and sample feeds for validation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from sd_accel.core import ShapeRanges
from sd_accel.profiles import Profile, Range


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: tuple[str | int, ...]  # ints are fixed sizes, strings are symbols resolved per request
    dtype: torch.dtype


class ComponentSpec(ABC):
    """One component of one pipeline. Subclasses set ``name`` and fill the abstract methods."""

    name: str  # one of core.COMPONENTS: "clip", "clip2", "t5", "unet", "transformer", "vae_decoder", ...

    @property
    def attribute(self) -> str:
        """The pipeline attribute whose module this component stands in for."""
        from sd_accel.core import PIPELINE_ATTRIBUTE

        return PIPELINE_ATTRIBUTE[self.name]

    def __init__(self, pipe) -> None:
        self.pipe = pipe

    @abstractmethod
    def torch_module(self) -> torch.nn.Module:
        """The pipeline's module this component's engine stands in for."""

    @abstractmethod
    def inputs(self) -> tuple[TensorSpec, ...]: ...

    @abstractmethod
    def outputs(self) -> tuple[TensorSpec, ...]: ...

    @abstractmethod
    def export_module(self) -> torch.nn.Module:
        """A module taking the inputs positionally (in ``inputs()`` order) and returning a tuple
        of the outputs (in ``outputs()`` order): what ``torch.onnx.export`` traces."""

    @abstractmethod
    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        """(min, opt, max) of every symbol for a profile."""

    @abstractmethod
    def export_dims(self) -> dict[str, int]:
        """Symbol values for the trace example (chosen so the graph stays general)."""

    # ---- derived; subclasses rarely override ----------------------------------------------

    def shape_ranges(self, profile: Profile) -> ShapeRanges:
        ranges = self.dim_ranges(profile)
        out: ShapeRanges = {}
        for t in self.inputs():
            out[t.name] = tuple(  # type: ignore[assignment]
                tuple(d if isinstance(d, int) else ranges[d][i] for d in t.dims) for i in range(3)
            )
        return out

    def shapes(self, dims: dict[str, int]) -> dict[str, tuple[int, ...]]:
        return {t.name: tuple(d if isinstance(d, int) else dims[d] for d in t.dims) for t in self.inputs()}

    def unbatched(self) -> frozenset[str]:
        """The inputs without a batch axis (FLUX.1's ``img_ids`` / ``txt_ids``): a batch is never
        split along them."""
        return frozenset(t.name for t in self.inputs() if not (t.dims and str(t.dims[0]).startswith("B")))

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {
            t.name: {i: d for i, d in enumerate(t.dims) if isinstance(d, str)}
            for t in (*self.inputs(), *self.outputs())
        }

    def sample_feed(self, dims: dict[str, int], seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Random inputs of the given dims (ids in the vocabulary, timesteps in range)."""
        g = torch.Generator("cpu").manual_seed(seed)
        feed = {}
        for t, shape in zip(self.inputs(), self.shapes(dims).values(), strict=True):
            if t.dtype in (torch.int32, torch.int64):
                feed[t.name] = torch.randint(0, self.int_high(t.name), shape, generator=g, dtype=t.dtype)
            else:
                feed[t.name] = (torch.randn(shape, generator=g) * self.scale(t.name)).to(t.dtype)
        return {k: v.to(device) for k, v in feed.items()}

    def int_high(self, name: str) -> int:
        return 2

    def scale(self, name: str) -> float:
        return 1.0
