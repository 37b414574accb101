"""ControlNet on engines (ONNX Runtime, tiny random models): the ``controlnet`` and ``unet_control``
components, images against torch with one and two ControlNets, scales, guess mode,
control_guidance_start/end, img2img, SDXL, and the counted fallback of a call no engine covers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sd_accel import accelerate, build_engines, stats
from sd_accel.models.builtin import build_tiny_pipeline
from sd_accel.models.tiny_controlnet import tiny_controlnet

PROFILE = dict(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96))
STEPS = 3


def control_pipe(family: str = "sd15", nets: int = 1, kind: str = "txt2img"):
    """A fresh tiny ControlNet pipeline (the same random weights each time): its nets are made
    from its UNet with seeds 0, 1, ..."""
    import diffusers
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    base = build_tiny_pipeline(family)
    made = [tiny_controlnet(base.unet, seed=i) for i in range(nets)]
    net = made[0] if nets == 1 else MultiControlNetModel(made)
    xl = "XL" if family == "sdxl" else ""
    cls = {"txt2img": f"StableDiffusion{xl}ControlNetPipeline",
           "img2img": f"StableDiffusion{xl}ControlNetImg2ImgPipeline",
           "inpaint": f"StableDiffusion{xl}ControlNetInpaintPipeline"}[kind]
    parts = {k: v for k, v in base.components.items() if k not in ("safety_checker", "feature_extractor",
                                                                     "image_encoder")}
    extra = {} if xl else {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    return getattr(diffusers, cls)(**parts, controlnet=net, **extra)


def hint(seed: int = 3, size: int = 64) -> torch.Tensor:
    return torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(seed))


def run(pipe, size: int = 64, **kwargs) -> np.ndarray:
    g = torch.Generator("cpu").manual_seed(0)
    kwargs.setdefault("image", hint(size=size))
    return pipe("a cat", num_inference_steps=STEPS, height=size, width=size, generator=g, output_type="np",
                **kwargs).images


def torch_ref(family="sd15", nets=1, kind="txt2img", **kwargs) -> np.ndarray:
    return run(accelerate(control_pipe(family, nets, kind), precision="fp32", sampler="Euler"), **kwargs)


def on_engines(engine_dir, family="sd15", nets=1, kind="txt2img"):
    return accelerate(control_pipe(family, nets, kind), engines=True, engine_dir=str(engine_dir), precision="fp32",
                      sampler="Euler", backend="onnxruntime")


@pytest.fixture(scope="session")
def sd15_control_engines(tmp_path_factory):
    """Engines of two tiny SD 1.5 ControlNets and of the residual-taking UNet (one dynamic profile)."""
    engine_dir = tmp_path_factory.mktemp("controlnet-engines")
    records = build_engines(control_pipe(nets=2), profiles=[PROFILE], backend="onnxruntime", engine_dir=engine_dir,
                            components=["controlnet", "unet_control"], progress=False)
    return engine_dir, records


def test_residual_shapes_follow_the_profile():
    from sd_accel.components.controlnet import control_specs
    from sd_accel.profiles import Profile

    specs = control_specs(control_pipe())
    assert set(specs) == {"controlnet", "unet_control"}
    net, unet = specs["controlnet"], specs["unet_control"]
    profile = Profile.of(dict(batch=(1, 1, 2), height=(64, 72, 96), width=(64, 72, 96)))
    ranges = unet.shape_ranges(profile)
    for point in (0, 2):  # min and max: the ControlNet's real outputs have the shapes the UNet engine takes
        dims = {k: v[point] for k, v in net.dim_ranges(profile).items()}
        with torch.no_grad():
            outs = net.export_module()(*net.sample_feed(dims).values())
        assert [tuple(o.shape) for o in outs] == [ranges[n][point] for n in unet.residual_names()]
        assert all(o.abs().max() > 0 for o in outs)  # non-zero residuals (random zero convolutions)
    assert net.shape_ranges(profile)["controlnet_cond"][2] == (4, 3, 96, 96)  # the control image at pixel size


@pytest.mark.slow
def test_engines_validated_with_nonzero_residuals(sd15_control_engines):
    _, records = sd15_control_engines
    got = sorted(r.key.component for r in records)
    assert got == ["controlnet", "controlnet", "unet_control"]  # two nets (two weights ids), one UNet
    assert len({r.key.model for r in records if r.key.component == "controlnet"}) == 2
    for r in records:
        assert r.validation["ok"] and r.validation["points"] == ["opt", "max"], r.key.name


@pytest.mark.slow
def test_one_controlnet_matches_torch(sd15_control_engines):
    engine_dir, _ = sd15_control_engines
    ref = torch_ref()
    assert np.abs(ref - torch_ref(controlnet_conditioning_scale=0.0)).max() > 1e-2  # the net does something
    pipe = on_engines(engine_dir)
    out = run(pipe)
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert s["controlnet"]["engine_calls"] == STEPS and s["unet_control"]["engine_calls"] == STEPS
    assert s["controlnet"]["torch_calls"] == 0 and s["unet_control"]["torch_calls"] == 0


@pytest.mark.slow
def test_two_controlnets_scales_and_start_end_match_torch(sd15_control_engines):
    engine_dir, _ = sd15_control_engines
    kwargs = dict(image=[hint(3), hint(4)], controlnet_conditioning_scale=[0.7, 1.3],
                  control_guidance_start=[0.0, 0.4], control_guidance_end=[1.0, 0.8])
    ref = torch_ref(nets=2, **kwargs)
    pipe = on_engines(engine_dir, nets=2)
    out = run(pipe, **kwargs)
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert s["controlnet"]["engine_calls"] == STEPS and s["controlnet.1"]["engine_calls"] == STEPS
    assert s["unet_control"]["engine_calls"] == STEPS  # one UNet engine for the sum of both nets
    assert all(s[k]["torch_calls"] == 0 for k in ("controlnet", "controlnet.1", "unet_control"))


@pytest.mark.slow
def test_guess_mode_matches_torch(sd15_control_engines):
    engine_dir, _ = sd15_control_engines
    ref = torch_ref(guess_mode=True, controlnet_conditioning_scale=0.8)
    pipe = on_engines(engine_dir)
    out = run(pipe, guess_mode=True, controlnet_conditioning_scale=0.8)
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)  # the net sees the conditional half only (batch 1), the UNet both
    assert s["controlnet"]["engine_calls"] == STEPS and s["unet_control"]["engine_calls"] == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["img2img", "inpaint"])
def test_img2img_and_inpaint_controlnet_match_torch(sd15_control_engines, kind):
    engine_dir, _ = sd15_control_engines
    kwargs = dict(image=hint(5), control_image=hint(3), strength=1.0)
    if kind == "inpaint":
        kwargs["mask_image"] = (hint(6)[:, :1] > 0.5).float()
    ref = torch_ref(kind=kind, **kwargs)
    pipe = on_engines(engine_dir, kind=kind)
    out = run(pipe, **kwargs)
    assert np.abs(out - ref).max() < 2e-3
    assert stats(pipe)["unet_control"]["engine_calls"] == STEPS


@pytest.mark.slow
def test_size_no_engine_covers_runs_torch_counted(sd15_control_engines):
    engine_dir, _ = sd15_control_engines
    ref = torch_ref(size=128, image=hint(size=128))
    pipe = on_engines(engine_dir)
    out = run(pipe, size=128, image=hint(size=128))
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert s["controlnet"]["torch_calls"] == STEPS and s["unet_control"]["torch_calls"] == STEPS
    assert s["controlnet"]["engine_calls"] == 0 and s["unet_control"]["engine_calls"] == 0


@pytest.mark.slow
def test_sdxl_controlnet_matches_torch(tmp_path):
    build_engines(control_pipe("sdxl"), profiles=[dict(batch=1, height=64, width=64)], backend="onnxruntime",
                  engine_dir=tmp_path, components=["controlnet", "unet_control"], progress=False)
    ref = torch_ref("sdxl")
    pipe = on_engines(tmp_path, "sdxl")
    out = run(pipe)
    assert np.abs(out - ref).max() < 2e-3
    s = stats(pipe)
    assert s["controlnet"]["engine_calls"] == STEPS and s["unet_control"]["engine_calls"] == STEPS


# ---------------------------------------------------------------------------------- loading offline


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_single_file_round_trip(family, tmp_path):
    from sd_accel.models.controlnet import controlnet_pipeline, load_controlnet

    from support.controlnet_layout import save_controlnet_file

    base = build_tiny_pipeline(family)
    net = tiny_controlnet(base.unet)
    path = save_controlnet_file(net, tmp_path / "control_tiny.safetensors")
    back = load_controlnet(path, pipe=base)
    want, got = net.state_dict(), back.state_dict()
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    assert list(back.config.block_out_channels) == list(net.config.block_out_channels)
    assert back.config.get("addition_embed_type") == net.config.get("addition_embed_type")
    # without the prefix too (files saved from the ControlNet alone)
    bare = load_controlnet(save_controlnet_file(net, tmp_path / "bare.safetensors", prefix=""), pipe=base)
    assert torch.equal(bare.state_dict()["controlnet_mid_block.weight"], want["controlnet_mid_block.weight"])
    net.save_pretrained(tmp_path / "folder")
    folder = load_controlnet(tmp_path / "folder", pipe=base)
    assert torch.equal(folder.state_dict()["controlnet_mid_block.weight"], want["controlnet_mid_block.weight"])
    pipe = controlnet_pipeline(base, [back, folder])
    assert type(pipe).__name__ == f"StableDiffusion{'XL' if family == 'sdxl' else ''}ControlNetPipeline"
    assert len(pipe.controlnet.nets) == 2


def test_pickle_refused_and_family_mismatch_is_clear(tmp_path):
    from sd_accel.core import CheckpointError, InvalidValue
    from sd_accel.models.controlnet import load_controlnet

    from support.controlnet_layout import controlnet_to_original, save_controlnet_file

    sd15, sdxl = build_tiny_pipeline("sd15"), build_tiny_pipeline("sdxl")
    net = tiny_controlnet(sd15.unet)
    torch.save(controlnet_to_original(net), tmp_path / "control.pth")
    with pytest.raises(CheckpointError, match="pickle"):
        load_controlnet(tmp_path / "control.pth")
    assert load_controlnet(tmp_path / "control.pth", allow_pickle=True, pipe=sd15) is not None
    path = save_controlnet_file(net, tmp_path / "sd15_control.safetensors")
    with pytest.raises(InvalidValue, match="SD 1.x ControlNet and the checkpoint is SDXL"):
        load_controlnet(path, pipe=sdxl)
    with pytest.raises(CheckpointError, match="not a ControlNet"):
        from safetensors.torch import save_file

        save_file({"foo.weight": torch.zeros(2)}, str(tmp_path / "junk.safetensors"))
        load_controlnet(tmp_path / "junk.safetensors")


# ---------------------------------------------------------------------------------- the CLI


@pytest.mark.slow
def test_cli_build_and_generate_with_a_controlnet_file(sd15_control_engines, tmp_path, capsys):
    """In-process (the subprocess start is most of a CLI test's cost): the tiny built-in model's
    ControlNet as a single file; its engines and the residual UNet's are the fixture's (the same
    weights), so the build finds them cached and the generation runs on them."""
    import json

    from PIL import Image, ImageDraw

    from sd_accel import load_pipeline
    from sd_accel.cli import main

    from support.controlnet_layout import save_controlnet_file

    net = save_controlnet_file(tiny_controlnet(load_pipeline("builtin:tiny-sd15").unet), tmp_path / "cn.safetensors")
    photo = Image.new("RGB", (64, 64), "black")
    ImageDraw.Draw(photo).ellipse([12, 12, 52, 52], fill="white")
    photo.save(tmp_path / "photo.png")
    engines = str(sd15_control_engines[0])

    def cli(*args: str) -> dict:
        assert main([*args, "--json"]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    built = cli("build", "--controlnet", str(net), "--components", "controlnet,unet_control", "--batch", "1-1-2",
                "--height", "64-64-96", "--width", "64-64-96", "--backend", "onnxruntime", "--engine-dir", engines)
    assert sorted(e["component"] for e in built["engines"]) == ["controlnet", "unet_control"]
    report = cli("generate", "--controlnet", str(net), "--control-image", str(tmp_path / "photo.png"),
                 "--control-preprocess", "canny", "--control-scale", "0.8", "--steps", "2", "--size", "64x64",
                 "--engines", "on", "--backend", "onnxruntime", "--engine-dir", engines,
                 "--out", str(tmp_path / "img.png"))
    assert report["components"]["controlnet"] == "engine" and report["components"]["unet_control"] == "engine"


def test_canny_finds_the_edges_of_a_shape():
    from PIL import Image, ImageDraw

    from sd_accel.models.hints import canny

    photo = Image.new("RGB", (64, 64), "black")
    ImageDraw.Draw(photo).rectangle([16, 16, 47, 47], fill="white")
    edges = np.asarray(canny(photo))[..., 0] > 0
    assert edges[16:48, 15:18].any(axis=1).all()  # every row of the left side has an edge pixel
    assert not edges[24:40, 24:40].any() and not edges[:8, :8].any()  # none inside or in the flat background


@pytest.mark.slow
def test_changed_weights_never_run_stale_engines_and_refit_serves_the_unet(sd15_control_engines, tmp_path):
    import shutil

    from sd_accel import refit_engines

    engine_dir = shutil.copytree(sd15_control_engines[0], tmp_path / "engines")
    pipe = on_engines(engine_dir)
    with torch.no_grad():  # a weight edit (what a fused LoRA does), on the UNet and on the ControlNet
        pipe.unet.torch_module.conv_in.weight.mul_(1.1)
        pipe.controlnet.controlnet_mid_block.weight.mul_(1.5)
    pipe.unet.touched()
    pipe.controlnet._sd_accel_engine.touched()
    changed = control_pipe()
    with torch.no_grad():
        changed.unet.conv_in.weight.mul_(1.1)
        changed.controlnet.controlnet_mid_block.weight.mul_(1.5)
    ref = run(accelerate(changed, precision="fp32", sampler="Euler"))
    assert np.abs(run(pipe) - ref).max() < 2e-3
    s = stats(pipe)
    assert s["unet_control"]["torch_calls"] == STEPS and s["controlnet"]["torch_calls"] == STEPS
    assert any("weights changed" in why for why in s["unet_control"]["fallbacks"])
    assert "unet_control" in refit_engines(pipe, progress=False)
    assert np.abs(run(pipe) - ref).max() < 2e-3
    assert stats(pipe)["unet_control"]["engine_calls"] == STEPS


@pytest.mark.slow
def test_openvino_controlnet_engines_match_torch(tmp_path):
    pytest.importorskip("openvino")
    records = build_engines(control_pipe(), profiles=[dict(batch=1, height=64, width=64)], backend="openvino",
                            precision="fp32", engine_dir=tmp_path, components=["controlnet", "unet_control"],
                            progress=False)
    assert all(r.validation["ok"] for r in records)
    pipe = accelerate(control_pipe(), engines=True, engine_dir=str(tmp_path), precision="fp32", sampler="Euler",
                      backend="openvino")
    assert np.abs(run(pipe) - torch_ref()).max() < 2e-3
    s = stats(pipe)
    assert s["controlnet"]["engine_calls"] == STEPS and s["unet_control"]["engine_calls"] == STEPS
    # guess mode: the net sees batch 1, which the static engine (2 rows) serves doubled
    assert np.abs(run(pipe, guess_mode=True) - torch_ref(guess_mode=True)).max() < 2e-3
    assert stats(pipe)["controlnet"]["engine_calls"] == 2 * STEPS


@pytest.mark.slow
def test_openvino_int8_controlnet_and_residual_unet_calibrate_on_control_runs(tmp_path):
    """int8 ControlNet engines: calibrated on the pipeline's own ControlNet runs (made-up edge maps,
    every step captured: the nets' inputs and the residuals they gave the UNet), checked on held-out
    captured steps behind the int8 gate, and the image stays near torch's."""
    pytest.importorskip("openvino")
    from sd_accel.backends.openvino import OpenVinoBackend

    if "int8" not in OpenVinoBackend().precisions():
        pytest.skip("OpenVINO int8 needs NNCF, which is not installed")
    records = build_engines(control_pipe(), profiles=[dict(batch=1, height=64, width=64)], backend="openvino",
                            precision="int8", engine_dir=tmp_path, components=["controlnet", "unet_control"],
                            progress=False)
    assert sorted(r.key.component for r in records) == ["controlnet", "unet_control"]
    for r in records:
        assert r.key.precision == "int8" and r.validation["ok"], r.validation
        assert r.validation["points"][0].startswith("holdout")  # judged on captured steps, not random feeds
    cal = {f.name.split("-")[1] for f in (tmp_path / "calibration").glob("*.npz")}
    assert {"controlnet", "unet_control"} <= cal, cal
    from sd_accel.core import CalibrationSet

    (control_file,) = [f for f in (tmp_path / "calibration").glob("*-unet_control-*.npz")]
    feeds = CalibrationSet.load("unet_control", control_file).feeds
    assert feeds and all(np.abs(f["mid"]).max() > 0 for f in feeds)  # residuals the net really gave
    pipe = accelerate(control_pipe(), engines=True, engine_dir=str(tmp_path), precision="fp32",
                      engine_precision="int8", sampler="Euler", backend="openvino")
    out, ref = run(pipe), torch_ref()
    s = stats(pipe)
    assert s["controlnet"]["engine_calls"] == STEPS and s["unet_control"]["engine_calls"] == STEPS
    psnr = 10 * np.log10(1.0 / np.mean((out - ref) ** 2))
    assert psnr > 25, psnr  # int8 (a random tiny model): near torch, not equal to it


@pytest.mark.slow
def test_engines_auto_builds_the_controlnet_and_residual_unet_on_first_use(tmp_path):
    pipe = accelerate(control_pipe(), engines="auto", engine_dir=str(tmp_path), precision="fp32", sampler="Euler",
                      backend="onnxruntime")
    from sd_accel.runtime.swap import set_build_progress

    set_build_progress(pipe, False)
    out = run(pipe)
    s = stats(pipe)
    assert len(s["controlnet"]["builds"]) == 1 and len(s["unet_control"]["builds"]) == 1
    assert s["controlnet"]["engine_calls"] == STEPS and s["unet_control"]["engine_calls"] == STEPS
    assert np.abs(out - torch_ref()).max() < 2e-3


class _NoisyNet:
    """A stand-in engine runner for a ControlNet: torch's residuals plus Gaussian noise of ``scale``
    times each residual's RMS (on the residuals in ``names``, or all)."""

    def __init__(self, spec, scale: float, names: tuple[str, ...] | None = None) -> None:
        self.spec, self.scale, self.names = spec, scale, names

    def infer(self, feed: dict) -> dict:
        with torch.no_grad():
            outs = self.spec.export_module()(*feed.values())
        g = torch.Generator().manual_seed(0)
        got = {}
        for t, out in zip(self.spec.outputs(), outs, strict=True):
            if self.names is None or t.name in self.names:
                out = out + self.scale * out.norm() / out.numel() ** 0.5 * torch.randn(out.shape, generator=g)
            got[t.name] = out
        return got


def test_controlnet_residuals_off_by_more_than_the_tolerance_are_judged_by_the_unet_they_feed(monkeypatch):
    """bf16 residuals 6% off at the deepest levels moved the UNet by 1%: the net passes when the
    UNet fed its residuals stays within tolerance, and fails, naming the UNet, when it does not."""
    from sd_accel.components.controlnet import ControlNetSpec
    from sd_accel.profiles import Profile
    from sd_accel.validate import TOLERANCE, validate

    spec = ControlNetSpec(control_pipe())
    profile = Profile.of(dict(batch=1, height=64, width=64))
    tol = TOLERANCE["bf16"]
    for names in (None, ("mid",)):  # 8% off everywhere, or at the mid block only
        v = validate(spec, _NoisyNet(spec, 0.08, names), profile, "bf16")
        assert v.rel_l2 > tol and v.ok, v.why
        assert v.consumer_rel is not None and v.consumer_rel < tol
    v = validate(spec, _NoisyNet(spec, 1.0), profile, "bf16")
    assert not v.ok and v.consumer_rel > tol
    assert "the unet_control it feeds is" in v.why and "its own outputs" in v.why
    ok = validate(spec, _NoisyNet(spec, 0.0), profile, "bf16")  # within tolerance: the UNet is not run
    assert ok.ok and ok.consumer_rel is None
    monkeypatch.setattr(ControlNetSpec, "consumer", lambda self: None)  # no torch UNet to judge by
    v = validate(spec, _NoisyNet(spec, 0.08), profile, "bf16")
    assert not v.ok and v.consumer_rel is None and "relative error" in v.why and "exceeds" in v.why


def test_webui_controlnet_units_are_read_and_refused_by_name():
    import base64
    import io

    from PIL import Image

    from sd_accel.core import InvalidValue
    from sd_accel.serve.controlnet_units import parse_controlnet_units, pipeline_arguments

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "white").save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    args = [{"enabled": True, "image": "data:image/png;base64," + b64, "module": "canny",
             "model": "control_v11p_sd15_canny [d14c016b]", "weight": 0.6, "guidance_start": 0.1,
             "guidance_end": 0.9, "threshold_a": 50, "threshold_b": 150},
            {"enabled": False, "model": "off"},
            {"input_image": b64, "module": "none", "model": "depth", "control_mode": "Balanced"}]
    units = parse_controlnet_units({"controlnet": {"args": args}})
    assert [(u.model, u.module, u.weight) for u in units] == [("control_v11p_sd15_canny", "canny", 0.6),
                                                              ("depth", "none", 1.0)]
    assert (units[0].low, units[0].high, units[0].guidance_start) == (50.0, 150.0, 0.1)
    call = pipeline_arguments(units)
    assert call["controlnet_conditioning_scale"] == [0.6, 1.0] and call["control_guidance_end"] == [0.9, 1.0]
    assert [im.size for im in call["image"]] == [(64, 64), (64, 64)]
    for bad, match in (({"module": "openpose"}, "canny preprocessor"),
                       ({"control_mode": "ControlNet is more important"}, "control_mode"),
                       ({"guidance_start": 0.8, "guidance_end": 0.2}, "after guidance_end"),
                       ({"image": "not base64!"}, "base64")):
        with pytest.raises(InvalidValue, match=match):
            parse_controlnet_units({"controlnet": {"args": [{**args[2], **bad}]}})


# ---------------------------------------------------------------- the service (sd-accel serve)

def _unit_args(model: str = "cn [d14c016b]", module: str = "canny", **more) -> dict:
    """One sd-webui-controlnet API unit, its hint a white disc on black (as a client sends it)."""
    import base64
    import io

    from PIL import Image, ImageDraw

    photo = Image.new("RGB", (64, 64), "black")
    ImageDraw.Draw(photo).ellipse([12, 12, 52, 52], fill="white")
    buf = io.BytesIO()
    photo.save(buf, format="PNG")
    return {"enabled": True, "image": base64.b64encode(buf.getvalue()).decode(), "module": module,
            "model": model, "weight": 0.8, "threshold_a": 50, "threshold_b": 150, **more}


@pytest.fixture(scope="module")
def controlnet_dir(tmp_path_factory):
    """A service's ControlNet folder: the tiny model's ControlNet (seed 0: the weights of the
    engines in ``sd15_control_engines``) as an original-layout single file named ``cn``."""
    from sd_accel import load_pipeline

    from support.controlnet_layout import save_controlnet_file

    folder = tmp_path_factory.mktemp("controlnets")
    save_controlnet_file(tiny_controlnet(load_pipeline("builtin:tiny-sd15").unet), folder / "cn.safetensors")
    (folder / "notes.txt").write_text("not a ControlNet")
    return folder


def _replica(controlnet_dir, **accel):
    from sd_accel import load_pipeline
    from sd_accel.serve.config import ServeConfig
    from sd_accel.serve.replica import ModelServer

    accel = {"engines": False, "precision": "fp32", "sampler": "Euler", **accel}
    config = ServeConfig(accel=accel, controlnet_dir=str(controlnet_dir), num_cpus=1, max_batch_size=2,
                         batch_wait_ms=300)
    return ModelServer(config, pipe=accelerate(load_pipeline("builtin:tiny-sd15"), config.accel))


def _pixels(png: bytes) -> np.ndarray:
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)


def test_service_reads_controlnet_units_and_refuses_other_scripts_by_name():
    from sd_accel.core import InvalidValue
    from sd_accel.serve.txt2img import parse_txt2img

    body = {"prompt": "x", "alwayson_scripts": {"ControlNet": {"args": [_unit_args(), {"enabled": False}]},
                                                "Extra options": {"args": []}}}
    req = parse_txt2img(body)
    assert [u.model for u in req.control] == ["cn"]
    sent = req.backend_request()
    assert sent["controlnet"][0]["model"] == "cn" and sent["controlnet"][0]["weight"] == 0.8
    assert "controlnet" not in parse_txt2img({"prompt": "x"}).backend_request()
    with pytest.raises(InvalidValue, match="alwayson_scripts.Refiner is not supported"):
        parse_txt2img({"prompt": "x", "alwayson_scripts": {"Refiner": {"args": [True, "base", 0.8]}}})
    with pytest.raises(InvalidValue, match="alwayson_scripts"):
        parse_txt2img({"prompt": "x", "alwayson_scripts": ["controlnet"]})


@pytest.mark.slow
def test_service_replica_runs_controlnet_units_batches_equal_ones_and_names_what_it_lacks(controlnet_dir):
    import asyncio

    from sd_accel.core import InvalidValue
    from sd_accel.serve.controlnet_units import parse_controlnet_units

    replica = _replica(controlnet_dir)
    assert sorted(replica.controlnets) == ["cn"]  # the text file is not listed
    units = [u.to_dict() for u in parse_controlnet_units({"controlnet": {"args": [_unit_args()]}})]
    req = {"prompt": "a cat", "steps": 2, "cfg": 7.0, "width": 64, "height": 64, "seed": 5, "batch": 1}
    plain = asyncio.run(replica.generate(req))
    solo = asyncio.run(replica.generate(dict(req, controlnet=units)))
    assert np.abs(_pixels(solo["images"][0]) - _pixels(plain["images"][0])).max() > 8  # the ControlNet acted
    assert 'ControlNet 0: "Module: canny, Model: cn, Weight: 0.8' in solo["infotexts"][0]

    async def together():
        return await asyncio.gather(replica.generate(dict(req, controlnet=units)),
                                    replica.generate(dict(req, seed=6, controlnet=units)),
                                    replica.generate(dict(req, seed=7)))

    first, second, alone = asyncio.run(together())
    assert first["call_sizes"] == [2] and second["call_sizes"] == [2]  # same units: one call
    assert alone["call_sizes"] == [1]  # no ControlNet: never in a ControlNet call
    assert np.abs(_pixels(first["images"][0]) - _pixels(solo["images"][0])).max() <= 2
    with pytest.raises(InvalidValue, match="not in this service's controlnet_dir; it has: cn"):
        asyncio.run(replica.generate(dict(req, controlnet=[dict(units[0], model="depth")])))


@pytest.mark.slow
def test_service_controlnet_runs_on_engines_and_its_routes_list_the_models(sd15_control_engines, controlnet_dir):
    import asyncio

    from fastapi.testclient import TestClient

    from sd_accel.serve.app import build_app
    from sd_accel.serve.controlnet_units import parse_controlnet_units

    engines = str(sd15_control_engines[0])
    on_engines = _replica(controlnet_dir, engines=True, backend="onnxruntime", engine_dir=engines)
    in_torch = _replica(controlnet_dir)
    units = [u.to_dict() for u in parse_controlnet_units({"controlnet": {"args": [_unit_args(weight=1.2)]}})]
    req = {"prompt": "a cat", "steps": 2, "cfg": 7.0, "width": 64, "height": 64, "seed": 1, "batch": 1,
           "controlnet": units}
    got = asyncio.run(on_engines.generate(req))
    want = asyncio.run(in_torch.generate(req))
    assert np.abs(_pixels(got["images"][0]) - _pixels(want["images"][0])).max() <= 2
    used = stats(on_engines.control_pipe(("cn",)))
    assert used["controlnet"]["engine_calls"] == 2 and used["controlnet"]["torch_calls"] == 0
    assert used["unet_control"]["engine_calls"] == 2 and used["unet_control"]["torch_calls"] == 0

    class Backend:
        async def generate(self, request):
            return await in_torch.generate(request)

        async def health(self):
            return {"ok": True}

    client = TestClient(build_app(on_engines.config, Backend()))
    assert client.get("/controlnet/model_list").json() == {"model_list": ["cn"]}
    assert client.get("/controlnet/module_list").json()["module_list"] == ["none", "canny"]
    answer = client.post("/sdapi/v1/txt2img", json={
        "prompt": "a cat", "steps": 2, "width": 64, "height": 64, "seed": 1,
        "alwayson_scripts": {"controlnet": {"args": [_unit_args(weight=1.2)]}}})
    assert answer.status_code == 200, answer.text
    assert "ControlNet 0" in json_info(answer)["infotexts"][0]
    bad = client.post("/sdapi/v1/txt2img", json={"prompt": "x", "alwayson_scripts": {
        "controlnet": {"args": [_unit_args(module="openpose")]}}})
    assert bad.status_code == 422 and "canny preprocessor" in bad.json()["detail"]


@pytest.mark.slow
def test_service_build_missing_builds_the_controlnets_of_its_folder(controlnet_dir, tmp_path):
    """``--build-missing`` with ``controlnet_dir``: each ControlNet's engine and the residual UNet's
    are built before traffic (a file that is no ControlNet is skipped), so a request's units run
    on engines from its first call, nothing built then."""
    import asyncio

    from sd_accel import EngineCache
    from sd_accel.serve.config import ServeConfig
    from sd_accel.serve.controlnet_units import parse_controlnet_units
    from sd_accel.serve.deployment import _build_task

    folder = tmp_path / "nets"
    folder.mkdir()
    (folder / "cn.safetensors").symlink_to(controlnet_dir / "cn.safetensors")
    (folder / "broken.safetensors").write_bytes(b"not a safetensors file")
    config = ServeConfig(model="builtin:tiny-sd15", controlnet_dir=str(folder), engine_dir=str(tmp_path / "e"),
                         accel={"backend": "onnxruntime", "precision": "fp32"}, max_batch_size=2,
                         build_profiles=[{"batch": [1, 1, 2], "height": 64, "width": 64}])
    names, _ = _build_task(config.to_dict())
    built = sorted(r.key.component for r in EngineCache(tmp_path / "e").list())
    assert built == ["clip", "controlnet", "unet", "unet_control", "vae_decoder", "vae_encoder"], built
    assert len(names) == len(built)
    replica = _replica(folder, engines=True, backend="onnxruntime", engine_dir=str(tmp_path / "e"))
    units = [u.to_dict() for u in parse_controlnet_units({"controlnet": {"args": [_unit_args()]}})]
    asyncio.run(replica.generate({"prompt": "a cat", "steps": 2, "cfg": 7.0, "width": 64, "height": 64, "seed": 1,
                                  "batch": 1, "controlnet": units}))
    used = stats(replica.control_pipe(("cn",)))
    assert used["controlnet"]["engine_calls"] == 2 and used["controlnet"]["torch_calls"] == 0
    assert used["unet_control"]["engine_calls"] == 2 and used["unet_control"]["torch_calls"] == 0


def json_info(answer) -> dict:
    import json

    return json.loads(answer.json()["info"])


@pytest.mark.parametrize("nets", [1, 2])
def test_attention_option_reaches_every_controlnet(nets):
    """attention='sliced' (or xFormers) is set on the ControlNets as on the UNet: before, they kept
    diffusers' default processor whatever was asked."""
    from diffusers.models.attention_processor import SlicedAttnProcessor

    pipe = accelerate(control_pipe(nets=nets), precision="fp32", attention="sliced")
    control = pipe.controlnet
    modules = list(getattr(control, "nets", [control]))
    assert len(modules) == nets
    for net in modules:
        assert {type(p) for p in net.attn_processors.values()} == {SlicedAttnProcessor}
    assert {type(p) for p in pipe.unet.attn_processors.values()} == {SlicedAttnProcessor}
    assert np.isfinite(run(pipe, image=[hint(3 + i) for i in range(nets)] if nets > 1 else hint())).all()
