"""The TensorRT backend against the real TensorRT bindings (10.x and 11.x) and the real polygraphy.

TensorRT cannot run here. Its binding wheels' name lists (``tests/support/trt/names/``, made by
``scripts/trt_names.py``) and the installed polygraphy can: every TensorRT name the backend uses
must exist in each version it runs on, every polygraphy call must bind to polygraphy's
signature, and the whole build and load path must run on a stand-in ``tensorrt`` that knows only
one version's names (``support.trt.dryrun``).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
from pathlib import Path

import pytest
import torch

from sd_accel.backends.tensorrt import builder
from sd_accel.backends.tensorrt.versions import features

from support.trt import api_names
from support.trt.api_names import (
    BUILD,
    ONLY_10_FP16,
    ONLY_11,
    POLYGRAPHY,
    REFIT,
    RUNTIME,
    STREAMING,
    TRT_OBJECTS,
    NameList,
    available_versions,
    declared_names,
    load_list,
    used_names,
)
from support.trt.dryrun import dry_run, engine_plan, on_cpu, pretend_gpu

BACKEND_DIR = Path(builder.__file__).parent
ROOT = BACKEND_DIR.parents[2]
NEWEST_10 = "10.16.1.11"
NEWEST_11 = "11.4.0.106"
VERSIONS = available_versions()


# ---- the committed name lists ---------------------------------------------------------------------


def test_lists_cover_the_newest_10_and_11():
    assert NEWEST_10 in VERSIONS and NEWEST_11 in VERSIONS
    for version in VERSIONS:
        listed = load_list(version)
        assert listed.wheels, f"{version}: the header must name the wheels it came from"
        for wheel in listed.wheels:
            name, sha = wheel.split(" sha256=")
            assert name.endswith(".whl") and f"-{version}-" in name and len(sha) == 64
        assert 800 < len(listed.names) < 5000, "an extraction that kept too little or too much"
        assert listed.version == version


def test_list_lookup_follows_linker_tail_merging():
    names = load_list(NEWEST_11)
    assert names.has("unset_named_weights") and names.has("set_named_weights")
    assert names.has("device_memory_size_v2") and names.has("execute_async_v3")
    assert not names.has("execute_async_v4") and not names.has("int8_calibrator")
    assert names.missing("DataType.BF16") == [] and names.missing("IProgressMonitor.__init__") == []
    assert names.missing("BuilderFlag.FP16") == ["FP16"]


def test_known_differences_between_10_and_11():
    """Guards the extraction: the API changes NVIDIA documents for TensorRT 11 show up."""
    ten, eleven = load_list(NEWEST_10), load_list(NEWEST_11)
    for gone in ("platform_has_fast_fp16", "int8_calibrator", "IInt8Calibrator", "device_memory_size",
                 "PREFER_PRECISION_CONSTRAINTS", "EXPLICIT_BATCH", "CUBLAS", "CUDNN",
                 "FP16"):  # BuilderFlag.FP16: weak typing is gone
        assert ten.has(gone) and not eleven.has(gone), gone
    for kept in ("device_memory_size_v2", "STRONGLY_TYPED", "NATIVE_INSTANCENORM", "IProgressMonitor", "BF16", "INT64"):
        assert ten.has(kept) and eleven.has(kept), kept


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_every_name_the_backend_uses_exists_in_that_version(version, precision):
    listed = load_list(version)
    names = used_names(version, precision) | used_names(version, precision, streaming=True)
    missing = {name: listed.missing(name) for name in sorted(names) if listed.missing(name)}
    assert not missing, f"TensorRT {version} lacks names the backend uses on its {precision} path: {missing}"


def test_version_only_groups_are_really_version_only():
    """The explicit branches are needed: 11.x lacks what the 10.x branch uses. (STRONGLY_TYPED exists in
    10.x too; it is 11-only because only the 11.x branch asks for it.)"""
    eleven = load_list(NEWEST_11)
    assert all(eleven.missing(n) for n in ONLY_10_FP16 if n.startswith("BuilderFlag."))
    assert used_names(NEWEST_10, "fp16") >= ONLY_10_FP16 and not used_names(NEWEST_10, "fp16") & ONLY_11
    assert used_names(NEWEST_11, "fp16") >= ONLY_11 and not used_names(NEWEST_11, "fp16") & ONLY_10_FP16
    assert not used_names(NEWEST_10, "fp32") & (ONLY_10_FP16 | ONLY_11)
    assert not (RUNTIME | BUILD | REFIT | POLYGRAPHY) & (ONLY_10_FP16 | ONLY_11)


def _wheel_dir() -> Path:
    return Path.home() / ".cache" / "sd-accel" / "trt-wheels"


def _load_script():
    spec = importlib.util.spec_from_file_location("trt_names_script", ROOT / "scripts" / "trt_names.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("version", VERSIONS)
def test_lists_match_the_wheels_when_they_are_cached(version):
    """Offline: only where ``scripts/trt_names.py`` has left the wheels in its cache."""
    script = _load_script()
    wheels = [line.split(" sha256=")[0] for line in load_list(version).wheels]
    if not all((_wheel_dir() / w).exists() for w in wheels):
        pytest.skip(f"wheels not in {_wheel_dir()} (python scripts/trt_names.py fetches them)")
    text = script.generate(version, _wheel_dir(), download=False)
    assert text == api_names.list_path(version).read_text(), "regenerate: python scripts/trt_names.py"


def test_the_generator_reads_an_elf_rodata_section():
    script = _load_script()
    # A minimal 64-bit ELF: header, one .rodata and the section name table.
    import struct

    rodata = b"\0get_tensor_name\0N8nvinfer18ILoggerE\0nvinfer1::DataType\0a docstring, ending in words\0"
    shstr = b"\0.rodata\0.shstrtab\0"
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    body = rodata + shstr
    shoff = 64 + len(body)
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 2)
    sections = bytes(64)
    sections += struct.pack("<IIQQQQIIQQ", 1, 1, 2, 0, 64, len(rodata), 0, 0, 1, 0)
    sections += struct.pack("<IIQQQQIIQQ", 9, 3, 0, 0, 64 + len(rodata), len(shstr), 0, 0, 1, 0)
    names = script.names_from_so(bytes(header) + body + sections)
    assert names == {"get_tensor_name", "DataType"}


# ---- the backend's source: every TensorRT name in it is declared ---------------------------------


def _chain(node: ast.AST) -> tuple[ast.AST, list[str]]:
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return node, attrs[::-1]


def _root_is_trt(node: ast.AST) -> bool:
    """Whether an expression is rooted at the ``trt`` module or a TensorRT object."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr in TRT_OBJECTS
        node = node.func if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name) and (node.id == "trt" or node.id in TRT_OBJECTS)


def _dotted(parts: list[str]) -> str:
    return ".".join(p for p in parts if not (p.startswith("__") and p != "__version__"))


def scan_source(source: str, filename: str = "<src>") -> tuple[set[str], list[str]]:
    """TensorRT names a backend source uses, and problems the declarations cannot cover."""
    tree = ast.parse(source, filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    used: set[str] = set()
    problems: list[str] = []
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a for a in node.names] if isinstance(node, ast.Import) else []
            for alias in mods:
                if alias.name.split(".")[0] == "tensorrt" and (alias.name != "tensorrt" or alias.asname != "trt"):
                    problems.append(f"{where}: import TensorRT as `import tensorrt as trt`, not {alias.name} as {alias.asname}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tensorrt":
                problems.append(f"{where}: `from tensorrt import ...` hides names from the scan; use trt.<name>")
        elif isinstance(node, ast.Attribute) and not isinstance(parents.get(node), ast.Attribute):
            base, attrs = _chain(node)
            if isinstance(base, ast.Name) and base.id == "trt":
                if _dotted(attrs):
                    used.add(_dotted(attrs))
            elif isinstance(base, ast.Name) and base.id in TRT_OBJECTS and not attrs[0].startswith("_"):
                used.add(f"{TRT_OBJECTS[base.id]}.{attrs[0]}")
            elif isinstance(base, ast.Name) and base.id == "self" and len(attrs) >= 2 and attrs[0] in TRT_OBJECTS:
                used.add(f"{TRT_OBJECTS[attrs[0]]}.{attrs[1]}")
        elif isinstance(node, ast.ClassDef):
            for b in node.bases:
                base, attrs = _chain(b)
                if isinstance(base, ast.Name) and base.id == "trt":
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                            used.add(f"{_dotted(attrs)}.{item.name}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr"):
            if node.args and _root_is_trt(node.args[0]):
                problems.append(f"{where}: {node.func.id}() on a TensorRT object hides the name from the scan")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _root_is_trt(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                name = t.id if isinstance(t, ast.Name) else (
                    t.attr if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" else None)
                if name is not None and name not in TRT_OBJECTS:
                    problems.append(f"{where}: {name!r} holds a TensorRT object: add it to api_names.TRT_OBJECTS")
    return used, problems


def _backend_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(BACKEND_DIR.glob("*.py"))}


def test_source_scan_finds_what_it_should():
    src = '''
import tensorrt as trt
class M(trt.IProgressMonitor):
    def phase_start(self, a, b, c): ...
    def _helper(self): ...
def f(path):
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(b"")
    self.context = engine.create_execution_context()
    self.context.execute_async_v3(0)
    x = trt.DataType.HALF
    getattr(engine, "device_memory_size")
'''
    used, problems = scan_source(src)
    assert used >= {"IProgressMonitor.phase_start", "Runtime", "Logger", "Logger.WARNING", "DataType.HALF",
                    "ICudaEngine.create_execution_context", "IExecutionContext.execute_async_v3"}
    assert "IProgressMonitor._helper" not in used
    assert any("'runtime' holds a TensorRT object" in p for p in problems) is ("runtime" not in TRT_OBJECTS)
    assert any("'x' holds a TensorRT object" in p for p in problems)
    assert any("getattr()" in p for p in problems)
    _, problems = scan_source("from tensorrt import Runtime\nimport tensorrt\n")
    assert len(problems) == 2


def test_every_tensorrt_name_in_the_backend_source_is_declared():
    used, problems = set(), []
    for name, text in _backend_sources().items():
        u, p = scan_source(text, name)
        used |= u
        problems += p
    assert not problems, "\n".join(problems)
    direct = RUNTIME | BUILD | REFIT
    undeclared = used - declared_names()
    assert not undeclared, f"used in the backend but not declared in api_names: {sorted(undeclared)}"
    stale = direct - used
    assert not stale, f"declared in api_names RUNTIME/BUILD/REFIT but not used in the source any more: {sorted(stale)}"
    assert used <= direct | ONLY_10_FP16 | ONLY_11 | STREAMING
    everything = "\n".join(_backend_sources().values())
    for var in TRT_OBJECTS:
        assert var in everything, f"TRT_OBJECTS has {var!r}, which the source no longer uses"


# ---- the same, executed: a dry run on each version's names ---------------------------------------


@pytest.fixture(scope="module")
def unet_onnx(tmp_path_factory):
    """The tiny SD 1.5 UNet, exported to ONNX once, and its spec."""
    from sd_accel.components import specs_for
    from sd_accel.models.builtin import build_tiny_pipeline
    from sd_accel.onnx.export import onnx_artifact

    spec = specs_for(build_tiny_pipeline("sd15"))["unet"]
    root = tmp_path_factory.mktemp("trt-cache")
    return spec, onnx_artifact(spec, root), root


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_build_path_runs_on_each_versions_names(version, precision, unet_onnx, tmp_path, monkeypatch):
    from sd_accel.backends.tensorrt.builder import ENGINE_FILE, META_FILE, TensorRTBackend
    from sd_accel.profiles import PRESETS

    spec, onnx_path, _ = unet_onnx
    shapes = spec.shape_ranges(PRESETS["dynamic-256-512"])
    timing = tmp_path / "cache" / "timing" / f"timing.sm90.trt{version}.cache"
    timing.parent.mkdir(parents=True)
    timing.write_bytes(b"an earlier build's cache")  # so polygraphy loads it and merges the new one
    seen = []
    pretend_gpu(monkeypatch, "sm90")
    with dry_run(version) as run:
        files = TensorRTBackend(tmp_path / "cache").build(
            onnx_path, shapes, precision, tmp_path / "engine", lambda f, m: seen.append((f, m)))
    assert files == [ENGINE_FILE, META_FILE] and (tmp_path / "engine" / ENGINE_FILE).exists()
    assert "BuilderFlag.REFIT" in run.used  # built refittable, on every version
    assert timing.read_bytes() != b"an earlier build's cache"
    assert seen[-1] == (1.0, "TensorRT: engine saved")
    expected = used_names(version, precision) - RUNTIME - (REFIT - POLYGRAPHY)  # refits: see below
    assert expected <= run.used, f"declared for the build but not touched: {sorted(expected - run.used)}"
    if features(version).strongly_typed_only and precision == "fp16":
        assert (onnx_path.parent / "model.fp16.onnx").exists()


@pytest.mark.parametrize("version", VERSIONS)
def test_an_engine_larger_than_half_the_card_is_built_and_loaded_with_weights_streamed(
        version, unet_onnx, tmp_path, monkeypatch, caplog):
    """FLUX.1's transformer in fp16 (24 GB) does not fit a 24 GB card beside its activations: an
    engine whose weights take more than half the card is built with ``BuilderFlag.WEIGHT_STREAMING``
    on a strongly typed network (an fp16 ONNX, no FP16 flag, on 10.x too) and loaded with
    TensorRT's automatic budget. TensorRT 10.0 cannot: it builds as before and says so."""
    import logging

    from sd_accel.backends.tensorrt.builder import (
        ENGINE_FILE,
        META_FILE,
        TensorRTBackend,
        engine_weight_bytes,
    )
    from sd_accel.profiles import PRESETS

    spec, onnx_path, _ = unet_onnx
    shapes = spec.shape_ranges(PRESETS["dynamic-256-512"])
    weights = engine_weight_bytes(onnx_path, "fp16")
    pretend_gpu(monkeypatch, "sm90", memory=weights + weights // 2)  # weights are 2/3 of the card
    streams = features(version).weight_streaming
    with dry_run(version) as run, caplog.at_level(logging.WARNING, logger="sd_accel"):
        backend = TensorRTBackend(tmp_path / "cache")
        files = backend.build(onnx_path, shapes, "fp16", tmp_path / "engine", lambda f, m: None)
        runner = on_cpu(backend.load(tmp_path / "engine", files, shapes))
        budget = (runner.engine.weight_streaming_budget_v2, runner.engine.streamable_weights_size) if streams else None
        runner.close()
    meta = json.loads((tmp_path / "engine" / META_FILE).read_text())
    assert files == [ENGINE_FILE, META_FILE] and meta["weight_streaming"] is streams
    if streams:
        assert STREAMING <= run.used, sorted(STREAMING - run.used)
        assert "BuilderFlag.FP16" not in run.used and meta["onnx_precision"] == "fp16"
        assert budget[0] == budget[1] // 2 > 0  # TensorRT's automatic budget, set before the context
    else:
        assert not (STREAMING - {"NetworkDefinitionCreationFlag.STRONGLY_TYPED"}) & run.used
        assert any("cannot stream weights" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("version", [NEWEST_10, NEWEST_11])
def test_an_engine_that_fits_is_not_streamed_unless_asked(version, unet_onnx, tmp_path, monkeypatch):
    from sd_accel.backends.tensorrt.builder import META_FILE, STREAMING_ENV, TensorRTBackend
    from sd_accel.profiles import PRESETS

    spec, onnx_path, _ = unet_onnx
    shapes = spec.shape_ranges(PRESETS["dynamic-256-512"])
    pretend_gpu(monkeypatch, "sm90")  # 24 GB: the tiny UNet fits many times over
    for setting, streamed in ((None, False), ("1", True)):
        if setting:
            monkeypatch.setenv(STREAMING_ENV, setting)
        with dry_run(version):
            TensorRTBackend(tmp_path / "cache").build(onnx_path, shapes, "fp16", tmp_path / str(setting),
                                                      lambda f, m: None)
        assert json.loads((tmp_path / str(setting) / META_FILE).read_text())["weight_streaming"] is streamed


@pytest.mark.slow
@pytest.mark.parametrize("version", [NEWEST_10, NEWEST_11])
def test_flux_transformer_build_runs_on_each_versions_names(version, tmp_path, monkeypatch):
    """FLUX.1's transformer (dynamic in image tokens and T5 length, rotary positions as inputs)
    through the same build path: its profile's names are the engine's inputs."""
    from sd_accel.backends.tensorrt.builder import ENGINE_FILE, TensorRTBackend
    from sd_accel.components import specs_for
    from sd_accel.models.builtin import build_tiny_pipeline
    from sd_accel.onnx.export import onnx_artifact
    from sd_accel.profiles import Profile

    spec = specs_for(build_tiny_pipeline("flux-dev"))["transformer"]
    onnx_path = onnx_artifact(spec, tmp_path / "cache")
    shapes = spec.shape_ranges(Profile(batch=(1, 1, 2), height=(512, 1024, 1024), width=(512, 1024, 1024),
                                       text=(256, 512, 512)))
    assert shapes["img_ids"] == ((1024, 3), (4096, 3), (4096, 3)) and shapes["txt_ids"][2] == (512, 3)
    pretend_gpu(monkeypatch, "sm90")
    with dry_run(version):
        files = TensorRTBackend(tmp_path / "cache").build(onnx_path, shapes, "fp16", tmp_path / "engine",
                                                          lambda f, m: None)
    assert ENGINE_FILE in files and (tmp_path / "engine" / ENGINE_FILE).exists()


def test_the_10x_fp16_config_would_break_on_11x(unet_onnx, tmp_path, monkeypatch):
    """The reason for the branch: polygraphy's fp16=True needs BuilderFlag.FP16, which 11.x lacks.
    The stand-in says it is 10.x (so the backend takes the 10.x branch) but has 11.x's names."""
    from sd_accel.backends.tensorrt.builder import TensorRTBackend
    from sd_accel.core import EngineError

    spec, onnx_path, root = unet_onnx
    shapes = spec.shape_ranges(spec_profile())
    pretend_gpu(monkeypatch, "sm90")
    eleven_named_ten = NameList(NEWEST_10, load_list(NEWEST_11).names, ())
    with dry_run(NEWEST_10, eleven_named_ten) as run, pytest.raises(EngineError, match="could not build"):
        TensorRTBackend(root).build(onnx_path, shapes, "fp16", tmp_path, lambda f, m: None)
    assert "BuilderFlag.FP16" in run.missing


def spec_profile():
    from sd_accel.profiles import PRESETS

    return PRESETS["static-512"]


@pytest.mark.parametrize("version", VERSIONS)
def test_load_and_infer_path_runs_on_each_versions_names(version, tmp_path, monkeypatch):
    from sd_accel.backends.tensorrt.builder import ENGINE_FILE, TensorRTBackend

    shapes = {"sample": ((1, 4, 8, 8), (2, 4, 8, 8), (4, 4, 16, 16)), "timestep": ((1,), (2,), (4,))}
    (tmp_path / ENGINE_FILE).write_bytes(engine_plan(
        {"sample": {"dtype": "HALF", "min": [1, 4, 8, 8], "max": [4, 4, 16, 16]},
         "timestep": {"dtype": "FLOAT", "min": [1], "max": [4]}},
        {"latent": {"dtype": "HALF", "like": "sample", "scale": 0.5}},
    ))
    pretend_gpu(monkeypatch)
    with dry_run(version) as run:
        runner = on_cpu(TensorRTBackend().load(tmp_path, [ENGINE_FILE], shapes))
        sample = torch.randn(2, 4, 12, 10)
        out = runner.infer({"sample": sample, "timestep": torch.tensor([1.0, 2.0])})
        runner.close()
    torch.testing.assert_close(out["latent"].float(), (sample.half() * 0.5).float())
    assert RUNTIME <= run.used | {"__version__"}, sorted(RUNTIME - run.used)


@pytest.mark.parametrize("version", VERSIONS)
def test_refit_path_runs_on_each_versions_names(version, tmp_path, monkeypatch):
    """The refit (``trt.Refitter``) on each version's names, from the engine the build path made."""
    from sd_accel.backends.tensorrt.builder import TensorRTBackend
    from sd_accel.onnx.weights import onnx_values

    path = tmp_path / "onnx" / "model.onnx"
    path.parent.mkdir()
    torch.onnx.export(torch.nn.Linear(8, 4).eval(), (torch.randn(2, 8),), str(path), input_names=["x"],
                      output_names=["y"], dynamo=False)
    shapes = {"x": ((2, 8), (2, 8), (2, 8))}
    pretend_gpu(monkeypatch)
    with dry_run(version) as run:
        files = TensorRTBackend().build(path, shapes, "fp16", tmp_path / "engine", lambda f, m: None)
        changed = torch.nn.Linear(8, 4).state_dict()
        out = TensorRTBackend().patch_weights(tmp_path / "engine", files, onnx_values(path.parent, changed),
                                              tmp_path / "refit")
    assert out == files
    assert REFIT <= run.used, sorted(REFIT - run.used)


# ---- polygraphy: every call binds to the installed polygraphy's real signature ------------------


def _bind_create_config(kwargs: dict) -> None:
    """``CreateConfig(**kwargs)``: its own parameters, then what ``**kwargs`` passes to its base."""
    from polygraphy.backend.trt import CreateConfig

    bound = inspect.signature(CreateConfig.__init__).bind(None, **kwargs)
    var_kw = next(p.name for p in inspect.signature(CreateConfig.__init__).parameters.values()
                  if p.kind is inspect.Parameter.VAR_KEYWORD)
    rest = bound.arguments.get(var_kw, {})
    base = next(c for c in CreateConfig.__mro__[1:] if "__init__" in vars(c))
    params = inspect.signature(base.__init__).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), "cannot check further"
    inspect.signature(base.__init__).bind(None, **rest)


@pytest.mark.parametrize("version", [NEWEST_10, NEWEST_11])
def test_polygraphy_calls_bind_to_the_real_signatures(version, tmp_path):
    from polygraphy.backend.trt import CreateConfig, engine_from_network, network_from_onnx_path, save_engine

    from sd_accel.backends.tensorrt.builder import (
        BUILDER_OPTIMIZATION_LEVEL,
        build_time_config_kwargs,
        config_kwargs,
        engine_call,
        parse_call,
        progress_monitor,
    )

    feats = features(version)
    shapes = {"sample": ((1, 4, 64, 64), (2, 4, 64, 64), (8, 4, 96, 96))}
    timing = tmp_path / "t.cache"
    with dry_run(version):
        import tensorrt as trt

        args, kw = parse_call(trt, tmp_path / "model.onnx", feats)
        inspect.signature(network_from_onnx_path).bind(*args, **kw)
        assert kw["strongly_typed"] is feats.strongly_typed_only

        kwargs = config_kwargs(shapes, "fp16", feats, timing)
        kwargs.update(build_time_config_kwargs(trt, 2**30, progress_monitor(trt, lambda f, m: None)))
        _bind_create_config(kwargs)
        config = CreateConfig(**kwargs)  # a real one: CreateConfig only stores them until called
        assert config.fp16 is feats.precision_flags
        assert config.builder_optimization_level == BUILDER_OPTIMIZATION_LEVEL
        assert config.tactic_sources == [] and config.timing_cache_path == str(timing)
        assert list(config.memory_pool_limits.values()) == [2**30]
        assert config.progress_monitor is kwargs["progress_monitor"]
        assert config.refittable is True and not config.strip_plan  # BuilderFlag.REFIT, weights kept
        assert tuple(config.profiles[0]["sample"].max) == (8, 4, 96, 96)

        args, kw = engine_call(object(), config, timing)
        inspect.signature(engine_from_network).bind(*args, **kw)
        assert kw["save_timing_cache"] == str(timing)
        inspect.signature(save_engine).bind(object(), str(tmp_path / "engine.plan"))


def test_create_config_binding_check_catches_a_wrong_name():
    with pytest.raises(TypeError):
        _bind_create_config({"builder_optimisation_level": 3})
    with pytest.raises(TypeError):
        _bind_create_config({"fp16": True, "workspace": 1})


@pytest.fixture(scope="module")
def tiny_specs():
    """Every component's spec of the tiny SD 1.5 and SDXL pipelines, with the ControlNet kinds
    (``controlnet``, ``unet_control``: their residual inputs and outputs get profiles too)."""
    import diffusers

    from sd_accel.components import specs_for
    from sd_accel.components.controlnet import control_specs
    from sd_accel.models.builtin import build_tiny_pipeline
    from sd_accel.models.tiny_controlnet import tiny_controlnet

    out = {}
    for family in ("sd15", "sdxl"):
        pipe = build_tiny_pipeline(family)
        xl = "XL" if family == "sdxl" else ""
        parts = {k: v for k, v in pipe.components.items() if k not in ("safety_checker", "feature_extractor",
                                                                     "image_encoder")}
        extra = {} if xl else {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
        control = getattr(diffusers, f"StableDiffusion{xl}ControlNetPipeline")(
            **parts, controlnet=tiny_controlnet(pipe.unet), **extra)
        out[family] = {**specs_for(pipe), **control_specs(control)}
        assert {"controlnet", "unet_control"} <= set(out[family])
    # the transformer families: their transformer (image tokens, T5 length) and T5 get profiles too
    for family in ("sd3", "flux-dev"):
        out[family] = specs_for(build_tiny_pipeline(family))
        assert {"transformer", "t5"} <= set(out[family])
    return out


@pytest.mark.parametrize("preset", ["static-512", "static-768", "static-1024", "dynamic-256-512",
                                    "dynamic-512-768", "dynamic-768-1024"])
def test_every_preset_makes_profiles_polygraphy_accepts(preset, tiny_specs):
    from polygraphy.backend.trt import Profile

    from sd_accel.backends.tensorrt.builder import profile_for
    from sd_accel.profiles import PRESETS

    for family, specs in tiny_specs.items():
        for name, spec in specs.items():
            shapes = spec.shape_ranges(PRESETS[preset])
            profile = profile_for(shapes)
            assert isinstance(profile, Profile) and set(profile) == {t.name for t in spec.inputs()}
            for tensor, (lo, opt, hi) in shapes.items():
                entry = profile[tensor]
                assert (tuple(entry.min), tuple(entry.opt), tuple(entry.max)) == (lo, opt, hi), (family, name)
                assert all(0 < a <= b <= c for a, b, c in zip(lo, opt, hi, strict=True)), (family, name, tensor)
                if PRESETS[preset].static:
                    assert lo == opt == hi
