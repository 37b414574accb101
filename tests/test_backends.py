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
    assert backend.name == entry.name and backend.torch_device == entry.torch_device
    info = backend.info()
    assert info.name == entry.name
    if info.usable:
        assert info.version and info.arch
        assert backend.default_precision() in backend.precisions()
    else:
        assert info.why_not


def test_names_and_errors():
    assert registry.choices()[0] == "auto" and set(registry.names()) == {"tensorrt", "openvino", "onnxruntime"}
    with pytest.raises(InvalidValue, match="allowed: auto, tensorrt"):
        registry.get_backend("onnx")
    with pytest.raises(InvalidValue, match="AccelConfig.backend='onnx'"):
        AccelConfig(backend="onnx")
    if not registry.create("tensorrt").info().usable:
        with pytest.raises(DeviceError, match="cannot run here"):
            registry.get_backend("tensorrt")
        assert registry.get_backend("auto").name == "onnxruntime"


def test_a_new_backend_is_one_module_and_one_entry(monkeypatch, tmp_path, tiny_sd15):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    extra = registry.BackendEntry("ortcopy", "fake_backend", "cpu", "CPUs", "it is in the tests")
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

