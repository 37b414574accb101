"""The layering of the Layout (docs/reference/layout.md), checked on the source: no module imports a layer above its
own (lazy imports inside functions included), and no chain of imports comes back to where it
started."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sd_accel"
# Bottom to top, as the Layout (docs/reference/layout.md) lists them. A layer is the first name under sd_accel.
ORDER = ["core", "paths", "units", "pages", "profiles", "device", "models", "optimize", "samplers", "components", "onnx",
         "backends", "cache", "runtime", "calibration", "validate", "build_segments", "build", "autobuild", "refit", "prompts", "config",
         "api", "generate", "preview",
         "ui", "bench", "serve", "cli_engines", "cli", "webui", "comfyui"]


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
    assert not unknown, f"add these to ORDER (and docs/reference/layout.md): {unknown}"


def test_no_layer_imports_upwards():
    upward = [f"{m} -> {i}" for m, deps in _graph().items() if "." in m for i in deps
              if _layer(i) != _layer(m) and ORDER.index(_layer(i)) > ORDER.index(_layer(m))]
    assert not upward, "\n".join(sorted(upward))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of any length: the strongly connected components with more than one
    module (Tarjan's algorithm, iterative: the package is deeper than the recursion limit allows)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles_of_any_length():
    # A submodule importing its own package is no dependency (Python imports the package first
    # anyway), so those edges are left out; every other chain that comes back is a cycle.
    graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in _graph().items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each a set of modules that reach one another):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_long_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]


FACES = ("ui", "bench", "serve", "cli_engines", "cli", "webui")
# What the faces may import from the layers below them (api.py's docstring says why); a name ending
# in "." stands for every module under it.
FACE_MODULES = {
    "*": {"sd_accel", "sd_accel.api", "sd_accel.config", "sd_accel.core", "sd_accel.profiles", "sd_accel.generate",
          "sd_accel.preview",
          "sd_accel.samplers", "sd_accel.units", "sd_accel.backends.registry", "sd_accel.build",
          "sd_accel.cache.intermediates"},
    "webui": {"sd_accel.components.ldm_", "sd_accel.components.flux", "sd_accel.components.flux.", "sd_accel.components.sd3",
              "sd_accel.components.sd3.", "sd_accel.runtime", "sd_accel.runtime.modules", "sd_accel.runtime.weights",
              "sd_accel.refit",
              "sd_accel.onnx.weights", "sd_accel.onnx.fingerprint", "sd_accel.onnx.export"},
    "bench": {"sd_accel.paths"},
}


def _allowed(face: str, module: str) -> bool:
    return any(module == name or (name.endswith((".", "_")) and module.startswith(name))
               for name in FACE_MODULES["*"] | FACE_MODULES.get(face, set()))


def test_faces_use_only_what_api_py_says_they_may():
    graph = _graph()
    beyond = [f"{m} -> {i}" for m, deps in graph.items() if "." in m and _layer(m) in FACES for i in deps
              if ("." not in i or _layer(i) not in FACES) and not _allowed(_layer(m), i)]
    assert not beyond, "a face reaches past what api.py's docstring allows:\n" + "\n".join(sorted(beyond))


def _readme_layout() -> str:
    """The layout's code block, on docs/reference/layout.md (it was README's "Layout")."""
    text = (PACKAGE.parent / "docs" / "reference" / "layout.md").read_text()
    return text.split("# Layout of the code", 1)[1].split("```", 2)[1]


def test_readmes_layout_names_every_layer_and_only_what_exists():
    listed = set(re.findall(r"sd_accel/([A-Za-z_]+)", _readme_layout()))
    on_disk = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    named = listed | set(re.findall(r"\b([a-z_]+)\.py\b", _readme_layout()))  # "(cli_engines.py: ...)"
    assert not on_disk - named, f"add to docs/reference/layout.md: {sorted(on_disk - named)}"
    assert not listed - on_disk, f"docs/reference/layout.md names what is gone: {sorted(listed - on_disk)}"
    for path in re.findall(r"^((?:tests|scripts|extension)/[A-Za-z_/]*)", _readme_layout(), re.M):
        assert (PACKAGE.parent / path).exists(), path


def test_one_builder_runs_every_faces_jobs():
    """Faces hand a list of EngineJob to build.run_jobs; nothing else loops over jobs calling the
    per-engine build, numbers progress ticks or reaches for the builder's private parts."""
    private = re.compile(r"\b(_build_one|build_one|make_tick|_reporter)\b")
    outside = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                     if p.name != "build.py" and private.search(p.read_text()))
    assert not outside, outside
