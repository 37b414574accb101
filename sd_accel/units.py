"""Sizes and ages as people type them (``20GB``, ``30d``) and sizes as they read them (``1.5 GB``).

Foundation level: nothing here imports more than :mod:`sd_accel.core`, so the CLI, the panel
and the cache use it without pulling anything in.

>>> parse_size("20GB"), parse_age("30d"), format_size(1_500_000_000)
(20000000000, 2592000.0, '1.5 GB')
"""

from __future__ import annotations

import re
from decimal import Decimal

from sd_accel.core import InvalidValue

_SIZE_UNITS = {
    "b": 1,
    **dict.fromkeys(("k", "kb"), 1000),
    **dict.fromkeys(("m", "mb"), 1000**2),
    **dict.fromkeys(("g", "gb"), 1000**3),
    **dict.fromkeys(("t", "tb"), 1000**4),
    **{"kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4},
}
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def _number_and_unit(text: str, units: dict[str, int], bare: str, what: str, example: str) -> Decimal:
    """``text`` (a number, then a unit from ``units``; ``bare`` when none) in the base unit."""
    match = _NUMBER_UNIT.match(str(text))
    unit = (match[2].lower() or bare) if match else ""
    if match is None or unit not in units:
        raise InvalidValue(
            f"Cannot read {what} {text!r}: write a number and a unit, e.g. {example} "
            f"(units: {', '.join(units)})."
        )
    return Decimal(match[1]) * units[unit]


def parse_size(text: str) -> int:
    """Bytes in a size such as ``20GB``. KB/MB/GB/TB are powers of 1000, KiB..TiB of 1024.

    A bare number is bytes; case and a space before the unit do not matter.

    >>> parse_size("20GB"), parse_size("1.5 kb"), parse_size("2KiB"), parse_size("512")
    (20000000000, 1500, 2048, 512)
    """
    return int(_number_and_unit(text, _SIZE_UNITS, "b", "size", "500MB, 20GB, 1.5TB"))


def parse_age(text: str) -> float:
    """Seconds in an age such as ``30d``: s, m (minutes), h, d, w; a bare number is seconds.

    >>> parse_age("30d"), parse_age("1.5h"), parse_age("90")
    (2592000.0, 5400.0, 90.0)
    """
    return float(_number_and_unit(text, _AGE_UNITS, "s", "age", "90s, 30m, 12h, 30d, 2w"))


def format_size(n: int | float) -> str:
    """A human-readable size, powers of 1000 like :func:`parse_size`.

    >>> format_size(1_500_000_000), format_size(12)
    ('1.5 GB', '12 B')
    """
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
