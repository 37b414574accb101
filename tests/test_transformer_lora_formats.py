"""FLUX.1 LoRAs in the formats people share, on the transformer's engine in diffusers (issue 45,
LoRA): kohya / sd-scripts keys (``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``, fused
qkv, ``alpha``) and XLabs keys (``double_blocks.0.processor.qkv_lora1.down.weight``), written as
those trainers write their files, loaded by ``load_lora_weights`` (diffusers converts the keys)
and applied by ``refit_engines``: the image matches torch with the same file, and differs from the
image without it. Tiny FLUX.1 schnell, random weights (the LoRAs too), ONNX Runtime fp32.

diffusers' kohya converter splits a single block's fused ``linear1`` by FLUX.1's real widths
(3072 x 3 + 12288), so the tiny model's kohya file leaves ``linear1`` out; every other kohya key
(double blocks' fused qkv, projections, MLPs, modulations; single blocks' ``linear2`` and
modulation) is in it. PEFT / diffusers keys: ``test_transformer_lora.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, refit_engines, stats
from sd_accel.profiles import Profile

MODEL = "builtin:tiny-flux"
RANK = 4


def _image(pipe) -> np.ndarray:
    return pipe("a cat", height=64, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(1),
                output_type="np").images[0]


def _kohya(config, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """sd-scripts' FLUX.1 LoRA keys, its fused layers kept fused, alpha = rank / 2."""
    dim = config.num_attention_heads * config.attention_head_dim
    mlp = 4 * dim
    sd: dict[str, torch.Tensor] = {}

    def lora(name: str, out_features: int, in_features: int) -> None:
        sd[f"lora_unet_{name}.lora_down.weight"] = torch.randn(RANK, in_features, generator=gen) * 0.3
        sd[f"lora_unet_{name}.lora_up.weight"] = torch.randn(out_features, RANK, generator=gen) * 0.3
        sd[f"lora_unet_{name}.alpha"] = torch.tensor(RANK / 2)

    for i in range(config.num_layers):
        for stream in ("img", "txt"):
            lora(f"double_blocks_{i}_{stream}_attn_qkv", 3 * dim, dim)
            lora(f"double_blocks_{i}_{stream}_attn_proj", dim, dim)
            lora(f"double_blocks_{i}_{stream}_mlp_0", mlp, dim)
            lora(f"double_blocks_{i}_{stream}_mlp_2", dim, mlp)
            lora(f"double_blocks_{i}_{stream}_mod_lin", 6 * dim, dim)
    for i in range(config.num_single_layers):
        lora(f"single_blocks_{i}_linear2", dim, dim + mlp)
        lora(f"single_blocks_{i}_modulation_lin", 3 * dim, dim)
    return sd


def _xlabs(config, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """XLabs' FLUX.1 LoRA keys: the double blocks' attention, qkv fused, as its trainer saves them."""
    dim = config.num_attention_heads * config.attention_head_dim
    sd: dict[str, torch.Tensor] = {}
    for i in range(config.num_layers):
        for n in ("1", "2"):
            for layer, out_features in (("qkv", 3 * dim), ("proj", dim)):
                key = f"double_blocks.{i}.processor.{layer}_lora{n}"
                sd[f"{key}.down.weight"] = torch.randn(RANK, dim, generator=gen) * 0.3
                sd[f"{key}.up.weight"] = torch.randn(out_features, RANK, generator=gen) * 0.3
    return sd


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-formats")
    build_engines(load_pipeline(MODEL), profiles=[Profile(batch=1, height=64, width=64, text=512)],
                  backend="onnxruntime", precision="fp32", components=["transformer"], engine_dir=root, progress=False)
    return root


@pytest.mark.parametrize("fmt", ["kohya", "xlabs"])
def test_a_shared_flux_lora_file_is_refitted_into_the_engine(engines, tmp_path, fmt):
    config = load_pipeline(MODEL).transformer.config
    state = (_kohya if fmt == "kohya" else _xlabs)(config, torch.Generator().manual_seed(0))
    path = tmp_path / f"{fmt}.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))

    reference = load_pipeline(MODEL)
    base = _image(reference)
    reference.load_lora_weights(str(path), adapter_name="shared")
    expected = _image(reference)
    assert np.abs(expected - base).max() > 1e-2, "the LoRA file changed nothing: the test would prove nothing"

    pipe = accelerate(load_pipeline(MODEL), AccelConfig(engines=True, engine_dir=str(engines), backend="onnxruntime",
                                                        precision="fp32"))
    pipe.load_lora_weights(str(path), adapter_name="shared")
    assert list(refit_engines(pipe, progress=False)) == ["transformer"]
    got = _image(pipe)
    counts = stats(pipe)["transformer"]
    assert counts["engine_calls"] == 2 and counts["torch_calls"] == 0, counts
    assert np.abs(got - expected).max() < 2e-3
