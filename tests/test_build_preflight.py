"""A build that cannot fit in memory is refused before it starts (issue 46: "a refit or build that
would not fit says so before it starts and leaves the host running"): the export of a module
needs at least one fp32 copy of its weights, and FLUX.1's transformer (45 GB of them) would
otherwise run the machine out of memory halfway through."""

from __future__ import annotations

import pytest
import torch

from sd_accel import build_engines
from sd_accel.build import EXPORT_OVERHEAD, export_needs
from sd_accel.cache.store import EngineCache
from sd_accel.components import specs_for
from sd_accel.core import EngineError


def test_the_export_needs_one_fp32_copy_of_the_weights_at_least(tiny_factory):
    pipe = tiny_factory("sd15")
    spec = specs_for(pipe)["unet"]
    count = sum(p.numel() for p in pipe.unet.parameters()) + sum(b.numel() for b in pipe.unet.buffers())
    assert export_needs(spec) == 4 * count + EXPORT_OVERHEAD
    # held in half precision, the export still makes an fp32 copy
    spec16 = specs_for(tiny_factory("sd15").to(torch.float16))["unet"]
    assert export_needs(spec16) == export_needs(spec)


def test_a_build_that_cannot_fit_is_refused_before_anything_is_written(tiny_factory, tmp_path, monkeypatch):
    pipe = tiny_factory("sd15")
    free = export_needs(specs_for(pipe)["vae_decoder"]) - 1
    monkeypatch.setattr("sd_accel.device.available_memory", lambda: free)
    engines = tmp_path / "engines"
    with pytest.raises(EngineError, match=r"not enough memory to build the vae_decoder engine: .* needs at least "
                                          r".*SD_ACCEL_NO_PREFLIGHT=1"):
        build_engines(pipe, profiles=[dict(batch=1, height=64, width=64)], backend="onnxruntime",
                      components=["vae_decoder"], engine_dir=engines, progress=False)
    assert EngineCache(engines).list() == []
    exported = [p for p in engines.rglob("*") if p.suffix in (".onnx", ".data")] if engines.exists() else []
    assert exported == []
    # the pipeline goes on in PyTorch
    image = pipe("a cat", height=64, width=64, num_inference_steps=1, output_type="np").images[0]
    assert image.shape == (64, 64, 3)


def test_the_check_lets_what_fits_build_and_can_be_skipped(tiny_factory, tmp_path, monkeypatch):
    pipe = tiny_factory("sd15")
    need = export_needs(specs_for(pipe)["vae_decoder"])
    profile = [dict(batch=1, height=64, width=64)]
    monkeypatch.setattr("sd_accel.device.available_memory", lambda: need)
    (record,) = build_engines(pipe, profiles=profile, backend="onnxruntime", components=["vae_decoder"],
                              engine_dir=tmp_path / "a", progress=False, validate=False)
    assert record.status == "ok"
    monkeypatch.setattr("sd_accel.device.available_memory", lambda: 1)
    monkeypatch.setenv("SD_ACCEL_NO_PREFLIGHT", "1")
    (record,) = build_engines(pipe, profiles=profile, backend="onnxruntime", components=["vae_decoder"],
                              engine_dir=tmp_path / "b", progress=False, validate=False)
    assert record.status == "ok"


def test_a_build_in_segments_needs_its_largest_segment_not_the_whole_module(tiny_factory):
    """FLUX.1's transformer (45 GB in fp32) is built one segment at a time: the pre-flight asks for
    the memory of the largest segment's export, not the whole module's."""
    from sd_accel.components.segments import SegmentPolicy, plan_for

    spec = specs_for(tiny_factory("flux-schnell"))["transformer"]
    plan = plan_for(spec, SegmentPolicy(budget=1, always=True))  # one block per segment
    assert plan is not None and len(plan.segments) >= 3
    whole, segmented = export_needs(spec), export_needs(spec, plan)
    assert EXPORT_OVERHEAD < segmented < whole
