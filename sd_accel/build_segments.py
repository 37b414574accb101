"""Build a transformer in segments (issue 44: build within the machine): each segment of the plan
(``sd_accel.components.segments``) exported to ONNX, built by the backend and its export deleted
before the next one starts, so a build holds one segment's fp32 copy and export at a time instead
of the whole module's (1.7-4.7x the fp32 weights: FLUX.1's 44 GB cannot be exported whole on a
24 GB machine). The segment engines make one chained engine (``sd_accel.backends.chain``), checked
against torch as one engine is (``sd_accel.validate``), with a torch reference that also runs one
segment in fp32 at a time.

The segment exports are not kept (a FLUX.1 export is 44 GB of fp32 on disk): another profile
exports again, and a LoRA refit of a chained engine builds it again (``sd_accel.refit``).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from sd_accel.backends.chain import ChainLink, load_engine, write_chain
from sd_accel.components.segments import SegmentPlan, SegmentSpec, state_name
from sd_accel.core import Progress
from sd_accel.onnx.attention import sdpa_attention
from sd_accel.onnx.export import export_onnx, fp32_on
from sd_accel.pages import trim_heap
from sd_accel.profiles import Profile
from sd_accel.runtime.weights import release

log = logging.getLogger("sd_accel")

_SCRATCH = ".segment-onnx"  # inside the build slot: a crash leaves it where the slot's leftovers go


def build_chain(be, spec, plan: SegmentPlan, profile: Profile, precision: str, out_dir: Path,
                progress: Progress, release=None) -> list[str]:
    """Export and build each segment of ``plan`` into ``out_dir/segNN``; returns the chained
    engine's files (relative to ``out_dir``). ``release(spec)``: hands back the pages of the torch
    weights a segment's export read (the build's ``release_torch_weights``)."""
    links: list[ChainLink] = []
    count = len(plan.segments)
    if release is not None:
        release(spec)  # the fingerprint read every weight: only one segment's are needed at a time
    for segment in plan.segments:
        part = SegmentSpec(spec, segment)
        start = time.perf_counter()
        base, share = segment.index / count, 1 / count

        def sub(frac: float, msg: str, base: float = base, share: float = share, name: str = part.name) -> None:
            progress(base + share * frac, f"{name}: {msg}")

        scratch = Path(out_dir) / _SCRATCH
        try:
            onnx_path = export_onnx(part, scratch, lambda f, m: sub(0.4 * f, m))
            if release is not None:
                release(spec)  # (it trims the heap too: the segment's fp32 copy and traced graph)
            else:
                trim_heap()
            folder = Path(out_dir) / segment.folder
            folder.mkdir(parents=True, exist_ok=True)
            shapes = part.shape_ranges(profile)
            # int8 in segments: weights only (no calibration: a segment's inputs are the states the
            # segments before it make)
            scope = be.int8_weights_only if precision == "int8" else None
            files = be.build(onnx_path, shapes, precision, folder, lambda f, m: sub(0.4 + 0.6 * f, m),
                             int8_scope=scope)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            trim_heap()  # the segment's fp32 copy and export, freed but kept by malloc
        outputs = tuple(t.name for t in part.outputs())
        links.append(ChainLink(segment.folder, tuple(files), shapes, tuple(t.name for t in part.inputs()), outputs,
                               tuple(map(state_name, outputs))))
        log.info("%s: built in %.1f s (%d of %d)", part.name, time.perf_counter() - start, segment.index + 1, count)
    return write_chain(out_dir, links, plan.tag)


class _Chain(torch.nn.Module):
    """The torch reference of a chained engine: the segments in turn, each in float32 only while it
    runs (the whole module is never held in fp32: a bf16 FLUX.1 would take 44 GB)."""

    def __init__(self, parts: list[SegmentSpec], inputs: list[str], outputs: list[str], device: str) -> None:
        super().__init__()
        self.parts, self.input_names, self.output_names, self.device = parts, inputs, outputs, device

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = dict(zip(self.input_names, args, strict=True))
        for part in self.parts:
            module = part.torch_module()
            with fp32_on(module, self.device), sdpa_attention(module):
                out = module(*(state[t.name] for t in part.inputs()))
            release(module)  # its weights' pages, where they are mapped from their file: the next segment's turn
            state.update(zip((state_name(t.name) for t in part.outputs()), out, strict=True))
        return tuple(state[name] for name in self.output_names)


class ChainReference:
    """``spec`` for :func:`sd_accel.validate.validate` with its torch reference run segment by
    segment (:class:`_Chain`); everything else is ``spec``'s. Its ``torch_module`` is an empty
    module, so the validation's own fp32 conversion moves nothing."""

    def __init__(self, spec, plan: SegmentPlan, device: str = "cpu") -> None:
        self._spec = spec
        self._parts = [SegmentSpec(spec, s) for s in plan.segments]
        self._device = device
        self._empty = torch.nn.Module()

    def __getattr__(self, name: str):
        return getattr(self._spec, name)

    def torch_module(self) -> torch.nn.Module:
        return self._empty

    def export_module(self) -> torch.nn.Module:
        return _Chain(self._parts, [t.name for t in self._spec.inputs()], [t.name for t in self._spec.outputs()],
                      self._device)


@contextmanager
def chain_runner(be, out_dir: Path, files: list[str], shapes, streaming: bool = True) -> Iterator:
    """The chained engine's runner for its check against torch: streaming by default (one segment's
    weights in memory at a time, see :func:`sd_accel.backends.chain.load_engine`)."""
    runner = load_engine(be, out_dir, files, shapes, streaming=streaming)
    try:
        yield runner
    finally:
        runner.close()


__all__ = ["ChainReference", "build_chain", "chain_runner"]
