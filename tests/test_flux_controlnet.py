"""FLUX.1 ControlNet on engines in diffusers (issue 45, ControlNet): ``FluxControlNetPipeline``
with a ``FluxControlNetModel`` (plain and union), one net or two (``FluxMultiControlNetModel``),
scales and ``control_guidance_end``: the nets run on ``controlnet`` engines, the transformer on
its residual-taking engine (``transformer_control``), and the image matches torch's. Tiny FLUX.1
schnell with random weights (the nets' zero-initialised projections made random, so that the
ControlNet changes the picture), ONNX Runtime fp32 (OpenVINO: one test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, stats
from sd_accel.components.flux.controlnet import spread
from sd_accel.profiles import Profile
from sd_accel.runtime.transformer import NO_CONTROL_ENGINE

from support.transformer_nets import flux_net as _net

PROFILE = Profile(batch=1, height=64, width=64, text=512)
CONTROL = Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8"))


def _pipeline(nets: list[tuple[int, int | None]]):
    from diffusers import FluxControlNetPipeline, FluxMultiControlNetModel

    base = load_pipeline("builtin:tiny-flux")
    made = [_net(base.transformer, seed, modes) for seed, modes in nets]
    parts = {k: v for k, v in base.components.items()
             if k in ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer")}
    return FluxControlNetPipeline(**parts, controlnet=made[0] if len(made) == 1 else FluxMultiControlNetModel(made))


def _image(pipe, **kw) -> np.ndarray:
    return pipe("a cat", height=64, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(1),
                output_type="np", **kw).images[0]


CASES = {
    "one": ([(0, None)], dict(control_image=CONTROL, controlnet_conditioning_scale=0.8)),
    "union": ([(0, 3)], dict(control_image=CONTROL, control_mode=2, controlnet_conditioning_scale=0.7)),
    "two": ([(0, None), (1, None)], dict(control_image=[CONTROL, CONTROL.rotate(90)],
                                         controlnet_conditioning_scale=[0.6, 1.1], control_guidance_end=[1.0, 0.5])),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux-controlnet")
    for name, (nets, _) in CASES.items():
        records = build_engines(_pipeline(nets), profiles=[PROFILE], backend="onnxruntime", precision="fp32",
                                components=["controlnet", "transformer_control"], engine_dir=root, progress=False)
        assert all(r.validation and r.validation["ok"] for r in records), (name, [r.validation for r in records])
    return root


@pytest.mark.parametrize("case", sorted(CASES))
def test_flux_controlnet_runs_on_engines_and_matches_torch(built, case):
    nets, kw = CASES[case]
    expected = _image(_pipeline(nets), **kw)
    without = _image(_pipeline(nets), **{**kw, "controlnet_conditioning_scale": 0.0 if case != "two" else [0.0, 0.0]})
    assert np.abs(expected - without).max() > 0.05, "the ControlNet changed nothing: the test would prove nothing"
    pipe = accelerate(_pipeline(nets), AccelConfig(engines=True, engine_dir=str(built), backend="onnxruntime",
                                                   precision="fp32"))
    got = _image(pipe, **kw)
    counts = stats(pipe)
    for key in ["controlnet", "controlnet.1"][: len(nets)] + ["transformer_control"]:
        assert counts[key]["engine_calls"] == 2 and counts[key]["torch_calls"] == 0, (key, counts[key])
    assert np.abs(got - expected).max() < 2e-3


def test_union_modes_differ_and_each_matches_torch(built):
    nets, kw = CASES["union"]
    pipe = accelerate(_pipeline(nets), AccelConfig(engines=True, engine_dir=str(built), backend="onnxruntime",
                                                   precision="fp32"))
    images = {}
    for mode in (0, 2):
        images[mode] = _image(pipe, **{**kw, "control_mode": mode})
        assert np.abs(images[mode] - _image(_pipeline(nets), **{**kw, "control_mode": mode})).max() < 1e-4
    # the mode is an input of the engine, not baked in: one token among 512 (random weights) moves
    # the picture by ~7e-4, a hundred times the engine's distance from torch
    assert np.abs(images[0] - images[2]).max() > 3e-4


def test_without_a_residual_engine_the_transformer_runs_torch_and_says_what_to_build(tmp_path):
    nets, kw = CASES["one"]
    build_engines(_pipeline(nets), profiles=[PROFILE], backend="onnxruntime", precision="fp32",
                  components=["controlnet", "transformer"], engine_dir=tmp_path, progress=False)
    pipe = accelerate(_pipeline(nets), AccelConfig(engines=True, engine_dir=str(tmp_path), backend="onnxruntime",
                                                   precision="fp32"))
    got = _image(pipe, **kw)
    counts = stats(pipe)
    assert counts["controlnet"]["engine_calls"] == 2, counts
    assert counts["transformer_control"]["torch_calls"] == 2, counts["transformer_control"]
    assert list(counts["transformer_control"]["fallbacks"]) == [NO_CONTROL_ENGINE]
    assert np.abs(got - _image(_pipeline(nets), **kw)).max() < 2e-3


@pytest.mark.parametrize(("samples", "blocks", "repeat"), [(1, 1, False), (2, 19, False), (4, 19, False),
                                                           (10, 38, False), (2, 19, True), (5, 19, False),
                                                           (0, 3, False)])
def test_residuals_spread_over_blocks_as_the_transformer_adds_them(samples, blocks, repeat):
    """diffusers' rule, with the interval it computes: block i adds sample i // ceil(blocks /
    samples), or i % samples for XLabs' repeat."""
    got = spread(list(range(samples)) if samples else None, blocks, repeat)
    if not samples:
        assert got == [None] * blocks
        return
    interval = int(np.ceil(blocks / samples))
    assert got == [(i % samples) if repeat else (i // interval) for i in range(blocks)]


@pytest.mark.slow
def test_flux_controlnet_on_openvino(tmp_path):
    pytest.importorskip("openvino")
    nets, kw = CASES["union"]
    build_engines(_pipeline(nets), profiles=[PROFILE], backend="openvino", precision="fp32",
                  components=["controlnet", "transformer_control"], engine_dir=tmp_path, progress=False)
    pipe = accelerate(_pipeline(nets), AccelConfig(engines=True, engine_dir=str(tmp_path), backend="openvino",
                                                   precision="fp32"))
    got = _image(pipe, **kw)
    counts = stats(pipe)
    assert counts["controlnet"]["engine_calls"] == 2 and counts["transformer_control"]["engine_calls"] == 2, counts
    assert np.abs(got - _image(_pipeline(nets), **kw)).max() < 5e-3


def test_a_flux_controlnet_folder_loads_into_its_pipeline_and_other_families_are_refused(tmp_path):
    from sd_accel import with_controlnets
    from sd_accel.core import InvalidValue
    from sd_accel.models.tiny_controlnet import tiny_controlnet

    flux = load_pipeline("builtin:tiny-flux")
    _net(flux.transformer, 0).save_pretrained(tmp_path / "flux-net")
    pipe = with_controlnets(flux, [tmp_path / "flux-net", tmp_path / "flux-net"])
    assert type(pipe).__name__ == "FluxControlNetPipeline"
    assert [type(n).__name__ for n in pipe.controlnet.nets] == ["FluxControlNetModel"] * 2
    assert pipe.controlnet.nets[0].sd_accel_source == str(tmp_path / "flux-net")

    sd15 = load_pipeline("builtin:tiny-sd15")
    with pytest.raises(InvalidValue, match="is a FLUX.1 ControlNet and the checkpoint is SD 1.x"):
        with_controlnets(sd15, [tmp_path / "flux-net"])
    with pytest.raises(InvalidValue, match="SD 1.x / SDXL ControlNet and the checkpoint is FLUX.1"):
        with_controlnets(flux, [tiny_controlnet(sd15.unet)])


def test_a_lora_on_the_transformer_is_refitted_into_the_residual_taking_engine(tmp_path):
    """FLUX.1 with a LoRA and a ControlNet, the workflow people run: ``refit_engines`` refits
    ``transformer_control`` (no rebuild) and the image matches torch with both."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from sd_accel import refit_engines

    nets, kw = CASES["one"]
    src = _pipeline(nets)
    src.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for key, param in src.transformer.named_parameters():
            if "lora_" in key:  # peft starts B at zero: a LoRA that changes nothing
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    type(src).save_lora_weights(tmp_path / "lora", transformer_lora_layers=get_peft_model_state_dict(src.transformer))
    build_engines(_pipeline(nets), profiles=[PROFILE], backend="onnxruntime", precision="fp32",
                  components=["controlnet", "transformer_control"], engine_dir=tmp_path / "engines", progress=False)
    reference = _pipeline(nets)
    reference.load_lora_weights(tmp_path / "lora", adapter_name="style")
    expected = _image(reference, **kw)

    pipe = accelerate(_pipeline(nets), AccelConfig(engines=True, engine_dir=str(tmp_path / "engines"),
                                                   backend="onnxruntime", precision="fp32"))
    without = _image(pipe, **kw)
    assert np.abs(without - expected).max() > 1e-2  # the LoRA changes the picture
    pipe.load_lora_weights(tmp_path / "lora", adapter_name="style")
    assert list(refit_engines(pipe, progress=False)) == ["transformer_control"]
    got = _image(pipe, **kw)
    counts = stats(pipe)
    assert counts["transformer_control"]["engine_calls"] == 4 and counts["transformer_control"]["torch_calls"] == 0
    assert np.abs(got - expected).max() < 2e-3


def test_cli_builds_and_generates_with_a_flux_union_controlnet_folder(tmp_path, capsys):
    """``sd-accel build --controlnet FOLDER`` builds the net's and the residual-taking transformer's
    engines; ``generate --controlnet FOLDER --control-mode N`` runs both on them (in-process)."""
    import json

    from sd_accel.cli import main

    _net(load_pipeline("builtin:tiny-flux").transformer, 0, modes=3).save_pretrained(tmp_path / "union")
    CONTROL.save(tmp_path / "hint.png")
    engines = str(tmp_path / "engines")

    def cli(*args: str) -> dict:
        assert main([*args, "--json"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    common = ["--model", "builtin:tiny-flux", "--controlnet", str(tmp_path / "union"), "--backend", "onnxruntime",
              "--engine-dir", engines]
    built = cli("build", *common, "--components", "controlnet,transformer_control", "--height", "64",
                "--width", "64", "--text", "512", "--static")
    assert sorted(e["component"] for e in built["engines"]) == ["controlnet", "transformer_control"]
    report = cli("generate", *common, "--control-image", str(tmp_path / "hint.png"), "--control-mode", "2",
                 "--control-scale", "0.8", "--steps", "2", "--size", "64x64", "--engines", "on",
                 "--out", str(tmp_path / "img.png"))
    assert report["components"]["controlnet"] == "engine" and report["components"]["transformer_control"] == "engine"
    assert (tmp_path / "img.png").is_file()
