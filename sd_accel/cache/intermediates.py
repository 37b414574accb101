"""Intermediates: what the cache keeps besides engines, and which engines they serve.

Two kinds live under the cache root, written by other modules:

- ``onnx/<component>.<fingerprint16>.s<spec>/``: the ONNX export of a component's weights
  (:mod:`sd_accel.onnx.export`), the source every engine of that component is built from;
  3.3 GB for the SD 1.5 UNet. ``.<name>.tmp-*`` / ``.<name>.old-*`` beside it are an export in
  progress or one a crash left; they count towards that export.
- ``calibration/<fingerprint16>-<component>-<digest>.npz``: the real input feeds static int8
  builds quantize with (:mod:`sd_accel.calibration`); megabytes, minutes to capture again.

**The rule.** An intermediate is *kept* while the cache holds an engine of the same component and
weights (for an export, also of the same export spec version): another profile or precision of
that component is built from it without exporting or capturing again. With no such engine it is
*unused*, and ``delete`` / ``prune`` remove it. While a build of its component runs (in any
process) it is *in use*, and nothing removes it; calibration data is in use while any build runs
(one capture writes the feeds of every component). Engines never read an intermediate once built:
each engine folder holds every file it runs from.

This module only reads the disk and matches; :class:`sd_accel.cache.store.EngineCache` removes,
under the locks.

In a cache with engines, ``scan(cache.root, cache.list())`` says, e.g.,
``[('onnx/unet.0123456789abcdef.s2', 'kept for 2 engines'), ('calibration/...npz', 'unused')]``.
An export no engine was built from:

>>> import tempfile
>>> root = Path(tempfile.mkdtemp())
>>> (root / "onnx" / "unet.0123456789abcdef.s2").mkdir(parents=True)
>>> _ = (root / "onnx" / "unet.0123456789abcdef.s2" / "model.onnx").write_bytes(b"graph")
>>> [(i.name, i.status) for i in scan(root, records=[])]
[('onnx/unet.0123456789abcdef.s2', 'unused')]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..paths import (
    CALIBRATION_DIR,
    CALIBRATION_TEMP,
    ONNX_DIR,
    calibration_temp,
    parse_calibration,
    parse_export,
    parse_export_temp,
)
from .record import EngineRecord

KINDS = (ONNX_DIR, CALIBRATION_DIR)  # named, written and parsed in sd_accel.paths


@dataclass(frozen=True)
class Intermediate:
    """One export folder or calibration file, its size, and the engines it is kept for."""

    kind: str  # "onnx" | "calibration"
    name: str  # relative to the cache root, e.g. "onnx/unet.0123456789abcdef.s1"
    component: str  # "" for a file whose name does not say (never matched to an engine)
    weights: str  # the 16 hex digits of the weights' fingerprint in its name
    spec_version: int | None  # exports only
    size_bytes: int
    engines: tuple[str, ...] = ()  # names of the engines it is kept for
    building: bool = False  # a build of its component is running

    @property
    def unused(self) -> bool:
        """No engine is built from it and no build runs that may read it: delete/prune remove it."""
        return not self.engines and not self.building

    @property
    def status(self) -> str:
        if self.building:
            return "in use by a running build"
        if self.engines:
            n = len(self.engines)
            return f"kept for {n} engine{'s' if n != 1 else ''}"
        return "unused"

    @property
    def label(self) -> str:
        return "ONNX export" if self.kind == ONNX_DIR else "calibration data"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "component": self.component, "weights": self.weights,
                "size_bytes": self.size_bytes, "status": self.status, "engines": list(self.engines)}


def _size(path: Path) -> int:
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:  # removed while we looked
        return 0


def serves(record: EngineRecord) -> set[tuple[str, str]]:
    """The (component, weights16) pairs an engine was built from: its key's weights, and for
    engines keyed by another id (the WebUI's checkpoint hash) the fingerprint kept beside it."""
    pairs = {(record.key.component, record.key.model[:16])}
    webui = (record.extra or {}).get("webui")
    if isinstance(webui, dict) and isinstance(webui.get("weights_fingerprint"), str):
        pairs.add((record.key.component, webui["weights_fingerprint"][:16]))
    return pairs


def paths(root: Path, item: Intermediate) -> list[Path]:
    """Everything on disk that ``item`` counts: the export folder or file and its temporaries."""
    base = root / item.name
    if item.kind == ONNX_DIR:
        folder = base.parent
        temps = [p for p in folder.glob(f".{base.name}.*") if parse_export_temp(p.name)] if folder.is_dir() else []
        return [base, *temps]
    return [base, calibration_temp(base)]


def scan(root: Path, records: Iterable[EngineRecord], building: Iterable[str] = ()) -> list[Intermediate]:
    """Every intermediate under ``root``, matched with ``records`` by the rule in the docstring;
    ``building``: components with a build running."""
    records = list(records)
    building = set(building)
    served: dict[tuple[str, str], list[EngineRecord]] = {}
    for r in records:
        for pair in serves(r):
            served.setdefault(pair, []).append(r)
    found: list[Intermediate] = []
    for name, component, weights, spec, size in [*_exports(root), *_calibrations(root)]:
        users = served.get((component, weights), []) if component else []
        if spec is not None:
            users = [r for r in users if r.key.spec_version == spec]
        kind = name.split("/", 1)[0]
        busy = bool(building) if kind == CALIBRATION_DIR else bool(component) and component in building
        found.append(Intermediate(kind, name, component, weights, spec, size, tuple(sorted(r.name for r in users)),
                                  busy))
    return sorted(found, key=lambda i: i.name)


def _exports(root: Path):
    folder = root / ONNX_DIR
    if not folder.is_dir():
        return
    sizes: dict[str, int] = {}
    for entry in folder.iterdir():
        temp = parse_export_temp(entry.name)
        if temp:  # an export in progress, or left by a crash: counted with its export
            sizes[temp] = sizes.get(temp, 0) + _size(entry)
        elif entry.is_dir():
            sizes[entry.name] = sizes.get(entry.name, 0) + _size(entry)
    for name, size in sorted(sizes.items()):
        parsed = parse_export(name)
        if parsed:
            component, weights, spec = parsed
            yield f"{ONNX_DIR}/{name}", component, weights, spec, size
        else:  # an export of another layout: counted, never matched to an engine
            yield f"{ONNX_DIR}/{name}", "", "", None, size


def _calibrations(root: Path):
    folder = root / CALIBRATION_DIR
    if not folder.is_dir():
        return
    sizes: dict[str, int] = {}
    for entry in folder.iterdir():
        if not entry.is_file():
            continue
        name = entry.name[: -len(CALIBRATION_TEMP)] if entry.name.endswith(CALIBRATION_TEMP) else entry.name
        sizes[name] = sizes.get(name, 0) + _size(entry)
    for name, size in sorted(sizes.items()):
        parsed = parse_calibration(name)
        if parsed:
            yield f"{CALIBRATION_DIR}/{name}", *parsed, None, size
        else:
            yield f"{CALIBRATION_DIR}/{name}", "", "", None, size


def parse_name(name: str) -> tuple[str, str] | None:
    """``(kind, entry)`` for an intermediate's name as listed (``onnx/unet.0123456789abcdef.s1``),
    None for anything else (an engine name, a path that leaves its folder)."""
    kind, _, entry = name.strip().strip("/").partition("/")
    if kind not in KINDS or not entry or "/" in entry or entry.startswith(".") or entry in ("..", "."):
        return None
    return kind, entry
