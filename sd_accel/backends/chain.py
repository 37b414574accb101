"""A chain of engines standing as one: the engine of a transformer built in segments
(``sd_accel.components.segments``). Each segment's engine lies in a folder of its own inside the
chained engine's folder, built by the backend like any engine; ``segments.json`` says their order,
files, shapes, and which tensors each takes and gives.

:class:`ChainRunner` keeps the runner contract (``infer``, ``shapes``, ``close``), so validation,
the cache record and the pipeline's swap take a chain as they take one engine. It runs the
segments in turn, each fed the call's inputs and the tensors the segments before it gave, keeping
loaded those that fit in memory (:func:`chain_keeping`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from sd_accel.core import EngineError, EngineFault, InvalidValue, ShapeRanges, covers
from sd_accel.pages import trim_heap

log = logging.getLogger("sd_accel")

CHAIN_FILE = "segments.json"
STREAMING_ENV = "SD_ACCEL_CHAIN_STREAMING"
RESERVE_ENV = "SD_ACCEL_CHAIN_RESERVE_GB"


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
    backend's runners for a chain.

    ``streaming`` (a chain only): False loads every segment now and keeps them; True loads each
    segment when its turn comes and closes it after (one segment's weights in memory at a time, at
    the cost of a load per segment per call: what a build's check against torch runs, so that an
    engine is checked on a machine that holds only a part of it, FLUX.1 in fp32: 44 GB). ``None``:
    :func:`chain_keeping` decides (what the pipeline's engines do: by default, keep loaded the
    segments that fit and stream the rest, measured on the calls themselves)."""
    if not is_chain(files):
        return backend.load(engine_dir, list(files), shapes)
    links = read_chain(engine_dir)
    keep = chain_keeping(backend) if streaming is None else (KEEP_NONE if streaming else KEEP_ALL)
    return ChainRunner(backend, Path(engine_dir), links, shapes, keep)


KEEP_ALL, KEEP_NONE, KEEP_FIT = "all", "none", "fit"


def chain_keeping(backend) -> str:
    """Which segments of a chained engine stay loaded between calls (``SD_ACCEL_CHAIN_STREAMING``):
    ``off``: all (:data:`KEEP_ALL`, loaded at once); ``on``: none (:data:`KEEP_NONE`, each loaded
    for its turn); ``auto``, the default: those that fit (:data:`KEEP_FIT`, see
    :class:`ChainRunner`), or all where the backend's engines live on the card (TensorRT) and host
    memory says nothing of them."""
    value = os.environ.get(STREAMING_ENV, "auto").strip().lower()
    if value in ("on", "1", "yes", "true"):
        return KEEP_NONE
    if value in ("off", "0", "no", "false"):
        return KEEP_ALL
    if value not in ("", "auto"):
        raise InvalidValue(f"{STREAMING_ENV}={value!r}: use auto, on or off")
    return KEEP_FIT if getattr(backend, "engines_in_host_memory", True) else KEEP_ALL


def chain_reserve() -> int:
    """The memory a chain leaves available when it keeps segments loaded (``KEEP_FIT``):
    ``SD_ACCEL_CHAIN_RESERVE_GB``, or the larger of 4 GiB and 25% of the machine's memory: what
    the rest of the call needs beside it (FLUX.1's VAE decode at 1024 px, T5 for the next prompt,
    the next segment's load and first inference: about 1 GB for a FLUX.1 double block at 1024 px).
    FLUX.1's int4 chain at 1024 px on 24 GB: peak RSS 21.1 GiB with 4.3 GB kept, 19.6 GiB with 6 GB
    (scripts/BENCHMARKS-full-size.md)."""
    value = os.environ.get(RESERVE_ENV, "").strip()
    if value:
        try:
            gb = float(value)
        except ValueError:
            gb = -1.0
        if gb < 0:
            raise InvalidValue(f"{RESERVE_ENV}={value!r}: give the gigabytes to leave available, e.g. 4")
        return int(gb * 1e9)
    from sd_accel.device import total_memory

    total = total_memory()
    return max(4 << 30, int(0.25 * total)) if total else 4 << 30


class ChainRunner:
    """``infer(feed) -> outputs`` through the segments in turn, each fed the call's inputs and what
    the segments before it gave. Feeds outside ``shapes`` (the whole engine's) are refused; the
    outputs are the last segment's (a runner's buffers where that segment stays loaded: clone what
    you keep, as for one engine).

    ``keep``: :data:`KEEP_ALL` loads every segment now and keeps them; :data:`KEEP_NONE` loads each
    for its turn and closes it after, its outputs copied out first; :data:`KEEP_FIT` loads each
    segment on its first turn and keeps it while the memory available after it ran stays above
    :func:`chain_reserve`, closing it otherwise (so a bigger shape, which grows what a loaded
    segment holds, closes the segments that no longer fit). Memory is read after each segment's
    run rather than estimated: what a backend holds depends on the shape (OpenVINO's int4 FLUX.1
    chain: 2.6x its files at 512 px, out of memory at 1024 px loaded whole;
    scripts/BENCHMARKS-full-size.md)."""

    def __init__(self, backend, engine_dir: Path, links: Sequence[ChainLink], shapes: ShapeRanges,
                 keep: str = KEEP_ALL) -> None:
        if not links:
            raise EngineFault("a chained engine needs at least one segment")
        if keep not in (KEEP_ALL, KEEP_NONE, KEEP_FIT):
            raise ValueError(f"keep={keep!r}: one of {KEEP_ALL!r}, {KEEP_NONE!r}, {KEEP_FIT!r}")
        self.backend, self.engine_dir, self.links, self.shapes, self.keep = backend, engine_dir, list(links), shapes, keep
        self.loaded: dict[int, object] = {}  # segment index -> its runner, while it stays loaded
        self.reserve = chain_reserve() if keep == KEEP_FIT else 0
        self._told = 0  # the streamed count last logged
        if keep == KEEP_ALL:
            try:
                for i in range(len(self.links)):
                    self.loaded[i] = self._load(i)
            except BaseException:
                self.close()
                raise

    @property
    def once_bytes(self) -> int:
        """What the next call loads once whatever its shape, of the loaded segments (validation's
        memory estimate, :func:`sd_accel.validate.max_point_need`)."""
        return sum(int(getattr(r, "once_bytes", 0) or 0) for r in self.loaded.values())

    @property
    def per_shape_bytes(self) -> int:
        return sum(int(getattr(r, "per_shape_bytes", 0) or 0) for r in self.loaded.values())

    def infer(self, feed: dict) -> dict:
        _check_covers(self.shapes, feed)
        state = self.run_links(feed, 0, len(self.links))
        if self.keep == KEEP_FIT and self.streamed != self._told:
            self._told = self.streamed
            log.info("%s: %d of its %d segments stay loaded, the others load for their turn (%s keeps %.1f GB "
                     "available)", self.engine_dir.name, len(self.loaded), len(self.links), RESERVE_ENV,
                     self.reserve / 1e9)
        return {name: state[given] for name, given in zip(self.links[-1].outputs, self.links[-1].gives, strict=True)}

    def run_links(self, state: dict, start: int, stop: int) -> dict:
        """``state`` (the call's inputs and what the segments before ``start`` gave) with what
        segments ``start`` to ``stop - 1`` give, under their ``gives`` names: a first-block step
        cache runs the first segment, then the others or only the last
        (:mod:`sd_accel.runtime.step_cache`)."""
        state = dict(state)
        for i in range(start, stop):
            link = self.links[i]
            runner = self.loaded.get(i) or self._load(i)
            out = runner.infer({name: state[name] for name in link.inputs})
            if not self._stays(i):
                out = {name: t.clone() for name, t in out.items()}  # the runner's buffers go with it
                self.loaded.pop(i, None)
                runner.close()
                del runner
                trim_heap()  # the segment's weights, freed by the runtime but kept by malloc
            else:
                self.loaded[i] = runner
            state.update({given: out[name] for name, given in zip(link.outputs, link.gives, strict=True)})
        return state

    def _load(self, i: int):
        link = self.links[i]
        return self.backend.load(self.engine_dir / link.folder, list(link.files), link.shapes)

    def _stays(self, i: int) -> bool:
        if self.keep != KEEP_FIT:
            return self.keep == KEEP_ALL
        from sd_accel.device import available_memory

        free = available_memory()
        stays = free is None or free > self.reserve
        if not stays and i in self.loaded:
            log.info("%s: segment %d closed (%.1f GB available, %.1f GB kept in reserve): it loads for its turn "
                     "from now on", self.engine_dir.name, i, free / 1e9, self.reserve / 1e9)
        return stays

    @property
    def streamed(self) -> int:
        """How many segments are not loaded now (each loads for its turn on the next call)."""
        return len(self.links) - len(self.loaded)

    def close(self) -> None:
        runners, self.loaded = list(self.loaded.values()), {}
        for runner in runners:
            runner.close()
        if runners:
            trim_heap()


def _check_covers(shapes: ShapeRanges, feed: dict) -> None:
    """A chain, as any runner, refuses a feed outside its ranges rather than padding it."""
    if not covers(shapes, feed):
        got = {k: tuple(v.shape) for k, v in feed.items()}
        raise EngineError(f"engine does not cover shapes {got}; its ranges are {shapes}")
