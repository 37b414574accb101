"""The original single-file layout: diffusers' own converters must read back exactly what was written."""

from __future__ import annotations

import types

import diffusers
import pytest
import torch
import transformers
from accelerate import init_empty_weights
from diffusers.loaders import single_file_utils as sfu
from safetensors import safe_open

from sd_accel.models.families import FAMILIES, load_family_configs

from support.ldm_layout import (
    SD1_CLIP_PREFIX,
    SD2_OPEN_CLIP_PREFIX,
    SDXL_CLIP_PREFIX,
    SDXL_OPEN_CLIP_PREFIX,
    UNET_PREFIX,
    VAE_PREFIX,
    save_single_file,
    text_encoder_layout,
    to_original_layout,
)

StateDict = dict[str, torch.Tensor]

# Every key of a file starts with one of its layout's prefixes, and every prefix is used.
LAYOUT_PREFIXES = {
    "sd1": (UNET_PREFIX, VAE_PREFIX, SD1_CLIP_PREFIX + "text_model."),
    "sd2": (UNET_PREFIX, VAE_PREFIX, SD2_OPEN_CLIP_PREFIX),
    "sdxl": (UNET_PREFIX, VAE_PREFIX, SDXL_CLIP_PREFIX + "text_model.", SDXL_OPEN_CLIP_PREFIX),
}


@pytest.fixture(scope="module")
def tiny_sd2(tiny_factory):
    return tiny_factory("sd2-v")


@pytest.fixture(scope="module")
def tiny_sd15_inpaint(tiny_sd15):
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel.from_config({**tiny_sd15.unet.config, "in_channels": 9})
    return diffusers.StableDiffusionInpaintPipeline(
        **{**tiny_sd15.components, "unet": unet.eval()}, requires_safety_checker=False
    )


@pytest.fixture(scope="module")
def tiny_pipes(tiny_sd15, tiny_sd2, tiny_sdxl, tiny_sd15_inpaint) -> dict:
    return {"sd15": tiny_sd15, "sd2-v": tiny_sd2, "sdxl": tiny_sdxl, "sd15-inpaint": tiny_sd15_inpaint}


def _as_model_keys(model: torch.nn.Module, state: StateDict) -> StateDict:
    # As diffusers' from_single_file does: transformers >= 5.6 CLIPTextModel has no text_model wrapper.
    if hasattr(model, "text_model"):
        return state
    return {k.removeprefix("text_model."): v for k, v in state.items()}


def _read_back(ldm: StateDict, pipe) -> dict[str, StateDict]:
    """``ldm`` converted back with diffusers' own single-file converters, per pipeline model."""
    out = {
        "unet": sfu.convert_ldm_unet_checkpoint(ldm, dict(pipe.unet.config)),
        "vae": sfu.convert_ldm_vae_checkpoint(ldm, dict(pipe.vae.config)),
    }
    layout = text_encoder_layout(pipe)
    if layout == "sd2":
        text = sfu.convert_open_clip_checkpoint(pipe.text_encoder, ldm, prefix=SD2_OPEN_CLIP_PREFIX)
        # diffusers skips the file's final resblock by its real SD 2.x index (23); the tiny model's is n.
        extra = f"text_model.encoder.layers.{pipe.text_encoder.config.num_hidden_layers}."
        text = {k: v for k, v in text.items() if not k.startswith(extra)}
    else:
        text = sfu.convert_ldm_clip_checkpoint(ldm)
    out["text_encoder"] = _as_model_keys(pipe.text_encoder, text)
    if layout == "sdxl":
        text_2 = sfu.convert_open_clip_checkpoint(pipe.text_encoder_2, ldm, prefix=SDXL_OPEN_CLIP_PREFIX)
        out["text_encoder_2"] = _as_model_keys(pipe.text_encoder_2, text_2)
    return out


def _assert_same_tensors(got: StateDict, expected: StateDict) -> None:
    assert sorted(got) == sorted(expected)
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


@pytest.mark.parametrize(
    ("name", "layout", "model_type"),
    [
        ("sd15", "sd1", "v1"),
        ("sd2-v", "sd2", "v1"),
        ("sdxl", "sdxl", "v1"),
        ("sd15-inpaint", "sd1", "inpainting"),
    ],
)
def test_diffusers_reads_back_every_weight(tiny_pipes, name, layout, model_type):
    pipe = tiny_pipes[name]
    assert text_encoder_layout(pipe) == layout
    ldm = to_original_layout(pipe)

    prefixes = LAYOUT_PREFIXES[layout]
    assert all(k.startswith(prefixes) for k in ldm)
    assert all(any(k.startswith(p) for k in ldm) for p in prefixes)

    back = _read_back(ldm, pipe)
    for component, state in back.items():
        _assert_same_tensors(state, getattr(pipe, component).state_dict())
    # Tiny widths and depths miss diffusers' v2/xl detection keys (1024-wide attn2.to_k,
    # resblocks.9), so only the inpainting check applies here; real shapes are tested below.
    assert sfu.infer_diffusers_model_type(ldm) == model_type


def test_vae_attention_is_written_as_1x1_conv(tiny_sd15):
    ldm = to_original_layout(tiny_sd15)
    linear = tiny_sd15.vae.decoder.mid_block.attentions[0].to_q.weight
    conv = ldm[VAE_PREFIX + "decoder.mid.attn_1.q.weight"]
    assert conv.shape == (*linear.shape, 1, 1)
    assert torch.equal(conv[:, :, 0, 0], linear)


def test_sd2_file_has_openclip_final_layer_and_projection(tiny_sd2):
    ldm = to_original_layout(tiny_sd2)
    config = tiny_sd2.text_encoder.config
    n = config.num_hidden_layers
    blocks = SD2_OPEN_CLIP_PREFIX + "transformer.resblocks."
    last = {k[len(f"{blocks}{n - 1}.") :]: v for k, v in ldm.items() if k.startswith(f"{blocks}{n - 1}.")}
    extra = {k[len(f"{blocks}{n}.") :]: v for k, v in ldm.items() if k.startswith(f"{blocks}{n}.")}
    assert "attn.in_proj_weight" in last
    _assert_same_tensors(extra, last)
    assert not any(k.startswith(f"{blocks}{n + 1}.") for k in ldm)
    # The width diffusers splits in_proj at; SD 2.x never uses the projection itself.
    assert ldm[SD2_OPEN_CLIP_PREFIX + "text_projection"].shape == (config.hidden_size, config.hidden_size)


def test_sdxl_open_clip_has_no_extra_layer_and_real_projection(tiny_sdxl):
    ldm = to_original_layout(tiny_sdxl)
    encoder = tiny_sdxl.text_encoder_2
    n = encoder.config.num_hidden_layers
    blocks = SDXL_OPEN_CLIP_PREFIX + "transformer.resblocks."
    assert f"{blocks}{n - 1}.attn.in_proj_weight" in ldm
    assert not any(k.startswith(f"{blocks}{n}.") for k in ldm)
    assert torch.equal(ldm[SDXL_OPEN_CLIP_PREFIX + "text_projection"], encoder.text_projection.weight.T)
    assert SDXL_OPEN_CLIP_PREFIX + "positional_embedding" in ldm


def _meta_pipeline(family: str, in_channels: int | None = None) -> types.SimpleNamespace:
    """A family's real-size models with shapes but no data, enough to lay out a real file."""
    configs = load_family_configs(FAMILIES[family])
    unet_config = dict(configs["unet/config.json"])
    if in_channels is not None:
        unet_config["in_channels"] = in_channels
    encoders = {
        "text_encoder": transformers.CLIPTextModel,
        "text_encoder_2": transformers.CLIPTextModelWithProjection,
    }
    with init_empty_weights():
        parts = {
            "unet": diffusers.UNet2DConditionModel.from_config(unet_config),
            "vae": diffusers.AutoencoderKL.from_config(configs["vae/config.json"]),
        }
        for name, cls in encoders.items():
            if f"{name}/config.json" in configs:
                parts[name] = cls(transformers.CLIPTextConfig(**configs[f"{name}/config.json"]))
    return types.SimpleNamespace(**parts)


# Keys and shapes as found in the released single-file checkpoints.
_SD15_KEYS = {
    "model.diffusion_model.input_blocks.3.0.op.weight": (320, 320, 3, 3),
    "model.diffusion_model.middle_block.1.proj_in.weight": (1280, 1280, 1, 1),
    "model.diffusion_model.output_blocks.2.1.conv.weight": (1280, 1280, 3, 3),
    "model.diffusion_model.output_blocks.5.2.conv.weight": (1280, 1280, 3, 3),
    # diffusers' "v1" key: "v1" is also its fallback, so the key itself is checked too.
    sfu.CHECKPOINT_KEY_NAMES["v1"]: (320, 640, 1, 1),
    "first_stage_model.encoder.mid.attn_1.q.weight": (512, 512, 1, 1),
    "first_stage_model.decoder.up.0.block.0.nin_shortcut.weight": (128, 256, 1, 1),
    "cond_stage_model.transformer.text_model.encoder.layers.11.mlp.fc2.weight": (768, 3072),
}
REAL_FILES = {
    "sd15": (None, "v1", {**_SD15_KEYS, "model.diffusion_model.input_blocks.0.0.weight": (320, 4, 3, 3)}),
    "sd15-inpaint": (
        9,
        "inpainting",
        {**_SD15_KEYS, "model.diffusion_model.input_blocks.0.0.weight": (320, 9, 3, 3)},
    ),
    "sd2-v": (
        None,
        "v2",
        {
            "model.diffusion_model.input_blocks.1.1.proj_in.weight": (320, 320),
            "cond_stage_model.model.transformer.resblocks.23.attn.in_proj_weight": (3072, 1024),
            "cond_stage_model.model.positional_embedding": (77, 1024),
            "cond_stage_model.model.token_embedding.weight": (49408, 1024),
            "cond_stage_model.model.text_projection": (1024, 1024),
        },
    ),
    "sdxl": (
        None,
        "xl_base",
        {
            "model.diffusion_model.label_emb.0.0.weight": (1280, 2816),
            "model.diffusion_model.input_blocks.4.1.transformer_blocks.1.attn2.to_k.weight": (640, 2048),
            "model.diffusion_model.input_blocks.7.1.transformer_blocks.9.attn1.to_q.weight": (1280, 1280),
            "model.diffusion_model.output_blocks.2.2.conv.weight": (1280, 1280, 3, 3),
            "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight": (768,),
            "conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_weight": (3840, 1280),
            "conditioner.embedders.1.model.text_projection": (1280, 1280),
        },
    ),
}
# One past the last resblock: SD 2.x files have 24, SDXL's bigG 32.
_NO_SUCH_KEYS = {
    "sd2-v": "cond_stage_model.model.transformer.resblocks.24.ln_1.weight",
    "sdxl": "conditioner.embedders.1.model.transformer.resblocks.32.ln_1.weight",
}


@pytest.mark.parametrize("name", sorted(REAL_FILES))
def test_real_architectures_look_like_released_files(name):
    in_channels, model_type, shapes = REAL_FILES[name]
    pipe = _meta_pipeline(name.removesuffix("-inpaint"), in_channels)
    ldm = to_original_layout(pipe)

    assert sfu.infer_diffusers_model_type(ldm) == model_type
    assert {k: tuple(ldm[k].shape) for k in shapes if k in ldm} == shapes
    assert _NO_SUCH_KEYS.get(name) not in ldm

    unet = sfu.convert_ldm_unet_checkpoint(ldm, dict(pipe.unet.config))
    expected = pipe.unet.state_dict()
    assert {k: v.shape for k, v in unet.items()} == {k: v.shape for k, v in expected.items()}


def test_save_single_file_loads_back_with_from_single_file(tiny_sd15, tmp_path):
    from sd_accel.models.builtin import tiny_configs
    from sd_accel.models.families import materialize

    path = save_single_file(tiny_sd15, tmp_path / "sub" / "tiny-sd15.safetensors")
    assert path == tmp_path / "sub" / "tiny-sd15.safetensors"
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}

    folder = materialize(tiny_configs("sd15"))
    loaded = diffusers.StableDiffusionPipeline.from_single_file(
        str(path), config=str(folder), local_files_only=True
    )
    for component in ("unet", "vae", "text_encoder"):
        _assert_same_tensors(
            getattr(loaded, component).state_dict(), getattr(tiny_sd15, component).state_dict()
        )


def test_save_single_file_casts_to_dtype(tiny_sd15, tmp_path):
    path = save_single_file(tiny_sd15, tmp_path / "half.safetensors", dtype=torch.float16)
    expected = to_original_layout(tiny_sd15)
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        for key in f.keys():
            tensor = f.get_tensor(key)
            assert tensor.dtype == torch.float16
            assert torch.equal(tensor, expected[key].to(torch.float16))
