"""The layering of README's Layout section, checked on the source: no module imports a layer above its
own (lazy imports inside functions included), and no two modules import each other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sd_accel"
# Bottom to top, as README's Layout lists them. A layer is the first name under sd_accel.
ORDER = ["core", "paths", "units", "pages", "profiles", "device", "models", "optimize", "samplers", "components", "onnx",
         "backends", "cache", "runtime", "calibration", "validate", "build", "autobuild", "refit", "prompts", "config",
         "api", "generate",
         "ui", "bench", "serve", "cli_engines", "cli", "webui"]


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {n for n in found if n.startswith("sd_accel.")}


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}


def _layer(module: str) -> str:
    return module.split(".")[1]


def test_every_module_belongs_to_a_known_layer():
    unknown = sorted({_layer(m) for m in _graph() if "." in m} - set(ORDER))
    assert not unknown, f"add these to ORDER (and README's Layout): {unknown}"


def test_no_layer_imports_upwards():
    upward = [f"{m} -> {i}" for m, deps in _graph().items() if "." in m for i in deps
              if _layer(i) != _layer(m) and ORDER.index(_layer(i)) > ORDER.index(_layer(m))]
    assert not upward, "\n".join(sorted(upward))


def test_no_two_modules_import_each_other():
    graph = _graph()
    pairs = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
                    if a in graph.get(b, ()) and not b.startswith(a + ".") and not a.startswith(b + ".")})
    assert not pairs, pairs


def _readme_layout() -> str:
    text = (PACKAGE.parent / "README.md").read_text()
    return text.split("## Layout", 1)[1].split("```", 2)[1]


def test_readmes_layout_names_every_layer_and_only_what_exists():
    listed = set(re.findall(r"sd_accel/([A-Za-z_]+)", _readme_layout()))
    on_disk = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    named = listed | set(re.findall(r"\b([a-z_]+)\.py\b", _readme_layout()))  # "(cli_engines.py: ...)"
    assert not on_disk - named, f"add to README's Layout: {sorted(on_disk - named)}"
    assert not listed - on_disk, f"README's Layout names what is gone: {sorted(listed - on_disk)}"
    for path in re.findall(r"^((?:tests|scripts|extension)/[A-Za-z_/]*)", _readme_layout(), re.M):
        assert (PACKAGE.parent / path).exists(), path
