"""CUDA-graph bookkeeping for the compiled backend: one captured graph per fixed input shape.

A CUDA graph replays the kernels of one call with no Python and no launch cost, which is what a
few-step image needs (about 4,970 kernel launches per image for 40 ms of kernels, measured on an
H200). A graph is tied to fixed shapes and fixed addresses: its inputs are copied into static
buffers, its outputs land in static buffers, and it reads the weights at the addresses they had
when it was captured. So :class:`GraphBook` keeps:

- which shapes have a graph (a call's signature: names, shapes, dtypes of its inputs), captured
  on the second call at that shape (the first compiles and warms up), at most ``max_graphs``;
- the weights' addresses at capture: when a weight is replaced (a LoRA fused by assignment, a
  ``load_state_dict(assign=True)``) every graph is dropped and captured again, so a replay never
  reads freed or stale memory. Values changed in place need nothing: the graph reads them live;
- why a call did not replay (first call at a shape, out of graph slots, capture failed).

The capture itself is behind :class:`GraphCapturer`, the shape of ``torch.cuda.CUDAGraph`` used
through ``torch.cuda.graph``: :class:`CudaGraphCapturer` on a GPU, a stand-in in the tests (they
run on CPUs) that replays by calling the function again into the same output buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

Signature = tuple[tuple[str, tuple[int, ...], str], ...]


class GraphCapturer(Protocol):
    """What :class:`GraphBook` needs of a CUDA graph."""

    def capture(self, fn: Callable[[], Sequence[torch.Tensor]]) -> Sequence[torch.Tensor]:
        """Run ``fn`` once under capture; its outputs become the graph's static output buffers."""
        ...

    def replay(self) -> None:
        """Run the captured kernels again: reads the static inputs, writes the static outputs."""
        ...


class CudaGraphCapturer:
    """The real one: ``torch.cuda.CUDAGraph``, warmed up on a side stream (as PyTorch requires:
    lazy initialisation and autotuning must not happen inside a capture), graphs of one runner
    sharing a memory pool (their calls never overlap, and the runtime copies what it keeps)."""

    def __init__(self, pool: object | None = None, warmup: int = 2) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.warmup = warmup

    def capture(self, fn: Callable[[], Sequence[torch.Tensor]]) -> Sequence[torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


def cuda_capturers() -> Callable[[], GraphCapturer]:
    """A factory of real capturers sharing one memory pool."""
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraphCapturer(pool)


def signature(args: Sequence[torch.Tensor], names: Sequence[str]) -> Signature:
    return tuple((n, tuple(a.shape), str(a.dtype)) for n, a in zip(names, args, strict=True))


def weight_addresses(module: torch.nn.Module) -> tuple[int, ...]:
    """Where every weight lives now: a captured graph is valid only while these stay."""
    return tuple(t.data_ptr() for t in (*module.parameters(), *module.buffers()))


@dataclass
class _Graph:
    capturer: GraphCapturer
    inputs: list[torch.Tensor]
    outputs: tuple[torch.Tensor, ...]


@dataclass
class GraphCounts:
    captures: int = 0
    replays: int = 0
    without: int = 0  # calls that ran the compiled module without a graph
    dropped: int = 0  # graphs dropped because a weight moved
    reasons: dict[str, int] = field(default_factory=dict)  # why calls ran without a graph

    def to_dict(self) -> dict[str, object]:
        return {"captures": self.captures, "replays": self.replays, "without": self.without,
                "dropped": self.dropped, "reasons": dict(self.reasons)}


class GraphBook:
    """One runner's CUDA graphs, one per input signature.

    ``run(fn, args, names, weights)`` returns ``fn(*args)``'s outputs: from a replay where a
    graph of that signature exists, else by calling ``fn`` (and capturing a graph when this is the
    signature's second call and a slot is free). The outputs of a replay are the graph's static
    buffers: the next replay overwrites them (the runtime copies what it hands on).
    """

    def __init__(self, new_capturer: Callable[[], GraphCapturer], max_graphs: int = 8) -> None:
        self.new_capturer = new_capturer
        self.max_graphs = max_graphs
        self.graphs: dict[Signature, _Graph] = {}
        self.seen: set[Signature] = set()
        self.failed: dict[Signature, str] = {}
        self.weights: tuple[int, ...] | None = None
        self.counts = GraphCounts()

    @property
    def captured(self) -> list[Signature]:
        return list(self.graphs)

    def drop(self) -> None:
        self.counts.dropped += len(self.graphs)
        self.graphs.clear()

    def run(self, fn: Callable[..., Sequence[torch.Tensor]], args: Sequence[torch.Tensor], names: Sequence[str],
            weights: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        if weights != self.weights:
            if self.weights is not None:
                self.drop()  # a weight was replaced: its old address may be freed or reused
            self.weights = weights
        sig = signature(args, names)
        graph = self.graphs.get(sig)
        if graph is not None:
            for static, new in zip(graph.inputs, args, strict=True):
                static.copy_(new)
            graph.capturer.replay()
            self.counts.replays += 1
            return graph.outputs
        reason = self._why_not(sig)
        if reason is None:
            return self._capture(fn, args, sig)
        self.seen.add(sig)
        self.counts.without += 1
        self.counts.reasons[reason] = self.counts.reasons.get(reason, 0) + 1
        return tuple(fn(*args))

    def _why_not(self, sig: Signature) -> str | None:
        if sig in self.failed:
            return f"its capture failed: {self.failed[sig]}"
        if sig not in self.seen:
            return "first call at this shape (compiles and warms up before a capture)"
        if len(self.graphs) >= self.max_graphs:
            return f"{self.max_graphs} graphs held (CompileSettings.max_graphs)"
        return None

    def _capture(self, fn, args: Sequence[torch.Tensor], sig: Signature) -> tuple[torch.Tensor, ...]:
        inputs = [a.clone() for a in args]  # the graph's own input buffers: callers' tensors come and go
        capturer = self.new_capturer()
        try:
            outputs = tuple(capturer.capture(lambda: tuple(fn(*inputs))))
        except Exception as exc:  # not capturable (a CPU sync, a dynamic allocation): run without
            self.failed[sig] = f"{type(exc).__name__}: {exc}"[:200]
            self.counts.without += 1
            return tuple(fn(*args))
        self.graphs[sig] = _Graph(capturer, inputs, outputs)
        self.counts.captures += 1
        # a CUDA capture records kernels without running them: one replay computes this call's outputs
        capturer.replay()
        return outputs
