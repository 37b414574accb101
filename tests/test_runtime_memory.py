"""Torch weights of engine-served modules leave anonymous RAM (a memory-mapped spill file) and
come back, unchanged, for a fallback, an export, a fingerprint, ``unswap`` or ``save_pretrained``."""

from __future__ import annotations

import copy
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, pages, stats
from sd_accel.onnx.fingerprint import cached_fingerprint, clear_fingerprint, fingerprint
from sd_accel.runtime import weights
from sd_accel.runtime.modules import EngineUNet
from sd_accel.runtime.swap import torch_modules, unswap

STATIC = dict(batch=1, height=64, width=64)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """The weights' bytes, which is what parking and mapping must keep."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Outputs within float tolerance: a tensor moved to another address (a file map, a spill
    file) may take another matmul path whose sums round differently in the last bit (seen on an
    AMD EPYC: 1.2e-6 on 96% of the elements), so outputs are never compared at atol=0."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


needs_proc = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RssAnon/RssFile come from /proc (Linux)")


class Big(torch.nn.Module):
    """About 96 MB of fp32 weights, a tied pair and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(2048, 4096)
        self.b = torch.nn.Linear(4096, 2048)
        self.c = torch.nn.Linear(2048, 2048)
        self.tied = torch.nn.Linear(2048, 2048, bias=False)
        self.tied.weight = self.c.weight
        self.register_buffer("scale", torch.arange(7, dtype=torch.float64))

    @torch.no_grad()  # saved tensors of autograd would keep the old weights alive
    def forward(self, x):
        return self.tied(self.c(self.b(self.a(x)))) * self.scale[3].float()


@needs_proc
def test_anonymous_weights_are_spilled_and_compute_the_same(tmp_path):
    torch.manual_seed(0)
    module = Big()
    x = torch.randn(3, 2048)
    ref = module(x)
    reference = copy.deepcopy(module)
    fp = fingerprint(module)
    size_kb = sum(p.numel() * p.element_size() for p in module.parameters()) // 1024
    before = _status_kb("RssAnon")
    spill = weights.park(module, tmp_path, "big")
    assert spill is not None and spill.spilled_bytes >= size_kb * 1024 and spill.mapped_bytes == 0
    assert before - _status_kb("RssAnon") > 0.8 * size_kb  # the anonymous copy is gone
    assert module.c.weight is module.tied.weight  # ties survive
    assert cached_fingerprint(module) == fp  # no rehash needed, same value
    file_before = _status_kb("RssFile")
    _close(module(x), ref)
    assert _status_kb("RssFile") - file_before > 0.8 * size_kb  # a use pages them in (file-backed)
    assert weights.release(module) > 0.8 * size_kb * 1024
    assert _status_kb("RssFile") - file_before < 0.2 * size_kb
    _close(module(x), ref)  # and in again
    _same_weights(module, reference)
    assert fingerprint(module) == fp
    if os.name == "posix":
        assert list((tmp_path / weights.SPILL_DIR).iterdir()) == []  # unlinked once mapped
    assert weights.park(module, tmp_path, "big") is spill  # parking again only pages out


def test_weights_made_in_inference_mode_are_parked_and_still_compute(tmp_path):
    """ComfyUI loads its models under ``torch.inference_mode``: their weights are inference tensors
    (no edit counter, new data only as inference tensors). A real ComfyUI kept its UNet whole in
    RAM beside the engines when parking them failed on that."""
    torch.manual_seed(0)
    with torch.inference_mode():
        module = Big()
    x = torch.randn(3, 2048)
    with torch.inference_mode():
        ref = module(x)
    size_kb = sum(p.numel() * p.element_size() for p in module.parameters()) // 1024
    before = _status_kb("RssAnon")
    spill = weights.park(module, tmp_path, "comfyui-like")
    assert spill is not None and weights.parked(module) is spill
    assert before - _status_kb("RssAnon") > 0.8 * size_kb
    with torch.inference_mode():
        _close(module(x), ref)
    assert weights.park(module, tmp_path, "comfyui-like") is spill


def test_a_parked_module_deep_copies_and_the_copy_owns_its_weights(tmp_path):
    """A once-accelerated pipeline copied for another use (the suite's ``fresh``) failed: a memory map
    cannot be copied. The copy holds its weights in ordinary memory and is not parked."""
    torch.manual_seed(0)
    module = Big()
    reference = copy.deepcopy(module)
    assert weights.park(module, tmp_path, "big") is not None
    twin = copy.deepcopy(module)
    assert weights.parked(twin) is None and weights.parked(module) is not None
    _same_weights(twin, reference)
    twin.a.weight.data.add_(1.0)  # its own memory: the parked module is untouched
    _same_weights(module, reference)


@needs_proc
def test_memory_mapped_weights_stay_in_their_file_and_hashing_leaves_them_out(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(0)
    big = Big()
    save_file({k: v.contiguous() for k, v in big.state_dict().items() if k != "tied.weight"},
              tmp_path / "w.safetensors")
    # what diffusers does when it loads a .safetensors file: tensors memory-mapped from it
    module = Big()
    with safe_open(tmp_path / "w.safetensors", "pt") as fh:
        loaded = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    module.load_state_dict(loaded, strict=False, assign=True)
    module.tied.weight = module.c.weight
    if not weights.FileMaps().holds(module.a.weight.data_ptr(), 4):
        pytest.skip("this safetensors copies tensors instead of mapping them; the spill test covers that case")
    size_kb = sum(p.numel() * p.element_size() for p in module.parameters()) // 1024
    module(torch.randn(1, 2048))  # everything resident: hashing leaves weights in use as they are
    file_before = _status_kb("RssFile")
    assert fingerprint(module) and file_before - _status_kb("RssFile") < 0.2 * size_kb
    weights.release(module)  # not in memory: hashing reads them, and hands them back as it goes
    clear_fingerprint(module)
    file_before = _status_kb("RssFile")
    fp = fingerprint(module)
    assert _status_kb("RssFile") - file_before < 0.2 * size_kb
    weights.release(module)
    clear_fingerprint(module)
    assert fingerprint(module, hand_back=False) == fp  # (what it was before: they stayed)
    assert _status_kb("RssFile") - file_before > 0.8 * size_kb
    spill = weights.park(module, tmp_path, "mapped")
    assert spill.spilled_bytes == 0 and spill.mapped_bytes >= size_kb * 1024 and spill.path is None
    assert not (tmp_path / weights.SPILL_DIR).exists()  # nothing written
    _same_weights(module, big)
    _close(module(torch.ones(1, 2048)), big(torch.ones(1, 2048)))
    assert fingerprint(module) == fp


def _mapped_rss_kb(path: Path) -> int:
    """Resident KB of this process's mappings of the file ``path`` (/proc/self/smaps)."""
    target, total, inside = os.path.realpath(path), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
            inside = len(head) == 6 and head[5] == target
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@needs_proc
def test_release_file_hands_back_the_pages_of_every_mapping_of_a_file(tmp_path):
    """What the OpenVINO build does with the export its converted model memory-maps."""
    import mmap

    data = np.random.default_rng(0).integers(0, 255, 32 << 20, dtype=np.uint8)
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "model.onnx.data").write_bytes(data.tobytes())
    with open(folder / "model.onnx.data", "rb") as fh:
        maps = [mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) for _ in range(2)]
    try:
        views = [np.frombuffer(m, dtype=np.uint8) for m in maps]
        assert all(int(v.sum()) == int(data.sum()) for v in views)  # read: every page resident
        assert _mapped_rss_kb(folder / "model.onnx.data") > 0.8 * 2 * (32 << 10)
        handed = pages.release_file(folder)  # a folder: the files under it
        assert handed >= 0.99 * 2 * (32 << 20)
        assert _mapped_rss_kb(folder / "model.onnx.data") < 0.1 * (32 << 10)
        np.testing.assert_array_equal(views[1], data)  # read again from the file
        assert pages.release_file(tmp_path / "elsewhere") == 0
    finally:
        del views
        for m in maps:
            m.close()


@needs_proc
@pytest.mark.slow
def test_the_pipelines_torch_weights_are_paged_out_while_the_backend_builds(tmp_path, monkeypatch):
    """The backend holds the converted model and its compiled copy; the torch weights beside it
    (4 GB for SD 1.5) are paged out then, and back for the validation against torch."""
    from sd_accel import validate as validate_module
    from sd_accel.backends.onnxruntime import OnnxRuntimeBackend
    from sd_accel.models.builtin import builtin_path

    # A copy of its own: other pipelines of this test session map the builtin's files too, and a
    # page mapped twice is not handed back. Synced: page-outs skip pages not yet on disk.
    folder = Path(shutil.copytree(builtin_path("tiny-sd15"), tmp_path / "model"))
    files = {name: next((folder / name).glob("*.safetensors")) for name in ("unet", "text_encoder")}
    for f in files.values():
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    pipe = load_pipeline(str(folder))
    with torch.no_grad():
        for name in files:
            sum(float(p.sum()) for p in getattr(pipe, name).parameters())  # everything resident
    resident = {name: _mapped_rss_kb(f) for name, f in files.items()}
    assert all(kb > 0.8 * f.stat().st_size / 1024 for (name, kb), f in zip(resident.items(), files.values(),
                                                                          strict=True))
    seen = {}
    real_build, real_validate = OnnxRuntimeBackend.build, validate_module.validate

    def build(self, *args, **kwargs):
        seen["build"] = {name: _mapped_rss_kb(f) for name, f in files.items()}
        return real_build(self, *args, **kwargs)

    def validate(*args, **kwargs):
        result = real_validate(*args, **kwargs)
        seen["validated"] = _mapped_rss_kb(files["unet"])
        return result

    monkeypatch.setattr(OnnxRuntimeBackend, "build", build)
    monkeypatch.setattr(validate_module, "validate", validate)
    (rec,) = build_engines(pipe, profiles=[STATIC], components=["unet"], backend="onnxruntime", precision="fp32",
                           engine_dir=tmp_path / "engines", progress=False)
    for name, kb in seen["build"].items():
        assert kb < 0.1 * resident[name], f"{name}: {kb} KB of {resident[name]} still resident during the build"
    assert seen["validated"] > 0.5 * resident["unet"]  # the torch reference read them back from the file
    assert rec.validation["ok"] and rec.validation["rel_l2"] < 1e-3


def test_edits_after_parking_are_kept_even_when_pages_are_handed_back(tmp_path):
    module = Big()
    weights.park(module, tmp_path, "big")
    with torch.no_grad():
        module.a.weight.add_(1.0)  # copy-on-write: the file stays as it was
    edited = module.a.weight.clone()
    assert weights.parked(module) is None
    weights.release(module)  # page-outs never drop written pages
    torch.testing.assert_close(module.a.weight, edited, rtol=0, atol=0)
    spill = weights.park(module, tmp_path, "big")  # parks again, edit included
    assert spill is not None and weights.parked(module) is spill
    torch.testing.assert_close(module.a.weight, edited, rtol=0, atol=0)


def test_modules_that_cannot_be_parked_say_why(tmp_path, caplog):
    module = Big().to(torch.float16)
    module.a.weight = torch.nn.Parameter(module.a.weight.detach().to("meta"))
    with caplog.at_level(logging.INFO, logger="sd_accel"):
        assert weights.park(module, tmp_path, "odd") is None
    assert any("stay in RAM" in r.getMessage() and "meta" in r.getMessage() for r in caplog.records)


@pytest.fixture(scope="module")
def unet_engines(tmp_path_factory):
    engine_dir = tmp_path_factory.mktemp("engines")
    build_engines(load_pipeline("builtin:tiny-sd15"), profiles=[STATIC], components=["unet"],
                  backend="onnxruntime", engine_dir=engine_dir, progress=False)
    return engine_dir


def _generate(pipe, size=64):
    g = torch.Generator("cpu").manual_seed(0)
    return pipe("a cat", num_inference_steps=2, height=size, width=size, generator=g, output_type="np").images


@pytest.mark.slow
def test_swap_parks_engine_served_modules_and_the_fallback_loads_them_once(unet_engines, caplog):
    pipe = load_pipeline("builtin:tiny-sd15")
    original = copy.deepcopy(pipe.unet.state_dict())
    pipe = accelerate(pipe, AccelConfig(engines=True, engine_dir=str(unet_engines), backend="onnxruntime", precision="fp32",
                                        sampler="Euler"))
    assert isinstance(pipe.unet, EngineUNet)
    spill = weights.parked(pipe.unet.torch_module)
    # diffusers mapped the weights from the model's .safetensors: they stay there, nothing is written
    assert spill is not None and spill.mapped_bytes > 0 and spill.spilled_bytes == 0
    assert weights.parked(pipe.text_encoder) is None  # no engine for it: untouched
    # what diffusers reads every call answers as before
    assert pipe.unet.dtype == torch.float32 and pipe.unet.device.type == "cpu"
    assert pipe.unet.config.in_channels == 4
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        _generate(pipe)  # on the engine
        _generate(pipe, size=72)  # no engine: torch
        _generate(pipe, size=72)
    assert stats(pipe)["unet"]["torch_calls"] == 4
    said = [r.getMessage() for r in caplog.records if "loading the torch UNet for a fallback" in r.getMessage()]
    assert len(said) == 1
    # the torch module holds the real weights for export, fingerprints and saving
    with torch_modules(pipe):
        for name, value in pipe.unet.state_dict().items():
            torch.testing.assert_close(value, original[name], rtol=0, atol=0)
    unswap(pipe)
    assert type(pipe.unet).__name__ == "UNet2DConditionModel"


@pytest.mark.slow
def test_parked_pipeline_images_equal_unparked_ones(unet_engines):
    config = AccelConfig(engines=True, engine_dir=str(unet_engines), backend="onnxruntime", precision="fp32", sampler="Euler")
    parked = load_pipeline("builtin:tiny-sd15")
    parked.unet.to(torch.float64).to(torch.float32)  # same values in anonymous memory (as after a conversion)
    parked = accelerate(parked, config)
    spill = weights.parked(parked.unet.torch_module)
    assert spill.spilled_bytes > 0 and spill.mapped_bytes == 0  # written to the spill file, then mapped
    plain = load_pipeline("builtin:tiny-sd15")
    from sd_accel.backends.registry import get_backend
    from sd_accel.cache.store import EngineCache
    from sd_accel.runtime.swap import swap_engines

    plain = accelerate(plain, precision="fp32", sampler="Euler")
    cache = EngineCache(unet_engines)
    swap_engines(plain, cache, get_backend("onnxruntime", cache_root=cache.root), park_weights=False)
    assert weights.parked(plain.unet.torch_module) is None
    with torch_modules(parked), torch_modules(plain):
        _same_weights(parked.unet, plain.unet)
    for size in (64, 72):  # engine, then torch fallback (the parked weights at another address)
        np.testing.assert_allclose(_generate(parked, size), _generate(plain, size), rtol=0, atol=1e-4)
