"""The compiled PyTorch backend (``backend="compile"``): the engine contract with real Inductor on
a CPU (profiles, keys, the per-call fallback and its reason, validation, stats, a warm second
process, live weights), the CUDA-graph bookkeeping with a CPU stand-in for the capturer, and
``auto`` on a (simulated) CUDA machine without TensorRT.

One real Inductor compile of the tiny UNet per module (tens of seconds on 2 cores) plus one warm
start in a subprocess; the rest traces with Dynamo only (``compiler="eager"``) or compiles nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sd_accel.backends import registry
from sd_accel.backends.compile import builder as compile_builder
from sd_accel.backends.compile.builder import CompileBackend, CompileSettings, architecture_id
from sd_accel.backends.compile.graphs import GraphBook, weight_addresses
from sd_accel.backends.compile.runner import CompiledRunner
from sd_accel.core import EngineError, InvalidValue
from sd_accel.profiles import Profile
from sd_accel.runtime.selection import ComponentEngines

from support.fake_graphs import FailingGraph, FakeGraph

ROOT = Path(__file__).resolve().parents[1]
PROFILE = {"batch": 1, "height": 64, "width": 64}


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> bool:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12)) < tol


def _unet_feed(spec, size: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    from sd_accel.backends.compile.builder import _feed_at

    return _feed_at(spec, spec.shape_ranges(Profile.of({**PROFILE, "height": size, "width": size})), "opt", "cpu")


def _eager(spec, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return spec.export_module()(*[feed[t.name] for t in spec.inputs()])[0]


# ---- one real Inductor build of the tiny UNet, shared by the module -------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_factory):
    """The tiny SD 1.5 UNet compiled by Inductor for a static 64 px profile, validated against
    eager torch, in a fresh engine folder (Inductor's caches in it, as without a user setting)."""
    from sd_accel import build_engines

    saved = compile_builder._USER_CACHE_DIR
    compile_builder._USER_CACHE_DIR = False  # the suite may set TORCHINDUCTOR_CACHE_DIR; the backend's own folder here
    saved_env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    engines = tmp_path_factory.mktemp("compile") / "engines"
    pipe = tiny_factory("sd15")
    events = []
    try:
        records = build_engines(pipe, profiles=[PROFILE], backend="compile", components=["unet"],
                                engine_dir=engines, progress=events.append)
        yield pipe, engines, records, events
    finally:
        compile_builder._USER_CACHE_DIR = saved
        if saved_env is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved_env


@pytest.fixture(scope="module")
def served(built):
    """The pipeline with its compiled UNet swapped in (``accelerate(backend="compile")``)."""
    from sd_accel import accelerate

    pipe, engines, _, _ = built
    return accelerate(pipe, backend="compile", engines=True, engine_dir=engines)


@pytest.mark.slow
def test_the_engine_is_keyed_like_every_engine_and_validated_against_eager(built, tiny_factory):
    from sd_accel import build_engines
    from sd_accel.device import cpu_class

    pipe, engines, (record,), events = built
    key = record.key
    assert (key.component, key.backend, key.precision) == ("unet", "compile", "fp32")
    assert key.arch == cpu_class() and key.backend_version == f"torch-{torch.__version__}"
    assert key.profile == Profile.of(PROFILE).tag and key.model == architecture_id(pipe.unet)
    assert sorted(record.files) == ["inductor.bin", "manifest.json"]
    assert (engines / key.name / "inductor.bin").stat().st_size > 0
    assert any((engines / "inductor").iterdir())  # Inductor's caches beside the engines
    assert record.validation["ok"] and record.validation["max_abs"] < 1e-3
    assert not any("ONNX" in e.stage for e in events)  # built from the module: nothing exported
    # Another set of weights of the same architecture (a fine-tune, a fused LoRA) is the same engine:
    # the compiled graph takes the weights as inputs.
    other = tiny_factory("sd15")
    with torch.no_grad():
        for p in other.unet.parameters():
            p.add_(0.01)
    (again,) = build_engines(other, profiles=[PROFILE], backend="compile", components=["unet"], engine_dir=engines,
                             progress=False)
    assert again.key == key
    # ... and another precision or profile is another engine
    be = registry.create("compile")
    assert be.precisions() == ("bf16", "fp32") and "bf16" in be.missing("fp16")
    with pytest.raises(InvalidValue, match="fp16 on a CPU"):
        build_engines(other, profiles=[PROFILE], backend="compile", precision="fp16", components=["unet"],
                      engine_dir=engines, progress=False)


@pytest.mark.slow
def test_calls_are_served_counted_and_a_shape_outside_the_profile_falls_back_with_its_reason(served):
    from sd_accel import stats

    pipe = served
    reset_stats(pipe)
    pipe("a cat", num_inference_steps=2, height=64, width=64, output_type="pt")
    unet = stats(pipe)["unet"]
    assert unet["engine_calls"] >= 2 and unet["torch_calls"] == 0  # (PNDM: one more call than steps)
    (compiled,) = unet["compiled"].values()  # the runner's own counters
    assert compiled["calls"] >= unet["engine_calls"] and compiled["refused"] == {}
    pipe("a cat", num_inference_steps=1, height=72, width=72, output_type="pt")
    unet = stats(pipe)["unet"]
    assert unet["torch_calls"] == 1 and any("no engine covers" in r for r in unet["fallbacks"])
    # the runner itself refuses a shape outside its profile, saying which
    runner = pipe.unet.engines["unet"].handles[0].runner
    with pytest.raises(EngineError, match="does not cover shapes"):
        runner.infer(_unet_feed(_spec(pipe), size=72))
    assert runner.stats()["refused"] == {"outside profile": 1}


def reset_stats(pipe) -> None:
    for engines in pipe.unet.engines.values():
        engines.reset_stats()


def _spec(pipe):
    from sd_accel.components import specs_for
    from sd_accel.runtime.swap import torch_modules

    with torch_modules(pipe):
        return specs_for(pipe)["unet"]


@pytest.mark.slow
def test_weights_are_read_live_never_stale_and_never_recompiled(served):
    """A weight changed in place, or replaced by a new Parameter (as a fused LoRA or
    ``load_state_dict(assign=True)`` does), shows in the very next call, with no recompile, no
    refit and no fallback."""
    from torch._dynamo.utils import counters

    from sd_accel import stats

    pipe = served
    spec = _spec(pipe)
    engines: ComponentEngines = pipe.unet.engines["unet"]
    feed = _unet_feed(spec)
    first = engines.run(feed)["latent"].clone()
    assert _close(first, _eager(spec, feed))
    runner = engines.handles[0].runner
    compiles, graphs = runner.counts.compiles, counters["stats"]["unique_graphs"]
    unet = pipe.unet.torch_module
    with torch.no_grad():
        unet.conv_in.weight.mul_(1.5)  # in place
    changed = engines.run(feed)["latent"].clone()
    assert not _close(changed, first) and _close(changed, _eager(spec, feed))
    unet.conv_out.weight = torch.nn.Parameter(unet.conv_out.weight.detach() * 0.5)  # a new tensor
    replaced = engines.run(feed)["latent"].clone()
    assert not _close(replaced, changed) and _close(replaced, _eager(spec, feed))
    assert runner.counts.compiles == compiles and counters["stats"]["unique_graphs"] == graphs
    # through the pipeline: the changed module is served by the engine, not sent to torch as stale
    reset_stats(pipe)
    pipe("a cat", num_inference_steps=1, height=64, width=64, output_type="pt")
    assert pipe.unet.stale() is None and stats(pipe)["unet"]["torch_calls"] == 0


_BUILD = """
import sys
from sd_accel import build_engines
from sd_accel.models.builtin import build_tiny_pipeline
build_engines(build_tiny_pipeline("sd15"), profiles=[{"batch": 1, "height": 64, "width": 64}], backend="compile",
              components=["unet"], engine_dir=sys.argv[1])
"""

_CHILD = """
import json, sys
from torch._dynamo.utils import counters
from sd_accel import accelerate, stats
from sd_accel.models.builtin import build_tiny_pipeline
pipe = accelerate(build_tiny_pipeline("sd15"), backend="compile", engines=True, engine_dir=sys.argv[1])
pipe("a cat", num_inference_steps=1, height=64, width=64, output_type="pt")
print("RESULT" + json.dumps({"inductor": dict(counters["inductor"]), "unet": stats(pipe)["unet"]}))
"""


@pytest.mark.slow
def test_a_second_process_starts_warm_from_the_engine_folder(tmp_path):
    # Both processes fresh, as a user's two runs are: a build inside the test worker inherits what
    # earlier tests left in torch's global state (configs, flags), which enters Inductor's cache key.
    engines = tmp_path / "engines"
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}  # the engine folder's caches
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    build = subprocess.run([sys.executable, "-c", _BUILD, str(engines)], capture_output=True, text=True, env=env,
                           timeout=600, cwd=ROOT)
    assert build.returncode == 0, build.stderr[-3000:]
    assert any((engines / "inductor").iterdir())
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(engines)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["unet"]["engine_calls"] == 1 and result["unet"]["torch_calls"] == 0
    assert result["inductor"].get("fxgraph_cache_hit", 0) >= 1, result["inductor"]
    assert result["inductor"].get("fxgraph_cache_miss", 0) == 0, result["inductor"]


# ---- Dynamo-only runs (no code generation): a module with a graph break, the graph book -----------


class _Branchy(torch.nn.Module):
    """Data-dependent control flow: a graph break under ``fullgraph=True``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            return (y * 2,)
        return (y,)


class _Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return (torch.nn.functional.gelu(self.lin(x)),)


class _Spec:
    """The part of a component spec the compiled backend reads."""

    name = "toy"

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def torch_module(self):
        return self.module

    def export_module(self):
        return self.module

    def inputs(self):
        from sd_accel.components.spec import TensorSpec

        return (TensorSpec("x", ("B", 8), torch.float32),)

    def outputs(self):
        from sd_accel.components.spec import TensorSpec

        return (TensorSpec("y", ("B", 8), torch.float32),)


SHAPES = {"x": ((1, 8), (2, 8), (4, 8))}


def _runner(module: torch.nn.Module, capturer=None, max_graphs: int = 8, static: bool = False) -> CompiledRunner:
    be = CompileBackend("cpu", CompileSettings(compiler="eager", max_graphs=max_graphs))
    be.new_capturer = capturer
    spec = _Spec(module)
    be.attach("m", spec)
    manifest = {"component": "toy", "model": "m", "precision": "fp32", "static": static}
    return CompiledRunner(be, manifest, SHAPES)


def test_a_graph_break_sends_the_call_to_torch_with_the_reason_and_stays_refused():
    runner = _runner(_Branchy())
    handle = type("H", (), {"broken": None, "failures": 0, "shapes": SHAPES, "name": "toy-engine", "record": None,
                            "static": False, "get_runner": lambda self: runner})()
    engines = ComponentEngines("toy", [handle])
    engines._order = lambda h, feed: 0
    x = {"x": torch.randn(2, 8)}
    assert engines.run(x) is None  # torch serves it
    (reason,) = engines.stats.fallbacks
    assert "torch.compile cannot compile toy" in reason
    with pytest.raises(EngineError, match="cannot compile"):
        runner.infer(x)  # remembered for these shapes: no second attempt
    assert runner.stats()["refused"] == {"graph break": 2}


def test_a_runner_without_its_live_module_refuses_and_build_wants_the_module():
    be = CompileBackend("cpu", CompileSettings(compiler="eager"))
    runner = CompiledRunner(be, {"component": "toy", "model": "m", "precision": "fp32"}, SHAPES)
    with pytest.raises(EngineError, match="live torch module.*backend='compile'"):
        runner.infer({"x": torch.randn(2, 8)})
    with pytest.raises(EngineError, match="not from ONNX"):
        be.build(Path("x.onnx"), SHAPES, "fp32", Path("."), lambda f, m: None)
    with pytest.raises(InvalidValue, match="SD_ACCEL_COMPILE_MODE"):
        os.environ["SD_ACCEL_COMPILE_MODE"] = "fastest"
        try:
            CompileSettings.from_env()
        finally:
            del os.environ["SD_ACCEL_COMPILE_MODE"]


def test_cuda_graphs_one_per_shape_replayed_and_recaptured_when_a_weight_moves():
    FakeGraph.made.clear()
    module = _Plain()
    runner = _runner(module, capturer=FakeGraph, max_graphs=2)

    def call(batch: int, seed: int) -> torch.Tensor:
        x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(seed))
        out = runner.infer({"x": x})["y"]
        with torch.no_grad():
            assert _close(out, module(x)[0], 1e-5)
        return out

    call(2, 0)  # first call at a shape: compiles and warms up, no graph
    out = call(2, 1)  # second: captured (and replayed once to compute it)
    book = runner.graphs
    assert book.counts.captures == 1 and len(FakeGraph.made) == 1 and book.captured[0][0][1] == (2, 8)
    again = call(2, 2)  # a replay: new inputs copied into the graph's buffers, same output tensor
    assert again is out and book.counts.replays == 1
    call(1, 3), call(1, 4), call(4, 5), call(4, 6)  # two more shapes; only two graphs are held
    assert len(book.graphs) == 2 and any("2 graphs held" in r for r in book.counts.reasons)
    with torch.no_grad():
        module.lin.weight.mul_(2.0)  # in place: the graph reads it where it is
    call(2, 7)
    assert book.counts.dropped == 0
    module.lin.weight = torch.nn.Parameter(module.lin.weight.detach().clone())  # moved: graphs dropped
    call(2, 8)
    assert book.counts.dropped == 2 and book.counts.captures == 3  # captured again at the new address
    assert runner.stats()["graphs"]["replays"] == book.counts.replays


def test_a_dynamic_profile_serves_every_shape_in_its_range_without_a_compile_per_shape():
    runner = _runner(_Plain(), static=False)
    module = runner.backend.attached("toy", "m").module
    for batch in (2, 4, 1, 3, 4, 2):
        x = torch.randn(batch, 8)
        with torch.no_grad():
            assert _close(runner.infer({"x": x})["y"], module(x)[0], 1e-5)
    assert runner.counts.compiles <= 2  # the first shape, then one graph dynamic in the batch
    with pytest.raises(EngineError, match="does not cover"):
        runner.infer({"x": torch.randn(5, 8)})


def test_a_shape_whose_capture_fails_runs_without_a_graph_and_is_not_tried_again():
    module = _Plain()
    book = GraphBook(FailingGraph)
    x = torch.randn(2, 8)
    weights = weight_addresses(module)
    for _ in range(3):
        with torch.no_grad():
            (y,) = book.run(module, (x,), ("x",), weights)
            assert _close(y, module(x)[0], 1e-6)
    assert book.counts.captures == 0 and list(book.failed.values())[0].startswith("RuntimeError")
    assert any("capture failed" in r for r in book.counts.reasons)


# ---- auto ------------------------------------------------------------------------------------------


def test_auto_takes_compile_on_cuda_without_tensorrt_and_tensorrt_where_it_runs(monkeypatch):
    assert registry.auto_order("cuda") == ("tensorrt", "compile", "onnxruntime")
    assert "compile" not in registry.auto_order("cpu")  # slower than OpenVINO there: opt-in
    assert "compile" not in registry.auto_order("cuda", live_modules=False)  # the WebUI's and ComfyUI's auto
    if not registry.create("tensorrt").info().usable:
        assert registry.get_backend("auto", device="cuda").name == "compile"
    import sd_accel.backends.tensorrt as trt

    class Usable:
        name = "tensorrt"

        def info(self):
            return registry.importlib.import_module("sd_accel.backends.base").BackendInfo(
                "tensorrt", "10.0", "sm90", True)

    monkeypatch.setattr(trt, "create", lambda cache_root=None: Usable())
    assert registry.get_backend("auto", device="cuda").name == "tensorrt"
