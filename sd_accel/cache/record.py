"""What the cache stores about one engine: its record (``meta.json``), checksums, JSON on disk.

:class:`EngineRecord` is the truth for one engine folder; :class:`BrokenEngine` is a folder that
has none. :func:`files_checksum` and :func:`files_size` measure a record's files, and
:func:`write_json_atomic` is how every JSON file of the cache reaches the disk (all or nothing).
The cache itself (folders, locks, the index) is :mod:`sd_accel.cache.store`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import InvalidValue, ShapeRanges
from .key import EngineKey

META_FILE = "meta.json"  # in each engine folder: the folder's EngineRecord as JSON

_CHUNK = 8 << 20


def safe_relative(name: str) -> str:
    """``name`` as a relative POSIX path inside an engine folder, or :class:`InvalidValue`.

    >>> safe_relative("data/weights.bin")
    'data/weights.bin'
    >>> safe_relative("../x")
    Traceback (most recent call last):
    ...
    sd_accel.core.InvalidValue: '../x' cannot name an engine file (relative, inside the folder, not meta.json)
    """
    path = Path(name)
    if not name or path.is_absolute() or ".." in path.parts or path.as_posix() == META_FILE:
        raise InvalidValue(
            f"{name!r} cannot name an engine file (relative, inside the folder, not {META_FILE})"
        )
    return path.as_posix()


def _shapes_to_json(shapes: ShapeRanges) -> dict[str, list[list[int]]]:
    return {name: [list(s) for s in ranges] for name, ranges in shapes.items()}


def _shapes_from_json(data: dict[str, Any]) -> ShapeRanges:
    out: ShapeRanges = {}
    for name, ranges in data.items():
        lo, opt, hi = (tuple(int(d) for d in s) for s in ranges)
        out[str(name)] = (lo, opt, hi)
    return out


@dataclass
class EngineRecord:
    """What the cache knows about one engine; ``meta.json`` holds it as JSON.

    ``shapes`` is the backend's :data:`ShapeRanges` (tuples in memory, nested lists on disk).
    ``checksum`` is ``sha256:<hex>`` over the files (see :func:`files_checksum`).

    >>> key = EngineKey("0123456789abcdef", "unet", "onnxruntime", "1.32.0", "cpu-x86_64-avx512", "fp32",
    ...                 "static.b1.h64.w64.t77")
    >>> r = EngineRecord(key, ["model.onnx"], {"x": ((1, 4), (1, 4), (2, 4))}, "sha256:..",
    ...                  1024, 0.0, 0.0, 3.2)
    >>> EngineRecord.from_dict(r.to_dict()) == r
    True
    """

    key: EngineKey
    files: list[str]
    shapes: ShapeRanges
    checksum: str
    size_bytes: int
    created: float
    last_used: float
    build_seconds: float
    validation: dict[str, Any] | None = None
    status: str = "ok"  # "ok" | "bad"
    bad_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The engine's folder name, ``key.name``."""
        return self.key.name

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; :meth:`from_dict` reads it back to an equal record."""
        data = dataclasses.asdict(self)
        data["key"] = self.key.to_dict()
        data["shapes"] = _shapes_to_json(self.shapes)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineRecord:
        """The record in ``data``; ValueError saying what is wrong when it is not one."""
        try:
            record = cls(
                key=EngineKey.from_dict(data["key"]),
                files=[safe_relative(str(f)) for f in data["files"]],
                shapes=_shapes_from_json(data["shapes"]),
                checksum=str(data["checksum"]),
                size_bytes=int(data["size_bytes"]),
                created=float(data["created"]),
                last_used=float(data.get("last_used", data["created"])),
                build_seconds=float(data.get("build_seconds", 0.0)),
                validation=data.get("validation"),
                status=str(data.get("status", "ok")),
                bad_reason=data.get("bad_reason"),
                extra=dict(data.get("extra") or {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidValue(f"not an engine record ({type(exc).__name__}: {exc})") from exc
        if record.status not in ("ok", "bad"):
            raise InvalidValue(f"not an engine record (status {record.status!r})")
        return record


@dataclass(frozen=True)
class BrokenEngine:
    """An engine folder that cannot be used (no or unreadable meta.json). Never deleted silently."""

    name: str
    path: Path
    reason: str


# --------------------------------------------------------------------------- files and JSON


def files_checksum(folder: Path, files: Iterable[str]) -> str:
    """``sha256:<hex>`` over each file's name, length and bytes, in order; streamed.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())                              # e.g. engines/unet.sm89...
    >>> _ = (folder / "engine.plan").write_bytes(b"engine bytes")
    >>> files_checksum(folder, ["engine.plan"])[:15]
    'sha256:1c685239'
    """
    digest = hashlib.sha256()
    for name in files:
        path = folder / name
        digest.update(name.encode() + b"\0" + struct.pack("<Q", path.stat().st_size))
        with open(path, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def files_size(folder: Path, files: Iterable[str]) -> int:
    """Bytes in ``files`` (names relative to ``folder``): what a record's ``size_bytes`` counts."""
    return sum((folder / name).stat().st_size for name in files)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` through a temp file + fsync + os.replace: all or nothing."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def plain_json(data: Any) -> Any:
    """``data`` as it reads back from JSON (numpy / torch scalars become numbers).

    >>> plain_json({"ok": True, "t": (1, 2)})
    {'ok': True, 't': [1, 2]}
    """
    return json.loads(json.dumps(data, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
