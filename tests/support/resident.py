"""How much of a module's weights lies in file-backed mappings, and how much of that is resident
now (``/proc/self/smaps``): for tests of parked weights (Linux only)."""

from __future__ import annotations

from pathlib import Path

import torch


def _smaps_rss() -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of every mapping of this process."""
    out: list[tuple[int, int, int]] = []
    lo = hi = 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
        elif line.startswith("Rss:"):
            out.append((lo, hi, int(line.split()[1]) * 1024))
    return out


def resident_share(module: torch.nn.Module) -> tuple[float, float]:
    """(share of the module's weight bytes in file-backed mappings, resident bytes of those
    mappings over their weight bytes)."""
    from sd_accel.runtime.weights import FileMaps

    maps = FileMaps()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*module.parameters(), *module.buffers())}
    total = sum(storages.values())
    mapped = {p: n for p, n in storages.items() if n and maps.holds(p, n)}
    rss = sum(r for lo, hi, r in _smaps_rss() if any(lo <= p < hi for p in mapped))
    return sum(mapped.values()) / max(1, total), rss / max(1, sum(mapped.values()))
