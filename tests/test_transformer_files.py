"""SD3.5 and FLUX.1 single files as people download them, read back offline: tiny models of the real
architectures written in the original key layouts (tests/support/transformer_layout.py) and laid
out the way ComfyUI users keep them."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from sd_accel import build_engines, load_pipeline
from sd_accel.core import CheckpointError
from sd_accel.models.builtin import build_tiny_pipeline
from sd_accel.pages import FileMaps

from support import transformer_layout as layout


def _same(a: torch.nn.Module, b: torch.nn.Module, atol: float = 0.0) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.allclose(sa[k].float(), sb[k].float(), atol=atol, rtol=0), k


def _image(pipe) -> np.ndarray:
    g = torch.Generator("cpu").manual_seed(0)
    return pipe(prompt="a cat", num_inference_steps=2, height=64, width=64, generator=g, output_type="np",
                max_sequence_length=32).images


@pytest.fixture(scope="module")
def flux_dev():
    return build_tiny_pipeline("flux-dev")


def _comfy_flux(root: Path, pipe, t5_dtype=torch.float8_e4m3fn, prefix: bool = False) -> Path:
    """models/diffusion_models/flux1-dev.safetensors, models/vae/ae.safetensors,
    models/text_encoders/clip_l.safetensors and t5xxl_fp8_e4m3fn.safetensors."""
    for folder in ("diffusion_models", "vae", "text_encoders"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    path = root / "diffusion_models" / "flux1-dev.safetensors"
    layout.save(layout.flux_transformer_state_dict(pipe.transformer, prefix="model.diffusion_model." if prefix else ""),
                path)
    layout.save(layout.vae_state_dict(pipe.vae), root / "vae" / "ae.safetensors")
    layout.save(layout.clip_state_dict(pipe.text_encoder), root / "text_encoders" / "clip_l.safetensors")
    layout.save(layout.t5_state_dict(pipe.text_encoder_2, dtype=t5_dtype),
                root / "text_encoders" / "t5xxl_fp8_e4m3fn.safetensors")
    return path


@pytest.mark.parametrize("prefix", [False, True])
def test_flux_transformer_file_with_its_parts_in_comfyuis_folders(tmp_path, flux_dev, prefix):
    path = _comfy_flux(tmp_path / "models", flux_dev, prefix=prefix)
    pipe = load_pipeline(path)
    assert type(pipe).__name__ == "FluxPipeline" and pipe.sd_accel_model.family == "flux-dev"
    _same(flux_dev.transformer, pipe.transformer)
    _same(flux_dev.vae, pipe.vae)
    _same(flux_dev.text_encoder, pipe.text_encoder)
    # T5 as published in fp8 e4m3: each weight is the fp8 value, read without an fp32 detour
    ref = {k: v.to(torch.float8_e4m3fn).float() for k, v in flux_dev.text_encoder_2.state_dict().items()}
    for k, v in pipe.text_encoder_2.state_dict().items():
        assert torch.equal(v.float(), ref[k]), k
    assert pipe.transformer.config.guidance_embeds and pipe.transformer.config.axes_dims_rope == [4, 14, 14]
    assert np.isfinite(_image(pipe)).all()


def test_flux_schnell_file_is_told_from_dev(tmp_path):
    schnell = build_tiny_pipeline("flux-schnell")
    pipe = load_pipeline(_comfy_flux(tmp_path, schnell))
    assert pipe.sd_accel_model.family == "flux-schnell" and not pipe.transformer.config.guidance_embeds
    assert pipe.scheduler.config.use_dynamic_shifting is False  # schnell's own sampler settings


def test_flux_parts_named_and_missing(tmp_path, flux_dev):
    path = _comfy_flux(tmp_path / "models", flux_dev)
    alone = tmp_path / "elsewhere" / "flux.safetensors"
    alone.parent.mkdir()
    alone.write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match=r"needs its vae \(ae.safetensors\), clip_l \(clip_l.safetensors\), "
                                              r"t5 \(t5xxl_fp16.safetensors\).*parts="):
        load_pipeline(alone)
    enc = tmp_path / "models" / "text_encoders"
    pipe = load_pipeline(alone, parts={"vae": tmp_path / "models" / "vae" / "ae.safetensors",
                                       "clip_l": enc / "clip_l.safetensors", "t5": enc / "t5xxl_fp8_e4m3fn.safetensors"})
    _same(flux_dev.transformer, pipe.transformer)
    with pytest.raises(CheckpointError, match="unknown parts"):
        load_pipeline(alone, parts={"clip_g": enc / "clip_l.safetensors"})


def test_truncated_flux_file_names_what_is_missing(tmp_path, flux_dev):
    path = _comfy_flux(tmp_path, flux_dev)
    state = layout.flux_transformer_state_dict(flux_dev.transformer)
    del state["single_blocks.0.linear2.weight"]
    layout.save(state, path)
    with pytest.raises(CheckpointError, match="missing.*proj_out.weight"):
        load_pipeline(path)


@pytest.fixture(scope="module")
def sd3():
    return build_tiny_pipeline("sd3")


def test_sd3_file_with_its_text_encoders_inside(tmp_path, sd3):
    path = tmp_path / "sd3.5_medium_incl_clips.safetensors"
    layout.save(layout.sd3_state_dict(sd3, with_text_encoders=True), path)
    pipe = load_pipeline(path)
    assert type(pipe).__name__ == "StableDiffusion3Pipeline" and pipe.sd_accel_model.family == "sd3"
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        _same(getattr(sd3, name), getattr(pipe, name))
    assert pipe.transformer.config.dual_attention_layers == [0] and pipe.transformer.config.qk_norm == "rms_norm"
    np.testing.assert_allclose(_image(pipe), _image(sd3), atol=1e-5)


def test_sd3_file_with_separate_clip_l_clip_g_and_t5(tmp_path, sd3):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "clip").mkdir()
    path = tmp_path / "checkpoints" / "sd3.5_medium.safetensors"
    layout.save(layout.sd3_state_dict(sd3, with_text_encoders=False), path)
    layout.save(layout.clip_state_dict(sd3.text_encoder, dtype=torch.float16), tmp_path / "clip" / "clip_l.safetensors")
    with pytest.raises(CheckpointError, match=r"clip_g \(clip_g.safetensors\), t5 \(t5xxl_fp16.safetensors\)"):
        load_pipeline(path)
    layout.save(layout.clip_state_dict(sd3.text_encoder_2), tmp_path / "clip" / "clip_g.safetensors")
    layout.save(layout.t5_state_dict(sd3.text_encoder_3), tmp_path / "clip" / "t5xxl_fp16.safetensors")
    pipe = load_pipeline(path)
    _same(sd3.transformer, pipe.transformer)
    maps = FileMaps()  # left on the file's mapping, not copied (SD3.5 Large: 16 GB of bf16)
    params = [p for name, p in pipe.transformer.named_parameters() if not name.startswith("norm_out.")
              and not name.startswith(f"transformer_blocks.{len(pipe.transformer.transformer_blocks) - 1}.norm1_context")]
    assert all(maps.holds(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in params)
    _same(sd3.text_encoder_2, pipe.text_encoder_2)
    _same(sd3.text_encoder, pipe.text_encoder, atol=1e-3)  # stored in fp16


def test_scaled_fp8_encoder_is_refused_by_name(tmp_path, sd3):
    state = layout.sd3_state_dict(sd3, with_text_encoders=True)
    state["text_encoders.t5xxl.transformer.scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    path = tmp_path / "sd3.5_medium_incl_clips_t5xxlfp8scaled.safetensors"
    layout.save(state, path)
    with pytest.raises(CheckpointError, match="scaled fp8.*t5xxl_fp16"):
        load_pipeline(path)


def test_fp8_flux_transformer_stays_fp8_on_its_file_and_builds(tmp_path, flux_dev):
    """A ``flux1-dev-fp8-e4m3fn.safetensors`` (every 2-D weight fp8, the rest bf16, as published):
    loaded into a bf16 pipeline its fp8 weights stay fp8 on the file's mapping (cast to bf16,
    FLUX.1's would be 24 GB), the transformer reports bf16 and computes each layer in bf16 (the
    torch forward equals the bf16 model of the same fp8-rounded weights), and an engine builds from
    it, checked against that torch forward; the weights are still the file's after both."""
    from sd_accel.profiles import Profile

    path = _comfy_flux(tmp_path / "models", flux_dev)
    state = layout.flux_transformer_state_dict(flux_dev.transformer)
    fp8 = {k: v.to(torch.float8_e4m3fn) if v.dim() == 2 else v.to(torch.bfloat16) for k, v in state.items()}
    layout.save(fp8, path.with_name("flux1-dev-fp8-e4m3fn.safetensors"))
    path.unlink()
    pipe = load_pipeline(path.with_name("flux1-dev-fp8-e4m3fn.safetensors"), torch_dtype=torch.bfloat16)
    model = pipe.transformer

    def on_file() -> bool:
        maps = FileMaps()
        return all(maps.holds(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes())
                   for name, p in model.named_parameters()  # (the final modulation's halves swapped: a copy)
                   if p.dtype == torch.float8_e4m3fn and not name.startswith("norm_out."))

    weights = [p for p in model.parameters() if p.dtype == torch.float8_e4m3fn]
    assert len(weights) > 20 and model.dtype == torch.bfloat16 and on_file()
    ref = copy.deepcopy(flux_dev.transformer).float()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 2:  # rounded to fp8 from the same float32 the file's were
                p.copy_(p.to(torch.float8_e4m3fn).float())
    ref = ref.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    feed = dict(hidden_states=torch.randn(1, 16, cfg.in_channels, generator=g).bfloat16(),
                encoder_hidden_states=torch.randn(1, 8, cfg.joint_attention_dim, generator=g).bfloat16(),
                pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g).bfloat16(),
                timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]), img_ids=torch.zeros(16, 3),
                txt_ids=torch.zeros(8, 3), return_dict=False)
    with torch.no_grad():
        got, want = model(**feed)[0].float(), ref(**feed)[0].float()
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (got - want).abs().max()
    assert all(p.dtype == torch.float8_e4m3fn for p in weights) and on_file()
    (record,) = build_engines(pipe, profiles=[Profile(batch=1, height=64, width=64, text=32)], backend="openvino",
                              precision="fp32", components=["transformer"], engine_dir=tmp_path / "engines",
                              progress=False)
    assert record.validation["ok"] and record.validation["rel_l2"] < 1e-2, record.validation
    assert all(p.dtype == torch.float8_e4m3fn for p in model.parameters() if p.dim() == 2) and on_file()


def test_bf16_flux_file_loads_in_bf16_by_default_and_stays_bf16_in_float32(tmp_path, flux_dev):
    """A bf16 ``flux1-dev.safetensors`` (as published): with no dtype asked the pipeline is bf16
    (in float32 FLUX.1 would be 48 GB, its T5 19 GB); asked for float32, the transformer's weights
    stay bf16 on the file's mapping and each layer computes in float32, equal to the float32 model
    of the same bf16 weights."""
    path = _comfy_flux(tmp_path / "models", flux_dev)
    layout.save({k: v.to(torch.bfloat16) for k, v in layout.flux_transformer_state_dict(flux_dev.transformer).items()},
                path)
    pipe = load_pipeline(path)
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.vae.dtype == torch.bfloat16
    assert pipe.text_encoder_2.dtype == torch.bfloat16
    model = load_pipeline(path, torch_dtype=torch.float32).transformer
    assert model.dtype == torch.float32
    stored = [p for name, p in model.named_parameters() if not name.startswith("norm_out.")]
    maps = FileMaps()
    assert all(p.dtype == torch.bfloat16 and maps.holds(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes())
               for p in stored)
    ref = copy.deepcopy(flux_dev.transformer).to(torch.bfloat16).float()
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    feed = dict(hidden_states=torch.randn(1, 16, cfg.in_channels, generator=g),
                encoder_hidden_states=torch.randn(1, 8, cfg.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g),
                timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]), img_ids=torch.zeros(16, 3),
                txt_ids=torch.zeros(8, 3), return_dict=False)
    with torch.no_grad():
        got, want = model(**feed)[0], ref(**feed)[0]
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert all(p.dtype == torch.bfloat16 for p in stored)
