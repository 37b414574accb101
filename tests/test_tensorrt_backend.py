"""The TensorRT backend: everything that needs no GPU runs here; the rest skips with the reason.

Build and load paths run on ``support.trt.dryrun``'s stand-in ``tensorrt`` (one real version's
names, an engine that computes on the CPU); ``tests/test_trt_names.py`` checks the names themselves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sd_accel.backends.registry import get_backend
from sd_accel.backends.tensorrt.builder import (
    ENGINE_FILE,
    META_FILE,
    TensorRTBackend,
    config_kwargs,
    profile_for,
    progress_monitor,
    timing_cache_path,
    trt_status,
)
from sd_accel.backends.tensorrt.runner import TensorRTRunner, torch_dtype
from sd_accel.backends.tensorrt.versions import features, onnx_precision
from sd_accel.core import EngineError
from sd_accel.onnx.fp16 import FP16_ONNX_FILE, fp16_onnx

from support.trt.api_names import NameList
from support.trt.dryrun import dry_run, engine_plan, on_cpu, pretend_gpu

TRT_OK, TRT_VERSION, TRT_WHY = trt_status()
V10, V11 = "10.16.1.11", "11.4.0.106"


def test_version_features():
    assert features("10.13.3").precision_flags and not features("10.13.3").strongly_typed_only
    assert features("11.4.0").strongly_typed_only and not features("11.4.0").precision_flags
    assert onnx_precision("fp16", features("11.4.0")) == "fp16"
    assert onnx_precision("fp16", features("10.13.3")) == "fp32"  # 10.x: fp32 ONNX + FP16 flag
    assert onnx_precision("fp32", features("11.4.0")) == "fp32"
    with pytest.raises(ValueError, match="10.x or 11.x"):
        features("8.6.1")
    with pytest.raises(ValueError, match="not a TensorRT version"):
        features("latest")


@pytest.mark.parametrize(("version", "fp16_flag"), [("10.13.3", True), ("11.4.0", False)])
def test_config_kwargs_per_version(version, fp16_flag):
    shapes = {"sample": ((1, 4, 64, 64), (2, 4, 64, 64), (8, 4, 96, 96)), "timestep": ((1,), (2,), (8,))}
    kwargs = config_kwargs(shapes, "fp16", features(version), Path("/tmp/t.cache"))
    assert ("fp16" in kwargs) is fp16_flag
    (profile,) = kwargs["profiles"]
    assert tuple(profile["sample"].max) == (8, 4, 96, 96)
    assert tuple(profile["timestep"].opt) == (2,)
    assert kwargs["load_timing_cache"] == "/tmp/t.cache"
    assert kwargs["tactic_sources"] == []
    kwargs = config_kwargs(shapes, "fp32", features(version), None)
    assert "fp16" not in kwargs and "load_timing_cache" not in kwargs


def test_profile_for_refuses_what_tensorrt_would():
    ok = profile_for({"x": ((1, 4), (2, 4), (4, 4))})
    assert tuple(ok["x"].min) == (1, 4)
    with pytest.raises(EngineError, match="min <= opt <= max"):
        profile_for({"x": ((2, 4), (1, 4), (4, 4))})
    with pytest.raises(EngineError, match="rank"):
        profile_for({"x": ((1, 4), (2, 4, 1), (4, 4))})
    with pytest.raises(EngineError, match="0 < min"):
        profile_for({"x": ((0, 4), (2, 4), (4, 4))})


def test_timing_cache_is_per_arch_and_version(tmp_path):
    a = timing_cache_path(tmp_path, "sm89", "10.13.3")
    assert a != timing_cache_path(tmp_path, "sm90", "10.13.3")
    assert a != timing_cache_path(tmp_path, "sm89", "11.4.0")
    assert a.parent == tmp_path / "timing" and a.name == "timing.sm89.trt10.13.3.cache"


def _export(module, x, path, **kw):
    torch.onnx.export(module, (x,), str(path), input_names=["x"], output_names=["y"], dynamo=False, **kw)


def test_fp16_onnx_for_strongly_typed_builds(tmp_path):
    import onnx
    import onnxruntime as ort

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)).eval()
    path = tmp_path / "model.onnx"
    x = torch.randn(2, 8)
    _export(model, x, path)
    half = fp16_onnx(path)
    assert half.name == FP16_ONNX_FILE
    m = onnx.load(str(half))
    assert any(init.data_type == onnx.TensorProto.FLOAT16 for init in m.graph.initializer)
    assert m.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # I/O stay fp32
    sess = ort.InferenceSession(str(half), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": x.numpy()})
    np.testing.assert_allclose(y, model(x).detach().numpy(), atol=1e-2)
    # Reused, not rewritten; nothing half-written left behind.
    stamp = half.stat().st_mtime_ns
    assert fp16_onnx(path) == half and half.stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob(".fp16-*"))


def test_fp16_onnx_keeps_the_timestep_embedding_fp32(tmp_path):
    """diffusers computes sin/cos of ``t * freq`` in fp32 even in fp16 models; so must the fp16 ONNX.
    Plain fp16 is off by ~0.2 here (timestep 999.37: fp16 steps are 0.5 there)."""
    import onnx
    import onnxruntime as ort
    from diffusers.models.embeddings import Timesteps

    class Embed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = Timesteps(64, True, 0)
            self.lin = torch.nn.Linear(64, 16)

        def forward(self, t):
            return self.lin(self.t(t))

    torch.manual_seed(0)
    module = Embed().eval()
    t = torch.tensor([999.37, 500.5, 1.0, 0.25])
    path = tmp_path / "model.onnx"
    torch.onnx.export(module, (t,), str(path), input_names=["timestep"], output_names=["emb"], dynamo=False,
                      dynamic_axes={"timestep": {0: "B"}})
    half = onnx.load(str(fp16_onnx(path)))
    types = {v.name: v.type.tensor_type.elem_type for v in half.graph.value_info}
    for node in half.graph.node:
        if node.op_type in ("Sin", "Cos"):
            assert types.get(node.input[0], onnx.TensorProto.FLOAT) == onnx.TensorProto.FLOAT
    sess = ort.InferenceSession(str(tmp_path / FP16_ONNX_FILE), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"timestep": t.numpy()})
    with torch.no_grad():
        ref = module(t).numpy()
    assert np.abs(y - ref).max() < 2e-3


def test_fp16_onnx_writes_external_data_for_big_models(tmp_path, monkeypatch):
    import onnxruntime as ort

    import sd_accel.onnx.optimize as optimize

    monkeypatch.setattr(optimize, "EXTERNAL_DATA_THRESHOLD", 100)
    model = torch.nn.Linear(64, 64).eval()
    x = torch.randn(2, 64)
    _export(model, x, tmp_path / "model.onnx")
    half = fp16_onnx(tmp_path / "model.onnx")
    assert (tmp_path / (FP16_ONNX_FILE + ".data")).stat().st_size >= 64 * 64 * 2
    (y,) = ort.InferenceSession(str(half), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
    np.testing.assert_allclose(y, model(x).detach().numpy(), atol=2e-2)


# ---- build, on the dry-run TensorRT ----------------------------------------------------------------


@pytest.fixture
def small_onnx(tmp_path):
    path = tmp_path / "onnx" / "model.onnx"
    path.parent.mkdir()
    _export(torch.nn.Linear(8, 4).eval(), torch.randn(2, 8), path, dynamic_axes={"x": {0: "B"}, "y": {0: "B"}})
    return path, {"x": ((1, 8), (2, 8), (4, 8))}


@pytest.mark.parametrize("version", [V10, V11])
def test_build_names_its_engine_and_reports_progress(version, small_onnx, tmp_path, monkeypatch):
    path, shapes = small_onnx
    seen = []
    pretend_gpu(monkeypatch, "sm89")
    with dry_run(version):
        files = TensorRTBackend(tmp_path / "cache").build(
            path, shapes, "fp16", tmp_path / "out", lambda f, m: seen.append((f, m)))
    assert files == [ENGINE_FILE, META_FILE] and (tmp_path / "out" / ENGINE_FILE).is_file()
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0
    assert any(m.startswith("TensorRT: ") and "Tactic" in m for _, m in seen)  # the monitor's phases
    assert timing_cache_path(tmp_path / "cache", "sm89", version).is_file()
    assert (path.parent / FP16_ONNX_FILE).exists() is features(version).strongly_typed_only


class Cancelled(Exception):
    pass


@pytest.mark.parametrize("version", [V10, V11])
def test_a_cancelled_build_raises_the_callers_exception(version, small_onnx, tmp_path, monkeypatch):
    path, shapes = small_onnx
    pretend_gpu(monkeypatch)

    def progress(fraction, message):
        if fraction > 0.4:
            raise Cancelled("stop")

    with dry_run(version), pytest.raises(Cancelled):
        TensorRTBackend().build(path, shapes, "fp32", tmp_path / "out", progress)
    assert not (tmp_path / "out" / ENGINE_FILE).exists()


def test_progress_monitor_reports_the_outer_phase_and_stops_on_error():
    seen = []
    with dry_run(V11):
        import tensorrt as trt

        monitor = progress_monitor(trt, lambda f, m: seen.append(round(f, 3)))
        monitor.phase_start("build", None, 2)
        monitor.phase_start("tactics", "build", 4)
        assert monitor.step_complete("tactics", 1)
        monitor.phase_finish("tactics")
        assert monitor.step_complete("build", 0)
        assert seen == [0.25, 0.5]
        failing = progress_monitor(trt, lambda f, m: 1 / 0)
        failing.phase_start("build", None, 0)  # TensorRT may announce 0 steps
        assert failing.step_complete("build", 0) is False
        assert isinstance(failing.error, ZeroDivisionError)
        assert failing.step_complete("build", 1) is False


def test_build_refuses_other_precisions(small_onnx, tmp_path, monkeypatch):
    path, shapes = small_onnx
    pretend_gpu(monkeypatch)
    with dry_run(V10), pytest.raises(EngineError, match="int8"):
        TensorRTBackend().build(path, shapes, "int8", tmp_path, lambda f, m: None)
    assert TensorRTBackend().precisions() == ("fp16", "fp32")


def test_build_without_tensorrt_says_why(small_onnx, tmp_path):
    path, shapes = small_onnx
    if TRT_OK:
        pytest.skip("TensorRT is usable here")
    with pytest.raises(EngineError, match="TensorRT"):
        TensorRTBackend().build(path, shapes, "fp16", tmp_path, lambda f, m: None)


def test_trt_status_reasons(monkeypatch):
    with dry_run("8.6.1", NameList("8.6.1", frozenset(), ())):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        ok, version, why = trt_status()
        assert (ok, version) == (False, "8.6.1") and "NVIDIA GPU" in why
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        ok, _, why = trt_status()
        assert not ok and "too old" in why
    with dry_run(V11):
        ok, version, why = trt_status()
        assert ok and version == V11 and why == ""


# ---- load and run, on the dry-run TensorRT and an engine that computes on the CPU -----------------

SHAPES = {"sample": ((1, 4, 8, 8), (2, 4, 8, 8), (4, 4, 16, 16)), "ids": ((1, 77), (2, 77), (4, 154))}


def _engine(tmp_path: Path, ids_dtype: str = "INT32") -> Path:
    path = tmp_path / ENGINE_FILE
    path.write_bytes(engine_plan(
        {"sample": {"dtype": "HALF", "min": [1, 4, 8, 8], "max": [4, 4, 16, 16]},
         "ids": {"dtype": ids_dtype, "min": [1, 77], "max": [4, 154]}},
        {"latent": {"dtype": "FLOAT", "like": "sample", "scale": 2.0},
         "ids_out": {"dtype": "INT64", "like": "ids", "scale": 1}},
    ))
    return path


@pytest.mark.parametrize("version", [V10, V11])
def test_runner_sizes_outputs_per_call_and_reuses_buffers(version, tmp_path, monkeypatch):
    pretend_gpu(monkeypatch)
    with dry_run(version):
        runner = on_cpu(TensorRTRunner(_engine(tmp_path), SHAPES))
        assert runner.inputs == ["sample", "ids"] and runner.outputs == ["latent", "ids_out"]
        assert runner.dtypes == {"sample": torch.float16, "ids": torch.int32, "latent": torch.float32,
                                 "ids_out": torch.int64}
        sample = torch.randn(2, 4, 12, 10, dtype=torch.float64)
        ids = torch.randint(0, 49408, (2, 154))
        out = runner.infer({"sample": sample, "ids": ids})
        torch.testing.assert_close(out["latent"], sample.half().float() * 2)
        assert torch.equal(out["ids_out"], ids)
        first = out["latent"]
        again = runner.infer({"sample": sample, "ids": ids})
        assert again["latent"] is first  # the same buffer: callers copy what they keep
        bigger = runner.infer({"sample": torch.ones(4, 4, 16, 16), "ids": ids[:, :77].contiguous()})
        assert bigger["latent"].shape == (4, 4, 16, 16) and bigger["ids_out"].shape == (2, 77)
        assert runner.context._launches == 3
        # An input that starts mid-allocation (a view) still reads the right values.
        base = torch.randn(1 + 2 * 4 * 8 * 8)
        view = base[1:].view(2, 4, 8, 8)
        out = runner.infer({"sample": view, "ids": ids[:, :77]})
        torch.testing.assert_close(out["latent"], view.half().float() * 2)
        runner.close()
        with pytest.raises(EngineError, match="closed"):
            runner.infer({"sample": view, "ids": ids[:, :77]})


def test_runner_refuses_feeds_outside_its_ranges(tmp_path, monkeypatch):
    pretend_gpu(monkeypatch)
    with dry_run(V10):
        runner = on_cpu(TensorRTRunner(_engine(tmp_path), SHAPES))
        ids = torch.zeros(1, 77, dtype=torch.int64)
        with pytest.raises(EngineError, match="does not cover"):
            runner.infer({"sample": torch.zeros(8, 4, 8, 8), "ids": ids})
        with pytest.raises(EngineError, match="does not cover"):
            runner.infer({"sample": torch.zeros(1, 4, 8, 8)})
        # The engine's own profile is narrower than the record claims: TensorRT refuses the shape.
        runner.shapes = {**SHAPES, "sample": ((1, 4, 8, 8), (2, 4, 8, 8), (4, 4, 32, 32))}
        with pytest.raises(EngineError, match="refused shape"):
            runner.infer({"sample": torch.zeros(1, 4, 32, 32), "ids": ids})


def test_runner_explains_an_engine_it_cannot_use(tmp_path):
    with dry_run(V11):
        (tmp_path / ENGINE_FILE).write_bytes(b"corrupt")
        with pytest.raises(EngineError, match="another TensorRT version or for another GPU"):
            TensorRTRunner(tmp_path / ENGINE_FILE, SHAPES)
        with pytest.raises(EngineError, match="has inputs"):
            TensorRTRunner(_engine(tmp_path), {"sample": SHAPES["sample"]})
        with pytest.raises(EngineError, match="no torch equivalent"):
            TensorRTRunner(_engine(tmp_path, ids_dtype="FP8"), SHAPES)
        import tensorrt as trt

        assert torch_dtype(trt, trt.DataType.BF16) is torch.bfloat16


def test_load_takes_only_its_engine_file(tmp_path):
    with pytest.raises(EngineError, match=ENGINE_FILE):
        TensorRTBackend().load(tmp_path, ["model.onnx"], SHAPES)


@pytest.mark.skipif(TRT_OK, reason="TensorRT is usable here; this checks the message where it is not")
def test_tensorrt_backend_refused_with_reason_where_absent():
    with pytest.raises(RuntimeError) as err:
        get_backend("tensorrt")
    assert "TensorRT" in str(err.value)
    assert get_backend("auto").name in ("openvino", "onnxruntime")  # the CPU's: OpenVINO where installed


# ---- refits: new weights into a built engine (trt.Refitter), on the stand-in -----------------------
# The stand-in's engines compute their ONNX graph on the CPU with the engine's own weights, and its
# Refitter follows TensorRT 10's interface and checks (names, counts, dtypes): what is verified here
# is our side of that interface, not TensorRT's refit on a GPU.


def _small(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()


@pytest.fixture
def refit_case(tmp_path, monkeypatch):
    """A small model's ONNX export, a way to build it on the stand-in, and a way to run an engine."""
    from sd_accel.onnx.weights import onnx_values

    path = tmp_path / "onnx" / "model.onnx"
    path.parent.mkdir()
    _export(_small(0), torch.randn(2, 8), path, dynamic_axes={"x": {0: "B"}, "y": {0: "B"}})
    shapes = {"x": ((1, 8), (2, 8), (4, 8))}
    x = torch.randn(3, 8)
    pretend_gpu(monkeypatch)

    class Case:
        def build(self, precision: str, out: str = "engine") -> list[str]:
            return TensorRTBackend().build(path, shapes, precision, tmp_path / out, lambda f, m: None)

        def patch(self, module_or_value, src: str = "engine", out: str = "refit", files=None):
            value = module_or_value
            if isinstance(module_or_value, torch.nn.Module):
                value = onnx_values(path.parent, module_or_value.state_dict())
            return TensorRTBackend().patch_weights(tmp_path / src, files or [ENGINE_FILE, META_FILE], value,
                                                   tmp_path / out)

        def run(self, folder: str = "refit", files=None) -> torch.Tensor:
            runner = on_cpu(TensorRTBackend().load(tmp_path / folder, files or [ENGINE_FILE, META_FILE], shapes))
            try:
                return runner.infer({"x": x})["y"].clone()
            finally:
                runner.close()

        def torch(self, module) -> torch.Tensor:
            with torch.no_grad():
                return module(x)

    case = Case()
    case.dir, case.value = tmp_path, lambda m: onnx_values(path.parent, m.state_dict())
    return case


@pytest.mark.parametrize(("version", "precision"), [(V10, "fp16"), (V10, "fp32"), (V11, "fp16"), (V11, "fp32")])
def test_built_engines_are_refittable_and_say_so(version, precision, refit_case):
    import json

    with dry_run(version) as run:
        files = refit_case.build(precision)
    assert files == [ENGINE_FILE, META_FILE] and "BuilderFlag.REFIT" in run.used
    meta = json.loads((refit_case.dir / "engine" / META_FILE).read_text())
    assert meta == {"refittable": True, "precision": precision, "weight_streaming": False,
                    "onnx_precision": onnx_precision(precision, features(version)),
                    "graph_constants": 0, "derived_weights": False}


@pytest.mark.parametrize(("version", "precision", "atol"), [(V10, "fp32", 1e-6), (V11, "fp32", 1e-6),
                                                           (V11, "fp16", 2e-3)])
def test_a_refit_engine_computes_with_the_new_weights(version, precision, atol, refit_case):
    """11.x fp16 engines hold fp16 weights (the ONNX is fp16): the refit converts them, or the
    Refitter would refuse them as TensorRT does."""
    base, changed = _small(0), _small(1)
    with dry_run(version):
        refit_case.build(precision)
        files = refit_case.patch(changed)
        assert files == [ENGINE_FILE, META_FILE]
        new, old = refit_case.run("refit"), refit_case.run("engine")
    torch.testing.assert_close(new, refit_case.torch(changed), atol=atol, rtol=0)
    torch.testing.assert_close(old, refit_case.torch(base), atol=atol, rtol=0)  # the base engine is untouched
    assert (new - old).abs().max() > 100 * atol


def test_refits_set_full_weights_never_deltas(refit_case):
    """LoRA A, then B, then A again gives A, even refitting each engine from the previous refit."""
    a, b = _small(1), _small(2)
    with dry_run(V11):
        refit_case.build("fp32")
        assert refit_case.patch(a, "engine", "a1")
        assert refit_case.patch(b, "a1", "b")
        assert refit_case.patch(a, "b", "a2")
        first, again = refit_case.run("a1"), refit_case.run("a2")
    assert torch.equal(first, again)
    torch.testing.assert_close(first, refit_case.torch(a), atol=1e-6, rtol=0)


def test_engines_that_are_not_refittable_are_not_patched(refit_case, monkeypatch):
    import json

    import sd_accel.backends.tensorrt.builder as builder

    changed = _small(1)
    with dry_run(V10):
        refit_case.build("fp32")
        # An engine built before refits existed: no engine.json in its record.
        assert refit_case.patch(changed, files=[ENGINE_FILE]) is None
        # Built without REFIT (the stand-in's Refitter then lists no weights, as TensorRT refuses).
        monkeypatch.setattr(builder, "config_kwargs", lambda *a: {**config_kwargs(*a), "refittable": False})
        refit_case.build("fp32", out="plain")
        assert json.loads((refit_case.dir / "plain" / META_FILE).read_text())["refittable"] is False
        assert refit_case.patch(changed, src="plain") is None
        meta = refit_case.dir / "plain" / META_FILE
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "refittable": True}))
        assert refit_case.patch(changed, src="plain") is None  # the engine itself says no
    assert not (refit_case.dir / "refit" / ENGINE_FILE).exists()


def test_a_weight_the_graph_does_not_name_means_no_patch(refit_case, caplog):
    changed = _small(1)
    value = refit_case.value(changed)
    with dry_run(V11):
        refit_case.build("fp32")
        first = next(iter(_initializers(refit_case.dir / "onnx" / "model.onnx")))
        with caplog.at_level("INFO", logger="sd_accel"):
            assert refit_case.patch(lambda name: None if name == first else value(name)) is None
        assert f"{first!r} is not an initializer" in caplog.text
        # A value of another size than the engine's (a layout the map got wrong) is refused too.
        assert refit_case.patch(lambda name: value(name).ravel()[:-1] if name == first else value(name)) is None
        assert refit_case.patch(changed) is not None


def _initializers(path: Path) -> list[str]:
    import onnx

    return [t.name for t in onnx.load(str(path), load_external_data=False).graph.initializer]


def test_the_graphs_own_constants_stay_as_built(tmp_path, monkeypatch):
    """A ConstantOfShape's value is a weight the parser names itself (no initializer does): it
    stays as built; a graph whose parser derives weights from initializers (BatchNormalization)
    is not patched."""
    import json

    from sd_accel.onnx.weights import onnx_values

    class Padded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.lin(x) + torch.zeros(x.shape[0], 4)  # a ConstantOfShape in the export

    torch.manual_seed(0)
    base, changed = Padded().eval(), Padded().eval()
    path = tmp_path / "onnx" / "model.onnx"
    path.parent.mkdir()
    _export(base, torch.randn(2, 8), path, dynamic_axes={"x": {0: "B"}, "y": {0: "B"}})
    shapes = {"x": ((1, 8), (2, 8), (4, 8))}
    x = torch.randn(3, 8)
    pretend_gpu(monkeypatch)
    with dry_run(V11):
        files = TensorRTBackend().build(path, shapes, "fp32", tmp_path / "engine", lambda f, m: None)
        meta = json.loads((tmp_path / "engine" / META_FILE).read_text())
        assert meta["graph_constants"] >= 1 and not meta["derived_weights"]
        value = onnx_values(path.parent, changed.state_dict())
        assert TensorRTBackend().patch_weights(tmp_path / "engine", files, value, tmp_path / "refit") == files
        runner = on_cpu(TensorRTBackend().load(tmp_path / "refit", files, shapes))
        torch.testing.assert_close(runner.infer({"x": x})["y"], changed(x).detach(), atol=1e-6, rtol=0)
        runner.close()
        (tmp_path / "engine" / META_FILE).write_text(json.dumps({**meta, "derived_weights": True}))
        assert TensorRTBackend().patch_weights(tmp_path / "engine", files, value, tmp_path / "refit2") is None


# ---- on an NVIDIA GPU with TensorRT (scripts/gpu_check.sh runs these) -----------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not TRT_OK, reason=f"needs TensorRT on an NVIDIA GPU: {TRT_WHY}")
@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_tensorrt_engines_match_torch(precision, tmp_path):
    """Every component of the tiny SD 1.5, static and dynamic, built, validated against torch,
    and loaded again from the cache."""
    from sd_accel import build_engines, load_pipeline

    pipe = load_pipeline("builtin:tiny-sd15")
    records = build_engines(
        pipe, profiles=[dict(batch=1, height=64, width=64), dict(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96))],
        backend="tensorrt", precision=precision, engine_dir=tmp_path, progress=False)
    assert len(records) == 2 * 4
    for record in records:
        assert record.status == "ok"
    again = build_engines(pipe, profiles=[dict(batch=1, height=64, width=64)], backend="tensorrt",
                          precision=precision, engine_dir=tmp_path, progress=False)
    assert {r.key.name for r in again} <= {r.key.name for r in records}


@pytest.mark.cuda
@pytest.mark.skipif(not TRT_OK, reason=f"needs TensorRT on an NVIDIA GPU: {TRT_WHY}")
def test_tensorrt_build_and_run_tiny_unet(tmp_path):
    from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, stats

    pipe = load_pipeline("builtin:tiny-sd15")
    build_engines(pipe, profiles=[dict(batch=1, height=64, width=64)], backend="tensorrt", engine_dir=tmp_path,
                  components=["unet"], progress=False)
    pipe = accelerate(pipe, AccelConfig(engines=True, engine_dir=str(tmp_path), backend="tensorrt"))
    pipe("a cat", num_inference_steps=2, height=64, width=64, generator=torch.Generator().manual_seed(0))
    assert stats(pipe)["unet"]["engine_calls"] == 2


@pytest.mark.slow
def test_refit_engines_puts_a_lora_on_a_stand_in_tensorrt_unet(tmp_path, monkeypatch):
    """End to end on the stand-in: the tiny SD 1.5 UNet's engine built refittable, a peft LoRA
    loaded after the swap, ``refit_engines`` refits it with ``trt.Refitter`` (no build), and the
    image equals torch + LoRA. The stand-in computes on the CPU: torch's device is the CPU here."""
    from peft import LoraConfig

    from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, refit_engines, stats

    pretend_gpu(monkeypatch)
    monkeypatch.setattr(TensorRTBackend, "torch_device", "cpu")
    load = TensorRTBackend.load
    monkeypatch.setattr(TensorRTBackend, "load", lambda self, *a: on_cpu(load(self, *a)))
    builds = []
    build = TensorRTBackend.build
    monkeypatch.setattr(TensorRTBackend, "build", lambda self, *a, **k: builds.append(a[0]) or build(self, *a, **k))

    def generate(pipe):
        g = torch.Generator("cpu").manual_seed(0)
        return pipe("a cat", num_inference_steps=2, height=64, width=64, generator=g, output_type="np").images

    def add_lora(pipe, seed: int) -> None:
        torch.manual_seed(seed)
        pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                         init_lora_weights=False))

    config = dict(precision="fp32", sampler="Euler", device="cpu")
    reference = accelerate(load_pipeline("builtin:tiny-sd15"), AccelConfig(**config))
    base = generate(reference)
    add_lora(reference, 0)
    want = generate(reference)
    assert np.abs(want - base).max() > 1e-2  # the LoRA makes a difference worth testing

    with dry_run(V11):
        build_engines(load_pipeline("builtin:tiny-sd15"), profiles=[dict(batch=1, height=64, width=64)],
                      components=["unet"], backend="tensorrt", precision="fp32", engine_dir=tmp_path, progress=False)
        pipe = accelerate(load_pipeline("builtin:tiny-sd15"),
                          AccelConfig(engines=True, engine_dir=str(tmp_path), backend="tensorrt", **config))
        np.testing.assert_allclose(generate(pipe), base, atol=1e-4)
        assert stats(pipe)["unet"]["engine_calls"] == 2  # the stand-in engine ran, not torch
        add_lora(pipe, 0)
        builds.clear()
        events = []
        done = refit_engines(pipe, progress=events.append)
        got = generate(pipe)
    assert list(done) == ["unet"] and not builds  # refitted in place: nothing built
    assert "writing the current weights into a copy of the engine" in [m for _, _, m in events]
    assert stats(pipe)["unet"]["engine_calls"] == 4 and not stats(pipe)["unet"]["fallbacks"]
    np.testing.assert_allclose(got, want, atol=1e-4)
