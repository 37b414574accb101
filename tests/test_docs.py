"""The documentation is checked like code.

- The site (mkdocs.yml, docs/) builds in strict mode: a broken link or anchor, a missing page or
  an API reference that does not resolve fails.
- Every code block marked runnable (an HTML comment ``<!-- runnable -->`` on the line before a
  ```` ```python ```` fence, in README.md or docs/) runs, on the built-in tiny models, in a folder
  of its own; an example that rots fails here.
- Every error sd-accel raises is on docs/troubleshooting.md, by class and by message prefix (the
  rule is at :func:`message_prefix`).
- The figures tables in README.md and docs/ are what scripts/figures.py renders from
  docs/figures/*.json: nobody retypes a figure.
"""

from __future__ import annotations

import ast
import doctest
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.scripts import load

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sd_accel"
PAGE = ROOT / "docs" / "troubleshooting.md"
BASE_ERROR = "SdAccelError"  # sd_accel/core.py: every error sd-accel raises derives from it
PREFIX_WORDS = 4


# --------------------------------------------------------------------------- the site


def test_site_builds_in_strict_mode(tmp_path):
    """``mkdocs build --strict`` (what ``scripts/docs.sh`` runs): warnings are errors."""
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI"):
            pytest.fail("mkdocs is not installed: the dev extra (pyproject.toml) installs it")
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    problems = [line for line in run.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert run.returncode == 0, "the site does not build in strict mode:\n" + "\n".join(problems or [run.stderr[-3000:]])
    assert (tmp_path / "site" / "troubleshooting" / "index.html").exists()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "build_engines" in api and "SdAccelError" in api  # the reference came from the docstrings


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines: move the details into a page under docs/"
    for command in ("scripts/run.sh", "scripts/test.sh"):
        assert command in "\n".join(lines), f"README.md must keep the command {command}"


# --------------------------------------------------------------------------- runnable blocks

RUNNABLE = re.compile(r"^<!-- runnable -->\n```python\n(?P<code>.*?)^```$", re.M | re.S)


def runnable_blocks() -> list[tuple[str, str]]:
    """``(page:line, code)`` of every block marked runnable in README.md and docs/; a block that
    appears on several pages (README's example is the first guide's) runs once, named by all."""
    blocks: dict[str, list[str]] = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        for m in RUNNABLE.finditer(text):
            line = text.count("\n", 0, m.start()) + 3
            blocks.setdefault(m.group("code"), []).append(f"{page.relative_to(ROOT)}:{line}")
    return [("+".join(where), code) for code, where in blocks.items()]


def test_runnable_blocks_are_found():
    where = [w for w, _ in runnable_blocks()]
    assert any(w.startswith("README.md:") for w in where) and len(where) >= 6, where


@pytest.fixture(scope="module")
def shared_engines(tmp_path_factory) -> Path:
    """One engine folder for every block: a later block reuses the tiny engines an earlier one built."""
    return tmp_path_factory.mktemp("doc-engines")


@pytest.mark.slow
@pytest.mark.parametrize("where,code", runnable_blocks(), ids=[w for w, _ in runnable_blocks()])
def test_runnable_block(where, code, tmp_path, monkeypatch, shared_engines, capsys):
    """The block runs as a user would paste it: in an empty folder, engines in the shared folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SD_ACCEL_ENGINE_DIR", str(shared_engines))
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    except Exception as exc:  # the page and line, not only this file's frame
        raise AssertionError(f"the runnable block at {where} fails: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------- errors on the troubleshooting page


def own_exceptions(package: Path = PACKAGE) -> set[str]:
    """Names of the classes defined under sd_accel/ that derive, by name, from ``SdAccelError``."""
    bases: dict[str, list[str]] = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
    ours, grew = {BASE_ERROR}, True
    while grew:
        new = {name for name, of in bases.items() if name not in ours and ours.intersection(of)}
        ours |= new
        grew = bool(new)
    return ours


def literal_start(node: ast.expr | None) -> str:
    """The literal text a message starts with: a string's, an f-string's up to its first
    placeholder, the left side of ``"..." + x``; empty when it starts with a value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        text = ""
        for part in node.values:
            if not isinstance(part, ast.Constant):
                break
            text += part.value
        return text
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return literal_start(node.left)
    return ""


def message_prefix(node: ast.expr | None) -> str:
    """THE RULE: the message's literal start (up to its first placeholder), at most its first
    four words, without trailing punctuation (`` :;,.([-'"{``).

    >>> message_prefix(ast.parse('f"no engine named {name!r} in {root}"', mode="eval").body)
    'no engine named'
    >>> message_prefix(ast.parse('"profiles= is empty"', mode="eval").body)
    'profiles= is empty'
    >>> message_prefix(ast.parse('"build cancelled; no partial engine was kept"', mode="eval").body)
    'build cancelled; no partial'
    >>> message_prefix(ast.parse('f"{path} is too small"', mode="eval").body)
    ''
    """
    words = literal_start(node).split()[:PREFIX_WORDS]
    return " ".join(words).rstrip(" :;,.([-'\"{")


def raised_errors(package: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """``(class, prefix)`` -> where sd_accel raises it: every ``raise Cls(message, ...)`` whose
    class is one of :func:`own_exceptions` (by name or as ``module.Cls``)."""
    ours = own_exceptions(package)
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in ours:
                prefix = message_prefix(node.exc.args[0] if node.exc.args else None)
                found.setdefault((name, prefix), []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def page_sections(text: str) -> dict[str, str]:
    """``## ClassName`` heading -> that section's text (up to the next ``## ``), spaces collapsed."""
    sections: dict[str, str] = {}
    for m in re.finditer(r"^## `?(\w+)`?[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S):
        sections[m.group(1)] = " ".join(m.group(2).split())
    return sections


def test_every_error_is_on_the_troubleshooting_page():
    """Each class sd_accel raises has a ``## ClassName`` section on docs/troubleshooting.md, and
    each message prefix (:func:`message_prefix`) appears in that section as the start of a code
    span: ```prefix`` (write it as ``- `prefix …`: what it means; what to do``)."""
    sections = page_sections(PAGE.read_text())
    missing: list[str] = []
    for (cls, prefix), where in sorted(raised_errors().items()):
        if cls not in sections:
            missing.append(f"no section for {cls} (raised at {where[0]}): add a heading '## {cls}' to "
                           "docs/troubleshooting.md with what it means and what to do")
            sections[cls] = ""  # said once per class
        elif prefix and f"`{prefix}" not in sections[cls]:
            missing.append(f"section '## {cls}' lacks the message prefix `{prefix}` (raised at {', '.join(where[:3])}): "
                           f"add a line '- `{prefix} …`: what it means; what to do' under '## {cls}'")
    assert not missing, ("docs/troubleshooting.md does not list every error sd-accel raises "
                         f"({len(missing)} to add):\n" + "\n".join(missing))


def test_the_walk_finds_the_errors():
    found = raised_errors()
    classes = {cls for cls, _ in found}
    assert {"InvalidValue", "EngineError", "CheckpointError", "ValidationFailed"} <= classes
    assert ("ValidationFailed", "engine") in found and len(found) > 100


# --------------------------------------------------------------------------- figures


def test_figures_tables_are_what_the_json_renders():
    figures = load("figures")
    stale = figures.stale(ROOT)
    assert not stale, (f"{', '.join(str(p.relative_to(ROOT)) for p in stale)}: the figures tables differ from "
                       "docs/figures/*.json; change the JSON, then run python scripts/figures.py")
    readme = (ROOT / "README.md").read_text()
    assert "<!-- figures:begin speed/headline:readme -->" in readme


def test_doc_scripts_doctests():
    for name in ("figures", "griffe_doctests"):
        result = doctest.testmod(load(name))
        assert result.failed == 0 and result.attempted > 0, name


def test_bench_appends_its_rows_to_a_figures_file(tmp_path):
    """``python scripts/bench.py --figures FILE`` appends each row with its machine, model, size,
    steps and command; scripts/figures.py renders them (the reference row's infinite PSNR empty)."""
    bench, figures = load("bench"), load("figures")
    report = {"config": {"model": "/cache/bench/sd15-random-seed0", "width": 256, "height": 256, "steps": 20},
              "machine": {"cpu": "AMD EPYC", "cores": 2, "device": {"arch": "cpu-x86_64-avx512-vnni-bf16"}},
              "rows": [{"variant": "diffusers", "s_per_image": 63.42, "e2e_speedup": 1.0, "psnr_db": float("inf"),
                        "peak_ram_gb": 4.7, "skipped": None},
                       {"variant": "openvino-int8", "s_per_image": 13.4, "e2e_speedup": 4.73, "psnr_db": 40.8,
                        "peak_ram_gb": 2.6, "skipped": None},
                       {"variant": "tensorrt-fp16", "skipped": "needs an NVIDIA GPU"}]}
    path = tmp_path / "figures" / "runs.json"
    assert bench.append_figures(path, report, "python scripts/bench.py --size 256", date="2026-12-06") == 2
    assert bench.append_figures(path, report, "python scripts/bench.py --size 256", date="2026-12-07") == 2
    page = tmp_path / "page.md"
    page.write_text("<!-- figures:begin runs/runs -->\n<!-- figures:end -->\n")
    table = figures.rewrite(page.read_text(), figures=path.parent).splitlines()
    assert table[1].startswith("| date | machine | model, size, steps | row | s/image |")
    assert table[3] == ("| 2026-12-06 | AMD EPYC, 2 cores (cpu-x86_64-avx512-vnni-bf16) | sd15-random-seed0, 256x256, 20 steps "
                        "| diffusers | 63.42 | 1.00x | - | 4.7 | `python scripts/bench.py --size 256` |")
    assert "| openvino-int8 | 13.40 | 4.73x | 40.8 | 2.6 |" in table[4] and len(table) == 1 + 2 + 4 + 1  # markers, head, rows
