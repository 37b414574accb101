"""SD3 / SD3.5 and FLUX.1 on engines: tiny models of the real architectures (SD 3.5 Medium's
dual-attention MMDiT with qk-norm, FLUX.1's double and single blocks with rotary positions and,
for dev, the guidance embedding), their two CLIPs or CLIP-L, T5 and the 16-channel VAE, built on
ONNX Runtime and OpenVINO and run inside diffusers' own pipelines against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sd_accel import accelerate, build_engines, load_pipeline, stats
from sd_accel.components import specs_for
from sd_accel.config import AccelConfig
from sd_accel.core import InvalidValue
from sd_accel.profiles import Profile
from sd_accel.runtime.transformer import EngineT5, EngineTransformer

# one dynamic profile: 64..128 px, batch 1..2, T5 length 32..128 (opt 64)
DYNAMIC = Profile(batch=(1, 1, 2), height=(64, 64, 128), width=(64, 64, 128), text=(32, 64, 128))
SD3_PARTS = ["clip", "clip2", "t5", "transformer", "vae_decoder", "vae_encoder"]
FLUX_PARTS = ["clip", "t5", "transformer", "vae_decoder", "vae_encoder"]


def generate(pipe, size: int = 64, steps: int = 3, prompt: str = "a photo of a cat", **kwargs) -> np.ndarray:
    g = torch.Generator("cpu").manual_seed(0)
    kwargs.setdefault("max_sequence_length", 64)
    return pipe(prompt=prompt, num_inference_steps=steps, height=size, width=size, generator=g, output_type="np",
                **kwargs).images


def engine_pipe(name: str, engine_dir, backend: str, **config):
    return accelerate(load_pipeline(name), AccelConfig(engines=True, engine_dir=str(engine_dir), precision="fp32",
                                                       backend=backend, **config))


def torch_image(name: str, **kwargs) -> np.ndarray:
    return generate(accelerate(load_pipeline(name), precision="fp32"), **kwargs)


@pytest.fixture(scope="module")
def ort_engines(tmp_path_factory):
    """ONNX Runtime fp32 engines of every part of tiny SD3 and tiny FLUX.1 schnell, one dynamic profile."""
    engine_dir = tmp_path_factory.mktemp("engines")
    records = {}
    for name, parts in (("builtin:tiny-sd3", SD3_PARTS), ("builtin:tiny-flux", FLUX_PARTS)):
        records[name] = build_engines(load_pipeline(name), profiles=[DYNAMIC], backend="onnxruntime",
                                      precision="fp32", components=parts, engine_dir=engine_dir, progress=False)
    return engine_dir, records


def test_each_family_has_its_components():
    sd3, flux = load_pipeline("builtin:tiny-sd3"), load_pipeline("builtin:tiny-flux")
    assert list(specs_for(sd3)) == SD3_PARTS
    assert list(specs_for(flux)) == FLUX_PARTS
    # T5 is SD3's third encoder and FLUX.1's second (where SDXL and SD3 have CLIP-G)
    assert specs_for(sd3)["t5"].attribute == "text_encoder_3"
    assert specs_for(flux)["t5"].attribute == "text_encoder_2"
    # the engine inputs each family's pipeline feeds its transformer
    assert [t.name for t in specs_for(sd3)["transformer"].inputs()] == [
        "hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"]
    dev = specs_for(load_pipeline("builtin:tiny-flux-dev"))["transformer"]
    assert [t.name for t in dev.inputs()] == ["hidden_states", "encoder_hidden_states", "pooled_projections",
                                              "timestep", "img_ids", "txt_ids", "guidance"]
    assert "guidance" not in [t.name for t in specs_for(flux)["transformer"].inputs()]  # schnell has none


def test_profile_dims_follow_each_family():
    sd3 = specs_for(load_pipeline("builtin:tiny-sd3"))
    flux = specs_for(load_pipeline("builtin:tiny-flux"))
    # SD3: CFG doubles the batch; the joint text is 77 CLIP tokens + T5's
    assert sd3["transformer"].dim_ranges(DYNAMIC) == {"B2": (1, 2, 4), "H8": (8, 8, 16), "W8": (8, 8, 16),
                                                       "S": (77 + 32, 77 + 64, 77 + 128)}
    # FLUX.1: no CFG batch; image tokens are (H / 16) * (W / 16)
    assert flux["transformer"].dim_ranges(DYNAMIC) == {"B": (1, 1, 2), "N": (16, 16, 64), "L": (32, 64, 128)}
    assert flux["t5"].dim_ranges(DYNAMIC) == {"B": (1, 1, 2), "L": (32, 64, 128)}
    # without a text range, each pipeline's own max_sequence_length default
    plain = Profile(batch=1, height=64, width=64)
    assert sd3["t5"].dim_ranges(plain)["L"] == (256, 256, 256)
    assert flux["t5"].dim_ranges(plain)["L"] == (512, 512, 512)
    with pytest.raises(InvalidValue, match="up to 512"):
        flux["t5"].dim_ranges(Profile(batch=1, height=64, width=64, text=1024))


@pytest.mark.slow
def test_engines_are_validated_at_opt_and_max(ort_engines):
    _, records = ort_engines
    for name, recs in records.items():
        assert {r.key.component for r in recs} == set(SD3_PARTS if "sd3" in name else FLUX_PARTS)
        for r in recs:
            assert r.validation["ok"] and r.validation["points"] == ["opt", "max"], (name, r.key.name)
            assert r.validation["rel_l2"] < 1e-4, (name, r.key.name, r.validation)
        assert any(".l32-128." in r.key.name for r in recs)  # the T5 range is in the engine's name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["builtin:tiny-sd3", "builtin:tiny-flux"])
def test_images_on_engines_match_torch(ort_engines, name):
    engine_dir, _ = ort_engines
    ref = torch_image(name)
    pipe = engine_pipe(name, engine_dir, "onnxruntime")
    assert isinstance(pipe.transformer, EngineTransformer)
    assert isinstance(pipe.text_encoder_3 if "sd3" in name else pipe.text_encoder_2, EngineT5)
    out = generate(pipe)
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert s["transformer"]["engine_calls"] == 3 and s["transformer"]["torch_calls"] == 0
    assert s["vae_decoder"]["engine_calls"] == 1
    # SD3 encodes the prompt and the negative prompt (CFG); FLUX.1 the prompt only
    calls = 2 if "sd3" in name else 1
    assert s["t5"]["engine_calls"] == calls and s["clip"]["engine_calls"] == calls
    if "sd3" in name:
        assert s["clip2"]["engine_calls"] == 2
    # the wrapper keeps the torch module's interface
    assert pipe.transformer.config.in_channels == load_pipeline(name).transformer.config.in_channels


@pytest.mark.slow
@pytest.mark.parametrize("name", ["builtin:tiny-sd3", "builtin:tiny-flux"])
def test_sizes_and_text_lengths_inside_the_profile_stay_on_engines(ort_engines, name):
    engine_dir, _ = ort_engines
    pipe = engine_pipe(name, engine_dir, "onnxruntime")
    long_prompt = " ".join(["a red bicycle leaning on a wall in the rain"] * 12)  # over one 77-token CLIP chunk
    for size, length in ((96, 64), (128, 128), (64, 32)):
        ref = torch_image(name, size=size, prompt=long_prompt, max_sequence_length=length)
        out = generate(pipe, size=size, prompt=long_prompt, max_sequence_length=length)
        assert np.abs(out - ref).max() < 2e-3, (size, length)
    s = stats(pipe)
    assert s["transformer"]["torch_calls"] == 0 and s["t5"]["torch_calls"] == 0, s


@pytest.mark.slow
@pytest.mark.parametrize("name", ["builtin:tiny-sd3", "builtin:tiny-flux"])
def test_uncovered_size_runs_torch_with_its_reason(ort_engines, name):
    engine_dir, _ = ort_engines
    pipe = engine_pipe(name, engine_dir, "onnxruntime")
    ref = torch_image(name, size=160)
    out = generate(pipe, size=160)  # 160 px: above the profile's 128
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)["transformer"]
    assert s["engine_calls"] == 0 and s["torch_calls"] == 3
    (reason,) = s["fallbacks"]
    assert "no engine covers" in reason
    assert ("(2, 16, 20, 20)" if "sd3" in name else "(1, 100, 64)") in reason


@pytest.mark.slow
def test_arguments_the_engine_lacks_run_torch(ort_engines):
    engine_dir, _ = ort_engines
    pipe = engine_pipe("builtin:tiny-sd3", engine_dir, "onnxruntime")
    # skip-layer guidance: on every step, a second call without layer 0
    generate(pipe, skip_guidance_layers=[0], guidance_scale=4.0, skip_layer_guidance_start=0.0,
             skip_layer_guidance_stop=1.0)
    s = stats(pipe)["transformer"]
    assert s["engine_calls"] == 3  # the plain calls stay on the engine
    (reason,) = s["fallbacks"]
    assert "skip_layers" in reason and s["fallbacks"][reason] == s["torch_calls"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["builtin:tiny-sd3", "builtin:tiny-flux"])
def test_img2img_encodes_on_the_vae_encoder_engine(ort_engines, name):
    import diffusers

    engine_dir, _ = ort_engines
    cls = diffusers.StableDiffusion3Img2ImgPipeline if "sd3" in name else diffusers.FluxImg2ImgPipeline
    image = np.random.default_rng(0).random((64, 64, 3)).astype(np.float32)

    def img2img(pipe):
        g = torch.Generator("cpu").manual_seed(0)
        return pipe(prompt="a cat", image=image, strength=0.7, num_inference_steps=4, generator=g, output_type="np",
                    max_sequence_length=64, height=64, width=64).images

    ref = img2img(cls.from_pipe(accelerate(load_pipeline(name), precision="fp32")))
    pipe = engine_pipe(name, engine_dir, "onnxruntime")
    out = img2img(cls.from_pipe(pipe))
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert s["vae_encoder"]["engine_calls"] == 1 and s["transformer"]["torch_calls"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["builtin:tiny-sd3", "builtin:tiny-flux-dev"])
def test_openvino_engines_match_torch(tmp_path, name):
    parts = SD3_PARTS[:-1] if "sd3" in name else FLUX_PARTS[:-1]
    records = build_engines(load_pipeline(name), profiles=[DYNAMIC], backend="openvino", precision="fp32",
                            components=parts, engine_dir=tmp_path, progress=False)
    assert all(r.validation["ok"] for r in records)
    ref = torch_image(name, size=96, guidance_scale=3.5)
    pipe = engine_pipe(name, tmp_path, "openvino")
    out = generate(pipe, size=96, guidance_scale=3.5)
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert all(s[c]["torch_calls"] == 0 and s[c]["engine_calls"] > 0 for c in parts), s


@pytest.mark.slow
def test_engines_auto_builds_what_the_call_needs(tmp_path):
    pipe = accelerate(load_pipeline("builtin:tiny-flux"), AccelConfig(engines="auto", engine_dir=str(tmp_path),
                                                                      precision="fp32", backend="onnxruntime"))
    ref = torch_image("builtin:tiny-flux", size=80, max_sequence_length=48)
    out = generate(pipe, size=80, max_sequence_length=48)
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert s["transformer"]["engine_calls"] == 3 and s["t5"]["engine_calls"] == 1, s
    names = {p.name.split(".")[0]: p.name for p in tmp_path.iterdir() if not p.name.startswith((".", "onnx"))}
    # the transformer's engine is static at the call's own grid (80 px: 5 x 5 tokens) and T5 length
    assert ".static.b1.h80.w80.t77.l48." in names["transformer"] + "."


def test_flow_models_take_the_flow_samplers():
    pipe = accelerate(load_pipeline("builtin:tiny-flux"), sampler="Euler Karras")
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert pipe.scheduler.config.use_karras_sigmas
    assert pipe.scheduler.config.use_dynamic_shifting is False  # schnell's own settings kept
    with pytest.raises(InvalidValue, match="no flow-matching form.*Euler"):
        accelerate(load_pipeline("builtin:tiny-sd3"), sampler="DPM++ 2M Karras")


@pytest.mark.slow
def test_flux_true_cfg_runs_the_negative_prompt_on_the_engine_too(ort_engines):
    engine_dir, _ = ort_engines
    kwargs = dict(true_cfg_scale=2.0, negative_prompt="blurry")
    ref = torch_image("builtin:tiny-flux", **kwargs)
    pipe = engine_pipe("builtin:tiny-flux", engine_dir, "onnxruntime")
    out = generate(pipe, **kwargs)
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert s["transformer"]["engine_calls"] == 6 and s["transformer"]["torch_calls"] == 0  # 3 steps x 2
    assert s["t5"]["engine_calls"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["builtin:tiny-sd3", "builtin:tiny-flux-dev"])
def test_bf16_and_int8_transformers_pass_their_gates(tmp_path, name):
    """bf16 by the per-call check; int8 (calibrated on the pipeline's own runs at the profile's T5
    length) by the held-out captured calls and then by the picture its pipeline makes, as int8
    UNets are judged."""
    pytest.importorskip("nncf", reason="OpenVINO int8 quantizes with NNCF (pip install nncf)")
    from sd_accel.backends.registry import get_backend

    if "bf16" not in get_backend("openvino", device="cpu").precisions():
        pytest.skip("this CPU has no bf16 (AVX512-BF16 or AMX): OpenVINO builds no bf16 engines here")
    profile = Profile(batch=1, height=64, width=64, text=64)
    for precision in ("bf16", "int8"):
        (record,) = build_engines(load_pipeline(name), profiles=[profile], backend="openvino", precision=precision,
                                  components=["transformer"], engine_dir=tmp_path, progress=False)
        assert record.validation["ok"] and record.key.precision == precision, record.validation
        assert record.validation["rel_l2"] < (0.05 if precision == "bf16" else 0.1)
        if precision == "int8":
            assert record.validation["points"][0].startswith("holdout")  # real captured calls
            assert record.validation["image_psnr"] > 35, record.validation  # measured 42.8 (SD3), 57.7 (FLUX dev)
    pipe = accelerate(load_pipeline(name), AccelConfig(engines=True, engine_dir=str(tmp_path), backend="openvino",
                                                       engine_precision="int8"))
    generate(pipe, guidance_scale=3.5)
    s = stats(pipe)["transformer"]
    assert s["torch_calls"] == 0 and any(".int8." in e for e in s["engines_used"]), s


@pytest.mark.slow
@pytest.mark.parametrize("name", ["builtin:tiny-sd3", "builtin:tiny-flux"])
def test_inpaint_pipelines_run_on_the_engines(ort_engines, name):
    import diffusers

    engine_dir, _ = ort_engines
    cls = diffusers.StableDiffusion3InpaintPipeline if "sd3" in name else diffusers.FluxInpaintPipeline
    rng = np.random.default_rng(0)
    image = rng.random((64, 64, 3)).astype(np.float32)
    mask = np.zeros((64, 64), np.float32)
    mask[16:48, 16:48] = 1.0

    def inpaint(pipe):
        g = torch.Generator("cpu").manual_seed(0)
        return pipe(prompt="a cat", image=image, mask_image=mask, strength=0.8, num_inference_steps=4, generator=g,
                    output_type="np", max_sequence_length=64, height=64, width=64).images

    ref = inpaint(cls.from_pipe(accelerate(load_pipeline(name), precision="fp32")))
    pipe = engine_pipe(name, engine_dir, "onnxruntime")
    out = inpaint(cls.from_pipe(pipe))
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert s["transformer"]["torch_calls"] == 0 and s["transformer"]["engine_calls"] > 0
    assert s["vae_encoder"]["engine_calls"] >= 1


@pytest.mark.slow
def test_flux_transformer_on_the_compiled_backend(tmp_path):
    """The compiled PyTorch backend (Inductor on this CPU) takes the transformer families' spec too."""
    name = "builtin:tiny-flux"
    (record,) = build_engines(load_pipeline(name), profiles=[Profile(batch=1, height=64, width=64, text=32)],
                              backend="compile", precision="fp32", components=["transformer"], engine_dir=tmp_path,
                              progress=False)
    assert record.validation["ok"] and record.validation["rel_l2"] < 1e-4 and record.key.backend == "compile"
    ref = torch_image(name, max_sequence_length=32)
    pipe = engine_pipe(name, tmp_path, "compile")
    out = generate(pipe, max_sequence_length=32)
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)["transformer"]
    assert s["engine_calls"] == 3 and s["torch_calls"] == 0, s
