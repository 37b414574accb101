"""Few-step models on engines: LCM-distilled UNets (``time_cond_proj_dim``: the ``timestep_cond``
input) on each CPU backend, detected in single files, and CFG <= 1 runs (one UNet row per image)
served by static engines. Tiny random models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sd_accel import AccelConfig, accelerate, build_engines, load_pipeline, stats
from sd_accel.autobuild import profile_for_call
from sd_accel.components import UNetSpec
from sd_accel.profiles import Profile

from support.lcm import COND_DIM, tiny_lcm_pipeline
from support.taesd_files import tiny_autoencoder, write_layouts

STATIC = dict(batch=1, height=64, width=64)


@pytest.fixture(scope="module")
def lcm_sd15():
    """One torch LCM pipeline for the tests that only read it."""
    return tiny_lcm_pipeline("sd15")


def _run(pipe, steps: int = 2, **kwargs) -> np.ndarray:
    g = torch.Generator("cpu").manual_seed(0)
    return pipe("a cat", num_inference_steps=steps, height=64, width=64, generator=g, output_type="np",
                **kwargs).images


def test_lcm_unet_spec_carries_timestep_cond_and_never_doubles_the_batch(lcm_sd15):
    spec = UNetSpec(lcm_sd15)
    names = [t.name for t in spec.inputs()]
    assert names[-1] == "timestep_cond" and spec.shapes({"B2": 1, "H8": 8, "W8": 8, "T": 77})["timestep_cond"] == (
        1, COND_DIM)
    assert spec.dim_ranges(Profile(**STATIC))["B2"] == (1, 1, 1)  # the default static profile fits LCM's calls


def test_cfg_off_profile_is_one_row_per_image_and_auto_builds_it_static(tiny_sd15):
    spec = UNetSpec(tiny_sd15)
    assert spec.dim_ranges(Profile(**STATIC))["B2"] == (2, 2, 2)
    off = Profile(**STATIC, cfg=False)
    assert spec.dim_ranges(off)["B2"] == (1, 1, 1)
    assert off.tag.endswith(".nocfg") and Profile.from_tag(off.tag) == off and Profile.of(off.to_dict()) == off
    feed = spec.sample_feed({"B2": 1, "H8": 8, "W8": 8, "T": 77})
    got = profile_for_call(spec, feed)  # a Turbo / CFG-1 call: static, not a dynamic batch range
    assert got is not None and got.static and not got.cfg and got.batch == (1, 1, 1)


@pytest.fixture(scope="module", params=["onnxruntime", "openvino"])
def lcm_engines(request, tmp_path_factory):
    """(backend, engine folder, the torch LCM pipeline, its torch image) for a static 64 px UNet engine."""
    if request.param == "openvino":
        pytest.importorskip("openvino")
    pipe = accelerate(tiny_lcm_pipeline("sd15"), precision="fp32")
    ref = _run(pipe, guidance_scale=4.0)
    folder = tmp_path_factory.mktemp(f"lcm-{request.param}")
    # fp32: the comparisons below are fp32's; OpenVINO's default is bf16 where the CPU has it (AVX512-BF16,
    # AMX), and this random tiny LCM UNet misses bf16's gate there (5.4e-2 on a Xeon with AMX).
    records = build_engines(pipe, profiles=[STATIC], backend=request.param, components=["unet"], engine_dir=folder,
                            precision="fp32", progress=False)
    assert records[0].validation["ok"] and records[0].validation["rel_l2"] < 1e-3
    return request.param, folder, pipe, ref


@pytest.mark.slow
def test_latent_consistency_pipeline_runs_on_the_lcm_unet_engine(lcm_engines):
    backend, folder, pipe, ref = lcm_engines
    accelerate(pipe, precision="fp32", engines=True, backend=backend, engine_dir=str(folder))
    assert pipe.unet.config.time_cond_proj_dim == COND_DIM  # the stand-in keeps the config diffusers reads
    out = _run(pipe, guidance_scale=4.0)
    assert np.abs(out - ref).max() < 1e-3
    s = stats(pipe)["unet"]
    assert s["engine_calls"] == 2 and s["torch_calls"] == 0


@pytest.mark.slow
def test_plain_sd_pipeline_with_an_lcm_unet_runs_one_row_per_image_on_the_engine(lcm_engines):
    from diffusers import StableDiffusionPipeline

    backend, folder, pipe, _ = lcm_engines
    accelerate(pipe, precision="fp32", engines=True, backend=backend, engine_dir=str(folder))
    sd = StableDiffusionPipeline(**{k: v for k, v in pipe.components.items() if k != "image_encoder"},
                                 image_encoder=None, requires_safety_checker=False)
    rows = []
    hook = sd.unet.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    try:
        _run(sd, guidance_scale=7.0)  # no CFG doubling for a guidance-embedded UNet
    finally:
        hook.remove()
    assert rows == [1, 1]
    assert stats(sd)["unet"]["torch_calls"] == 0


@pytest.mark.slow
def test_sdxl_lcm_unet_engine_matches_torch(tmp_path):
    pipe = accelerate(tiny_lcm_pipeline("sdxl"), precision="fp32")
    ref = _run(pipe, guidance_scale=1.0)
    build_engines(pipe, profiles=[STATIC], backend="onnxruntime", components=["unet"], engine_dir=tmp_path,
                  progress=False)
    accelerate(pipe, precision="fp32", engines=True, backend="onnxruntime", engine_dir=str(tmp_path))
    assert np.abs(_run(pipe, guidance_scale=1.0) - ref).max() < 1e-3
    assert stats(pipe)["unet"]["engine_calls"] == 2


def test_single_file_lcm_checkpoint_is_detected_and_loads_identically(lcm_sd15, tmp_path):
    from sd_accel.models.checkpoint import read_shapes
    from sd_accel.models.detect import detect

    from support.ldm_layout import save_single_file

    pipe = lcm_sd15
    path = save_single_file(pipe, tmp_path / "lcm.safetensors")
    assert detect(read_shapes(path)).guidance_embedded
    got = load_pipeline(str(path))
    assert got.unet.config.time_cond_proj_dim == COND_DIM
    assert type(got.scheduler).__name__ == "LCMScheduler"
    want = pipe.unet.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in got.unet.state_dict().items())


def test_a_pipeline_takes_an_argument_only_when_its_signature_names_it(lcm_sd15, tiny_sd15):
    from sd_accel.prompts import takes_argument

    # LatentConsistencyModelPipeline.__call__ has **kwargs: that must not count as a negative prompt
    assert not takes_argument(lcm_sd15, "negative_prompt") and not takes_argument(lcm_sd15, "eta")
    assert takes_argument(lcm_sd15, "prompt") and takes_argument(lcm_sd15, "prompt_embeds")
    assert takes_argument(tiny_sd15, "negative_prompt") and takes_argument(tiny_sd15, "eta")


def _generate_counting_encodes(pipe, **fields):
    """(generate()'s first image as floats, the input ids of each text-encoder call)."""
    from sd_accel.generate import GenerationParams, generate

    ids = []
    hook = pipe.text_encoder.register_forward_pre_hook(lambda _m, args: ids.append(args[0][0].tolist()))
    try:
        result = generate(pipe, GenerationParams(prompt="a cat", width=64, height=64, **fields))
    finally:
        hook.remove()
    return result, np.asarray(result.images[0], dtype=np.float32) / 255, ids


def test_generate_on_an_lcm_pipeline_warns_once_and_drops_the_negative_prompt(lcm_sd15, caplog):
    import logging

    pipe = lcm_sd15
    ref, ref_image, _ = _generate_counting_encodes(pipe, steps=2, cfg=4.0)
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        result, image, encodes = _generate_counting_encodes(pipe, steps=2, cfg=4.0, negative_prompt="blurry",
                                                            eta=0.3)
    ignored = [r for r in caplog.records if "negative prompt" in r.getMessage()]
    assert len(ignored) == 1 and "LatentConsistencyModelPipeline" in ignored[0].getMessage()
    assert len([r for r in caplog.records if "takes no eta" in r.getMessage()]) == 1  # the same **kwargs
    assert result.unet_calls == 2 and len(encodes) == 1  # the negative prompt is never encoded
    assert np.abs(image - ref_image).max() < 1e-2  # 8-bit images: within a level or two


def test_generate_on_a_plain_sd_pipeline_still_passes_the_negative_prompt(tiny_sd15, caplog):
    import logging

    pipe = tiny_sd15
    negative = pipe.tokenizer("blurry", padding="max_length", max_length=pipe.tokenizer.model_max_length,
                              truncation=True).input_ids
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        result, _, encodes = _generate_counting_encodes(pipe, steps=1, cfg=7.0, negative_prompt="blurry")
    assert not [r for r in caplog.records if "negative prompt" in r.getMessage()]
    assert len(encodes) == 2 and encodes[1] == negative  # CFG's second row comes from the negative prompt
    assert result.unet_calls == 1


@pytest.mark.slow
def test_cli_build_no_cfg_makes_one_row_per_image_unet_engines(tmp_path, capsys):
    from sd_accel import EngineCache
    from sd_accel.cli import main

    assert main(["build", "--model", "builtin:tiny-sd15", "--components", "unet", "--height", "64", "--width", "64",
                 "--static", "--no-cfg", "--backend", "onnxruntime", "--engine-dir", str(tmp_path), "--json"]) == 0
    (record,) = EngineCache(tmp_path).list()
    assert record.key.profile.endswith(".nocfg") and record.shapes["sample"][0][0] == 1


@pytest.mark.slow
def test_cli_build_no_cfg_makes_the_sdxl_turbo_unet_engine_a_cfg_0_call_runs_on(tmp_path, capsys):
    """`sd-accel build --preset static-512 --no-cfg` for SDXL: one row per image for the latents and
    for SDXL's added conditioning (text_embeds, time_ids), and an SDXL-Turbo call runs on it."""
    import json

    from sd_accel import EngineCache
    from sd_accel.cli import main

    assert main(["build", "--model", "builtin:tiny-sdxl", "--components", "unet", "--preset", "static-512",
                 "--no-cfg", "--backend", "onnxruntime", "--engine-dir", str(tmp_path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["engines"]
    assert row["component"] == "unet" and row["profile"] == "static.b1.h512.w512.t77.nocfg"
    (record,) = EngineCache(tmp_path).list()
    assert all(record.shapes[name][0][0] == 1 for name in ("sample", "encoder_hidden_states", "text_embeds",
                                                           "time_ids"))
    pipe = accelerate(load_pipeline("builtin:tiny-sdxl"), precision="fp32", sampler="Euler a SGM Uniform",
                      engines=True, backend="onnxruntime", engine_dir=str(tmp_path))
    pipe("a cat", num_inference_steps=1, guidance_scale=0.0, height=512, width=512, output_type="latent",
         generator=torch.Generator("cpu").manual_seed(0))
    s = stats(pipe)["unet"]
    assert s["engine_calls"] == 1 and s["torch_calls"] == 0


@pytest.mark.slow
def test_the_few_step_recipe_lcm_unet_and_taesd_on_auto_built_engines(tmp_path):
    """README's recipe: engines="auto" builds a one-row UNet engine and a TAESD decoder engine on
    first use, and the image matches torch."""
    paths = write_layouts(tiny_autoencoder(), tmp_path / "taesd")
    pipe = tiny_lcm_pipeline("sd15")
    tiny = f"tiny:{paths['single']}"
    ref = _run(accelerate(pipe, AccelConfig(precision="fp32", vae=tiny)))
    accelerate(pipe, AccelConfig(precision="fp32", vae=tiny, engines="auto", backend="onnxruntime",
                                 engine_dir=str(tmp_path / "engines")))
    assert np.abs(_run(pipe) - ref).max() < 1e-3
    s = stats(pipe)
    assert s["unet"]["engine_calls"] == 2 and s["vae_decoder"]["engine_calls"] == 1
    assert s["unet"]["torch_calls"] == 0 and s["vae_decoder"]["torch_calls"] == 0


@pytest.mark.slow
def test_turbo_style_cfg_0_runs_one_row_per_image_on_an_auto_built_static_engine(tmp_path):
    """SD-Turbo's recipe (the SD 2.x architecture, 1 step, CFG 0): one UNet row per image, served by a
    static one-row engine that engines="auto" builds, and the negative prompt never encoded."""
    pipe = load_pipeline("builtin:tiny-sd2")
    config = AccelConfig(precision="fp32", sampler="Euler a SGM Uniform")
    ref = _run(accelerate(pipe, config), steps=1, guidance_scale=0.0)
    accelerate(pipe, config, engines="auto", backend="onnxruntime", engine_dir=str(tmp_path))
    rows, encodes = [], []
    hooks = [pipe.unet.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0])),
             pipe.text_encoder.register_forward_pre_hook(lambda *_: encodes.append(1))]
    try:
        out = _run(pipe, steps=1, guidance_scale=0.0, negative_prompt="blurry")
    finally:
        for hook in hooks:
            hook.remove()
    assert np.abs(out - ref).max() < 1e-3
    assert rows == [1] and len(encodes) == 1
    s = stats(pipe)["unet"]
    assert s["engine_calls"] == 1 and s["torch_calls"] == 0
    assert ".static.b1." in s["builds"][0] and ".nocfg." in s["builds"][0]


@pytest.fixture(scope="module")
def sdxl_turbo_engines(tmp_path_factory):
    """One engine folder for both step counts: the second run finds the first one's engines."""
    return tmp_path_factory.mktemp("sdxl-turbo")


@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 4])
def test_sdxl_turbo_style_cfg_0_runs_one_row_per_image_on_an_auto_built_static_engine(steps, sdxl_turbo_engines):
    """SDXL-Turbo's recipe (the SDXL architecture at 512 px, 1 to 4 steps of Euler a with trailing
    spacing, CFG 0): one UNet row per image, with SDXL's added conditioning (``text_embeds``,
    ``time_ids``) one row too, served by a static one-row engine that engines="auto" builds; the
    negative prompt never encoded by either text encoder."""
    from sd_accel import EngineCache

    def run(pipe, **kwargs) -> np.ndarray:
        g = torch.Generator("cpu").manual_seed(0)
        return pipe("a cat", num_inference_steps=steps, guidance_scale=0.0, height=512, width=512, generator=g,
                    output_type="np", **kwargs).images

    pipe = load_pipeline("builtin:tiny-sdxl")
    config = AccelConfig(precision="fp32", sampler="Euler a SGM Uniform")
    accelerate(pipe, config)
    assert type(pipe.scheduler).__name__ == "EulerAncestralDiscreteScheduler"
    assert pipe.scheduler.config.timestep_spacing == "trailing"
    ref = run(pipe)
    accelerate(pipe, config, engines="auto", backend="onnxruntime", engine_dir=str(sdxl_turbo_engines))
    rows, encodes = [], {"text_encoder": 0, "text_encoder_2": 0}

    def unet_rows(_m, args, kwargs):
        added = kwargs["added_cond_kwargs"]
        rows.append((args[0].shape[0], added["text_embeds"].shape[0], added["time_ids"].shape[0]))

    def count(name):
        return lambda *_: encodes.__setitem__(name, encodes[name] + 1)

    hooks = [pipe.unet.register_forward_pre_hook(unet_rows, with_kwargs=True),
             *(getattr(pipe, name).register_forward_pre_hook(count(name)) for name in encodes)]
    try:
        out = run(pipe, negative_prompt="blurry")
    finally:
        for hook in hooks:
            hook.remove()
    assert np.abs(out - ref).max() < 1e-3
    assert rows == [(1, 1, 1)] * steps
    assert encodes == {"text_encoder": 1, "text_encoder_2": 1}  # the prompt's, not the negative's
    assert all(v["torch_calls"] == 0 for v in stats(pipe).values())  # text encoders and VAE on engines too
    s = stats(pipe)["unet"]
    assert s["engine_calls"] == steps
    (unet,) = [r for r in EngineCache(sdxl_turbo_engines).list() if r.key.component == "unet"]
    assert unet.key.profile == "static.b1.h512.w512.t77.nocfg"
    assert tuple(unet.shapes["sample"][0]) == (1, 4, 64, 64) and unet.shapes["text_embeds"][0][0] == 1
    assert s["builds"] in ([], [unet.key.name])  # built by the first run of this module, reused by the next


def test_long_prompts_leave_the_negative_out_where_the_call_reads_none(lcm_sd15):
    """Without CFG and for LCM the negative prompt costs no text-encoder call, and an LCM pipeline
    (which takes no negative embeddings) runs on what ``encode_long_prompt`` gives."""
    from sd_accel.prompts import encode_long_prompt, uses_negative_prompt

    long_prompt = " ".join(["a red cube on a wooden table"] * 20)  # > 75 tokens: two chunks
    plain = load_pipeline("builtin:tiny-sd15")
    calls = []
    hook = plain.text_encoder.register_forward_hook(lambda *_: calls.append(1))
    both = encode_long_prompt(plain, long_prompt, "blurry")
    assert set(both) == {"prompt_embeds", "negative_prompt_embeds"} and len(calls) == 4  # 2 chunks each
    calls.clear()
    alone = encode_long_prompt(plain, long_prompt, "blurry", guidance_scale=1.0)
    assert set(alone) == {"prompt_embeds"} and len(calls) == 2
    torch.testing.assert_close(alone["prompt_embeds"], both["prompt_embeds"])
    hook.remove()
    assert uses_negative_prompt(plain, 7.5) and not uses_negative_prompt(plain, 1.0)
    assert not uses_negative_prompt(lcm_sd15, 7.5)  # guidance-embedded UNet, and no negative argument
    embeds = encode_long_prompt(lcm_sd15, long_prompt, "blurry", guidance_scale=4.0)
    assert set(embeds) == {"prompt_embeds"} and embeds["prompt_embeds"].shape[1] == 154
    image = lcm_sd15(**embeds, num_inference_steps=1, height=64, width=64, output_type="np",
                     generator=torch.Generator("cpu").manual_seed(0)).images
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()
    xl = load_pipeline("builtin:tiny-sdxl")
    assert set(encode_long_prompt(xl, long_prompt, guidance_scale=1.0)) == {"prompt_embeds", "pooled_prompt_embeds"}
    assert len(encode_long_prompt(xl, long_prompt)) == 4


@pytest.mark.slow
def test_a_slimmer_one_step_unet_is_a_config_not_a_family(tmp_path):
    """SDXS-512's UNet (SD 2.1's text encoder, three blocks, no attention at the highest resolution,
    run at one step without CFG) builds through the same spec, driven by its config: validated, and
    a one-step image on the engine equals torch's."""
    import diffusers
    from diffusers import UNet2DConditionModel

    from sd_accel.models.builtin import build_tiny_pipeline

    base = build_tiny_pipeline("sd2-base")
    config = {k: v for k, v in base.unet.config.items() if not k.startswith("_")}
    config.update(block_out_channels=(32, 64, 64), attention_head_dim=(2, 2, 4),
                  down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"))
    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config(config).eval()
    pipe = diffusers.StableDiffusionPipeline(**{**base.components, "unet": unet})
    accelerate(pipe, precision="fp32", sampler="Euler")
    ref = _run(pipe, steps=1, guidance_scale=0.0)
    (record,) = build_engines(pipe, profiles=[Profile(batch=1, height=64, width=64, cfg=False)],
                              backend="onnxruntime", components=["unet"], engine_dir=tmp_path, progress=False)
    assert record.validation["ok"] and record.validation["rel_l2"] < 1e-3
    accelerate(pipe, precision="fp32", sampler="Euler", engines=True, backend="onnxruntime", engine_dir=str(tmp_path))
    assert np.abs(_run(pipe, steps=1, guidance_scale=0.0) - ref).max() < 1e-3
    assert stats(pipe)["unet"]["engine_calls"] == 1 and stats(pipe)["unet"]["torch_calls"] == 0
