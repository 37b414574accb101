"""The tiny autoencoder (TAESD, ``AutoencoderTiny``): loaded from a diffusers folder and from the
single files A1111 / ComfyUI use, swapped in by ``AccelConfig(vae="tiny:PATH")``, and run as
``vae_decoder`` / ``vae_encoder`` engines on each CPU backend, validated against its torch module."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, stats
from sd_accel.core import CheckpointError, InvalidValue
from sd_accel.models.taesd import MissingEncoder, load_tiny_vae

from support.taesd_files import tiny_autoencoder, write_layouts

STATIC = dict(batch=1, height=64, width=64)


@pytest.fixture(scope="session")
def taesd(tmp_path_factory):
    """(the torch AutoencoderTiny, {layout: path})"""
    vae = tiny_autoencoder()
    return vae, write_layouts(vae, tmp_path_factory.mktemp("taesd"))


def _run(pipe, steps: int = 2, **kwargs) -> np.ndarray:
    g = torch.Generator("cpu").manual_seed(0)
    return pipe("a cat", num_inference_steps=steps, height=64, width=64, generator=g, output_type="np",
                **kwargs).images


@pytest.mark.parametrize("layout", ["diffusers", "single", "single-folder", "prefixed"])
def test_every_file_layout_loads_the_same_autoencoder(taesd, layout):
    vae, paths = taesd
    path = paths["single"].parent if layout == "single-folder" else paths[layout]
    got = load_tiny_vae(path)
    z, x = torch.randn(1, 4, 8, 8), torch.rand(1, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        assert torch.allclose(got.decode(z).sample, vae.decode(z).sample, atol=1e-6)
        assert torch.allclose(got.encode(x).latents, vae.encode(x).latents, atol=1e-6)
    assert got.config.scaling_factor == 1.0 and got.config.latent_channels == 4


def test_a_decoder_file_alone_decodes_and_img2img_says_what_is_missing(taesd):
    vae, paths = taesd
    got = load_tiny_vae(paths["decoder_only"])
    assert isinstance(got.encoder, MissingEncoder)
    with pytest.raises(CheckpointError, match="taesd_encoder"):
        got.encode(torch.zeros(1, 3, 64, 64))


def test_foreign_file_and_bad_option_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"conv_in.weight": torch.zeros(4, 3, 3, 3)}, str(tmp_path / "x_decoder.safetensors"))
    with pytest.raises(CheckpointError, match="TAESD"):
        load_tiny_vae(tmp_path / "x_decoder.safetensors")
    with pytest.raises(InvalidValue, match="tiny:PATH"):
        AccelConfig(vae="taesd.safetensors")


def test_accelerate_on_a_tiny_vae_pipeline_runs_decodes_latents_as_they_are_and_swaps_back(taesd):
    """The regression: ``set_attn_processor`` on an AutoencoderTiny crashed accelerate. TAESD's
    scaling_factor is 1.0: the pipeline hands the decoder the final latents unchanged. The config's
    ``vae="tiny:PATH"`` swaps it in, and a config without it puts the model's own VAE back."""
    _, paths = taesd
    pipe = load_pipeline("builtin:tiny-sd15")
    own = pipe.vae
    accelerate(pipe, AccelConfig(vae=f"tiny:{paths['single']}", precision="fp32", attention="sdpa"))
    assert type(pipe.vae).__name__ == "AutoencoderTiny"
    seen = []
    decode = pipe.vae.decode
    pipe.vae.decode = lambda z, *a, **k: (seen.append(z.clone()), decode(z, *a, **k))[1]
    g = torch.Generator("cpu").manual_seed(0)
    latents = pipe("a cat", num_inference_steps=1, height=64, width=64, generator=g, output_type="latent").images
    assert _run(pipe, steps=1).shape == (1, 64, 64, 3)
    assert torch.equal(seen[-1], latents)
    accelerate(pipe, AccelConfig(precision="fp32"))
    assert pipe.vae is own
    pipe.vae = load_tiny_vae(paths["diffusers"])  # set by hand, as diffusers' docs do
    accelerate(pipe, precision="fp32", attention="sdpa")  # crashed with AttributeError before
    assert type(pipe.vae).__name__ == "AutoencoderTiny"


def test_cli_and_serve_flags_map_to_the_config():
    from sd_accel.cli import build_parser
    from sd_accel.serve.cli import config_from_args

    args = build_parser().parse_args(["generate", "--tiny-vae", "/m/taesd_decoder.safetensors"])
    assert args.tiny_vae == "/m/taesd_decoder.safetensors"
    served = config_from_args(build_parser().parse_args(["serve", "--tiny-vae", "/m/taesd_decoder.safetensors"]))
    assert served.accel.vae == "tiny:/m/taesd_decoder.safetensors"


def test_the_built_in_taesd_and_lcm_model_run_the_few_step_recipe_offline():
    """``builtin:taesd`` (TAESD's real architecture, random weights) and ``builtin:tiny-sd15-lcm`` (an
    LCM-distilled UNet: the guidance embedding of released LCM UNets): built once, loaded from the
    cache, and the pair makes an image; the autoencoder is refused as a model, with the way to use it."""
    from diffusers import AutoencoderTiny, LatentConsistencyModelPipeline, LCMScheduler

    tiny = load_tiny_vae("builtin:taesd")
    assert isinstance(tiny, AutoencoderTiny) and tiny.config.scaling_factor == 1.0
    assert sum(p.numel() for p in tiny.decoder.parameters()) > 1_000_000  # TAESD's size, not a toy
    again = load_tiny_vae("builtin:taesd")
    assert all(torch.equal(a, b) for a, b in zip(tiny.state_dict().values(), again.state_dict().values(), strict=True))
    pipe = load_pipeline("builtin:tiny-sd15-lcm")
    assert isinstance(pipe, LatentConsistencyModelPipeline) and isinstance(pipe.scheduler, LCMScheduler)
    assert pipe.unet.config.time_cond_proj_dim == 256
    accelerate(pipe, AccelConfig(precision="fp32", vae="tiny:builtin:taesd"))
    assert isinstance(pipe.vae, AutoencoderTiny)
    image = _run(pipe, steps=2, guidance_scale=8.0)
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()
    with pytest.raises(InvalidValue, match="tiny autoencoder, not a model.*--tiny-vae builtin:taesd"):
        load_pipeline("builtin:taesd")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_tiny_vae_engines_decode_and_encode_like_torch(taesd, tmp_path, backend):
    if backend == "openvino":
        pytest.importorskip("openvino")
    from diffusers import StableDiffusionImg2ImgPipeline

    _, paths = taesd
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), vae=f"tiny:{paths['single']}", precision="fp32")
    ref = _run(pipe, steps=1)
    image = torch.rand(1, 3, 64, 64)
    i2i_ref = _run(StableDiffusionImg2ImgPipeline(**pipe.components), image=image, strength=0.5)
    # fp32 to compare at 1e-3: OpenVINO's default is bf16 where the CPU has it (AVX512-BF16, AMX)
    records = build_engines(pipe, profiles=[STATIC], backend=backend, components=["vae_decoder", "vae_encoder"],
                            precision="fp32", engine_dir=tmp_path, progress=False)
    assert {r.key.component for r in records} == {"vae_decoder", "vae_encoder"}
    assert all(r.validation["ok"] and r.validation["rel_l2"] < 1e-3 for r in records)
    accelerate(pipe, vae=f"tiny:{paths['single']}", precision="fp32", engines=True, backend=backend,
               engine_dir=str(tmp_path))
    assert np.abs(_run(pipe, steps=1) - ref).max() < 1e-3
    i2i = _run(StableDiffusionImg2ImgPipeline(**pipe.components), image=image, strength=0.5)
    assert np.abs(i2i - i2i_ref).max() < 1e-3
    s = stats(pipe)
    assert s["vae_decoder"]["engine_calls"] == 2 and s["vae_encoder"]["engine_calls"] == 1
    assert s["vae_decoder"]["torch_calls"] == 0
