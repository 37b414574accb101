"""ComfyUI's FLUX.1 and SD3 / SD3.5 transformers on engines, in the stand-in ComfyUI
(``tests/comfyui_stub``: its ``Flux`` and ``OpenAISignatureMMDITWrapper`` keep ComfyUI 0.8's key
layouts, padding, rotary ids and sigma -> timestep mappings, tiny widths, random weights).

What is checked: ComfyUI's model and diffusers' transformer made from its weights agree on the
same call (the timestep and guidance scales, odd latent sides); the build node makes a
``transformer`` engine keyed by the model file; a sampling run on the applied MODEL counts its
calls on the engine and gives ComfyUI's own latent within tolerance; LoRA patches (a LoraLoader
after the apply node, several at once) refit the engine with ComfyUI's own patched weights at
each strength; ControlNet residuals, transformer patches, Kontext references, LoRA patches the
engine cannot take and sizes no profile covers run in PyTorch with the reason in the run's log
line."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest
import torch

STUB = Path(__file__).resolve().parent / "comfyui_stub"
sys.path.insert(0, str(STUB))
import comfy_harness as harness  # noqa: E402

sys.path.remove(str(STUB))

CUSTOM = "custom (ranges below)"
# 64 px (latent 8 x 8: 16 image tokens), cond + uncond in one batch, T5 lengths 12-24
BUILD = dict(components="unet", preset=CUSTOM, backend="onnxruntime", precision="fp32", batch="1-2",
             height="64", width="64", tokens="77", text="12-24")


@pytest.fixture(autouse=True)
def comfy_lean(monkeypatch, caplog):
    monkeypatch.setenv("SD_ACCEL_ORT_THREADS", "1")
    logger = logging.getLogger("sd_accel")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="sd_accel")
    yield
    logger.removeHandler(caplog.handler)
    harness.purge()


def _conds(family: str, tokens: int = 12, seed: int = 0) -> tuple[dict, dict]:
    """Positive and negative conds as ComfyUI's text encoders give them for the tiny widths."""
    g = torch.Generator().manual_seed(seed)
    pooled = 32 if family.startswith("flux") else 64
    tokens = tokens if family.startswith("flux") else 77 + tokens  # SD3: CLIP's 77 columns, then T5's

    def cond() -> dict:
        return {"cross_attn": torch.randn(1, tokens, 48, generator=g), "pooled_output": torch.randn(1, pooled, generator=g)}

    return cond(), cond()


def _report(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if "transformer calls this run" in r.getMessage()]
    assert lines, "no run report"
    return lines[-1]


def _load(comfy, tmp: Path, family: str, loader: str):
    if loader == "diffusion_models":  # UNETLoader: the transformer file alone
        path = harness.make_checkpoint(tmp / "models", f"tiny-{family}", seed=7, family=family, kind="diffusion_models")
        return comfy.sd.load_diffusion_model(str(path))
    path = harness.make_checkpoint(tmp / "models", f"tiny-{family}", seed=7, family=family)
    return comfy.sd.load_checkpoint_guess_config(str(path))[0]


@pytest.mark.parametrize("family", ["flux-dev", "flux-schnell", "sd3"])
def test_diffusers_transformer_computes_comfyuis_call(tmp_path, family):
    """The mapping itself: ComfyUI's model vs diffusers' transformer (made from its weights) fed as
    the engine is fed, at an odd latent size, with ComfyUI's timestep (sigma for FLUX, sigma x 1000
    for SD3) and FLUX's guidance as ComfyUI passes them."""
    from sd_accel.comfyui import flux, mmdit

    comfy = harness.start(tmp_path)
    model = _load(comfy, tmp_path, family, "checkpoints")
    base, dm = model.model, model.model.diffusion_model
    mod = flux if family.startswith("flux") else mmdit
    ref = mod.to_diffusers(dm)
    assert type(ref).__name__ == ("FluxTransformer2DModel" if mod is flux else "SD3Transformer2DModel")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 9, 7, generator=g)
    t = base.model_sampling.timestep(torch.tensor([0.8, 0.25]))
    positive, _ = _conds(family)
    context = torch.cat([positive["cross_attn"]] * 2)
    y = torch.cat([positive["pooled_output"]] * 2)
    with torch.no_grad():
        if mod is flux:
            guidance = torch.tensor([3.5, 3.5])
            want = dm(x, t, context, y=y, guidance=guidance)
            feed, shape = flux.feed(dm, x, t, context, y, guidance)
            assert ("guidance" in feed) == (family == "flux-dev")
            wrong = dict(feed, timestep=feed["timestep"] * 1000)  # diffusers scales by 1000 itself
            off = flux.output(ref(**wrong, return_dict=False)[0], shape)
            assert (off - want).abs().max() > 1e-3
        else:
            want = dm(x, t, context, y=y)
            feed, shape = mmdit.feed(dm, x, t, context, y)
        got = mod.output(ref(**feed, return_dict=False)[0], shape)
    assert got.shape == want.shape == x.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "loader"), [("flux-dev", "diffusion_models"), ("sd3", "checkpoints")])
def test_transformer_runs_on_its_engine_and_matches_comfyui(tmp_path, caplog, family, loader):
    comfy = harness.start(tmp_path)
    model = _load(comfy, tmp_path, family, loader)
    positive, negative = _conds(family)
    want = comfy.sample_dit(model, positive, negative)  # ComfyUI's own path (before any engine exists)

    applied, report = comfy.node("SdAccelBuildEngines").build(model, **BUILD)
    assert report.count("\n") == 0 and ", transformer," in report, report
    from sd_accel.comfyui.identity import checkpoint_id

    records = comfy.node("SdAccelListEngines").list()["result"][0]
    ckpt = checkpoint_id(model.model)
    assert ckpt.startswith("ckpt-") and ckpt in records  # keyed by the model file, as the UNet's are

    got = comfy.sample_dit(applied, positive, negative)
    line = _report(caplog)
    assert "2 on engines, 0 in PyTorch" in line, line  # 2 steps, cond + uncond in one call each
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)

    # a size no profile covers (96 px: 36 image tokens): PyTorch, said in the run's line
    comfy.sample_dit(applied, positive, negative, size=96)
    line = _report(caplog)
    assert "0 on engines, 2 in PyTorch" in line, line

    # a transformer patch (a block replacement, as other packs add them): PyTorch, named
    blocked = applied.clone()
    blocked.model_options["transformer_options"].setdefault("patches_replace", {})["dit"] = {
        ("double_block", 0): lambda args, extra: extra["original_block"](args)}
    comfy.sample_dit(blocked, positive, negative)
    line = _report(caplog)
    assert "transformer patches (dit:" in line and "0 on engines" in line, line


def _lora(model, seed: int, rank: int = 2) -> dict:
    """A LoRA's patches as ComfyUI's loader makes them (key -> LoRAAdapter) on the attention q/k/v
    (FLUX: fused, split into to_q/to_k/to_v on the engine), projections and first MLP layers."""
    from comfy.weight_adapter import LoRAAdapter

    g = torch.Generator().manual_seed(seed)  # (random factors: a uniform shift would vanish in the layer norms)
    patches = {}
    for key, w in model.model.state_dict().items():
        if key.startswith("diffusion_model.") and w.ndim == 2 and key.endswith(
                ("qkv.weight", "proj.weight", "linear1.weight", "img_mlp.0.weight", "fc1.weight")):
            patches[key] = LoRAAdapter(set(), (torch.randn(w.shape[0], rank, generator=g) * 0.3,
                                               torch.randn(rank, w.shape[1], generator=g) * 0.3,
                                               torch.tensor(float(rank)), None, None, None))
    return patches


def _with_loras(model, loras: list[tuple[dict, float]]):
    out = model.clone()  # (LoraLoaderModelOnly: a clone with the patches added, one loader per LoRA)
    for patches, strength in loras:
        out = out.clone()
        out.add_patches(patches, strength)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("family", "loader"), [("flux-dev", "diffusion_models"), ("sd3", "checkpoints")])
def test_lora_refits_the_transformer_engine_at_each_strength(tmp_path, caplog, monkeypatch, family, loader):
    """Two LoRAs after the apply node, the first at 0.7, 1.0 and 0.7 again: each run on the
    engine refitted with ComfyUI's patched weights, equal to ComfyUI's own PyTorch run with the
    same patches (never the previous strength's weights); without the LoRAs the base engine."""
    comfy = harness.start(tmp_path)
    model = _load(comfy, tmp_path, family, loader)
    positive, negative = _conds(family)
    applied, _ = comfy.node("SdAccelBuildEngines").build(model, **BUILD)
    base = comfy.sample_dit(applied, positive, negative)
    assert "2 on engines, 0 in PyTorch" in _report(caplog)
    a, b = _lora(model, seed=3), _lora(model, seed=4)
    seen = []
    for strength in (0.7, 1.0, 0.7):
        caplog.clear()
        want = comfy.sample_dit(_with_loras(model, [(a, strength), (b, 0.5)]), positive, negative)  # ComfyUI's own
        got = comfy.sample_dit(_with_loras(applied, [(a, strength), (b, 0.5)]), positive, negative)
        line = _report(caplog)
        assert "2 on engines, 0 in PyTorch" in line and "transformer on engine" in line, line
        assert re.search(rf"refitted for .*:{strength:g}\b", line) and ":0.5" in line, line
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        assert (got - base).abs().max() > 1e-2  # the LoRAs are in the result
        seen.append(got)
    assert (seen[1] - seen[0]).abs().max() > 1e-2  # 1.0 is not 0.7's weights
    torch.testing.assert_close(seen[2], seen[0], atol=2e-3, rtol=2e-3)  # 0.7 again: 0.7's, refitted again

    # without the LoRAs: the base engine, the LoRAs taken out of the weights
    caplog.clear()
    torch.testing.assert_close(comfy.sample_dit(applied, positive, negative), base, atol=2e-3, rtol=2e-3)
    assert "2 on engines, 0 in PyTorch" in _report(caplog)

    # a patch the conversion does not carry onto the engine: PyTorch, said in the run's line
    from sd_accel.comfyui import flux, mmdit

    fam = flux if family.startswith("flux") else mmdit
    monkeypatch.setattr(fam, "unmapped", lambda dm, keys: sorted(keys)[:1])
    want = comfy.sample_dit(_with_loras(model, [(a, 1.0)]), positive, negative)
    got = comfy.sample_dit(_with_loras(applied, [(a, 1.0)]), positive, negative)
    line = _report(caplog)
    assert "LoRA patches of weights the" in line and "0 on engines, 2 in PyTorch" in line, line
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_every_patched_weight_maps_onto_the_engine(tmp_path):
    """The converters carry every 2-D weight a LoRA loader patches (FLUX's fused q/k/v split into
    rows of to_q / to_k / to_v); a key that is not a weight of the model is named."""
    from sd_accel.comfyui import flux, mmdit

    comfy = harness.start(tmp_path)
    for family, mod in (("flux-dev", flux), ("sd3", mmdit)):
        dm = _load(comfy, tmp_path, family, "checkpoints").model.diffusion_model
        keys = ["diffusion_model." + k for k in dm.state_dict()]
        assert mod.unmapped(dm, keys) == []
        assert mod.unmapped(dm, ["diffusion_model.no_such.weight"]) == ["diffusion_model.no_such.weight"]


@pytest.mark.slow
def test_flux_calls_the_engine_does_not_take_run_in_pytorch(tmp_path, caplog):
    """ControlNet residuals, Kontext references, a missing guidance: each in PyTorch, named."""
    comfy = harness.start(tmp_path)
    model = _load(comfy, tmp_path, "flux-schnell", "checkpoints")
    applied, _ = comfy.node("SdAccelBuildEngines").build(model, **BUILD)
    positive, negative = _conds("flux-schnell")
    want = comfy.sample_dit(applied, positive, negative)
    assert "2 on engines, 0 in PyTorch" in _report(caplog)

    class Control:  # ComfyUI's ControlNet object, as get_control's result: residuals per block
        previous_controlnet = None

        def get_control(self, x, sigma, cond, batch):
            return {"input": [torch.zeros(x.shape[0], 16, 64)], "output": []}

    comfy.sample_dit(applied, dict(positive, control=Control()), dict(negative, control=Control()))
    line = _report(caplog)
    assert "no residual-taking transformer engine" in line and "0 on engines" in line, line

    ref = [torch.randn(1, 16, 8, 8)]
    comfy.sample_dit(applied, dict(positive, reference_latents=ref), dict(negative, reference_latents=ref))
    line = _report(caplog)
    assert "ref_latents" in line and "0 on engines" in line, line

    got = comfy.sample_dit(applied, positive, negative)  # and back on the engine
    assert "2 on engines, 0 in PyTorch" in _report(caplog)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unsupported_flux_variant_says_why(tmp_path):
    from sd_accel.comfyui import flux

    comfy = harness.start(tmp_path)
    dm = _load(comfy, tmp_path, "flux-dev", "checkpoints").model.diffusion_model
    assert flux.unsupported(dm) is None
    dm.params.txt_ids_dims = [0]
    assert "text rotary ids" in flux.unsupported(dm)


@pytest.mark.slow
def test_comfyuis_flux_engine_serves_load_pipeline_of_the_same_file(tmp_path, caplog):
    """Keyed by the file: ComfyUI's engine (UNETLoader's FLUX.1 file in Black Forest Labs' layout)
    serves ``load_pipeline`` + ``accelerate`` of that file (what the CLI and the app run)."""
    from sd_accel import accelerate, load_pipeline
    from sd_accel.models.builtin import build_tiny_pipeline
    from sd_accel.runtime.swap import stats

    from support import transformer_layout as layout

    ref = build_tiny_pipeline("flux-dev")
    root = tmp_path / "models"
    for folder in ("diffusion_models", "vae", "text_encoders"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    path = layout.save(layout.flux_transformer_state_dict(ref.transformer), root / "diffusion_models" / "flux1-dev.safetensors")
    layout.save(layout.vae_state_dict(ref.vae), root / "vae" / "ae.safetensors")
    layout.save(layout.clip_state_dict(ref.text_encoder), root / "text_encoders" / "clip_l.safetensors")
    layout.save(layout.t5_state_dict(ref.text_encoder_2), root / "text_encoders" / "t5xxl_fp16.safetensors")

    comfy = harness.start(tmp_path, tmp_path / "engines")
    model = comfy.sd.load_diffusion_model(str(path))  # (the pack wraps ComfyUI's loader: the file is known)
    # one image at 64 px (16 tokens), T5 at 16 tokens
    comfy.node("SdAccelBuildEngines").build(model, **dict(BUILD, batch="1", text="16"))
    harness.purge()

    pipe = accelerate(load_pipeline(str(path)), engines=True, backend="onnxruntime", engine_dir=tmp_path / "engines")
    assert any("built by the WebUI or ComfyUI, serve it too" in r.getMessage() for r in caplog.records)
    on = pipe("a cat", height=64, width=64, num_inference_steps=2, max_sequence_length=16,
              generator=torch.Generator().manual_seed(0), output_type="latent").images
    s = stats(pipe)["transformer"]
    assert s["engine_calls"] == 2 and s["torch_calls"] == 0, s
    off = ref("a cat", height=64, width=64, num_inference_steps=2, max_sequence_length=16,
              generator=torch.Generator().manual_seed(0), output_type="latent").images
    torch.testing.assert_close(on, off, atol=2e-3, rtol=2e-3)


class _Residuals:
    """ComfyUI's ControlNet object as the sampler asks it (``get_control``): random residuals for
    some double and single blocks, a None and a short one among them, as ControlNets give them."""

    previous_controlnet = None

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def get_control(self, x, sigma, cond, batch):
        g = torch.Generator().manual_seed(self.seed + int(float(sigma.flatten()[0]) * 1000))
        tokens = ((x.shape[-2] + 1) // 2) * ((x.shape[-1] + 1) // 2)

        def r(n: int) -> torch.Tensor:
            return torch.randn(x.shape[0], n, 64, generator=g) * 0.5

        return {"input": [r(tokens), None], "output": [r(tokens - 3)]}


@pytest.mark.slow
def test_flux_controlnet_residuals_run_on_the_residual_taking_engine(tmp_path, caplog):
    """ComfyUI's ControlNet residuals on FLUX.1 (the ``control`` dict its ControlNet nodes make):
    the Build node's ``unet_control`` makes ``transformer_control``; a run with residuals runs on it
    and gives ComfyUI's own latent; a run without them stays on the plain engine."""
    comfy = harness.start(tmp_path)
    model = _load(comfy, tmp_path, "flux-schnell", "checkpoints")
    positive, negative = _conds("flux-schnell")
    pos, neg = dict(positive, control=_Residuals(1)), dict(negative, control=_Residuals(2))
    want = comfy.sample_dit(model, pos, neg)  # ComfyUI's own path
    plain = comfy.sample_dit(model, positive, negative)
    assert (want - plain).abs().max() > 1e-2  # the residuals change the latent

    applied, report = comfy.node("SdAccelBuildEngines").build(model, **dict(BUILD, components="unet+unet_control"))
    assert "transformer_control" in report, report
    got = comfy.sample_dit(applied, pos, neg)
    line = _report(caplog)
    assert "2 on engines, 0 in PyTorch" in line, line
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    got = comfy.sample_dit(applied, positive, negative)
    assert "2 on engines, 0 in PyTorch" in _report(caplog)
    torch.testing.assert_close(got, plain, atol=2e-3, rtol=2e-3)


@pytest.mark.slow
def test_flux_controlnet_with_a_lora_runs_on_the_refitted_residual_taking_engine(tmp_path, caplog):
    """ControlNet residuals and a LoRA together on FLUX.1: the residual-taking engine is refitted
    to ComfyUI's patched weights at the run's first ControlNet call (the plain transformer engine
    only where a call has no residuals), each strength its own refit, every call on an engine and
    equal to ComfyUI's own run with the same LoRA and residuals."""
    comfy = harness.start(tmp_path)
    model = _load(comfy, tmp_path, "flux-schnell", "checkpoints")
    positive, negative = _conds("flux-schnell")
    pos, neg = dict(positive, control=_Residuals(1)), dict(negative, control=_Residuals(2))
    applied, _ = comfy.node("SdAccelBuildEngines").build(model, **dict(BUILD, components="unet+unet_control"))
    lora = _lora(model, seed=3)
    seen = []
    for strength in (0.7, 1.0):
        want = comfy.sample_dit(_with_loras(model, [(lora, strength)]), pos, neg)  # ComfyUI's own
        caplog.clear()
        got = comfy.sample_dit(_with_loras(applied, [(lora, strength)]), pos, neg)
        line = _report(caplog)
        assert "2 on engines, 0 in PyTorch" in line, line
        assert "transformer (ControlNet residuals) on engine" in line and f":{strength:g}" in line, line
        assert "flux transformer on engine" not in line, line  # every call had residuals: no plain refit
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        seen.append(got)
    assert (seen[1] - seen[0]).abs().max() > 1e-2  # 1.0 is not 0.7's weights
    # the same LoRA without residuals: the plain transformer engine, refitted (its own line)
    caplog.clear()
    want = comfy.sample_dit(_with_loras(model, [(lora, 1.0)]), positive, negative)
    got = comfy.sample_dit(_with_loras(applied, [(lora, 1.0)]), positive, negative)
    line = _report(caplog)
    assert "2 on engines, 0 in PyTorch" in line and "(ControlNet residuals)" not in line, line
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.slow
def test_build_node_run_again_on_built_engines_keeps_the_loaded_engines_and_refits(tmp_path, caplog):
    """ComfyUI executes the Build node again whenever its cached output was dropped (another graph
    ran in between); with every engine already built and loaded it builds nothing, and the loaded
    engines and the LoRA's refit of ``transformer_control`` stay: the next run with the same LoRA
    and residuals does not refit again (it did: 30 s in a real ComfyUI, minutes at full size)."""
    comfy = harness.start(tmp_path)
    model = _load(comfy, tmp_path, "flux-schnell", "checkpoints")
    positive, negative = _conds("flux-schnell")
    pos, neg = dict(positive, control=_Residuals(1)), dict(negative, control=_Residuals(2))
    build = dict(BUILD, components="unet+unet_control")
    applied, _ = comfy.node("SdAccelBuildEngines").build(model, **build)
    lora = _lora(model, seed=3)
    want = comfy.sample_dit(_with_loras(model, [(lora, 0.7)]), pos, neg)
    comfy.sample_dit(_with_loras(applied, [(lora, 0.7)]), pos, neg)
    assert "refitted" in _report(caplog)
    applied, _ = comfy.node("SdAccelBuildEngines").build(model, **build)  # (all cached: nothing built)
    caplog.clear()
    got = comfy.sample_dit(_with_loras(applied, [(lora, 0.7)]), pos, neg)
    line = _report(caplog)
    assert "2 on engines, 0 in PyTorch" in line and "no refit" in line, line
    assert not [r for r in caplog.records if "refitting" in r.getMessage()]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


class _MMDiTResiduals(_Residuals):
    """ComfyUI's ControlNet ``control`` for an MMDiT of two joint blocks (width 128): ``output[i]``
    added after joint block i, the last, context-pre-only block too (which diffusers' SD3 never
    adds to)."""

    def get_control(self, x, sigma, cond, batch):
        g = torch.Generator().manual_seed(self.seed + int(float(sigma.flatten()[0]) * 1000))
        tokens = ((x.shape[-2] + 1) // 2) * ((x.shape[-1] + 1) // 2)
        return {"output": [torch.randn(x.shape[0], tokens, 128, generator=g) * 0.5 for _ in range(2)]}


@pytest.mark.slow
def test_sd3_controlnet_residuals_run_on_the_residual_taking_engine(tmp_path, caplog):
    """ComfyUI's ControlNet residuals on SD3's MMDiT (after every joint block, the last one
    included): the Build node's ``unet_control`` makes SD3's ``transformer_control``; a run with
    residuals (and then with a LoRA too) runs on it and gives ComfyUI's own latent."""
    comfy = harness.start(tmp_path)
    model = _load(comfy, tmp_path, "sd3", "checkpoints")
    assert len(model.model.diffusion_model.joint_blocks) == 2  # the residuals above: one per block
    positive, negative = _conds("sd3")
    pos, neg = dict(positive, control=_MMDiTResiduals(1)), dict(negative, control=_MMDiTResiduals(2))
    want = comfy.sample_dit(model, pos, neg)  # ComfyUI's own path
    assert (want - comfy.sample_dit(model, positive, negative)).abs().max() > 1e-2

    applied, report = comfy.node("SdAccelBuildEngines").build(model, **dict(BUILD, components="unet+unet_control"))
    assert "transformer_control" in report, report
    caplog.clear()
    got = comfy.sample_dit(applied, pos, neg)
    line = _report(caplog)
    assert "2 on engines, 0 in PyTorch" in line, line
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)

    lora = _lora(model, seed=3)
    want = comfy.sample_dit(_with_loras(model, [(lora, 0.8)]), pos, neg)
    caplog.clear()
    got = comfy.sample_dit(_with_loras(applied, [(lora, 0.8)]), pos, neg)
    line = _report(caplog)
    assert "2 on engines, 0 in PyTorch" in line and "(ControlNet residuals) on engine" in line, line
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_flux_autoencoder_runs_on_engines(tmp_path, caplog):
    """FLUX.1's / SD3's 16-channel autoencoder (no quant convs) from a VAE loader: the Build node's
    vae_decoder / vae_encoder build its halves, and the pack's VAE Decode / Encode run them, equal
    to ComfyUI's own decode and encode."""
    comfy = harness.start(tmp_path)
    model = _load(comfy, tmp_path, "flux-schnell", "checkpoints")
    vae = comfy.sd.VAE(comfy.sd.AutoencoderKL(seed=5, z_channels=16))
    latent = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    want = vae.decode(latent)
    comfy.node("SdAccelBuildEngines").build(model, vae=vae, **dict(BUILD, components="vae_decoder+vae_encoder"))
    caplog.clear()
    (got,) = comfy.node("SdAccelVAEDecode").decode({"samples": latent}, vae)
    assert re.search(r"VAE decoder calls: 1 on engines, 0 in PyTorch", caplog.text), caplog.text
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    caplog.clear()
    (encoded,) = comfy.node("SdAccelVAEEncode").encode(want, vae)
    assert re.search(r"VAE encoder calls: 1 on engines, 0 in PyTorch", caplog.text), caplog.text
    torch.testing.assert_close(encoded["samples"], vae.encode(want), atol=2e-3, rtol=2e-3)
    assert encoded["samples"].shape == (1, 16, 8, 8)


def test_flux_text_encoders_run_on_engines(tmp_path, caplog):
    """FLUX.1's CLIP (a DualCLIPLoader's clip_l + t5xxl): the Build node's ``clip`` builds an engine
    for each (ComfyUI's T5 on ``comfy_t5``, its CLIP-L on ``comfy_clip``), and the pack's text-encode
    node runs both, equal to ComfyUI's own conditioning and pooled row."""
    comfy = harness.start(tmp_path)
    model = _load(comfy, tmp_path, "flux-schnell", "checkpoints")
    clip = comfy.sd.CLIP(seed=4, flux=True)
    with torch.inference_mode():
        ((want, extra),) = clip.encode_from_tokens_scheduled(clip.tokenize("a red cube on a table"))
    assert want.shape[1] == 256  # T5's tokens, padded as ComfyUI's T5 tokenizer pads them
    _, report = comfy.node("SdAccelBuildEngines").build(model, clip=clip, **dict(BUILD, components="clip", text="256"))
    assert "t5xxl" in report and "clip_l" in report, report
    caplog.clear()
    ((got, got_extra),) = comfy.node("SdAccelCLIPTextEncode").encode(clip, "a red cube on a table")[0]
    assert "text encoder t5xxl calls: 1 on engines, 0 in PyTorch" in caplog.text, caplog.text
    assert "text encoder clip_l calls: 1 on engines, 0 in PyTorch" in caplog.text, caplog.text
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_extra["pooled_output"], extra["pooled_output"], atol=2e-3, rtol=2e-3)


def test_a_refit_that_would_not_fit_runs_in_pytorch_before_copying(tmp_path, caplog, monkeypatch):
    """A LoRA refit of a transformer engine first makes a float32 copy of ComfyUI's patched weights
    (48 GB at FLUX.1's real size): where that copy and the engine would not fit, the run goes on in
    PyTorch with the reason, before anything is copied, and ComfyUI's result is its own."""
    import sd_accel.refit

    comfy = harness.start(tmp_path)
    model = _load(comfy, tmp_path, "flux-schnell", "checkpoints")
    positive, negative = _conds("flux-schnell")
    applied, _ = comfy.node("SdAccelBuildEngines").build(model, **BUILD)
    lora = _lora(model, seed=3)
    want = comfy.sample_dit(_with_loras(model, [(lora, 1.0)]), positive, negative)
    monkeypatch.setattr(sd_accel.refit, "available_memory", lambda: 1 << 20)
    caplog.clear()
    got = comfy.sample_dit(_with_loras(applied, [(lora, 1.0)]), positive, negative)
    line = _report(caplog)
    assert "0 on engines, 2 in PyTorch" in line and "not enough memory to refit" in line, line
    assert "a float32 copy of the patched transformer and the engine need" in caplog.text  # said in full once
    refit_line = line.splitlines()[1]  # (not "on engine ... refitted": the calls ran in PyTorch)
    assert "flux transformer engine" in refit_line and "not refitted for" in refit_line, line
    assert "on engine" not in refit_line, line
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
