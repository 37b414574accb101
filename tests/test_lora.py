"""LoRAs and changed weights on engines (issue 14): an engine never runs with weights other than
those its torch module holds now. A LoRA loaded, scaled, fused or unloaded, ``load_state_dict``,
a parameter edited or replaced after the swap: the call runs torch, counted with the reason, and
the log says once what to do."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, stats
from sd_accel.runtime import freshness, weights
from sd_accel.runtime.freshness import WeightsSnapshot
from sd_accel.runtime.modules import STALE

peft = pytest.importorskip("peft", reason="peft is not installed (it is in sd-accel[dev]); the LoRA tests need it")

STATIC = dict(batch=1, height=64, width=64)
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


# --------------------------------------------------------------------------- the snapshot alone


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x):
        return self.inner(x) + self.offset


def _lora(module: torch.nn.Module, targets=("inner.0", "inner.2"), name: str = "default"):
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(1)
    return inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=list(targets),
                                              init_lora_weights=False), module, adapter_name=name)


def test_snapshot_sees_each_kind_of_change():
    m = Tiny()
    snap = WeightsSnapshot.take(m)
    assert snap.changed() is None and snap.changed(full=True) is None
    with torch.no_grad():
        m.inner[0].weight.add_(1)  # through torch: the version counter moves
    assert snap.changed() == freshness.EDITED
    m = Tiny()
    snap = WeightsSnapshot.take(m)
    m.load_state_dict(Tiny().state_dict())
    assert snap.changed() == freshness.EDITED
    snap = WeightsSnapshot.take(m)
    m.inner[2].bias = torch.nn.Parameter(torch.ones(4))
    assert snap.changed() == freshness.REPLACED
    snap = WeightsSnapshot.take(m)
    m.inner[0].weight.data = torch.ones(8, 8)  # no version bump: only the full check sees it
    assert snap.changed() is None and snap.changed(full=True) == freshness.EDITED
    snap = WeightsSnapshot.take(m)
    m.inner[0].weight.data += 1  # PEFT's merge: neither pointer nor version moves
    assert snap.changed() is None and snap.changed(full=True) == freshness.VALUES


def test_snapshot_sees_lora_layers_their_scales_and_a_fuse_then_unload():
    m = Tiny()
    snap = WeightsSnapshot.take(m)
    _lora(m)
    assert snap.changed() == freshness.TREE
    with_lora = WeightsSnapshot.take(m)  # as after a refit with the LoRA
    assert with_lora.has_adapters()
    m.inner[0].scaling["default"] *= 0.5
    assert with_lora.changed() == freshness.ADAPTERS
    # fuse, then remove the LoRA layers: the original modules are back, with fused values
    from peft.tuners.tuners_utils import BaseTunerLayer

    m = Tiny()
    snap = WeightsSnapshot.take(m)
    _lora(m)
    for name, layer in list(m.named_modules()):
        if isinstance(layer, BaseTunerLayer):
            layer.merge()
            parent, _, child = name.rpartition(".")
            setattr(m.get_submodule(parent), child, layer.get_base_layer())
    assert snap.changed() is None  # the cheap check cannot see it ...
    assert snap.changed(full=True) == freshness.VALUES  # ... the full one does


def test_parking_is_not_a_change(tmp_path):
    m = Tiny()
    m.to(torch.float64).to(torch.float32)  # anonymous memory: parking spills it and moves the data
    before = WeightsSnapshot.take(m)
    assert weights.park(m, tmp_path, "tiny") is not None
    assert before.changed() is None  # same objects, versions and values ...
    assert before.changed(full=True) == freshness.EDITED  # ... at new addresses: hence the swap retakes it
    after = WeightsSnapshot.take(m)
    weights.release(m)
    m(torch.ones(1, 8))  # a fallback pages the weights in: still no change
    assert after.changed(full=True) is None


# --------------------------------------------------------------------------- on a pipeline


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-engines")
    build_engines(load_pipeline("builtin:tiny-sd15"), profiles=[STATIC], components=["unet", "clip"],
                  backend="onnxruntime", engine_dir=folder, progress=False)
    return folder


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """A LoRA for the tiny SD 1.5's UNet and text encoder, made with peft, saved as diffusers does."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    folder = tmp_path_factory.mktemp("lora")
    src = load_pipeline("builtin:tiny-sd15")
    torch.manual_seed(0)
    src.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=UNET_TARGETS, init_lora_weights=False))
    # transformers' add_adapter wants a newer peft than some machines have; peft's own injection suffices
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=TE_TARGETS, init_lora_weights=False),
                            src.text_encoder)
    StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=get_peft_model_state_dict(src.unet),
                                              text_encoder_lora_layers=get_peft_model_state_dict(src.text_encoder))
    return folder


def _config(engine_dir=None) -> AccelConfig:
    if engine_dir is None:
        return AccelConfig(precision="fp32", sampler="Euler")
    return AccelConfig(engines=True, engine_dir=str(engine_dir), backend="onnxruntime", precision="fp32", sampler="Euler")


def _generate(pipe, **kwargs):
    g = torch.Generator("cpu").manual_seed(0)
    return pipe("a cat", num_inference_steps=2, height=64, width=64, generator=g, output_type="np",
                **kwargs).images


@pytest.fixture(scope="module")
def torch_images(lora_dir):
    """What torch makes: without the LoRA, with it, at scale 0.5, and fused then unloaded."""
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config())
    out = {"base": _generate(pipe)}
    pipe.load_lora_weights(lora_dir, adapter_name="style")
    out["lora"] = _generate(pipe)
    out["half"] = _generate(pipe, cross_attention_kwargs={"scale": 0.5})
    pipe.set_adapters(["style"], [0.25])
    out["quarter"] = _generate(pipe)
    pipe.set_adapters(["style"], [1.0])
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    out["fused"] = _generate(pipe)
    assert np.abs(out["lora"] - out["base"]).max() > 1e-2  # the LoRA makes a difference worth testing
    assert np.abs(out["half"] - out["lora"]).max() > 1e-3
    return out


def _stale_calls(pipe, component: str) -> int:
    return sum(n for reason, n in stats(pipe)[component]["fallbacks"].items() if reason.startswith(STALE))


def _said(caplog, component: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith(f"{component}: running torch") and STALE in r.getMessage()]


@pytest.mark.slow
def test_lora_loaded_after_the_swap_runs_torch_and_says_so_once(engine_dir, lora_dir, torch_images, caplog):
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config(engine_dir))
    np.testing.assert_allclose(_generate(pipe), torch_images["base"], atol=1e-4)
    assert stats(pipe)["unet"]["engine_calls"] == 2 and stats(pipe)["clip"]["engine_calls"] == 2
    pipe.load_lora_weights(lora_dir, adapter_name="style")
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        lora = _generate(pipe)
        _generate(pipe)
    np.testing.assert_allclose(lora, torch_images["lora"], atol=1e-5)  # the LoRA image, not the base one
    s = stats(pipe)
    assert s["unet"]["engine_calls"] == 2 and _stale_calls(pipe, "unet") == 4
    assert s["clip"]["engine_calls"] == 2 and _stale_calls(pipe, "clip") == 4
    for component in ("unet", "clip"):
        said = _said(caplog, component)
        assert len(said) == 1 and "refit_engines(pipe)" in said[0] and "LoRA layers" in said[0]
    # a scale for this call, and set_adapters: torch, with those scales
    np.testing.assert_allclose(_generate(pipe, cross_attention_kwargs={"scale": 0.5}), torch_images["half"],
                               atol=1e-5)
    pipe.set_adapters(["style"], [0.25])
    np.testing.assert_allclose(_generate(pipe), torch_images["quarter"], atol=1e-5)
    # unloaded: the engines fit again
    pipe.unload_lora_weights()
    np.testing.assert_allclose(_generate(pipe), torch_images["base"], atol=1e-4)
    assert stats(pipe)["unet"]["engine_calls"] == 4 and stats(pipe)["clip"]["engine_calls"] == 4


@pytest.mark.slow
def test_fused_then_unloaded_lora_is_seen_and_stays_seen(engine_dir, lora_dir, torch_images):
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config(engine_dir))
    pipe.load_lora_weights(lora_dir, adapter_name="style")
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # the original modules are back, holding base + delta
    np.testing.assert_allclose(_generate(pipe), torch_images["fused"], atol=1e-5)
    np.testing.assert_allclose(_generate(pipe), torch_images["fused"], atol=1e-5)
    assert stats(pipe)["unet"]["engine_calls"] == 0 and _stale_calls(pipe, "unet") == 4
    assert any("values changed" in reason for reason in stats(pipe)["unet"]["fallbacks"])


@pytest.mark.slow
def test_edits_load_state_dict_and_replaced_parameters_run_torch(engine_dir):
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config(engine_dir))
    assert pipe.unet.stale() is None and pipe.text_encoder.stale() is None  # parked, not changed
    reference = accelerate(load_pipeline("builtin:tiny-sd15"), _config())
    original = copy.deepcopy(reference.unet.state_dict())
    with torch.no_grad():  # an in-place edit, through the torch module itself
        pipe.unet.torch_module.conv_in.weight.mul_(1.5)
        reference.unet.conv_in.weight.mul_(1.5)
    np.testing.assert_allclose(_generate(pipe), _generate(reference), atol=1e-5)
    assert any("edited in place" in r for r in stats(pipe)["unet"]["fallbacks"])
    pipe.unet.load_state_dict(original)  # back to the built weights, but edited: still torch
    reference.unet.load_state_dict(original)
    np.testing.assert_allclose(_generate(pipe), _generate(reference), atol=1e-5)
    assert stats(pipe)["unet"]["engine_calls"] == 0
    emb = pipe.text_encoder.torch_module.get_input_embeddings()
    emb.weight = torch.nn.Parameter(emb.weight.detach().clone())
    assert "parameters replaced" in pipe.text_encoder.stale()


# --------------------------------------------------------------------------- refit_engines (14.2)


@pytest.fixture(scope="module")
def lora_b(tmp_path_factory):
    """A second LoRA (UNet only), to check that refits never accumulate."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    folder = tmp_path_factory.mktemp("lora-b")
    src = load_pipeline("builtin:tiny-sd15")
    torch.manual_seed(7)
    src.unet.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=["to_k", "to_v"], init_lora_weights=False))
    StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=get_peft_model_state_dict(src.unet))
    return folder


def test_effective_weights_are_base_plus_each_active_delta_under_the_original_names():
    from sd_accel.onnx.weights import effective_weights

    m = Tiny()
    plain = {k: v.clone() for k, v in m.state_dict().items()}
    _lora(m)
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = m(x)
        got = effective_weights(m)
    assert set(got) == set(plain)  # no lora_A / base_layer names
    twin = Tiny()
    twin.load_state_dict(got)
    torch.testing.assert_close(twin(x), want)
    m.inner[0].scaling["default"] = 0.0  # a scale of 0: the base weight again
    torch.testing.assert_close(effective_weights(m)["inner.0.weight"], plain["inner.0.weight"])


def test_initializer_map_follows_the_exporter_names_and_refuses_a_changed_shape(tmp_path):
    import onnx

    from sd_accel.core import EngineError
    from sd_accel.onnx.weights import initializer_map

    class Wrapper(torch.nn.Module):  # as the export wrappers hold the module
        def __init__(self) -> None:
            super().__init__()
            self.net = Tiny()

        def forward(self, x):
            return self.net(x)

    w = Wrapper().eval()  # 3-D input: Linear exports as MatMul on a transposed, anonymous weight
    path = tmp_path / "tiny.onnx"
    torch.onnx.export(w, (torch.ones(1, 3, 8),), str(path), dynamo=False, do_constant_folding=True)
    model = onnx.load(str(path))
    shapes = {k: tuple(v.shape) for k, v in w.net.state_dict().items()}
    targets = initializer_map(model, shapes)
    assert {t.torch_name for t in targets.values()} == set(shapes)  # every weight found
    assert any(t.transpose for t in targets.values())  # a Linear weight read by MatMul, transposed
    with pytest.raises(EngineError, match="build new engines"):
        initializer_map(model, {**shapes, "inner.0.bias": (9,)})


def test_int8_engines_are_not_refitted_they_need_a_rebuild():
    from types import SimpleNamespace

    from sd_accel.core import InvalidValue
    from sd_accel.refit import refit_engine

    key = SimpleNamespace(precision="int8", name="unet.cpu.int8.static.b1.h64.w64.t77", model="0" * 16)
    handle = SimpleNamespace(record=SimpleNamespace(key=key))
    with pytest.raises(InvalidValue, match="int8 engines cannot be refitted.*rebuild"):
        refit_engine(handle, {}, None, lambda f, m: None)


@pytest.mark.slow
def test_refit_puts_the_lora_on_the_engines_and_never_accumulates(engine_dir, lora_dir, lora_b, torch_images):
    from sd_accel import refit_engines

    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config(engine_dir))
    pipe.load_lora_weights(lora_dir, adapter_name="style")
    events = []
    done = refit_engines(pipe, progress=lambda ev: events.append(ev))
    assert set(done) == {"unet", "clip"} and events and events[-1][1] == 1.0
    np.testing.assert_allclose(_generate(pipe), torch_images["lora"], atol=1e-4)
    s = stats(pipe)
    assert s["unet"]["engine_calls"] == 2 and s["clip"]["engine_calls"] == 2 and _stale_calls(pipe, "unet") == 0
    assert refit_engines(pipe, progress=False) == {}  # nothing changed since
    # a new scale: torch until refitted, then the engine at that scale
    pipe.set_adapters(["style"], [0.25])
    np.testing.assert_allclose(_generate(pipe), torch_images["quarter"], atol=1e-5)
    assert any("scales" in r for r in stats(pipe)["unet"]["fallbacks"])
    refit_engines(pipe, progress=False)
    np.testing.assert_allclose(_generate(pipe), torch_images["quarter"], atol=1e-4)
    assert stats(pipe)["unet"]["engine_calls"] == 4
    # A at full scale, then B, then A again: A's image, not a blend
    pipe.set_adapters(["style"], [1.0])
    refit_engines(pipe, progress=False)
    first_a = _generate(pipe)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(lora_b, adapter_name="b")
    refit_engines(pipe, progress=False)
    b = _generate(pipe)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(lora_dir, adapter_name="style")
    refit_engines(pipe, progress=False)
    again_a = _generate(pipe)
    np.testing.assert_allclose(again_a, first_a, atol=1e-5)
    np.testing.assert_allclose(again_a, torch_images["lora"], atol=1e-4)
    assert np.abs(b - first_a).max() > 1e-2
    assert _stale_calls(pipe, "unet") == 2  # only the call before the scale's refit
    # the base engines stay in the cache, untouched; the refits live in scratch folders
    fresh = accelerate(load_pipeline("builtin:tiny-sd15"), _config(engine_dir))
    np.testing.assert_allclose(_generate(fresh), torch_images["base"], atol=1e-4)
    scratch = list((engine_dir / ".refit").iterdir())
    assert scratch  # this pipeline's refits
    for module in (pipe.unet, pipe.text_encoder):
        for engines in module.engines.values():
            engines.close()
    assert not any((engine_dir / ".refit").iterdir())  # closed: scratch gone ...
    pipe.unet.remember_weights()
    _generate(pipe)  # ... and never the base engine in its place
    assert stats(pipe)["unet"]["engine_calls"] == 10 and any(
        "no usable engine" in r for r in stats(pipe)["unet"]["fallbacks"])
    assert set(refit_engines(pipe, progress=False)) == {"unet", "clip"}  # refitted again
    np.testing.assert_allclose(_generate(pipe), torch_images["lora"], atol=1e-4)
    assert stats(pipe)["unet"]["engine_calls"] == 12


@pytest.mark.slow
def test_refit_of_fused_weights_and_load_state_dict(engine_dir, lora_dir, torch_images):
    from sd_accel import refit_engines

    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config(engine_dir))
    pipe.load_lora_weights(lora_dir, adapter_name="style")
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    refit_engines(pipe, progress=False)
    np.testing.assert_allclose(_generate(pipe), torch_images["fused"], atol=1e-4)
    assert stats(pipe)["unet"]["engine_calls"] == 2


@pytest.fixture(scope="module")
def openvino_engines(tmp_path_factory):
    pytest.importorskip("openvino", reason="OpenVINO is not installed (pip install 'sd-accel[openvino]')")
    from sd_accel.backends.openvino.builder import has_bf16

    folder = tmp_path_factory.mktemp("lora-ov-engines")
    precisions = ["fp32"] + (["bf16"] if has_bf16() else [])
    for precision in precisions:
        build_engines(load_pipeline("builtin:tiny-sd15"), profiles=[STATIC], components=["unet"],
                      backend="openvino", precision=precision, engine_dir=folder, progress=False)
    return folder, precisions


@pytest.mark.slow
@pytest.mark.parametrize("where", ["memory", "copy"])
def test_refit_on_openvino_engines_fp32_and_bf16(openvino_engines, lora_dir, torch_images, where, monkeypatch):
    """The fast refit: the engine's graph compiled with its changed weights replaced in memory (no
    copy of engine.bin on disk), or, for an engine that kept no graph, the new weights written into
    a copy of engine.bin; nothing converted again either way."""
    from sd_accel import refit_engines
    from sd_accel.backends.openvino.builder import OpenVinoBackend

    if where == "copy":  # what an engine built before its graph was kept gets
        monkeypatch.setattr(OpenVinoBackend, "refit_runner", lambda *a, **k: None)
    folder, precisions = openvino_engines
    for precision in precisions:
        pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config(folder), backend="openvino",
                          engine_precision=precision)
        pipe.load_lora_weights(lora_dir, adapter_name="style")
        events = []
        done = refit_engines(pipe, progress=events.append)
        assert len(done["unet"]) == len(precisions)  # every engine of the UNet, validated
        said = [message for _, _, message in events]
        assert not [m for m in said if "converting" in m or "exported graph" in m], said
        copies = [p for p in (Path(folder) / ".refit").glob("p*/**/engine.bin")]
        if where == "memory":
            assert "writing the current weights into a copy of the engine" not in said, said
            assert copies == [], copies
        else:
            assert "writing the current weights into a copy of the engine" in said, said
            assert copies, "no patched copy of engine.bin was written"
        got = _generate(pipe)
        used = stats(pipe)["unet"]["engines_used"]
        assert stats(pipe)["unet"]["engine_calls"] == 2 and all(f".{precision}." in n for n in used)
        to_lora, to_base = np.abs(got - torch_images["lora"]).max(), np.abs(got - torch_images["base"]).max()
        if precision == "fp32":
            assert to_lora < 1e-3, to_lora
        else:  # bf16 on random tiny weights is far off torch: check that the LoRA is in, not the error
            assert to_lora < to_base / 2, (to_lora, to_base)


@pytest.mark.slow
def test_openvino_refit_of_a_folded_weight_compiles_again(openvino_engines, torch_images):
    """A norm scale is folded into the compiled engine, so writing it into engine.bin would change
    nothing: the refit sees the digest differ and converts and compiles instead, and the result
    matches torch with the same edit."""
    from sd_accel import refit_engines

    folder, _ = openvino_engines
    reference = load_pipeline("builtin:tiny-sd15")
    with torch.no_grad():
        reference.unet.conv_norm_out.weight.mul_(1.5)
    want = _generate(accelerate(reference, _config()))
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config(folder), backend="openvino",
                      engine_precision="fp32")
    with torch.no_grad():
        pipe.unet.conv_norm_out.weight.mul_(1.5)
    events = []
    refit_engines(pipe, progress=events.append)
    said = [message for _, _, message in events]
    assert "writing the current weights into the exported graph" in said and any("compiling" in m for m in said)
    got = _generate(pipe)
    assert stats(pipe)["unet"]["engine_calls"] == 2
    assert np.abs(got - want).max() < 1e-3


def test_openvino_weight_map_places_every_linear_and_conv_weight(openvino_engines):
    import json

    import onnx

    from sd_accel.backends.openvino.weight_map import MAP_FILE, patch
    from sd_accel.cache.store import EngineCache

    folder, _ = openvino_engines
    record = next(r for r in EngineCache(folder).list() if r.key.precision == "fp32")
    assert MAP_FILE in record.files
    table = json.loads((folder / record.name / MAP_FILE).read_text())
    (export,) = [p for p in (folder / "onnx").iterdir() if p.is_dir()]
    graph = onnx.load(str(export / "model.onnx"), load_external_data=False).graph
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.op_type)
    # the export keeps its graph only: its weights are graph inputs now, with their shapes
    dims = {i.name: len(i.type.tensor_type.shape.dim) for i in graph.input}
    dims.update({i.name: len(i.dims) for i in graph.initializer})
    linear_and_conv = {name for name, n in dims.items() if n in (2, 4) and readers.get(name) in
                       (["MatMul"], ["Conv"], ["Gemm"])}
    assert len(linear_and_conv) >= 50 and set(table["placed"]) == linear_and_conv
    assert not set(table["digests"]) & linear_and_conv
    # a value outside the map that changed (here: every one): the engine cannot take it by a patch
    assert patch(folder / record.name, record.files, lambda n: np.zeros(1, np.float32), folder / "x",
                 "engine.bin") is None
    assert not (folder / "x").exists()


def _patched_bin(folder, record, module, out, counts):
    """engine.bin of the engine ``record`` patched to ``module``'s current weights, as refit does."""
    from sd_accel.backends.openvino.weight_map import patch
    from sd_accel.onnx.weights import effective_weights, onnx_values

    (export,) = [p for p in (folder / "onnx").iterdir() if p.is_dir()]
    files = patch(folder / record.name, record.files, onnx_values(export, effective_weights(module)), out,
                  "engine.bin", counts)
    assert files == list(record.files)
    return (out / "engine.bin").read_bytes()


@pytest.mark.slow
def test_openvino_patch_writes_only_the_changed_weights_and_a_then_b_then_a_gives_a(
        openvino_engines, lora_dir, lora_b, tmp_path):
    import json

    from sd_accel.backends.openvino.weight_map import MAP_FILE
    from sd_accel.cache.store import EngineCache
    from sd_accel.onnx.weights import slim_weights

    folder, precisions = openvino_engines
    (export,) = [p for p in (folder / "onnx").iterdir() if p.is_dir()]
    torch_name = {w.onnx_name: w.torch_name for w in slim_weights(export)}
    for precision in precisions:  # fp32 storage, and bf16's fp16 storage
        record = next(r for r in EngineCache(folder).list() if r.key.precision == precision)
        placed = json.loads((folder / record.name / MAP_FILE).read_text())["placed"]
        base = (folder / record.name / "engine.bin").read_bytes()

        def lora_weights(targets, placed=placed):
            return sum(1 for n in placed if torch_name[n].endswith(tuple(f"{t}.weight" for t in targets)))

        pipe = load_pipeline("builtin:tiny-sd15")
        counts: dict = {}
        assert _patched_bin(folder, record, pipe.unet, tmp_path / f"{precision}-base", counts) == base
        assert counts == {"written": 0, "same": len(placed), "bytes_written": 0}  # the base: nothing written
        pipe.load_lora_weights(lora_dir, adapter_name="a")
        a = _patched_bin(folder, record, pipe.unet, tmp_path / f"{precision}-a", counts)
        assert 0 < counts["written"] == lora_weights(UNET_TARGETS) < len(placed) / 2, counts
        assert a != base
        pipe.unload_lora_weights()
        pipe.load_lora_weights(lora_b, adapter_name="b")
        b = _patched_bin(folder, record, pipe.unet, tmp_path / f"{precision}-b", counts)
        assert counts["written"] == lora_weights(["to_k", "to_v"]) and b not in (a, base)
        pipe.unload_lora_weights()
        pipe.load_lora_weights(lora_dir, adapter_name="a")
        # A again, after B: A's engine to the byte (each patch starts from the base engine)
        assert _patched_bin(folder, record, pipe.unet, tmp_path / f"{precision}-a2", counts) == a
        # an edit through .data (no version counter moves) is seen: one weight written
        pipe.unload_lora_weights()
        with torch.no_grad():
            pipe.unet.conv_in.weight.data[0, 0, 0, 0] += 1.0
        _patched_bin(folder, record, pipe.unet, tmp_path / f"{precision}-edit", counts)
        assert counts["written"] == 1, counts


class _ItemRunner:
    """Stands in for an engine: the torch module, with batch items of its outputs off by a
    relative ``off[item]``."""

    def __init__(self, spec, off=None) -> None:
        self.spec, self.off, self.batches = spec, off or {}, []

    def infer(self, feed):
        self.batches.append(next(iter(feed.values())).shape[0])
        with torch.no_grad():
            out = self.spec.export_module()(*feed.values())
        out = [o.clone() for o in (out if isinstance(out, tuple) else (out,))]
        for o in out:
            for i, f in self.off.items():
                o[i] *= 1 + f
        return dict(zip([t.name for t in self.spec.outputs()], out, strict=True))


def test_validation_of_one_item_at_opt_runs_the_full_batch_and_compares_the_first_item(monkeypatch):
    import sd_accel.validate as validation
    from sd_accel.components import specs_for
    from sd_accel.profiles import Profile

    computed = []
    real = validation.reference
    monkeypatch.setattr(validation, "reference", lambda module, feed, items=None, start=0, **kw: computed.append(
        (items, start)) or real(module, feed, items, start, **kw))
    validate = validation.validate
    spec = specs_for(load_pipeline("builtin:tiny-sd15"))["unet"]
    profile = Profile(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96))
    runner = _ItemRunner(spec)
    result = validate(spec, runner, profile, "fp32", items=1, points=("opt",))
    assert result.ok and result.points == ["opt"] and runner.batches == [2]  # no max point; batch 2 (guidance)
    assert computed == [(1, 0)]  # torch computed item 0 only
    assert validate(spec, _ItemRunner(spec, {1: 0.5}), profile, "fp32", items=1, points=("opt",)).ok
    computed.clear()
    assert not validate(spec, _ItemRunner(spec, {0: 0.5}), profile, "fp32", items=1, points=("opt",)).ok
    assert computed == [(1, 0), (None, 1)]  # off: judged on every item before refusing
    # an item a little above the tolerance, the batch within it (one item's precision error varies,
    # the tolerance is for the batch): accepted, as the full check accepts it
    computed.clear()
    assert validate(spec, _ItemRunner(spec, {0: 1.2e-3}), profile, "fp32", items=1, points=("opt",)).ok
    assert computed == [(1, 0), (None, 1)]
    # an item as close to torch as the base engine's same item was (its record: the baseline) passes
    # without the rest of the batch; further off than that, the batch is judged
    computed.clear()
    base = {"item_rel": {"opt": [1.9e-3, 1e-4]}}
    assert validate(spec, _ItemRunner(spec, {0: 2e-3}), profile, "fp32", items=1, points=("opt",), baseline=base).ok
    assert computed == [(1, 0)]
    result = validate(spec, _ItemRunner(spec, {0: 3e-3}), profile, "fp32", items=1, points=("opt",), baseline=base)
    assert not result.ok and computed[1:] == [(1, 0), (None, 1)] and "at opt exceeds" in result.why
    full = validate(spec, runner, profile, "fp32")  # the default: every item, every point
    assert set(full.item_rel) == {"opt", "max"} and len(full.item_rel["opt"]) == 2  # what a copy is held to
    assert full.points == ["opt", "max"] and not validate(spec, _ItemRunner(spec, {1: 0.5}), profile, "fp32").ok
    with pytest.raises(ValueError, match="none of the points"):
        validate(spec, runner, Profile(batch=1, height=64, width=64), "fp32", points=("max",))


@pytest.mark.slow
def test_openvino_fast_refit_checks_one_item_and_a_wrong_weight_sends_it_the_full_way(
        openvino_engines, lora_dir, torch_images, monkeypatch, caplog):
    """The written-weights refit is validated on one batch item at the opt shape; a weight
    written wrong (here on purpose: one LoRA layer's weight off by half) fails that check, and the
    refit goes the full way (convert + compile) and matches torch + LoRA."""
    import sd_accel.validate as validation
    from sd_accel import refit_engines
    from sd_accel.onnx import weights as onnx_weights
    from sd_accel.onnx.weights import slim_weights

    folder, _ = openvino_engines
    (export,) = [p for p in (folder / "onnx").iterdir() if p.is_dir()]
    victim = next(w.onnx_name for w in slim_weights(export) if w.torch_name.endswith("to_out.0.weight"))
    real_values, real_validate = onnx_weights.onnx_values, validation.validate
    checks = []

    def wrong_values(*args, **kwargs):
        value = real_values(*args, **kwargs)
        return lambda name: value(name) * 1.5 if name == victim else value(name)

    def spy(*args, **kwargs):
        result = real_validate(*args, **kwargs)
        if args[3] == "fp32":  # (spec, runner, profile, precision): bf16's tolerance may let this one pass
            checks.append((kwargs.get("items"), kwargs.get("points"), result.ok))
        return result

    monkeypatch.setattr(onnx_weights, "onnx_values", wrong_values)
    monkeypatch.setattr(validation, "validate", spy)
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config(folder), backend="openvino",
                      engine_precision="fp32")
    pipe.load_lora_weights(lora_dir, adapter_name="style")
    events = []
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        refit_engines(pipe, progress=events.append)
    said = [message for _, _, message in events]
    assert checks == [(1, ("opt",), False), (None, None, True)], checks  # fast: one item, failed; full: all
    assert "writing the current weights into the exported graph" in said and any("compiling" in m for m in said)
    assert any("disagrees with torch" in r.getMessage() for r in caplog.records)
    got = _generate(pipe)
    assert stats(pipe)["unet"]["engine_calls"] == 2
    assert np.abs(got - torch_images["lora"]).max() < 1e-3


def test_openvino_fast_refit_with_validate_false_runs_no_check_and_says_so(
        openvino_engines, lora_dir, torch_images, monkeypatch, caplog):
    """``validate=False`` is the caller's to give for the written-weights refit as for the full one:
    no torch reference is computed, the log says the engine was not validated, and the weights are
    the LoRA's all the same."""
    import sd_accel.validate as validation
    from sd_accel import refit_engines

    folder, _ = openvino_engines
    checks = []
    real_validate = validation.validate
    monkeypatch.setattr(validation, "validate", lambda *a, **k: checks.append(a[3]) or real_validate(*a, **k))
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config(folder), backend="openvino",
                      engine_precision="fp32")
    pipe.load_lora_weights(lora_dir, adapter_name="style")
    events = []
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        refit_engines(pipe, progress=events.append, validate=False)
    said = [message for _, _, message in events]
    assert checks == []
    assert "compiling the engine with the current weights" in said  # the fast path, in memory
    assert not any("exported graph" in m or "converting" in m for m in said)  # not a rebuild
    assert any("not validated (validate=False)" in r.getMessage() for r in caplog.records)
    got = _generate(pipe)
    assert stats(pipe)["unet"]["engine_calls"] == 2 and stats(pipe)["unet"]["torch_calls"] == 0
    assert np.abs(got - torch_images["lora"]).max() < 1e-3


# --------------------------------------------------------------------------- LoRA scales (14.3)


@pytest.mark.slow
def test_auto_refit_serves_lora_scales_on_engines_and_keeps_recent_refits(engine_dir, lora_dir, torch_images,
                                                                         monkeypatch):
    from sd_accel import refit, refit_engines

    made = []
    real = refit.refit_engine
    monkeypatch.setattr(refit, "refit_engine", lambda handle, *a, **k: made.append(handle.name) or real(handle, *a, **k))
    monkeypatch.setattr(refit, "KEEP_REFITS", 4)  # one by default (tests/test_refit_memory.py)
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config(engine_dir))
    pipe.load_lora_weights(lora_dir, adapter_name="style")
    refit_engines(pipe, progress=False, auto=True)
    assert len(made) == 2  # the UNet's and the text encoder's engine
    # a scale for this call: the UNet (scaled by the stand-in) and the text encoder (scaled by the
    # pipeline) run on engines refitted at that scale
    np.testing.assert_allclose(_generate(pipe, cross_attention_kwargs={"scale": 0.5}), torch_images["half"],
                               atol=1e-4)
    assert len(made) == 4 and _stale_calls(pipe, "unet") == 0 and stats(pipe)["unet"]["engine_calls"] == 2
    assert stats(pipe)["unet"]["torch_calls"] == 0 and stats(pipe)["clip"]["torch_calls"] == 0
    np.testing.assert_allclose(_generate(pipe, cross_attention_kwargs={"scale": 0.5}), torch_images["half"],
                               atol=1e-4)
    assert len(made) == 4  # the same scale again: the refits stay
    pipe.set_adapters(["style"], [0.25])
    np.testing.assert_allclose(_generate(pipe), torch_images["quarter"], atol=1e-4)
    assert len(made) == 6
    pipe.set_adapters(["style"], [1.0])
    np.testing.assert_allclose(_generate(pipe), torch_images["lora"], atol=1e-4)
    assert len(made) == 6  # scale 1 was refitted first: kept, switched back without a refit
    assert stats(pipe)["unet"]["torch_calls"] == 0 and stats(pipe)["unet"]["engine_calls"] == 8


@pytest.mark.slow
def test_a_scale_without_lora_layers_runs_on_the_engine_and_with_them_says_how(engine_dir, lora_dir, torch_images):
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config(engine_dir))
    np.testing.assert_allclose(_generate(pipe, cross_attention_kwargs={"scale": 0.5}), torch_images["base"],
                               atol=1e-4)
    assert stats(pipe)["unet"]["engine_calls"] == 2  # no LoRA: the scale changes nothing
    from sd_accel import refit_engines

    # a new pipeline: diffusers loads a LoRA into the text encoder at the scale of the last call
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), _config(engine_dir))
    pipe.load_lora_weights(lora_dir, adapter_name="style")
    refit_engines(pipe, progress=False)
    np.testing.assert_allclose(_generate(pipe, cross_attention_kwargs={"scale": 0.5}), torch_images["half"],
                               atol=1e-5)
    assert any("auto=True" in r for r in stats(pipe)["unet"]["fallbacks"])
