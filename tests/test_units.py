"""Sizes and ages as the CLI reads them (``prune --max-size 20GB --older-than 30d``) and writes them."""

from __future__ import annotations

import pytest

from sd_accel.units import format_size, parse_age, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20GB", 20_000_000_000),
        ("20gb", 20_000_000_000),
        ("1.5 TB", 1_500_000_000_000),
        ("500MB", 500_000_000),
        ("10KB", 10_000),
        ("2KiB", 2048),
        ("1GiB", 1 << 30),
        ("7B", 7),
        ("4096", 4096),
        ("3G", 3_000_000_000),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30d", 30 * 86400.0),
        ("2w", 14 * 86400.0),
        ("12h", 43200.0),
        ("15m", 900.0),
        ("90s", 90.0),
        ("1.5h", 5400.0),
        ("45", 45.0),
    ],
)
def test_parse_age(text: str, expected: float) -> None:
    assert parse_age(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "20 parsecs", "-5GB", "1e3", "twenty"])
def test_parse_size_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="Cannot read size"):
        parse_size(text)


@pytest.mark.parametrize("text", ["", "d", "3 months", "-1d", "5y"])
def test_parse_age_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="Cannot read age"):
        parse_age(text)


@pytest.mark.parametrize(
    ("n", "expected"),
    [(0, "0 B"), (999, "999 B"), (1000, "1.0 KB"), (5000, "5.0 KB"), (1_500_000_000, "1.5 GB"), (2e12, "2.0 TB")],
)
def test_format_size(n: float, expected: str) -> None:
    assert format_size(n) == expected


def test_format_size_reads_back_as_parse_size_reads_it() -> None:
    assert parse_size(format_size(20_000_000_000).replace(" ", "")) == 20_000_000_000
