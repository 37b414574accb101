"""The transformer families built in segments (issue 44): where the cuts go, the chained engine's
key, and tiny SD3 and FLUX.1 models built segment by segment matching torch and the engine built
whole, on ONNX Runtime and OpenVINO, and serving their pipelines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sd_accel import accelerate, build_engines, load_pipeline, stats
from sd_accel.backends.chain import CHAIN_FILE, ChainRunner, load_engine
from sd_accel.backends.registry import get_backend
from sd_accel.cache.key import EngineKey
from sd_accel.components import specs_for
from sd_accel.components.segments import SEGMENTS_ENV, SegmentPolicy, plan_for, state_name
from sd_accel.config import AccelConfig
from sd_accel.core import InvalidValue
from sd_accel.profiles import Profile
from sd_accel.validate import reference

DYNAMIC = Profile(batch=(1, 1, 2), height=(64, 64, 128), width=(64, 64, 128), text=(32, 64, 128))
EVERY_BLOCK = SegmentPolicy(budget=1, always=True)  # one block per segment


def _spec(name: str):
    return specs_for(load_pipeline(name))["transformer"]


def test_plan_cuts_between_blocks_in_order():
    spec = _spec("builtin:tiny-flux")
    module = spec.torch_module()
    plan = plan_for(spec, EVERY_BLOCK)
    blocks = [("transformer_blocks", i) for i in range(len(module.transformer_blocks))] + \
             [("single_transformer_blocks", i) for i in range(len(module.single_transformer_blocks))]
    assert [b for s in plan.segments for b in s.blocks] == blocks
    assert [s.first for s in plan.segments] == [True] + [False] * (len(blocks) - 1)
    assert [s.last for s in plan.segments] == [False] * (len(blocks) - 1) + [True]
    assert plan.tag == plan_for(spec, EVERY_BLOCK).tag and plan.tag.startswith(f"seg{len(blocks)}-")
    # a budget that holds every block: one segment, built whole
    assert plan_for(spec, SegmentPolicy(budget=1 << 40, always=True)) is None
    # by default only transformers past 4 GiB of fp32 weights are cut; a tiny one is built whole
    assert plan_for(spec, SegmentPolicy()) is None
    assert plan_for(spec, SegmentPolicy(budget=1, auto_above=1)).tag == plan.tag
    assert plan_for(spec, SegmentPolicy(budget=1, always=True, never=True)) is None
    # what is not a transformer family's spec is never cut
    assert plan_for(specs_for(load_pipeline("builtin:tiny-sd15"))["unet"], EVERY_BLOCK) is None


def test_sd3_plan_and_segment_tensors():
    spec = _spec("builtin:tiny-sd3")
    plan = plan_for(spec, EVERY_BLOCK)
    n = len(spec.torch_module().transformer_blocks)
    # the last block (context_pre_only) lies in the last segment, which also unpatchifies
    assert plan.segments[-1].blocks == (("transformer_blocks", n - 1),)
    from sd_accel.components.segments import SegmentSpec

    first, last = SegmentSpec(spec, plan.segments[0]), SegmentSpec(spec, plan.segments[-1])
    assert [t.name for t in first.inputs()] == [t.name for t in spec.inputs()]
    assert [t.name for t in first.outputs()] == ["hidden_next", "context_next", "temb"]
    assert [state_name(t.name) for t in first.outputs()] == ["hidden", "context", "temb"]
    assert [t.name for t in last.inputs()] == ["hidden", "context", "temb", "hidden_states"]
    assert [t.name for t in last.outputs()] == ["latent"]
    ranges = last.dim_ranges(DYNAMIC)
    assert ranges["T"] == tuple((h // 2) * (w // 2) for h, w in zip(ranges["H8"], ranges["W8"], strict=True))


def test_policy_from_the_environment(monkeypatch):
    monkeypatch.delenv(SEGMENTS_ENV, raising=False)
    assert SegmentPolicy.from_env() == SegmentPolicy()
    monkeypatch.setenv(SEGMENTS_ENV, "off")
    assert SegmentPolicy.from_env().never
    monkeypatch.setenv(SEGMENTS_ENV, "512")
    assert SegmentPolicy.from_env() == SegmentPolicy(budget=512 << 20, always=True)
    for bad in ("lots", "-1"):
        monkeypatch.setenv(SEGMENTS_ENV, bad)
        with pytest.raises(InvalidValue, match=SEGMENTS_ENV):
            SegmentPolicy.from_env()


def test_a_whole_engine_keeps_its_key_and_a_chain_has_its_own():
    fields = ("0123456789abcdef", "transformer", "openvino", "2026.4.1", "cpu-x", "fp32", "static.b1")
    whole, chain = EngineKey(*fields), EngineKey(*fields, layout="seg3-abcdef")
    assert "layout" not in whole.to_dict() and EngineKey.from_dict(whole.to_dict()) == whole
    assert EngineKey.from_dict(chain.to_dict()) == chain
    assert ".seg3-abcdef." in chain.name and chain.name != whole.name


def _build(name: str, backend: str, engine_dir, monkeypatch, segments: bool):
    monkeypatch.setenv(SEGMENTS_ENV, "0.01" if segments else "off")  # 10 KiB: one block per segment
    (record,) = build_engines(load_pipeline(name), profiles=[DYNAMIC], backend=backend, precision="fp32",
                              components=["transformer"], engine_dir=engine_dir, progress=False)
    return record


@pytest.mark.parametrize("backend", ["onnxruntime", pytest.param("openvino", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["builtin:tiny-sd3", "builtin:tiny-flux-dev"])
def test_segmented_engine_matches_torch_and_the_whole_engine(tmp_path, monkeypatch, name, backend):
    if backend == "openvino":
        pytest.importorskip("openvino")
    whole = _build(name, backend, tmp_path, monkeypatch, segments=False)
    chain = _build(name, backend, tmp_path, monkeypatch, segments=True)
    assert whole.key.layout == "" and chain.key.layout.startswith("seg")
    assert (chain.key.model, chain.key.profile) == (whole.key.model, whole.key.profile)
    assert CHAIN_FILE in chain.files and any(f.startswith("seg01/") for f in chain.files)
    for record in (whole, chain):
        assert record.validation["ok"] and record.validation["points"] == ["opt", "max"], record.validation
        assert record.validation["rel_l2"] < 1e-4, record.validation
    spec = _spec(name)
    be = get_backend(backend, cache_root=tmp_path)
    runners = [load_engine(be, tmp_path / r.key.name, list(r.files), {k: tuple(map(tuple, v)) for k, v in
                                                                        r.shapes.items()}) for r in (whole, chain)]
    try:
        assert isinstance(runners[1], ChainRunner)
        dims = {k: v[2] for k, v in spec.dim_ranges(DYNAMIC).items()}  # the max point: batch 2, 128 px
        feed = spec.sample_feed(dims, seed=5)
        got = [r.infer(feed)["latent"].clone() for r in runners]
        with torch.no_grad():
            (want,) = reference(spec.export_module().eval(), feed, whole=spec.unbatched())
        for g in got:
            assert g.shape == want.shape
            assert ((g - want).norm() / want.norm()).item() < 1e-4
        assert ((got[1] - got[0]).norm() / got[0].norm()).item() < 1e-4
    finally:
        for r in runners:
            r.close()


@pytest.mark.parametrize("name", ["builtin:tiny-sd3", "builtin:tiny-flux"])
def test_pipeline_runs_on_a_segmented_engine(tmp_path, monkeypatch, name):
    record = _build(name, "onnxruntime", tmp_path, monkeypatch, segments=True)
    assert record.key.layout
    g = torch.Generator("cpu").manual_seed(0)
    call = dict(prompt="a cat", num_inference_steps=3, height=64, width=64, max_sequence_length=64,
                output_type="np")
    ref = accelerate(load_pipeline(name), precision="fp32")(generator=g, **call).images
    pipe = accelerate(load_pipeline(name), AccelConfig(engines=True, engine_dir=str(tmp_path), precision="fp32",
                                                       backend="onnxruntime"))
    out = pipe(generator=torch.Generator("cpu").manual_seed(0), **call).images
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)["transformer"]
    assert s["engine_calls"] == 3 and s["torch_calls"] == 0, s


@pytest.mark.parametrize("backend", ["onnxruntime", pytest.param("openvino", marks=pytest.mark.slow)])
def test_t5_in_segments_matches_torch_and_the_whole_engine(tmp_path, monkeypatch, backend):
    if backend == "openvino":
        pytest.importorskip("openvino")
    records = []
    for segments in (False, True):
        monkeypatch.setenv(SEGMENTS_ENV, "0.01" if segments else "off")
        (record,) = build_engines(load_pipeline("builtin:tiny-sd3"), profiles=[DYNAMIC], backend=backend,
                                  precision="fp32", components=["t5"], engine_dir=tmp_path, progress=False)
        assert record.validation["ok"] and record.validation["rel_l2"] < 1e-4, record.validation
        records.append(record)
    whole, chain = records
    assert whole.key.layout == "" and chain.key.layout.startswith("seg")
    spec = specs_for(load_pipeline("builtin:tiny-sd3"))["t5"]
    plan = plan_for(spec, EVERY_BLOCK)
    from sd_accel.components.segments import SegmentSpec

    first = SegmentSpec(spec, plan.segments[0])
    assert [t.name for t in first.outputs()] == ["hidden_next", "position_bias"]
    be = get_backend(backend, cache_root=tmp_path)
    feed = spec.sample_feed({"B": 2, "L": 100}, seed=3)
    outs = []
    for record in records:
        runner = load_engine(be, tmp_path / record.key.name, list(record.files),
                             {k: tuple(map(tuple, v)) for k, v in record.shapes.items()})
        try:
            outs.append(runner.infer(feed)["last_hidden_state"].clone())
        finally:
            runner.close()
    with torch.no_grad():
        (want,) = reference(spec.export_module().eval(), feed)
    for got in outs:
        assert ((got - want).norm() / want.norm()).item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(("name", "component"), [("builtin:tiny-flux", "transformer"), ("builtin:tiny-sd3", "t5")])
def test_int8_in_segments_is_weights_only_on_openvino(tmp_path, monkeypatch, name, component):
    """int8 of a module built in segments compresses the weights only (no calibration: a segment's
    inputs are what the segments before it make): no calibration run, a smaller engine, within the
    int8 tolerance of torch."""
    pytest.importorskip("nncf")
    monkeypatch.setenv(SEGMENTS_ENV, "0.01")
    sizes = {}
    for precision in ("fp32", "int8"):
        (record,) = build_engines(load_pipeline(name), profiles=[Profile(batch=1, height=64, width=64, text=64)],
                                  backend="openvino", precision=precision, components=[component],
                                  engine_dir=tmp_path, progress=False)
        assert record.key.layout.startswith("seg") and record.validation["ok"], record.validation
        sizes[precision] = record.size_bytes
    assert record.validation["rel_l2"] < 0.1 and "int8_scope" not in record.extra
    assert sizes["int8"] < 0.6 * sizes["fp32"], sizes


@pytest.mark.slow
@pytest.mark.parametrize("segments", [True, False], ids=["segments", "whole"])
def test_int4_weights_on_openvino_judged_by_the_picture(tmp_path, monkeypatch, segments):
    """int4 (weights only, groups of 64, no calibration) builds whole or in segments, stores fewer
    bytes than int8's weights-only engine, and a per-call miss (forced here: tolerance 1e-4) within
    the ceiling is judged by the picture the pipeline makes on the engine at int8's picture gate."""
    pytest.importorskip("nncf")
    from sd_accel import validate

    monkeypatch.setenv(SEGMENTS_ENV, "0.01" if segments else "off")
    pipe = load_pipeline("builtin:tiny-flux")
    profile = Profile(batch=1, height=64, width=64, text=64)
    (int4,) = build_engines(pipe, profiles=[profile], backend="openvino", precision="int4",
                            components=["transformer"], engine_dir=tmp_path / "a", progress=False)
    assert int4.key.precision == "int4" and int4.key.layout.startswith("seg") == segments
    assert int4.validation["ok"] and int4.validation["rel_l2"] < validate.TOLERANCE["int4"], int4.validation
    if segments:
        (int8,) = build_engines(pipe, profiles=[profile], backend="openvino", precision="int8",
                                components=["transformer"], engine_dir=tmp_path / "b", progress=False)
        assert int4.size_bytes < int8.size_bytes, (int4.size_bytes, int8.size_bytes)
    monkeypatch.setitem(validate.TOLERANCE, "int4", 1e-4)
    (judged,) = build_engines(pipe, profiles=[profile], backend="openvino", precision="int4",
                              components=["transformer"], engine_dir=tmp_path / "c", progress=False)
    assert judged.validation["ok"] and judged.validation["image_psnr"] >= validate.PICTURE_PSNR["int4"]
    monkeypatch.setitem(validate.PICTURE_CEILING, "int4", 1e-3)  # past the ceiling: refused outright
    with pytest.raises(Exception, match="int4"):
        build_engines(pipe, profiles=[profile], backend="openvino", precision="int4", components=["transformer"],
                      engine_dir=tmp_path / "d", progress=False)
    assert not list((tmp_path / "d").rglob("engine.bin"))  # nothing kept


def test_a_chain_keeps_loaded_the_segments_that_fit_and_streams_the_rest(tmp_path, monkeypatch):
    """``SD_ACCEL_CHAIN_STREAMING``: ``auto`` loads each segment on its first turn and keeps it
    while the memory available after its run stays above the reserve, closing it otherwise, so
    that a bigger shape closes what no longer fits (FLUX.1's int4 chain on a 24 GB machine: 17.9 GiB
    loaded whole at 512 px, out of memory at 1024 px); ``on`` streams every segment, ``off`` loads
    them all at once. Each way computes what the loaded chain does."""
    from sd_accel.backends import chain as chain_module
    from sd_accel.backends.chain import KEEP_ALL, KEEP_FIT, KEEP_NONE, chain_keeping, chain_reserve

    record = _build("builtin:tiny-flux-dev", "onnxruntime", tmp_path, monkeypatch, segments=True)
    be = get_backend("onnxruntime", cache_root=tmp_path)
    folder, files = tmp_path / record.key.name, list(record.files)
    shapes = {k: tuple(map(tuple, v)) for k, v in record.shapes.items()}
    loads: list[str] = []
    real_load = be.load
    monkeypatch.setattr(be, "load", lambda d, f, s: loads.append(d.name) or real_load(d, f, s))
    monkeypatch.delenv(chain_module.STREAMING_ENV, raising=False)
    monkeypatch.setenv(chain_module.RESERVE_ENV, "1")  # keep 1 GB available
    assert chain_keeping(be) == KEEP_FIT and chain_reserve() == 10**9

    class OnTheCard:  # a backend whose engines live on the card (TensorRT): host memory says nothing
        engines_in_host_memory = False

    assert chain_keeping(OnTheCard()) == KEEP_ALL
    spec = _spec("builtin:tiny-flux-dev")
    dims = spec.dim_ranges(DYNAMIC)
    feed = spec.sample_feed({k: v[1] for k, v in dims.items()}, seed=3)
    bigger = spec.sample_feed({k: v[2] for k, v in dims.items()}, seed=4)

    monkeypatch.setenv(chain_module.STREAMING_ENV, "off")
    loaded = load_engine(be, folder, files, shapes, streaming=None)
    n = len(loaded.links)
    assert loaded.keep == KEEP_ALL and len(loads) == n and n >= 3  # every segment, at load
    want, want_big = loaded.infer(feed)["latent"].clone(), loaded.infer(bigger)["latent"].clone()
    loaded.close()

    def close_to(got, ref):
        return ((got - ref).norm() / ref.norm()).item() < 1e-5

    monkeypatch.setenv(chain_module.STREAMING_ENV, "on")
    streamed = load_engine(be, folder, files, shapes, streaming=None)
    loads.clear()
    assert streamed.keep == KEEP_NONE and close_to(streamed.infer(feed)["latent"], want)
    assert streamed.infer(feed)["latent"] is not None and len(loads) == 2 * n and streamed.streamed == n

    # auto on a machine where 2 segments fit: those stay, the rest load for each call
    monkeypatch.setenv(chain_module.STREAMING_ENV, "auto")
    free = {"left": 2}

    def available():  # read once after each segment's run
        free["left"] -= 1
        return 2 * 10**9 if free["left"] >= 0 else 10**8

    monkeypatch.setattr("sd_accel.device.available_memory", available)
    fit = load_engine(be, folder, files, shapes, streaming=None)
    loads.clear()
    assert fit.keep == KEEP_FIT and fit.streamed == n  # nothing loads before the first call
    assert close_to(fit.infer(feed)["latent"], want) and len(loads) == n
    assert sorted(fit.loaded) == [0, 1] and fit.streamed == n - 2
    kept = dict(fit.loaded)
    loads.clear()
    free["left"] = 10**6  # memory to spare now: the kept ones stay, the others load and stay
    assert close_to(fit.infer(feed)["latent"], want) and len(loads) == n - 2
    assert all(fit.loaded[i] is runner for i, runner in kept.items()) and fit.streamed == 0
    half = n // 2  # the step cache's partial runs
    assert set(fit.run_links(feed, 0, half)) >= set(fit.links[half - 1].gives)
    # a bigger shape takes what was available: each segment closes after its run
    monkeypatch.setattr("sd_accel.device.available_memory", lambda: 10**8)
    loads.clear()
    assert close_to(fit.infer(bigger)["latent"], want_big) and loads == [] and fit.streamed == n
    assert close_to(fit.infer(feed)["latent"], want) and len(loads) == n
    fit.close()

    monkeypatch.setenv(chain_module.STREAMING_ENV, "sometimes")
    with pytest.raises(InvalidValue, match="SD_ACCEL_CHAIN_STREAMING"):
        chain_keeping(be)
    monkeypatch.setenv(chain_module.RESERVE_ENV, "lots")
    with pytest.raises(InvalidValue, match="SD_ACCEL_CHAIN_RESERVE_GB"):
        chain_reserve()
    monkeypatch.delenv(chain_module.RESERVE_ENV)
    assert chain_reserve() >= 4 << 30
