"""LoRA on the transformer families' engines in diffusers (issue 45, LoRA): a LoRA saved the way
diffusers and PEFT share them (``save_lora_weights``), loaded with ``load_lora_weights`` on a
pipeline whose transformer runs on its engine, is applied by ``refit_engines`` (no rebuild), at
any scale, and the image matches torch with the same LoRA; with ``auto=True`` a scale change refits
before the call that needs it. Tiny SD3 and FLUX.1 schnell, random weights (the LoRA too), ONNX
Runtime fp32 engines."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, refit_engines, stats
from sd_accel.profiles import Profile

TEXT = {"builtin:tiny-flux": 512, "builtin:tiny-sd3": 256}  # each pipeline's default max_sequence_length


def _image(pipe) -> np.ndarray:
    return pipe("a cat", height=64, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(1),
                output_type="np").images[0]


@pytest.fixture(scope="module", params=sorted(TEXT))
def family(request, tmp_path_factory):
    """(model, engine folder, LoRA folder): the transformer's engine, and a rank-4 LoRA on its
    attention projections saved as diffusers saves one."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    name = request.param
    root = tmp_path_factory.mktemp("lora")
    pipe = load_pipeline(name)
    build_engines(pipe, profiles=[Profile(batch=1, height=64, width=64, text=TEXT[name])], backend="onnxruntime",
                  precision="fp32", components=["transformer"], engine_dir=root / "engines", progress=False)
    pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for key, param in pipe.transformer.named_parameters():
            if "lora_" in key:  # peft starts B at zero: a LoRA that changes nothing
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    type(pipe).save_lora_weights(root / "lora", transformer_lora_layers=get_peft_model_state_dict(pipe.transformer))
    return name, root / "engines", root / "lora"


def _torch_with_lora(name: str, lora, scale: float) -> np.ndarray:
    pipe = load_pipeline(name)
    pipe.load_lora_weights(lora, adapter_name="style")
    pipe.set_adapters(["style"], [scale])
    return _image(pipe)


@pytest.mark.slow
def test_a_lora_is_refitted_into_the_transformer_engine_at_each_scale(family):
    name, engines, lora = family
    base = _image(load_pipeline(name))
    pipe = accelerate(load_pipeline(name), AccelConfig(engines=True, engine_dir=str(engines), backend="onnxruntime",
                                                       precision="fp32"))
    pipe.load_lora_weights(lora, adapter_name="style")
    done = refit_engines(pipe, progress=False)
    assert list(done) == ["transformer"]
    want = _torch_with_lora(name, lora, 1.0)
    got = _image(pipe)
    effect = np.abs(want - base).max()
    assert effect > 0.01  # the LoRA changes the picture
    assert np.abs(got - want).max() < effect / 20
    # another scale: refitted again from the engine's base weights (never on top of the last refit)
    pipe.set_adapters(["style"], [0.5])
    refit_engines(pipe, progress=False)
    assert np.abs(_image(pipe) - _torch_with_lora(name, lora, 0.5)).max() < 2e-3
    counts = stats(pipe)["transformer"]
    assert counts["engine_calls"] == 4 and counts["torch_calls"] == 0, counts


@pytest.mark.slow
def test_a_scale_change_refits_before_the_call_with_auto(family):
    name, engines, lora = family
    pipe = accelerate(load_pipeline(name), AccelConfig(engines=True, engine_dir=str(engines), backend="onnxruntime",
                                                       precision="fp32"))
    pipe.load_lora_weights(lora, adapter_name="style")
    refit_engines(pipe, progress=False, auto=True)
    pipe.set_adapters(["style"], [0.3])  # no refit_engines call: the next call refits first
    assert np.abs(_image(pipe) - _torch_with_lora(name, lora, 0.3)).max() < 2e-3
    counts = stats(pipe)["transformer"]
    assert counts["engine_calls"] == 2 and counts["torch_calls"] == 0, counts
