"""A chain of engines standing as one: the engine of a transformer built in segments
(``sd_accel.components.segments``). Each segment's engine lies in a folder of its own inside the
chained engine's folder, built by the backend like any engine; ``segments.json`` says their order,
files, shapes, and which tensors each takes and gives.

:class:`ChainRunner` keeps the runner contract (``infer``, ``shapes``, ``close``), so validation,
the cache record and the pipeline's swap take a chain as they take one engine. It runs the
segments in turn, each fed the call's inputs and the tensors the segments before it gave.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from sd_accel.core import EngineError, EngineFault, InvalidValue, ShapeRanges, covers

log = logging.getLogger("sd_accel")

CHAIN_FILE = "segments.json"
STREAMING_ENV = "SD_ACCEL_CHAIN_STREAMING"
# What a loaded segment holds while it runs, per byte of its engine files, where its backend does
# not say (``RUN_BYTES_PER_ENGINE_BYTE``). OpenVINO's int4 FLUX.1 chain: 17.9 GiB at 512 px for
# 6.97 GiB of files, and out of memory at 1024 px on a 24 GB machine (scripts/BENCHMARKS-full-size.md).
DEFAULT_RUN_FACTOR = 1.5


@dataclass(frozen=True)
class ChainLink:
    """One segment engine: its folder (relative to the chain's), files (relative to its folder),
    shapes, the tensors it takes, its outputs, and the names they go on under (``gives``, in the
    order of ``outputs``): an ONNX graph cannot name an output as it names an input, so a segment
    whose ``hidden`` goes in and comes out changed calls the new one ``hidden_next``."""

    folder: str
    files: tuple[str, ...]
    shapes: ShapeRanges
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    gives: tuple[str, ...]


def write_chain(out_dir: Path, links: Sequence[ChainLink], layout: str) -> list[str]:
    """Write ``segments.json`` into ``out_dir``; returns the chain's files relative to it (the
    description first, then each segment's files)."""
    data = {"layout": layout, "segments": [asdict(link) for link in links]}
    (Path(out_dir) / CHAIN_FILE).write_text(json.dumps(data, indent=1))
    return [CHAIN_FILE] + [f"{link.folder}/{name}" for link in links for name in link.files]


def read_chain(engine_dir: Path) -> list[ChainLink]:
    try:
        data = json.loads((Path(engine_dir) / CHAIN_FILE).read_text())
        return [ChainLink(d["folder"], tuple(d["files"]), _tuples(d["shapes"]), tuple(d["inputs"]), tuple(d["outputs"]),
                          tuple(d["gives"]))
                for d in data["segments"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineFault(f"the chained engine in {engine_dir} has an unreadable {CHAIN_FILE} ({exc}); "
                          "delete it and build again") from exc


def _tuples(shapes: dict) -> ShapeRanges:
    return {name: tuple(tuple(int(d) for d in shape) for shape in bounds) for name, bounds in shapes.items()}  # type: ignore[misc]


def is_chain(files: Sequence[str]) -> bool:
    return CHAIN_FILE in files


def load_engine(backend, engine_dir: Path, files: Sequence[str], shapes: ShapeRanges,
                streaming: bool | None = False):
    """The runner of an engine: ``backend.load`` for one engine, a :class:`ChainRunner` of the
    backend's runners for a chain (every segment loaded; each maps its own weights).

    ``streaming``: a chain loads each segment when its turn comes and closes it after
    (:class:`StreamingChainRunner`): one segment's weights in memory at a time, at the cost of a
    load per segment per call. What a build's check against torch runs, so that an engine is
    checked on a machine that holds only a part of it (FLUX.1 in fp32: 44 GB). ``None``: decide
    by :func:`stream_chain` (what the pipeline's engines do)."""
    if not is_chain(files):
        return backend.load(engine_dir, list(files), shapes)
    links = read_chain(engine_dir)
    if streaming is None:
        streaming = stream_chain(backend, Path(engine_dir), files)
    if streaming:
        return StreamingChainRunner(backend, Path(engine_dir), links, shapes)
    runners: list = []
    try:
        for link in links:
            runners.append(backend.load(Path(engine_dir) / link.folder, list(link.files), link.shapes))
    except BaseException:
        for runner in runners:
            runner.close()
        raise
    return ChainRunner(runners, links, shapes)


def stream_chain(backend, engine_dir: Path, files: Sequence[str]) -> bool:
    """Whether a chained engine runs one segment at a time (``SD_ACCEL_CHAIN_STREAMING``: ``on``,
    ``off``, or ``auto``, the default: when every segment loaded at once would hold more than 80%
    of the memory available now, estimated as the engine's files times the backend's
    ``RUN_BYTES_PER_ENGINE_BYTE``). Streaming costs a load per segment per call (FLUX.1's 57 int4
    segments on OpenVINO: about 1 s each) and saves all but one segment's memory."""
    from sd_accel.device import available_memory

    value = os.environ.get(STREAMING_ENV, "auto").strip().lower()
    if value in ("on", "1", "yes", "true"):
        return True
    if value in ("off", "0", "no", "false"):
        return False
    if value not in ("", "auto"):
        raise InvalidValue(f"{STREAMING_ENV}={value!r}: use auto, on or off")
    size = sum((Path(engine_dir) / f).stat().st_size for f in files if (Path(engine_dir) / f).is_file())
    need = size * float(getattr(backend, "RUN_BYTES_PER_ENGINE_BYTE", DEFAULT_RUN_FACTOR))
    free = available_memory()
    if free is None or need <= 0.8 * free:
        return False
    log.info("%s: its segments would hold about %.1f GB loaded together, %.1f GB is available: they load one "
             "at a time for each call (%s=off keeps them loaded)", Path(engine_dir).name, need / 1e9, free / 1e9,
             STREAMING_ENV)
    return True


class ChainRunner:
    """``infer(feed) -> outputs`` through the segment runners in turn. Feeds outside ``shapes``
    (the whole engine's) are refused; the outputs are the last segment's (its runner's buffers:
    clone what you keep, as for one engine)."""

    def __init__(self, runners: Sequence, links: Sequence[ChainLink], shapes: ShapeRanges) -> None:
        if len(runners) != len(links) or not runners:
            raise EngineFault("a chained engine needs one runner per segment")
        self.runners = list(runners)
        self.links = list(links)
        self.shapes = shapes

    @property
    def once_bytes(self) -> int:
        """What the next call loads once whatever its shape: every segment's (validation's memory
        estimate, :func:`sd_accel.validate.max_point_need`)."""
        return sum(int(getattr(r, "once_bytes", 0) or 0) for r in self.runners)

    @property
    def per_shape_bytes(self) -> int:
        return sum(int(getattr(r, "per_shape_bytes", 0) or 0) for r in self.runners)

    def infer(self, feed: dict) -> dict:
        _check_covers(self.shapes, feed)
        state = self.run_links(feed, 0, len(self.links))
        return {name: state[given] for name, given in zip(self.links[-1].outputs, self.links[-1].gives, strict=True)}

    def run_links(self, state: dict, start: int, stop: int) -> dict:
        """``state`` (the call's inputs and what the segments before ``start`` gave) with what
        segments ``start`` to ``stop - 1`` give, under their ``gives`` names: a first-block step
        cache runs the first segment, then the others or only the last
        (:mod:`sd_accel.runtime.step_cache`). The tensors are the runners' buffers."""
        state = dict(state)
        for link, runner in zip(self.links[start:stop], self.runners[start:stop], strict=True):
            out = runner.infer({name: state[name] for name in link.inputs})
            state.update({given: out[name] for name, given in zip(link.outputs, link.gives, strict=True)})
        return state

    def close(self) -> None:
        for runner in self.runners:
            runner.close()


def _check_covers(shapes: ShapeRanges, feed: dict) -> None:
    """A chain, as any runner, refuses a feed outside its ranges rather than padding it."""
    if not covers(shapes, feed):
        got = {k: tuple(v.shape) for k, v in feed.items()}
        raise EngineError(f"engine does not cover shapes {got}; its ranges are {shapes}")


class StreamingChainRunner:
    """A chain run one segment at a time: each segment's runner loaded for its turn and closed
    after it, its outputs copied out first (a runner's buffers go with it). See :func:`load_engine`."""

    def __init__(self, backend, engine_dir: Path, links: Sequence[ChainLink], shapes: ShapeRanges) -> None:
        if not links:
            raise EngineFault("a chained engine needs at least one segment")
        self.backend, self.engine_dir, self.links, self.shapes = backend, engine_dir, list(links), shapes

    def infer(self, feed: dict) -> dict:
        _check_covers(self.shapes, feed)
        state = self.run_links(feed, 0, len(self.links))
        return {name: state[given] for name, given in zip(self.links[-1].outputs, self.links[-1].gives, strict=True)}

    def run_links(self, state: dict, start: int, stop: int) -> dict:
        """As :meth:`ChainRunner.run_links`, each segment loaded for its turn (its outputs copied)."""
        from sd_accel.pages import trim_heap

        state = dict(state)
        for link in self.links[start:stop]:
            runner = self.backend.load(self.engine_dir / link.folder, list(link.files), link.shapes)
            try:
                out = {name: t.clone() for name, t in runner.infer({n: state[n] for n in link.inputs}).items()}
            finally:
                runner.close()
                del runner
                trim_heap()  # the segment's weights, freed by the runtime but kept by malloc
            state.update({given: out[name] for name, given in zip(link.outputs, link.gives, strict=True)})
        return state

    def close(self) -> None:
        return None
