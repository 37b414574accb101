"""Disk use of the WebUI's engines, ONNX exports included, and removing exports nobody needs.

An engine is built from an ONNX export (``<engine dir>/onnx/<component>.<fingerprint>.s<N>``,
3.3 GB for the SD 1.5 UNet in fp32) that stays to make the next profile's build quick. The
tab and the API count it, and an export goes when the last engine built from it goes (or when
the build that made it failed and no engine uses it), so deleting every engine leaves nothing.

Each WebUI engine record names its export (``extra["webui"]["onnx"]``); older records are
matched by the export's weights fingerprint (``weights_fingerprint``), and diffusers engines by
their key (their weights id is the fingerprint). Where the engine cache itself counts and
removes exports (``cache.usage()``), its figures are used.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("sd_accel")

ONNX_DIR = "onnx"
CALIBRATION_DIR = "calibration"


def _tree_size(folder: Path) -> int:
    if not folder.is_dir():
        return 0
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:  # removed while we looked
            continue
    return total


def exports(cache) -> list[Path]:
    """The export folders under the engine directory (temporary and lock files left out)."""
    root = Path(cache.root) / ONNX_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def export_of(record) -> str | None:
    """The export folder name an engine was built from, when the record says or implies it."""
    webui = (record.extra or {}).get("webui") or {}
    if webui.get("onnx"):
        return str(webui["onnx"])
    fp = webui.get("weights_fingerprint") or (record.key.model if not record.key.model.startswith(("ckpt-", "vae-"))
                                              else None)
    if not fp:
        return None
    return f"{record.key.component}.{str(fp)[:16]}.s{record.key.spec_version}"


def needed_exports(cache, records: Iterable | None = None) -> set[str]:
    """Export folder names some engine in the cache was built from."""
    return {name for r in (cache.list() if records is None else records) if (name := export_of(r))}


def disk_totals(cache) -> dict[str, Any]:
    """``{"engines": n, "engine_bytes": ..., "onnx_bytes": ..., "onnx_unused_bytes": ...,
    "calibration_bytes": ..., "total_bytes": ...}`` for the engine directory."""
    records = cache.list()
    usage = getattr(cache, "usage", None)
    if callable(usage):  # the cache's own account, when it keeps one
        try:
            data = usage()
            data = data if isinstance(data, dict) else vars(data)
            return {"engines": len(records), **data}
        except Exception as exc:  # fall back to counting here
            log.debug("cache.usage() failed: %s", exc)
    needed = needed_exports(cache, records)
    onnx = {p.name: _tree_size(p) for p in exports(cache)}
    engine_bytes = int(cache.total_size())
    onnx_bytes = sum(onnx.values())
    calibration = _tree_size(Path(cache.root) / CALIBRATION_DIR)
    return {
        "engines": len(records),
        "engine_bytes": engine_bytes,
        "onnx_bytes": onnx_bytes,
        "onnx_unused_bytes": sum(size for name, size in onnx.items() if name not in needed),
        "calibration_bytes": calibration,
        "total_bytes": engine_bytes + onnx_bytes + calibration,
    }


def disk_line(cache) -> str:
    """One line for the tab: engines, exports, total, where."""
    from sd_accel.units import format_size

    t = disk_totals(cache)
    n = t["engines"]
    line = (f"{n} engine{'s' if n != 1 else ''} ({format_size(t.get('engine_bytes', 0))}) + ONNX exports "
            f"{format_size(t.get('onnx_bytes', 0))}")
    if t.get("calibration_bytes"):
        line += f" + calibration data {format_size(t['calibration_bytes'])}"
    line += f" = **{format_size(t.get('total_bytes', 0))}** on disk in `{cache.root}`"
    if t.get("onnx_unused_bytes"):
        line += f" ({format_size(t['onnx_unused_bytes'])} of exports no engine uses)"
    return line


def drop_unneeded(cache, names: Iterable[str]) -> list[str]:
    """Remove the export folders ``names`` that no engine in the cache needs; returns those removed.

    Each is removed under its export lock, taken without waiting: a folder another process is
    exporting into right now is left alone.
    """
    from filelock import FileLock, Timeout

    needed = needed_exports(cache)
    removed = []
    for name in sorted(set(names) - needed):
        folder = Path(cache.root) / ONNX_DIR / name
        if not folder.exists():
            continue
        lock = FileLock(str(folder) + ".lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(name)
        finally:
            lock.release()
        Path(str(folder) + ".lock").unlink(missing_ok=True)
    if removed:
        log.info("removed ONNX exports no engine needs: %s", ", ".join(removed))
    return removed


def delete_engine(cache, name: str) -> list[str]:
    """Delete engine ``name`` and the export it was built from when no other engine needs it;
    returns the exports removed. ValueError for a name that is not an engine's."""
    record = next((r for r in cache.list() if r.name == name), None)
    cache.delete(name)
    export = export_of(record) if record is not None else None
    return drop_unneeded(cache, [export] if export else [])
