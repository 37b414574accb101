"""``sd-accel serve`` with the transformer families (issue 45, the service): SD3 and FLUX.1 models
answer txt2img on their transformer engine, like requests share one call, CFG doubles the
transformer's batch where the family runs it (SD3) and not where guidance is an input (FLUX.1), and
what a family does not take (a WebUI sampler, FLUX.1's negative prompt) is refused
with the reason. Tiny models, random weights, ONNX Runtime fp32 engines."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest

from sd_accel import build_engines, load_pipeline
from sd_accel.core import InvalidValue
from sd_accel.generate import GenerationParams
from sd_accel.profiles import Profile
from sd_accel.serve.config import ServeConfig
from sd_accel.serve.replica import ModelServer

# the T5 length each pipeline asks for by default (max_sequence_length): what the engines must take
TEXT = {"builtin:tiny-flux": 512, "builtin:tiny-sd3": 256}
REQUEST = {"prompt": "a red cube", "steps": 2, "cfg": 3.5, "width": 64, "height": 64, "seed": 1, "batch": 1}


@pytest.fixture(scope="module", params=sorted(TEXT))
def served(request, tmp_path_factory):
    name = request.param
    engines = tmp_path_factory.mktemp("engines")
    build_engines(load_pipeline(name), profiles=[Profile(batch=(1, 1, 2), height=64, width=64, text=TEXT[name])],
                  backend="onnxruntime", precision="fp32", components=["transformer"], engine_dir=engines,
                  progress=False)
    server = ModelServer(ServeConfig(model=name, accel={"engines": True, "engine_dir": str(engines),
                                                        "backend": "onnxruntime"},
                                     batch_wait_ms=300, max_batch_size=2, num_cpus=1))
    return name, server


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)


@pytest.mark.slow
def test_like_requests_share_one_call_on_the_transformer_engine(served):
    name, server = served
    solo = asyncio.run(server.generate(REQUEST))

    async def two():
        return await asyncio.gather(server.generate(REQUEST), server.generate(dict(REQUEST, seed=2)))

    first, second = asyncio.run(two())
    assert first["call_sizes"] == second["call_sizes"] == [2]
    # the same seed gives the same picture alone or in a batch (float rounding aside)
    assert np.abs(_pixels(first["images"][0]) - _pixels(solo["images"][0])).max() <= 1
    assert np.abs(_pixels(first["images"][0]) - _pixels(second["images"][0])).max() > 0
    stats = server.stats()
    transformer = stats["engines"]["transformer"]
    # the solo call's steps, then the shared call's: all on the engine
    assert transformer["engine_calls"] == 2 * REQUEST["steps"] and transformer["torch_calls"] == 0, transformer
    # SD3 runs CFG (cond + uncond rows per image); FLUX.1's guidance is an input: one row per image
    rows = 2 if name.endswith("sd3") else 1
    assert stats["unet_batches"] == {rows: REQUEST["steps"], 2 * rows: REQUEST["steps"]}
    assert first["width"] == first["height"] == 64 and "Steps: 2" in first["infotexts"][0]


def test_what_a_flow_model_does_not_take_is_refused_with_the_reason(served):
    name, server = served
    with pytest.raises(InvalidValue, match="runs its own flow-matching Euler scheduler"):
        asyncio.run(server.generate(dict(REQUEST, sampler="DPM++ 2M")))
    with pytest.raises(InvalidValue, match="this service has no ControlNets"):  # (they run: test_serve_controlnet_families)
        asyncio.run(server.generate(dict(REQUEST, controlnet=[{"model": "canny", "image": b"x"}])))
    assert server.job_for(GenerationParams(**REQUEST, sampler="Euler")).key.sampler is None  # the model's own
    negative = dict(REQUEST, negative_prompt="blurry")
    if name.endswith("flux"):
        with pytest.raises(InvalidValue, match="takes no negative prompt"):
            asyncio.run(server.generate(negative))
    else:
        assert server.job_for(GenerationParams(**negative)).negative_prompt == "blurry"


def _png(width: int, height: int) -> str:
    import base64

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@pytest.mark.slow
def test_img2img_runs_the_init_image_on_the_transformer_engine(served):
    """``/sdapi/v1/img2img``'s request on SD3 and FLUX.1: the init image (any size: resized to the
    request's) at a strength; two requests of one image share a call; the denoiser is the engine."""
    from sd_accel.serve.img2img import parse_img2img

    _, server = served
    before = server.stats()["engines"]["transformer"]["engine_calls"]
    body = {"prompt": "a red cube", "steps": 4, "cfg_scale": 3.5, "width": 64, "height": 64, "seed": 3,
            "init_images": [_png(80, 48)], "denoising_strength": 0.5}
    req = parse_img2img(body)

    async def two():
        return await asyncio.gather(server.generate(req.backend_request()),
                                    server.generate(dict(req.backend_request(), seed=4)))

    first, second = asyncio.run(two())
    assert first["call_sizes"] == second["call_sizes"] == [2]
    assert _pixels(first["images"][0]).shape == (64, 64, 3)
    assert "Denoising strength: 0.5" in first["infotexts"][0]
    transformer = server.stats()["engines"]["transformer"]
    assert transformer["engine_calls"] - before == 2 and transformer["torch_calls"] == 0, transformer  # 4 x 0.5


def test_img2img_requests_are_checked_before_any_queue():
    from sd_accel.serve.img2img import parse_img2img

    base = {"prompt": "x", "init_images": [_png(8, 8)]}
    for body, reason in (({"prompt": "x"}, "init_images must hold one"),
                         (dict(base, init_images=["not an image"]), "not a base64-encoded image"),
                         (dict(base, denoising_strength=0), "denoising_strength=0 is not valid"),
                         (dict(base, mask=_png(8, 8)), "inpainting is not served"),
                         (dict(base, resize_mode=2), "resize_mode=2")):
        with pytest.raises(InvalidValue, match=reason):
            parse_img2img(body)
    request = parse_img2img(dict(base, denoising_strength=0.3))
    assert request.backend_request()["strength"] == 0.3 and request.body["init_images"] == ["<image>"]
