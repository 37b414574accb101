"""A CPU stand-in for a CUDA graph (``sd_accel.backends.compile.graphs.GraphCapturer``).

It keeps what makes CUDA graphs easy to get wrong: a replay reads the static input buffers the
capture saw and writes into the same output tensors (the caller's previous outputs change), and the
outputs of a capture hold nothing until a replay. (A replaced weight it would see, where a real graph
reads the old address: the tests check that the bookkeeping drops and captures again instead.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class FakeGraph:
    made: list[FakeGraph] = []  # every capturer made, in order (the tests reset it)

    def __init__(self) -> None:
        self.fn: Callable[[], Sequence[torch.Tensor]] | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.replays = 0
        FakeGraph.made.append(self)

    def capture(self, fn: Callable[[], Sequence[torch.Tensor]]) -> Sequence[torch.Tensor]:
        self.fn = fn
        # a real capture computes nothing: the outputs hold garbage until the first replay
        self.outputs = tuple(torch.full_like(t, float("nan")) for t in fn())
        return self.outputs

    def replay(self) -> None:
        assert self.fn is not None, "replay before capture"
        self.replays += 1
        for static, new in zip(self.outputs, self.fn(), strict=True):
            static.copy_(new)


class FailingGraph(FakeGraph):
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")
