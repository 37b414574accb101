"""LoRAs and changed weights on engines (issue 14): an engine never runs with weights other than
those its torch module holds now. A LoRA loaded, scaled, fused or unloaded, ``load_state_dict``,
a parameter edited or replaced after the swap: the call runs torch, counted with the reason, and
the log says once what to do."""

from __future__ import annotations

import copy
import logging

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
    return AccelConfig(engines=True, engine_dir=str(engine_dir), precision="fp32", sampler="Euler")


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
