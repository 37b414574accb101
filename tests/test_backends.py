"""The backend table: every face reads it, and a new backend is one module plus one entry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sd_accel import AccelConfig, EngineCache, accelerate, build_engines, stats
from sd_accel.backends import registry
from sd_accel.core import DeviceError, InvalidValue


@pytest.mark.parametrize("entry", registry.TABLE, ids=lambda e: e.name)
def test_every_entry_keeps_the_contract(entry):
    backend = registry.create(entry.name)
    # (the compiled backend runs where torch runs the pipeline: its entry says what it is for, CUDA)
    assert backend.name == entry.name and (backend.torch_device == entry.torch_device or entry.live_modules)
    info = backend.info()
    assert info.name == entry.name
    if info.usable:
        assert info.version and info.arch
        assert backend.default_precision() in backend.precisions()
    else:
        assert info.why_not


@pytest.mark.parametrize("entry", registry.TABLE, ids=lambda e: e.name)
def test_the_contract_is_declared_and_the_precisions_come_from_the_table(entry):
    """Optional capabilities are declared in backends/base.py with defaults (no caller probes
    with getattr); what a backend builds here is the table's ``builds`` less what is missing."""
    from sd_accel.backends.base import Backend
    from sd_accel.config import ENGINE_PRECISIONS

    backend = registry.create(entry.name)
    assert isinstance(backend, Backend)
    assert isinstance(backend.int8_scopes, tuple) and isinstance(backend.patches_weights, bool)
    assert set(backend.precisions()) <= set(entry.builds)
    for precision in entry.builds:
        assert (precision in backend.precisions()) == (backend.missing(precision) is None)
    assert set(ENGINE_PRECISIONS) == {p for e in registry.TABLE for p in e.builds}
    assert ENGINE_PRECISIONS == ("fp32", "fp16", "bf16", "int8", "int8-dynamic", "int4")


def test_names_and_errors():
    assert registry.choices()[0] == "auto" and set(registry.names()) == {"tensorrt", "compile", "openvino", "onnxruntime"}
    with pytest.raises(InvalidValue, match="allowed: auto, tensorrt"):
        registry.get_backend("onnx")
    with pytest.raises(InvalidValue, match="AccelConfig.backend='onnx'"):
        AccelConfig(backend="onnx")
    if not registry.create("tensorrt").info().usable:
        with pytest.raises(DeviceError, match="cannot run here"):
            registry.get_backend("tensorrt")
    usable = next(n for n in registry.auto_order() if registry.create(n).info().usable)
    assert registry.get_backend("auto").name == usable


def test_auto_is_openvino_on_cpus_and_never_on_cuda(monkeypatch):
    assert registry.auto_order("cpu") == registry.auto_order("mps") == ("openvino", "onnxruntime")
    # OpenVINO engines run on the CPU: a GPU without TensorRT takes the compiled PyTorch backend
    # (tests/test_compile_backend.py), then ONNX Runtime (CUDA provider)
    assert registry.auto_order("cuda:1") == ("tensorrt", "compile", "onnxruntime")
    if not torch.cuda.is_available():
        assert registry.auto_order() == registry.auto_order("cpu")
    if registry.create("openvino").info().usable:  # a regular dependency where it has wheels
        assert registry.get_backend("auto", device="cpu").name == "openvino"
        rows = {row["name"]: row for row in registry.describe()}
        assert rows["openvino"]["auto"] and not rows["onnxruntime"]["auto"]
    # where OpenVINO is missing, auto is ONNX Runtime
    import sd_accel.backends.openvino.builder as ov_builder

    monkeypatch.setattr(ov_builder.OpenVinoBackend, "info", lambda self: ov_builder.BackendInfo(
        "openvino", "", "cpu", False, "openvino is not installed"))
    assert registry.get_backend("auto", device="cpu").name == "onnxruntime"
    rows = {row["name"]: row for row in registry.describe()}
    assert rows["onnxruntime"]["auto"] and rows["openvino"]["install"].startswith("pip install openvino")


def test_a_precision_a_backend_cannot_build_says_what_it_needs(monkeypatch, tiny_sd15, tmp_path):
    import sd_accel.backends.openvino.builder as ov_builder

    ort = registry.create("onnxruntime")
    registry.check_precision(ort, "fp32")  # builds it: no error
    with pytest.raises(InvalidValue, match="fp16 engines come from the tensorrt or compile backend"):
        registry.check_precision(ort, "fp16")
    with pytest.raises(InvalidValue, match="int8-dynamic engines come from the onnxruntime backend"):
        registry.check_precision(registry.create("openvino"), "int8-dynamic")
    # int8 is opt-in, and NNCF with it: without NNCF the message says how to get it
    monkeypatch.setattr(ov_builder, "_has_nncf", lambda: False)
    with pytest.raises(InvalidValue, match=r"needs NNCF.*pip install nncf"):
        registry.check_precision(registry.create("openvino"), "int8")
    if registry.create("openvino").info().usable:  # and build_engines says it before any work
        with pytest.raises(InvalidValue, match="pip install nncf"):
            build_engines(tiny_sd15, profiles=[dict(batch=1, height=64, width=64)], backend="openvino",
                          precision="int8", components=["unet"], engine_dir=tmp_path, progress=False)
        assert not (tmp_path / "onnx").exists()
    monkeypatch.setattr(ov_builder, "has_bf16", lambda: False)
    with pytest.raises(InvalidValue, match="bf16 needs a CPU with AVX512-BF16 or AMX"):
        registry.check_precision(registry.create("openvino"), "bf16")
    assert registry.create("openvino").default_precision() == "fp32"  # int8 only when asked


def test_a_new_backend_is_one_module_and_one_entry(monkeypatch, tmp_path, tiny_sd15):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    extra = registry.BackendEntry("ortcopy", "support.fake_backend", "cpu", "CPUs", "it is in the tests")
    monkeypatch.setattr(registry, "TABLE", (*registry.TABLE, extra))

    rows = {row["name"]: row for row in registry.describe()}
    assert rows["ortcopy"]["usable"] and rows["ortcopy"]["precisions"] == ["fp32"]
    records = build_engines(tiny_sd15, profiles=[dict(batch=1, height=64, width=64)], backend="ortcopy",
                            components=["vae_decoder"], engine_dir=tmp_path, progress=False)
    assert [r.key.backend for r in records] == ["ortcopy"]
    assert EngineCache(tmp_path).find(backend="ortcopy")

    pipe = accelerate(tiny_sd15, AccelConfig(engines=True, backend="ortcopy", engine_dir=str(tmp_path)))
    try:
        pipe("a cat", num_inference_steps=1, height=64, width=64, generator=torch.Generator().manual_seed(0))
        assert stats(pipe)["vae_decoder"]["engine_calls"] == 1
    finally:
        accelerate(pipe, AccelConfig())  # give the session-scoped pipeline its torch modules back

