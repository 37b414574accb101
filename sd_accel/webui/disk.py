"""Disk use of the WebUI's engines, ONNX exports included, as the tab and the API show it.

An engine is built from an ONNX export (``<engine dir>/onnx/<component>.<fingerprint>.s<N>``,
3.3 GB for the SD 1.5 UNet in fp32) that stays to make the next profile's build quick. The engine
cache owns the accounting (:mod:`sd_accel.cache.intermediates`: WebUI engines are matched to
their export by the weights fingerprint kept in ``extra["webui"]``) and removes an export with
the last engine built from it; this module only words and splits its figures for the WebUI.
"""

from __future__ import annotations

from typing import Any

from sd_accel.cache.intermediates import CALIBRATION_DIR, ONNX_DIR


def disk_totals(cache, usage=None) -> dict[str, Any]:
    """``{"engines": n, "engine_bytes": ..., "onnx_bytes": ..., "onnx_unused_bytes": ...,
    "calibration_bytes": ..., "refit_bytes": ..., "total_bytes": ...}`` for the engine directory (``usage``: a
    :class:`sd_accel.cache.store.DiskUsage` already read)."""
    usage = usage or cache.disk_usage()

    def size(kind: str, unused_only: bool = False) -> int:
        return sum(i.size_bytes for i in usage.intermediates if i.kind == kind and (i.unused or not unused_only))

    return {
        "engines": usage.engines,
        "engine_bytes": usage.engines_bytes,
        "onnx_bytes": size(ONNX_DIR),
        "onnx_unused_bytes": size(ONNX_DIR, unused_only=True),
        "calibration_bytes": size(CALIBRATION_DIR),
        "refit_bytes": usage.refit_bytes,  # LoRA refits' engine copies (.refit/)
        "total_bytes": usage.total_bytes,
    }


def disk_line(cache) -> str:
    """One line for the tab: engines, exports, total, where."""
    from sd_accel.units import format_size

    t = disk_totals(cache)
    n = t["engines"]
    line = (f"{n} engine{'s' if n != 1 else ''} ({format_size(t['engine_bytes'])}) + ONNX exports "
            f"{format_size(t['onnx_bytes'])}")
    if t["calibration_bytes"]:
        line += f" + calibration data {format_size(t['calibration_bytes'])}"
    if t["refit_bytes"]:
        line += f" + LoRA refit copies {format_size(t['refit_bytes'])}"
    line += f" = **{format_size(t['total_bytes'])}** on disk in `{cache.root}`"
    if t["onnx_unused_bytes"]:
        line += f" ({format_size(t['onnx_unused_bytes'])} of exports no engine uses)"
    return line


def delete_engine(cache, name: str) -> list[str]:
    """Delete engine ``name`` (the cache then removes the intermediates no engine needs any
    more); returns the names of the intermediates removed. ValueError for a name that is not an
    engine's."""
    before = {i.name for i in cache.intermediates()}
    cache.delete(name)
    return sorted(before - {i.name for i in cache.intermediates()})
