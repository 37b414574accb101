"""Run a compiled component: torch tensors in and out, like every runner.

The runner compiles lazily (``torch.compile`` is itself lazy: the first call at a shape compiles,
from Inductor's on-disk cache when the engine's artifacts were loaded), casts the feed to the
compute dtype, replays a CUDA graph where one is held for the call's shapes (graphs.py) and
refuses what it cannot serve with a reason the runtime counts: a feed outside its profile, a
graph break at those shapes, no live module handed over.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from sd_accel.backends.compile.graphs import GraphBook, signature, weight_addresses
from sd_accel.backends.compile.settings import DTYPES, Attached, CompileSettings
from sd_accel.core import EngineError, ShapeRanges, covers

log = logging.getLogger("sd_accel")


def _compiles() -> int:
    """Graphs Dynamo has compiled in this process (its counter: a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass
class RunnerCounts:
    calls: int = 0
    compiles: int = 0  # Dynamo graphs compiled during this runner's calls (first shapes, recompiles)
    refused: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "compiles": self.compiles, "refused": dict(self.refused)}


class CompiledRunner:
    """``infer(feed) -> outputs`` through ``torch.compile`` of the live module. Outputs may be a
    CUDA graph's static buffers, overwritten by the next call: clone what you keep."""

    # ``backend``: the CompileBackend (builder.py, which imports this module: not named here)
    def __init__(self, backend: Any, manifest: dict[str, Any], shapes: ShapeRanges) -> None:
        self.backend = backend
        self.manifest = manifest
        self.shapes = shapes
        self.component: str = manifest["component"]
        self.model: str = manifest["model"]
        self.precision: str = manifest["precision"]
        self.counts = RunnerCounts()
        self._compiled: Any = None
        self._live: Attached | None = None
        self._broken: dict[tuple, str] = {}  # signature -> why (a graph break at those shapes)
        self.graphs: GraphBook | None = None

    # ---- setup -------------------------------------------------------------------------------

    def _ensure(self) -> Attached:
        live = self.backend.attached(self.component, self.model)
        if live is None:
            raise EngineError(f"the compiled {self.component} runs the live torch module, and none was handed "
                              "over: swap it in with accelerate(pipe, backend='compile')")
        if live is not self._live:  # first call, or a new swap handed over another module
            self._live = live
            self._compiled = None
        return live

    def _first_eager(self, live: Attached, args: list[torch.Tensor]) -> None:
        """Compile, after one eager call where a library sets its modules up lazily on their first
        call: transformers installs its output-capturing hooks under a threading lock, which Dynamo
        cannot enter (a graph break in every text encoder otherwise). Only there: an eager call of
        SD 1.5's UNet costs seconds on a CPU."""
        if any(type(m).__module__.startswith("transformers.") for m in live.module.modules()):
            with torch.no_grad():
                live.export(*args)
        self._compiled = self._compile(live)

    def _compile(self, live: Attached):
        settings: CompileSettings = self.backend.settings
        cuda = self.backend.cuda
        if cuda and settings.channels_last and any(isinstance(m, torch.nn.Conv2d) for m in live.module.modules()):
            # in place: the pipeline's module keeps its values; NHWC convolutions are Tensor Cores' layout
            live.module.to(memory_format=torch.channels_last)
        fullgraph = bool(self.manifest.get("fullgraph", settings.fullgraph))
        # (graphs only over a whole graph: the eager pieces between graph breaks may sync with the CPU)
        if cuda and settings.cuda_graphs and fullgraph and settings.mode not in ("reduce-overhead", "max-autotune"):
            from sd_accel.backends.compile.graphs import cuda_capturers

            self.graphs = GraphBook(self.backend.new_capturer or cuda_capturers(), settings.max_graphs)
        elif self.backend.new_capturer is not None and fullgraph:  # the tests' CPU stand-in
            self.graphs = GraphBook(self.backend.new_capturer, settings.max_graphs)
        static = bool(self.manifest.get("static"))
        if settings.compiler != "inductor":  # (modes are Inductor's)
            return torch.compile(live.export, backend=settings.compiler, fullgraph=fullgraph,
                                 dynamic=False if static else None)
        return torch.compile(live.export, mode=settings.mode, fullgraph=fullgraph, dynamic=False if static else None)

    # ---- calls ---------------------------------------------------------------------------------

    def _refuse(self, kind: str, why: str) -> EngineError:
        self.counts.refused[kind] = self.counts.refused.get(kind, 0) + 1
        return EngineError(why)

    def infer(self, feed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not covers(self.shapes, feed):
            got = {k: tuple(v.shape) for k, v in feed.items()}
            raise self._refuse("outside profile", f"the compiled {self.component} does not cover shapes {got}; "
                                                  f"its profile is {self.shapes}")
        live = self._ensure()
        module = live.module
        dtype = _compute_dtype(self.precision)
        weight = next(module.parameters())
        device = weight.device
        # float inputs in the weights' dtype; autocast (below) computes in the engine's precision
        args = [feed[n].to(device=device, dtype=weight.dtype if d.is_floating_point else d)
                for n, d in zip(live.inputs, live.dtypes, strict=True)]
        sig = signature(args, live.inputs)
        if sig in self._broken:
            raise self._refuse("graph break", self._broken[sig])
        before = _compiles()
        try:
            if self._compiled is None:
                self._first_eager(live, args)
            with torch.no_grad(), _autocast(weight.dtype, dtype, device):
                if self.graphs is not None:
                    outs = self.graphs.run(self._compiled, args, live.inputs, weight_addresses(module))
                else:
                    outs = self._compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as exc:  # a graph break (fullgraph) or an Inductor error
            first = " ".join(str(exc).split())[:300]
            self._broken[sig] = f"torch.compile cannot compile {self.component} at these shapes ({first})"
            raise self._refuse("graph break", self._broken[sig]) from exc
        finally:
            self.counts.compiles += _compiles() - before
        self.counts.calls += 1
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        return dict(zip(live.outputs, outs, strict=True))

    def stats(self) -> dict[str, Any]:
        """This runner's counters: calls, compiles, refusals and (with CUDA graphs) captures and replays."""
        out = self.counts.to_dict()
        if self.graphs is not None:
            out["graphs"] = self.graphs.counts.to_dict()
        return out

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.drop()
        self._compiled = None
        self._live = None


def _compute_dtype(precision: str) -> torch.dtype:
    return DTYPES[precision]


def _autocast(weights: torch.dtype, dtype: torch.dtype, device: torch.device):
    """Autocast when the engine's precision differs from the module's weights (a bf16 engine of an
    fp32 pipeline); a pipeline already in that dtype runs as it is."""
    if weights == dtype:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
