"""tests/support/transformer_layout.py writes SD3 / FLUX.1 single files in their original layouts: diffusers'
own single-file loaders (and transformers, for the separate text-encoder files) must read back exactly the
tensors the tiny models hold, byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel, StableDiffusion3Pipeline
from diffusers.loaders import single_file_utils as sfu
from safetensors import safe_open

from sd_accel.models.builtin import build_tiny_pipeline, tiny_configs
from sd_accel.models.families import materialize

from support.transformer_layout import (
    DIFFUSION_MODEL_PREFIX,
    SD3_CLIP_G_PREFIX,
    SD3_CLIP_L_PREFIX,
    SD3_T5_PREFIX,
    clip_state_dict,
    flux_transformer_state_dict,
    save,
    sd3_state_dict,
    t5_state_dict,
    vae_state_dict,
)

StateDict = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def tiny():
    """``tiny(family)`` -> ``(pipeline, config folder)``, each made once for the module."""
    made: dict[str, tuple] = {}

    def get(family: str):
        if family not in made:
            made[family] = build_tiny_pipeline(family), materialize(tiny_configs(family))
        return made[family]

    return get


def file_tensors(path: Path) -> StateDict:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_same_weights(expected: torch.nn.Module, actual: torch.nn.Module, cast: torch.dtype | None = None,
                        skip: tuple[str, ...] = ()) -> None:
    """Every parameter and buffer of ``actual`` equals ``expected``'s (after ``cast`` and back to fp32)."""
    want, got = expected.state_dict(), actual.state_dict()
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        if key in skip:
            continue
        if cast is not None:
            tensor = tensor.to(cast).to(torch.float32)
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key


def roots(state: StateDict, prefix: str = "") -> set[str]:
    return {k.removeprefix(prefix).split(".")[0] for k in state}


# -- FLUX.1 -----------------------------------------------------------------------------------

# diffusers' converter splits `single_blocks.*.linear1` at FLUX.1's own widths: `inner_dim = 3072` and
# `mlp_ratio = 4.0` are constants in `convert_flux_transformer_checkpoint_to_diffusers`, not read from the
# checkpoint or the config, so no narrower FLUX (the tiny models included) can be read by it as it is.
FLUX1_LINEAR1_SPLIT = (3072, 3072, 3072, 12288)


class _TorchAtWidth:
    """``torch`` as diffusers' single-file module sees it, where a split at FLUX.1's widths is taken at the
    tiny model's (q, k, v, then the MLP's input projection): everything else in the converter runs as is."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        block = transformer.single_transformer_blocks[0]
        inner, mlp = block.attn.to_q.out_features, block.proj_mlp.out_features
        self.sizes = (inner, inner, inner, mlp)

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def split(self, tensor: torch.Tensor, sizes, dim: int = 0):
        if isinstance(sizes, (tuple, list)) and tuple(sizes) == FLUX1_LINEAR1_SPLIT:
            sizes = self.sizes
        return torch.split(tensor, sizes, dim=dim)


def test_diffusers_reads_flux_files_only_at_flux1_width(tiny, tmp_path):
    """What the converter cannot do (see FLUX1_LINEAR1_SPLIT); the read-back tests below work around it."""
    pipe, folder = tiny("flux-dev")
    path = save(flux_transformer_state_dict(pipe.transformer), tmp_path / "flux1-dev.safetensors")
    with pytest.raises(RuntimeError, match="split_with_sizes"):
        FluxTransformer2DModel.from_single_file(str(path), config=str(folder), subfolder="transformer",
                                                local_files_only=True)


@pytest.mark.parametrize("prefix", ["", DIFFUSION_MODEL_PREFIX], ids=["bfl", "comfyui"])
@pytest.mark.parametrize("family", ["flux-dev", "flux-schnell"])
def test_flux_transformer_file_reads_back(tiny, tmp_path, monkeypatch, family, prefix):
    pipe, folder = tiny(family)
    model = pipe.transformer
    state = flux_transformer_state_dict(model, prefix=prefix)
    assert all(k.startswith(prefix) for k in state)
    expected_roots = {"time_in", "vector_in", "img_in", "txt_in", "double_blocks", "single_blocks", "final_layer"}
    assert roots(state, prefix) == expected_roots | ({"guidance_in"} if family == "flux-dev" else set())
    inner = model.transformer_blocks[0].attn.to_q.out_features
    mlp = model.single_transformer_blocks[0].proj_mlp.out_features
    assert state[f"{prefix}double_blocks.0.img_attn.qkv.weight"].shape[0] == 3 * inner
    assert state[f"{prefix}single_blocks.0.linear1.weight"].shape[0] == 3 * inner + mlp
    assert f"{prefix}double_blocks.0.txt_attn.norm.key_norm.scale" in state
    # the (shift, scale) halves: the original's first half is diffusers' second
    final = state[f"{prefix}final_layer.adaLN_modulation.1.weight"]
    assert torch.equal(final[: final.shape[0] // 2], model.norm_out.linear.weight[final.shape[0] // 2 :])

    path = save(state, tmp_path / "flux.safetensors")
    assert sfu.infer_diffusers_model_type(file_tensors(path)) == family  # guidance_in tells dev from schnell
    monkeypatch.setattr(sfu, "torch", _TorchAtWidth(model))
    loaded = FluxTransformer2DModel.from_single_file(str(path), config=str(folder), subfolder="transformer",
                                                     local_files_only=True)
    assert_same_weights(model, loaded)


def test_flux_ae_file_reads_back(tiny, tmp_path):
    pipe, folder = tiny("flux-dev")
    state = vae_state_dict(pipe.vae)
    assert roots(state) == {"encoder", "decoder"}  # no prefix, no quant convs (ae.safetensors)
    assert state["encoder.mid.attn_1.q.weight"].ndim == 4  # 1x1 convolutions in the original
    assert "encoder.down.0.block.0.norm1.weight" in state and "decoder.up.0.block.0.conv1.weight" in state
    path = save(state, tmp_path / "ae.safetensors")
    loaded = AutoencoderKL.from_single_file(str(path), config=str(folder), subfolder="vae", local_files_only=True)
    assert_same_weights(pipe.vae, loaded)


# -- SD3 / SD3.5 ------------------------------------------------------------------------------


def test_sd3_file_without_text_encoders_reads_back(tiny, tmp_path):
    pipe, folder = tiny("sd3")
    state = sd3_state_dict(pipe, with_text_encoders=False)
    assert {k.split(".")[0] for k in state} == {"model", "first_stage_model"}
    mmdit = {k.removeprefix(DIFFUSION_MODEL_PREFIX) for k in state if k.startswith(DIFFUSION_MODEL_PREFIX)}
    assert roots(dict.fromkeys(mmdit)) == {"pos_embed", "x_embedder", "t_embedder", "y_embedder",
                                            "context_embedder", "joint_blocks", "final_layer"}
    # the tiny model has SD3.5's qk-norm and one dual-attention layer (block 0)
    assert {"joint_blocks.0.x_block.attn2.qkv.weight", "joint_blocks.0.x_block.attn2.ln_q.weight",
            "joint_blocks.0.context_block.attn.ln_k.weight", "joint_blocks.0.context_block.mlp.fc2.bias"} <= mmdit
    last = len(pipe.transformer.transformer_blocks) - 1  # its context stream is pre-only
    assert not any(k.startswith((f"joint_blocks.{last}.context_block.mlp", f"joint_blocks.{last}.context_block.attn.proj"))
                   for k in mmdit)
    assert not any(".attn2." in k for k in mmdit if k.startswith(f"joint_blocks.{last}."))

    path = save(state, tmp_path / "sd3.5_medium.safetensors")
    # diffusers tells SD3 files by their real widths (adaLN 9216 = 6 x 1536, the position table), so a tiny
    # file is no "sd3" to its guesser: a loader has to pass the config (as here) or tell the family itself.
    assert sfu.infer_diffusers_model_type(file_tensors(path)) not in {"sd3", "sd35_medium", "sd35_large"}
    transformer = SD3Transformer2DModel.from_single_file(str(path), config=str(folder), subfolder="transformer",
                                                         local_files_only=True)
    assert_same_weights(pipe.transformer, transformer)
    vae = AutoencoderKL.from_single_file(str(path), config=str(folder), subfolder="vae", local_files_only=True)
    assert_same_weights(pipe.vae, vae)


@pytest.mark.parametrize("embed_tokens", [False, True], ids=["stripped-t5", "unstripped-t5"])
def test_sd3_file_with_text_encoders_reads_back(tiny, tmp_path, embed_tokens):
    pipe, folder = tiny("sd3")
    state = sd3_state_dict(pipe, with_text_encoders=True, t5_embed_tokens=embed_tokens)
    for prefix in (SD3_CLIP_L_PREFIX, SD3_CLIP_G_PREFIX):
        assert f"{prefix}text_model.embeddings.position_embedding.weight" in state
        assert f"{prefix}text_projection.weight" in state
    assert f"{SD3_T5_PREFIX}shared.weight" in state and f"{SD3_T5_PREFIX}encoder.block.0.layer.0.SelfAttention.q.weight" in state
    assert (f"{SD3_T5_PREFIX}encoder.embed_tokens.weight" in state) == embed_tokens

    path = save(state, tmp_path / "sd3_incl_clips_t5xxl.safetensors")
    loaded = StableDiffusion3Pipeline.from_single_file(str(path), config=str(folder), local_files_only=True)
    assert_same_weights(pipe.transformer, loaded.transformer)
    assert_same_weights(pipe.vae, loaded.vae)
    assert_same_weights(pipe.text_encoder_2, loaded.text_encoder_2)
    # diffusers puts the identity in CLIP-L's projection whatever the file holds (create_diffusers_clip_model_from_ldm)
    assert_same_weights(pipe.text_encoder, loaded.text_encoder, skip=("text_projection.weight",))
    width = pipe.text_encoder.config.hidden_size
    assert torch.equal(loaded.text_encoder.text_projection.weight, torch.eye(width))
    t5 = loaded.text_encoder_3
    if not embed_tokens:
        # transformers >= 5 gives T5's encoder its own embedding module (tied by parameter, no longer the same
        # module), and diffusers loads the file's tensors without tying: without the key it stays on `meta`.
        assert [k for k, v in t5.state_dict().items() if v.is_meta] == ["encoder.embed_tokens.weight"]
        t5.tie_weights()
    assert_same_weights(pipe.text_encoder_3, t5)


# -- Separate text-encoder files (ComfyUI) --------------------------------------------------------

TEXT_FILES = {
    # file: (tiny family, pipeline attribute, writer, transformers class)
    "clip_l": ("flux-dev", "text_encoder", clip_state_dict, transformers.CLIPTextModel),
    "clip_g": ("sd3", "text_encoder_2", clip_state_dict, transformers.CLIPTextModelWithProjection),
    "t5xxl": ("flux-dev", "text_encoder_2", t5_state_dict, transformers.T5EncoderModel),
}


@pytest.mark.parametrize(("name", "dtype"), [
    ("clip_l", None), ("clip_l", torch.float16), ("clip_g", torch.float16),
    ("t5xxl", torch.float16), ("t5xxl", torch.float8_e4m3fn),
], ids=["clip_l", "clip_l_fp16", "clip_g_fp16", "t5xxl_fp16", "t5xxl_fp8_e4m3fn"])
def test_text_encoder_file_reads_back(tiny, tmp_path, name, dtype):
    family, attribute, writer, cls = TEXT_FILES[name]
    pipe, folder = tiny(family)
    encoder = getattr(pipe, attribute)
    state = writer(encoder, dtype=dtype)
    if name.startswith("clip"):
        # transformers' names with `text_model.`, even where it flattened CLIPTextModel (>= 5.6)
        assert all(k.startswith(("text_model.", "text_projection.")) for k in state)
        assert ("text_projection.weight" in state) == (name == "clip_g")
    else:
        assert "shared.weight" in state and "encoder.embed_tokens.weight" not in state
    path = save(state, tmp_path / name / "model.safetensors")
    stored = file_tensors(path)
    assert {t.dtype for t in stored.values()} == {dtype or torch.float32}

    shutil.copy(Path(folder) / attribute / "config.json", path.parent / "config.json")
    loaded, info = cls.from_pretrained(path.parent, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_same_weights(encoder, loaded, cast=dtype)
