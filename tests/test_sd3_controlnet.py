"""SD3 ControlNet on engines in diffusers (issue 45, ControlNet): ``StableDiffusion3ControlNetPipeline``
with an ``SD3ControlNetModel`` (InstantX's kind), one net or two (``SD3MultiControlNetModel``),
classifier-free guidance's doubled batch: the nets on ``controlnet`` engines, the MMDiT on its
residual-taking engine (``transformer_control``), the image as torch's. Tiny SD3, random weights
(the nets' zero-initialised layers made random), ONNX Runtime fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, stats, with_controlnets
from sd_accel.components.sd3.controlnet import pick
from sd_accel.profiles import Profile

from support.transformer_nets import sd3_net as _net

PROFILE = Profile(batch=1, height=64, width=64)
CONTROL = Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8"))


def _pipeline(seeds: list[int]):
    base = load_pipeline("builtin:tiny-sd3")
    return with_controlnets(base, [_net(base.transformer, s) for s in seeds])


def _image(pipe, **kw) -> np.ndarray:
    return pipe("a cat", height=64, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(1),
                output_type="np", **kw).images[0]


CASES = {
    "one": ([0], dict(control_image=CONTROL, controlnet_conditioning_scale=0.8)),
    "two": ([0, 1], dict(control_image=[CONTROL, CONTROL.rotate(90)], controlnet_conditioning_scale=[0.6, 1.1],
                         control_guidance_end=[1.0, 0.5])),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd3-controlnet")
    records = build_engines(_pipeline([0, 1]), profiles=[PROFILE], backend="onnxruntime", precision="fp32",
                            components=["controlnet", "transformer_control"], engine_dir=root, progress=False)
    assert sorted(r.key.component for r in records) == ["controlnet", "controlnet", "transformer_control"]
    assert all(r.validation and r.validation["ok"] for r in records), [r.validation for r in records]
    return root


@pytest.mark.parametrize("case", sorted(CASES))
def test_sd3_controlnet_runs_on_engines_and_matches_torch(built, case):
    seeds, kw = CASES[case]
    expected = _image(_pipeline(seeds), **kw)
    off = [0.0] * len(seeds) if len(seeds) > 1 else 0.0
    assert np.abs(expected - _image(_pipeline(seeds), **{**kw, "controlnet_conditioning_scale": off})).max() > 0.05
    pipe = accelerate(_pipeline(seeds), AccelConfig(engines=True, engine_dir=str(built), backend="onnxruntime",
                                                    precision="fp32"))
    got = _image(pipe, **kw)
    counts = stats(pipe)
    for key in ["controlnet", "controlnet.1"][: len(seeds)] + ["transformer_control"]:
        assert counts[key]["engine_calls"] == 2 and counts[key]["torch_calls"] == 0, (key, counts[key])
    assert np.abs(got - expected).max() < 2e-3


def test_sd3_pipeline_kinds_and_families():
    from sd_accel.core import InvalidValue

    pipe = _pipeline([0])
    assert type(pipe).__name__ == "StableDiffusion3ControlNetPipeline"
    with pytest.raises(InvalidValue, match="no SD3 ControlNet img2img"):
        with_controlnets(load_pipeline("builtin:tiny-sd3"), [pipe.controlnet], kind="img2img")
    with pytest.raises(InvalidValue, match="is an SD3 / SD3.5 ControlNet and the checkpoint is FLUX.1"):
        with_controlnets(load_pipeline("builtin:tiny-flux"), [pipe.controlnet])


def test_samples_are_picked_per_block_as_the_mmdit_adds_them():
    transformer = load_pipeline("builtin:tiny-sd3").transformer
    blocks = len(transformer.transformer_blocks)
    for n in range(1, blocks + 1):
        interval = blocks / n
        want = {i: int(i / interval) for i, b in enumerate(transformer.transformer_blocks) if not b.context_pre_only}
        assert pick(list(range(n)), transformer) == want
    assert pick(None, transformer) == {}
