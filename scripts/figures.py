#!/usr/bin/env python
"""Render the figures tables of README.md and docs/ from the JSON in docs/figures/.

Speed and quality figures are typed once, into ``docs/figures/<file>.json`` (or appended there by
``python scripts/bench.py --figures docs/figures/runs.json``), and never by hand into the pages.
A page asks for a table between two marker comments; everything between them is this script's:

    <!-- figures:begin speed/headline -->
    (the rendered table)
    <!-- figures:end -->

``speed/headline`` is table ``headline`` of ``docs/figures/speed.json``; ``speed/headline:readme``
keeps only the rows tagged ``readme``; ``include:docs/snippets/NAME.md`` is that file as it is
(text that README.md and a docs page share, such as the table of what runs where).

A table is ``{"columns": [...], "rows": [...]}``: each column has a ``key`` (the row's field), a
``head`` and optionally a ``fmt`` (``str.format``) and a ``ratio`` (``[numerator key, denominator
key]``: the cell, when the row has no value of its own, is their quotient, so a speed-up is not
typed apart from its two times).

    python scripts/figures.py            # rewrite every marked table in README.md and docs/**/*.md
    python scripts/figures.py --check    # exit 1 and name the pages whose tables are not what the JSON says

``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"
BEGIN = re.compile(r"^<!-- figures:begin (?P<name>[\w./:-]+) -->\n", re.M)
END = "<!-- figures:end -->"


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def load_table(name: str, figures: Path = FIGURES) -> dict[str, Any]:
    """``file/table[:tag]`` -> the table, its rows filtered by the tag."""
    ref, _, tag = name.partition(":")
    file, _, table = ref.rpartition("/")
    path = figures / f"{file}.json"
    if not path.exists():
        raise SystemExit(f"figures: {path} does not exist (asked for by a marker {name!r})")
    tables = json.loads(path.read_text())["tables"]
    if table not in tables:
        raise SystemExit(f"figures: {path} has no table {table!r} (it has {', '.join(sorted(tables))})")
    spec = tables[table]
    rows = [r for r in spec["rows"] if not tag or tag in r.get("tags", ())]
    return {**spec, "rows": rows}


def cell(row: dict[str, Any], column: dict[str, Any]) -> str:
    """One cell: the row's value (or the column's ratio of two of its values), formatted.

    >>> cell({"a": 6.0, "b": 4.0}, {"key": "x", "ratio": ["a", "b"], "fmt": "{:.2f}x"})
    '1.50x'
    >>> cell({"a": 6.0, "b": 4.0, "x": 1.44}, {"key": "x", "ratio": ["a", "b"], "fmt": "{:.2f}x"})
    '1.44x'
    >>> cell({}, {"key": "x"})
    '-'
    """
    value = row.get(column["key"])
    if value is None and "ratio" in column:
        num, den = (row.get(k) for k in column["ratio"])
        value = num / den if num is not None and den else None
    if value is None:
        return "-"
    text = column.get("fmt", "{}").format(value)
    return text.replace("|", "\\|").replace("\n", " ")


def render(spec: dict[str, Any]) -> str:
    """A Markdown table (no trailing newline).

    >>> print(render({"columns": [{"key": "a", "head": "A"}], "rows": [{"a": 1}]}))
    | A |
    |---|
    | 1 |
    """
    columns = spec["columns"]
    lines = ["| " + " | ".join(c["head"] for c in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in spec["rows"]]
    return "\n".join(lines)


def rewrite(text: str, figures: Path = FIGURES) -> str:
    """``text`` with every marked table rendered anew.

    >>> rewrite("x\\n<!-- figures:begin f/t -->\\nold\\n<!-- figures:end -->\\n", figures=Path("/nonexistent"))
    Traceback (most recent call last):
    ...
    SystemExit: figures: /nonexistent/f.json does not exist (asked for by a marker 'f/t')
    """
    out, pos = [], 0
    for m in BEGIN.finditer(text):
        if m.start() < pos:
            continue
        end = text.find(END, m.end())
        if end < 0:
            raise SystemExit(f"figures: marker {m.group('name')!r} has no {END}")
        name = m.group("name")
        if name.startswith("include:"):
            body = (figures.parent.parent / name.removeprefix("include:")).read_text().rstrip("\n")
        else:
            body = render(load_table(name, figures))
        out += [text[pos:m.end()], body, "\n"]
        pos = end
    return "".join(out) + text[pos:]


def stale(root: Path = ROOT) -> list[Path]:
    """The pages whose marked tables differ from what the JSON renders."""
    return [p for p in pages(root) if p.exists() and rewrite(p.read_text(), root / "docs" / "figures") != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for p in bad:
            print(f"figures: {p.relative_to(ROOT)} is not what docs/figures/*.json renders; "
                  "run python scripts/figures.py", file=sys.stderr)
        return 1 if bad else 0
    for p in pages():
        if p.exists():
            new = rewrite(p.read_text())
            if new != p.read_text():
                p.write_text(new)
                print(f"figures: rewrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
