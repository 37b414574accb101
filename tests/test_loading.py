"""load_pipeline: diffusers folders, WebUI-style single files for SD 1.x / 2.x / SDXL, built-ins,
the offline CLIP tokenizer, and clear errors for files that are not what they claim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sd_accel import load_pipeline
from sd_accel.core import CheckpointError
from sd_accel.models.checkpoint import read_shapes
from sd_accel.models.detect import detect

from support.ldm_layout import save_single_file, to_original_layout

FAMILIES = ["sd15", "sd2-v", "sdxl"]
CLASSES = {"sd15": "StableDiffusionPipeline", "sd2-v": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_factory):
    """Each tiny family as the pipeline it came from and a single .safetensors file."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for fam in FAMILIES:
        pipe = tiny_factory(fam)
        out[fam] = (pipe, save_single_file(pipe, root / f"tiny-{fam}.safetensors"))
    return out


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def encode(pipe, text: str = "a photo of a cat") -> torch.Tensor:
    ids = pipe.tokenizer(text, padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        return pipe.text_encoder(ids)[0]


def test_tokenizer_gives_clip_ids_offline():
    pipe = load_pipeline("builtin:tiny-sd15")
    assert pipe.tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert pipe.tokenizer.pad_token == "<|endoftext|>"


def test_sdxl_second_tokenizer_pads_with_bang():
    pipe = load_pipeline("builtin:tiny-sdxl")
    assert type(pipe).__name__ == "StableDiffusionXLPipeline"
    ids = pipe.tokenizer_2("a photo of a cat", padding="max_length", max_length=77).input_ids
    assert ids[:7] == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert ids[7] == 0  # "!" is id 0, as OpenCLIP pads


@pytest.mark.parametrize("family", FAMILIES)
def test_detects_family_from_keys_and_shapes(checkpoints, family):
    _, path = checkpoints[family]
    det = detect(read_shapes(path), name=path.name)
    assert det.family == family
    assert det.inpaint is False


def test_detects_inpaint_from_unet_input_channels(tiny_factory, tmp_path):
    from diffusers import UNet2DConditionModel

    pipe = tiny_factory("sd15")
    pipe.unet = UNet2DConditionModel.from_config({**pipe.unet.config, "in_channels": 9})
    path = save_single_file(pipe, tmp_path / "inpaint.safetensors")
    assert detect(read_shapes(path)).inpaint is True
    loaded = load_pipeline(path)
    assert type(loaded).__name__ == "StableDiffusionInpaintPipeline"
    assert loaded.unet.config.in_channels == 9
    assert_same_weights(loaded.unet, pipe.unet)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_file_loads_back_identically(checkpoints, family):
    original, path = checkpoints[family]
    pipe = load_pipeline(path)
    assert type(pipe).__name__ == CLASSES[family]
    assert pipe.sd_accel_model.family == family
    assert_same_weights(pipe.unet, original.unet)
    assert_same_weights(pipe.vae, original.vae)
    assert torch.allclose(encode(pipe), encode(original), atol=1e-5)
    if family == "sdxl":
        assert_same_weights(pipe.text_encoder_2, original.text_encoder_2)
    # The reference config's non-shape settings survive the fit to tiny shapes.
    assert pipe.unet.config.attention_head_dim == original.unet.config.attention_head_dim
    assert pipe.vae.config.scaling_factor == original.vae.config.scaling_factor


def test_sd2_single_file_is_v_prediction_by_default(checkpoints):
    pipe = load_pipeline(checkpoints["sd2-v"][1])
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    assert pipe.sd_accel_model.prediction_type == "v_prediction"


def test_sd2_epsilon_from_sidecar_yaml_or_argument(checkpoints, tmp_path):
    src = checkpoints["sd2-v"][1]
    path = tmp_path / "sd21-base.safetensors"
    path.write_bytes(src.read_bytes())
    path.with_suffix(".yaml").write_text("model:\n  params:\n    parameterization: eps\n")
    assert load_pipeline(path).scheduler.config.prediction_type == "epsilon"
    path.with_suffix(".yaml").write_text('model:\n  params:\n    parameterization: "v"\n')
    assert load_pipeline(path).scheduler.config.prediction_type == "v_prediction"
    assert load_pipeline(src, prediction_type="epsilon").sd_accel_model.family == "sd2-base"


def test_diffusers_folder_loads(tiny_factory, tmp_path):
    original = tiny_factory("sdxl")
    original.save_pretrained(tmp_path / "xl")
    pipe = load_pipeline(tmp_path / "xl")
    assert pipe.sd_accel_model.family == "sdxl"
    assert_same_weights(pipe.unet, original.unet)


def test_builtin_is_cached_after_first_build():
    from sd_accel.models.builtin import builtin_path

    first = builtin_path("builtin:tiny-sd15")
    stamp = (first / "model_index.json").stat().st_mtime_ns
    assert builtin_path("tiny-sd15") == first
    assert (first / "model_index.json").stat().st_mtime_ns == stamp


def test_loading_never_touches_the_hub(checkpoints, monkeypatch):
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError(f"tried to download: {args} {kwargs}")

    for name in ("hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    pipe = load_pipeline(checkpoints["sd15"][1])
    assert pipe.sd_accel_model.family == "sd15"


# ---- bad input ------------------------------------------------------------------------------


def test_truncated_file_is_named_truncated(checkpoints, tmp_path):
    data = checkpoints["sd15"][1].read_bytes()
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_pipeline(bad)


def test_lora_file_is_named_a_lora(tmp_path):
    path = tmp_path / "style.safetensors"
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 320)}, str(path))
    with pytest.raises(CheckpointError, match="LoRA"):
        load_pipeline(path)


def test_unknown_file_names_what_was_found(tmp_path):
    path = tmp_path / "resnet.safetensors"
    save_file({"fc.weight": torch.zeros(2, 2), "conv1.weight": torch.zeros(1, 1, 3, 3)}, str(path))
    with pytest.raises(CheckpointError) as err:
        load_pipeline(path)
    assert "not a Stable Diffusion checkpoint" in str(err.value)
    assert "fc.weight" in str(err.value) or "conv1.weight" in str(err.value)


def test_unet_without_text_encoder_is_refused(checkpoints, tmp_path):
    state = to_original_layout(checkpoints["sd15"][0])
    state = {k: v.contiguous() for k, v in state.items() if not k.startswith("cond_stage_model.")}
    path = tmp_path / "no-te.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match="text encoder"):
        load_pipeline(path)


def test_pickle_refused_unless_opted_in(checkpoints, tmp_path):
    original, _ = checkpoints["sd15"]
    state = {k: v.contiguous() for k, v in to_original_layout(original).items()}
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": state, "global_step": 1}, path)
    with pytest.raises(CheckpointError) as err:
        load_pipeline(path)
    assert "allow_pickle=True" in str(err.value)
    pipe = load_pipeline(path, allow_pickle=True)
    assert_same_weights(pipe.unet, original.unet)


def test_missing_path_and_bad_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="builtin:tiny-sd15"):
        load_pipeline(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="model_index.json"):
        load_pipeline(tmp_path / "empty")
    with pytest.raises(ValueError, match="tiny-sdxl"):
        load_pipeline("builtin:tiny-sd9")
    with pytest.raises(ValueError, match="prediction_type"):
        load_pipeline("builtin:tiny-sd15", prediction_type="x0")


def test_shipped_configs_are_complete():
    from sd_accel.models.families import FAMILIES as KNOWN

    for fam in KNOWN.values():
        index = json.loads((fam.config_dir / "model_index.json").read_text())
        for name, entry in index.items():
            if isinstance(entry, list) and entry[0] is not None:
                folder = Path(fam.config_dir / name)
                assert any(folder.glob("*.json")), f"{fam.name}/{name} has no config"
