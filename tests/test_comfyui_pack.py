"""The ComfyUI node pack (``extension/comfyui`` + ``sd_accel.comfyui``) in the stand-in ComfyUI of
``tests/comfyui_stub``: nodes by ComfyUI's conventions, engines built from ComfyUI's MODEL and VAE
keyed as the WebUI keys the checkpoint, UNet calls on engines through ModelPatcher wrappers, LoRA
patches refitted (two strengths, never stale), other patches and ControlNet to PyTorch by name.

The engines are built once for the module (ONNX Runtime fp32, tiny models): the tests that use
them are marked slow."""

from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path

import pytest
import torch

STUB = Path(__file__).resolve().parent / "comfyui_stub"
sys.path.insert(0, str(STUB))
import comfy_harness as harness  # noqa: E402  (named apart from tests/webui_stub/harness.py: one sys.modules)

from support.resident import resident_share  # noqa: E402

sys.path.remove(str(STUB))


@pytest.fixture(autouse=True)
def comfy_lean(monkeypatch, caplog):
    """One ORT thread, caplog on the sd_accel logger, the stub's modules purged after."""
    monkeypatch.setenv("SD_ACCEL_ORT_THREADS", "1")
    logger = logging.getLogger("sd_accel")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="sd_accel")
    yield
    logger.removeHandler(caplog.handler)
    harness.purge()


CUSTOM = "custom (ranges below)"
BUILD = dict(components="unet+vae_decoder+vae_encoder", preset=CUSTOM, backend="onnxruntime", precision="fp32",
             batch="1", height="64", width="64", tokens="77-154")
EVERYTHING = "unet+unet_control+clip+vae_decoder+vae_encoder"


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    """Engines for the tiny checkpoint (UNet 64 px batch 1 with CFG, plain and residual-taking; the
    text encoder for prompts of up to 2 chunks; VAE halves), built once by the node."""
    tmp = tmp_path_factory.mktemp("comfy-engines")
    comfy = harness.start(tmp, tmp / "engines")
    model, clip, vae = comfy.load()
    applied, report = comfy.node("SdAccelBuildEngines").build(model, vae=vae, clip=clip,
                                                              **{**BUILD, "components": EVERYTHING})
    assert report.count("\n") == 4, report  # five engines
    assert comfy.utils.UPDATES and comfy.utils.UPDATES[-1][0] == comfy.utils.UPDATES[-1][1]  # the bar reached its end
    harness.purge()
    return tmp / "engines"


def _unet_calls(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if "UNet calls this run" in r.getMessage()]
    assert lines, "no run report"
    return lines[-1]


def test_nodes_follow_comfyui_conventions(tmp_path):
    comfy = harness.start(tmp_path)
    assert set(comfy.names) == set(comfy.nodes)
    for name, cls in comfy.nodes.items():
        inputs = cls.INPUT_TYPES()
        assert set(inputs) <= {"required", "optional", "hidden"} and "required" in inputs, name
        assert isinstance(cls.RETURN_TYPES, tuple) and callable(getattr(cls, cls.FUNCTION)), name
        assert cls.CATEGORY == "sd-accel"
    assert comfy.nodes["SdAccelApplyEngines"].RETURN_TYPES == ("MODEL",)
    assert comfy.nodes["SdAccelVAEDecode"].INPUT_TYPES()["required"] == {"samples": ("LATENT",), "vae": ("VAE",)}


def test_pack_without_sd_accel_loads_with_a_node_that_says_why(tmp_path):
    comfy = harness.start(tmp_path, without_sd_accel=True)
    assert list(comfy.nodes) == ["SdAccelUnavailable"]
    with pytest.raises(RuntimeError, match="pip install -e"):
        comfy.node("SdAccelUnavailable").why()


def test_unusable_backend_or_precision_is_said_in_the_node(tmp_path, monkeypatch):
    from sd_accel.backends import registry
    from sd_accel.core import DeviceError, SdAccelError

    comfy = harness.start(tmp_path)
    model, _, vae = comfy.load()
    build = comfy.node("SdAccelBuildEngines").build
    with pytest.raises(SdAccelError, match="precision='bf16': the onnxruntime backend builds fp32"):
        build(model, vae=vae, **{**BUILD, "precision": "bf16"})

    def unusable(name="auto", cache_root=None, device=None, live_modules=True):  # the registry's answer where TensorRT is missing
        raise DeviceError(f"backend={name!r} cannot run here: TensorRT is not installed")

    monkeypatch.setattr(registry, "get_backend", unusable)
    with pytest.raises(SdAccelError, match="'tensorrt' cannot run here.*TensorRT is not installed"):
        build(model, vae=vae, **{**BUILD, "backend": "tensorrt"})


def test_interrupt_cancels_the_build(tmp_path):
    comfy = harness.start(tmp_path)
    model, _, vae = comfy.load()
    comfy.model_management.interrupt_current_processing(True)
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        comfy.node("SdAccelBuildEngines").build(model, vae=vae, **{**BUILD, "components": "vae_decoder"})
    from sd_accel.comfyui.state import state

    assert not state().cache().list()


@pytest.mark.slow
def test_engines_serve_txt2img_keyed_like_the_webui(tmp_path, engine_dir, caplog):
    from sd_accel.webui.identity import weights_id

    comfy = harness.start(tmp_path, engine_dir)
    model, clip, vae = comfy.load()
    sha = hashlib.sha256(comfy.checkpoint.read_bytes()).hexdigest()[:10]
    from sd_accel.comfyui.state import state

    records = state().cache().list()
    # the WebUI's id for the same file; the text encoder's is that plus its name
    assert {r.key.model for r in records} == {weights_id(sha), weights_id(sha) + ".clip_l"}
    assert {r.key.component for r in records} == {"ldm_unet", "ldm_unet_control", "comfy_clip", "ldm_vae_decoder",
                                                  "ldm_vae_encoder"}
    unet_record = next(r for r in records if r.key.component == "ldm_unet")
    assert unet_record.extra["webui"]["hash"] == sha and unet_record.extra["webui"]["host"] == "comfyui"

    reference = comfy.sample(model, clip, steps=3)
    engines = comfy.node("SdAccelApplyEngines").apply(model)[0]
    assert engines is not model and engines.model is model.model  # a clone, ComfyUI's way
    got = comfy.sample(engines, clip, steps=3)
    torch.testing.assert_close(got, reference, atol=2e-3, rtol=2e-3)
    assert _unet_calls(caplog).startswith("sd-accel: UNet calls this run: 3 on engines, 0 in PyTorch")

    # A size no profile covers: PyTorch, counted and said once, with the same result as torch.
    caplog.clear()
    other = comfy.sample(engines, clip, steps=2, size=80)
    torch.testing.assert_close(other, comfy.sample(model, clip, steps=2, size=80), atol=1e-5, rtol=1e-5)
    assert "0 on engines, 2 in PyTorch" in _unet_calls(caplog)

    with torch.inference_mode():
        images = comfy.node("SdAccelVAEDecode").decode({"samples": got}, vae)[0]
        torch.testing.assert_close(images, vae.decode(got), atol=2e-3, rtol=2e-3)
        assert "VAE decoder calls: 1 on engines, 0 in PyTorch" in caplog.text
        latent = comfy.node("SdAccelVAEEncode").encode(images, vae)[0]["samples"]
        torch.testing.assert_close(latent, vae.encode(images), atol=2e-3, rtol=2e-3)
        assert "VAE encoder calls: 1 on engines" in caplog.text
    assert "forward" not in vae.first_stage_model.decoder.__dict__  # its own forward back


@pytest.mark.slow
def test_builds_keep_slim_exports_and_build_another_profile_from_them(tmp_path, engine_dir, caplog):
    """Issue 46 (disk): the node's builds keep each export's graph only (the residual-taking UNet's
    too), as ``build_engines`` does; another profile is built from that graph with the MODEL's
    weights, with no new export, and samples like PyTorch."""
    import shutil

    from sd_accel.onnx.weights import WEIGHTS_FILE, is_slim

    exports = sorted(p for p in (engine_dir / "onnx").iterdir() if p.is_dir() and not p.name.startswith("."))
    assert {p.name.split(".")[0] for p in exports} == {"ldm_unet", "ldm_unet_control", "comfy_clip",
                                                       "ldm_vae_decoder", "ldm_vae_encoder"}
    for folder in exports:
        assert is_slim(folder) and (folder / WEIGHTS_FILE).is_file() and not list(folder.glob("*.data")), folder.name
    copy = tmp_path / "engines"
    shutil.copytree(engine_dir, copy)  # a profile of its own, without changing the module's engines
    comfy = harness.start(tmp_path, copy)
    model, clip, _ = comfy.load()
    unet_weights = sum(t.numel() * t.element_size() for t in model.model.diffusion_model.state_dict().values())
    graph = next(p for p in (copy / "onnx").iterdir() if p.is_dir() and p.name.startswith("ldm_unet.")) / "model.onnx"
    assert sum(f.stat().st_size for f in graph.parent.iterdir()) < 0.25 * unet_weights
    before = (graph.stat().st_ino, graph.stat().st_mtime_ns)
    comfy.node("SdAccelBuildEngines").build(model, **{**BUILD, "components": "unet", "height": "64-96",
                                                       "width": "64-96"})
    assert "weights into the graph of ldm_unet" in caplog.text
    assert (graph.stat().st_ino, graph.stat().st_mtime_ns) == before and is_slim(graph.parent)  # no new export
    engines = comfy.node("SdAccelApplyEngines").apply(model)[0]
    caplog.clear()
    torch.testing.assert_close(comfy.sample(engines, clip, steps=2, size=80), comfy.sample(model, clip, steps=2, size=80),
                               atol=2e-3, rtol=2e-3)
    assert "2 on engines, 0 in PyTorch" in _unet_calls(caplog)


@pytest.mark.slow
def test_lora_refits_at_two_strengths_and_is_never_stale(tmp_path, engine_dir, caplog, monkeypatch):
    comfy = harness.start(tmp_path, engine_dir)
    from sd_accel.comfyui import unet as comfy_unet  # (the pack's modules as start() imported them)

    monkeypatch.setattr(comfy_unet, "KEPT_REFITS", 2)  # one by default (tests/test_refit_memory.py): switch back free
    model, clip, _ = comfy.load()
    lora = comfy.sd.lora_for(model, seed=3)
    engines = comfy.node("SdAccelApplyEngines").apply(model)[0]
    base = comfy.sample(engines, clip)
    results = {}
    for strength in (1.0, 0.5, 1.0):
        caplog.clear()
        torch_lora, _ = comfy.sd.load_lora_for_models(model, clip, lora, strength, strength)
        reference = comfy.sample(torch_lora, clip)
        engine_lora, _ = comfy.sd.load_lora_for_models(engines, clip, lora, strength, strength)  # LoraLoader after
        got = comfy.sample(engine_lora, clip)
        torch.testing.assert_close(got, reference, atol=2e-3, rtol=2e-3)
        assert (got - base).abs().max() > 1e-2  # the LoRA is in the image
        report = _unet_calls(caplog)
        assert "2 on engines, 0 in PyTorch" in report, report
        results.setdefault(strength, []).append(report)
    assert "refitted for" in results[1.0][0] and "kept from an earlier job" in results[1.0][1]
    assert "refitted for" in results[0.5][0] and "at 0.5" not in results[1.0][0]
    # Back to the plain MODEL: the base engine, with the LoRA taken out of the weights.
    caplog.clear()
    torch.testing.assert_close(comfy.sample(engines, clip), base, atol=2e-3, rtol=2e-3)
    assert "2 on engines" in _unet_calls(caplog)


@pytest.mark.slow
def test_patches_controlnet_and_wrappers_run_torch_by_name(tmp_path, engine_dir, caplog):
    comfy = harness.start(tmp_path, engine_dir)
    model, clip, _ = comfy.load()
    engines = comfy.node("SdAccelApplyEngines").apply(model)[0]

    def output_block_patch(h, hsp, transformer_options):  # FreeU's kind of patch
        return h * 1.1, hsp

    freeu = engines.clone()
    freeu.set_model_output_block_patch(output_block_patch)
    torch_freeu = model.clone()
    torch_freeu.set_model_output_block_patch(output_block_patch)
    torch.testing.assert_close(comfy.sample(freeu, clip), comfy.sample(torch_freeu, clip))
    report = _unet_calls(caplog)
    assert "0 on engines, 2 in PyTorch" in report and "output_block_patch" in report
    assert "test_patches_controlnet_and_wrappers_run_torch_by_name.output_block_patch" in report

    class T2IAdapter:  # adds to the input blocks: not in the residual-taking engine
        previous_controlnet = None

        def get_control(self, x, t, cond, batch):
            return {"output": [], "middle": [], "input": [torch.full_like(x[:, :1], 0.01)]}

    caplog.clear()
    comfy.sample(engines, clip, control=T2IAdapter())
    report = _unet_calls(caplog)
    assert "0 on engines, 2 in PyTorch" in report and "T2I-Adapter residuals (control input)" in report

    def other_pack_wrapper(executor, *args, **kwargs):
        return executor(*args, **kwargs)

    wrapped = engines.clone()
    wrapped.add_wrapper_with_key("diffusion_model", "other_pack", other_pack_wrapper)
    caplog.clear()
    comfy.sample(wrapped, clip)
    assert "other UNet wrappers" in _unet_calls(caplog) and "other_pack_wrapper" in _unet_calls(caplog)


def _controlnet(comfy, model, seed=5, strength=1.0, size=64, **kw):
    from comfy.controlnet import ControlNet

    hint = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(seed))
    return ControlNet(model.model.diffusion_model, hint, strength=strength, seed=seed, **kw)


@pytest.mark.slow
def test_controlnet_residuals_run_on_the_residual_taking_engine(tmp_path, engine_dir, caplog):
    comfy = harness.start(tmp_path, engine_dir)
    model, clip, _ = comfy.load()
    engines = comfy.node("SdAccelApplyEngines").apply(model)[0]
    plain = comfy.sample(model, clip)
    net = _controlnet(comfy, model)
    reference = comfy.sample(model, clip, control=net)
    assert (reference - plain).abs().max() > 1e-2  # the ControlNet is in the image
    caplog.clear()
    torch.testing.assert_close(comfy.sample(engines, clip, control=net), reference, atol=2e-3, rtol=2e-3)
    assert _unet_calls(caplog).startswith("sd-accel: UNet calls this run: 2 on engines, 0 in PyTorch (2 with ControlNet")

    # Two chained nets at other strengths, the second on for the first step only (start/end):
    # one engine serves both, and the step where no net is on runs the plain engine.
    first_sigma = float(model.model.model_sampling.sigmas[999])
    chained = _controlnet(comfy, model, seed=6, strength=0.6, sigma_range=(first_sigma - 1e-3, first_sigma + 1e-3),
                          previous=_controlnet(comfy, model, strength=0.8, sigma_range=(first_sigma - 1e-3, 1e9)))
    caplog.clear()
    got = comfy.sample(engines, clip, control=chained)
    torch.testing.assert_close(got, comfy.sample(model, clip, control=chained), atol=2e-3, rtol=2e-3)
    assert "2 on engines, 0 in PyTorch (1 with ControlNet residuals)" in _unet_calls(caplog)

    # A LoRA after the engines: both UNet engines refitted, never stale.
    lora = comfy.sd.lora_for(model, seed=3)
    torch_lora, _ = comfy.sd.load_lora_for_models(model, clip, lora, 0.7, 0.7)
    engine_lora, _ = comfy.sd.load_lora_for_models(engines, clip, lora, 0.7, 0.7)
    caplog.clear()
    got = comfy.sample(engine_lora, clip, control=net)
    torch.testing.assert_close(got, comfy.sample(torch_lora, clip, control=net), atol=2e-3, rtol=2e-3)
    assert "2 on engines, 0 in PyTorch (2 with ControlNet residuals)" in _unet_calls(caplog)


def test_controlnet_without_a_residual_engine_runs_torch_and_says_how_to_build_it(tmp_path, caplog):
    comfy = harness.start(tmp_path)
    model, clip, vae = comfy.load()
    comfy.node("SdAccelBuildEngines").build(model, **{**BUILD, "components": "unet"})
    engines = comfy.node("SdAccelApplyEngines").apply(model)[0]
    net = _controlnet(comfy, model)
    torch.testing.assert_close(comfy.sample(engines, clip, control=net), comfy.sample(model, clip, control=net))
    report = _unet_calls(caplog)
    assert "0 on engines, 2 in PyTorch" in report and "ControlNet residuals (ControlNet)" in report
    assert "components with unet_control" in report
    caplog.clear()
    comfy.sample(engines, clip)  # without the ControlNet: the plain engine
    assert "2 on engines, 0 in PyTorch" in _unet_calls(caplog)


def _cond(conditioning):
    (cond, extra), = conditioning
    return cond, extra["pooled_output"]


@pytest.mark.slow
def test_clip_text_encode_on_engines(tmp_path, engine_dir, caplog):
    comfy = harness.start(tmp_path, engine_dir)
    _, clip, _ = comfy.load()
    node = comfy.node("SdAccelCLIPTextEncode")
    assert comfy.names["SdAccelCLIPTextEncode"] == "sd-accel CLIP Text Encode"
    assert node.RETURN_TYPES == ("CONDITIONING",)
    transformer = clip.cond_stage_model.clip_l.transformer

    def both(c, text):
        with torch.inference_mode():
            mine = _cond(node.encode(c, text)[0])
            theirs = _cond(c.encode_from_tokens_scheduled(c.tokenize(text)))
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
        assert "forward" not in transformer.__dict__  # its own forward back
        return mine

    cond, pooled = both(clip, "a photo of a cat")
    assert cond.shape == (1, 77, 64) and pooled.shape == (1, 64)
    assert "text encoder clip_l calls: 1 on engines, 0 in PyTorch" in caplog.text

    skip = clip.clone()
    skip.clip_layer(-2)  # CLIPSetLastLayer: the penultimate layer, from the engine's hidden states
    assert (both(skip, "a photo of a cat")[0] - cond).abs().max() > 1e-2

    caplog.clear()
    long = both(clip, " ".join(f"word{i}" for i in range(120)))[0]  # two chunks, one engine call
    assert long.shape == (1, 154, 64) and "clip_l calls: 1 on engines" in caplog.text

    clip.embeddings = {"mine": torch.randn(2, 64, generator=torch.Generator().manual_seed(1)) * 0.02}
    with_embedding = both(clip, "a photo of embedding:mine")[0]  # textual inversion: vectors spliced in
    assert (with_embedding - both(clip, "a photo of x y")[0]).abs().max() > 1e-3

    # A LoRA's text-encoder patches: PyTorch (said once), the patched result, never the engine's.
    caplog.clear()
    _, patched = comfy.sd.load_lora_for_models(comfy.load()[0], clip, comfy.sd.clip_lora_for(clip, seed=2), 1.0, 1.0)
    lora_cond = both(patched, "a photo of a cat")[0]
    assert (lora_cond - cond).abs().max() > 1e-2
    assert "clip_l carries LoRA patches: it runs in PyTorch" in caplog.text
    assert "clip_l calls" not in caplog.text
    caplog.clear()
    torch.testing.assert_close(both(clip, "a photo of a cat")[0], cond)  # the plain CLIP again: the engine
    assert "clip_l calls: 1 on engines" in caplog.text


def test_patch_sets_name_each_lora_and_strength(tmp_path):
    from sd_accel.comfyui.identity import patch_set, unet_weights_id

    comfy = harness.start(tmp_path)
    model, clip, _ = comfy.load()
    a, b = comfy.sd.lora_for(model, seed=1), comfy.sd.lora_for(model, seed=2)

    def loras(lora, strength):
        return patch_set(comfy.sd.load_lora_for_models(model, clip, lora, strength, strength)[0].patches)

    a1, a05, b1 = loras(a, 1.0), loras(a, 0.5), loras(b, 1.0)
    assert a1[0][0] == a05[0][0] and (a1[0][1], a05[0][1]) == (1.0, 0.5)  # one LoRA, two strengths
    assert a1[0][0] != b1[0][0]  # same keys, another LoRA: another name (never the other's engine)
    assert loras(a, 0.0) == () and patch_set(model.patches) == ()
    ids = {unet_weights_id("ckpt-0123456789", s) for s in (a1, a05, b1, ())}
    assert len(ids) == 4 and "ckpt-0123456789" in ids


def test_a_checkpoint_overwritten_after_loading_is_keyed_by_the_weights_in_memory(tmp_path):
    """ComfyUI keeps serving the model it loaded when the file is overwritten under the same name;
    the engine id must then not be the new file's hash (an engine of other weights would be built
    and found under it)."""
    import os

    from sd_accel.comfyui.identity import checkpoint_id

    comfy = harness.start(tmp_path, tmp_path / "engines")
    model = comfy.load()[0]
    sha = hashlib.sha256(comfy.checkpoint.read_bytes()).hexdigest()[:10]
    assert checkpoint_id(model.model, tmp_path / "engines") == f"ckpt-{sha}"
    data = bytearray(comfy.checkpoint.read_bytes())
    data[-1] ^= 0xFF  # other bytes in place, same size
    comfy.checkpoint.write_bytes(bytes(data))
    stat = comfy.checkpoint.stat()
    os.utime(comfy.checkpoint, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    after = checkpoint_id(model.model, tmp_path / "engines", fingerprint_of=model.model.diffusion_model)
    assert after.startswith("fp-"), after
    assert after != f"ckpt-{hashlib.sha256(bytes(data)).hexdigest()[:10]}"


def test_engines_of_checkpoints_used_longer_ago_are_closed(tmp_path, monkeypatch):
    """Engines (and refits) of every checkpoint a session touched stayed in RAM until a real
    ComfyUI was killed for memory; only the KEPT_CHECKPOINTS most recent stay loaded."""
    import sd_accel.runtime
    from sd_accel.comfyui import state as state_mod
    from sd_accel.webui.lora import Refit

    closed = []

    class Found:
        def __init__(self, wid):
            self.wid, self.handles = wid, [object()]

        def close(self):
            closed.append(self.wid)

    monkeypatch.setattr(sd_accel.runtime, "engines_for", lambda cache, backend, wid, component, **kw: Found(wid))
    st = state_mod.State(tmp_path / "engines", backend="onnxruntime")
    monkeypatch.setattr(st, "backends_here", lambda: ["onnxruntime"])
    refit_engines = Found("ckpt-aaaaaaaaaa+lora-1")
    where = ("ckpt-aaaaaaaaaa", "onnxruntime", "root", 0)
    st.refits.add(where, Refit(engines=refit_engines, loras=(("l", 1.0),), base=()), keep=2)

    a = st.engines_for("ckpt-aaaaaaaaaa", "ldm_vae_decoder")
    assert st.engines_for("ckpt-aaaaaaaaaa.clip_l", "comfy_clip") is not None
    st.engines_for("ckpt-bbbbbbbbbb", "ldm_vae_decoder")
    assert st.engines_for("ckpt-aaaaaaaaaa", "ldm_vae_decoder") is a and not closed  # two checkpoints: kept
    st.engines_for("ckpt-cccccccccc", "ldm_vae_decoder")  # a third: b, the least recent, goes
    assert closed == ["ckpt-bbbbbbbbbb"]
    st.engines_for("ckpt-dddddddddd+lora-2", "ldm_vae_decoder")  # a fourth: a's engines and its refit go
    assert sorted(closed) == sorted(["ckpt-bbbbbbbbbb", "ckpt-aaaaaaaaaa", "ckpt-aaaaaaaaaa.clip_l",
                                     "ckpt-aaaaaaaaaa+lora-1"])
    assert st.refits.get(where, (("l", 1.0),)) is None



@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parking measures /proc/self/smaps")
def test_runs_on_engines_park_the_torch_unet_and_loras_still_patch_it(tmp_path, engine_dir, caplog):
    """Issue 46: ComfyUI keeps its fp32 UNet in RAM whatever serves the calls; beside the engines a
    real ComfyUI's engine runs held more than its PyTorch runs. A run the engines serve parks it
    (file-backed, its pages handed back at the run's end); LoRA patches still go into it and come
    out again, and a later PyTorch run computes what it did before."""
    comfy = harness.start(tmp_path, engine_dir)
    model, clip, _ = comfy.load()
    unet = model.model.diffusion_model
    base_torch = comfy.sample(model, clip)
    assert resident_share(unet)[0] == 0  # as loaded: anonymous memory
    engines = comfy.node("SdAccelApplyEngines").apply(model)[0]
    comfy.sample(engines, clip)
    assert "2 on engines, 0 in PyTorch" in _unet_calls(caplog)
    mapped, resident = resident_share(unet)
    assert mapped == 1.0 and resident < 0.25, (mapped, resident)
    lora = comfy.sd.lora_for(model, seed=3)
    torch_lora, _ = comfy.sd.load_lora_for_models(model, clip, lora, 0.7, 0.7)
    reference = comfy.sample(torch_lora, clip)
    engine_lora, _ = comfy.sd.load_lora_for_models(engines, clip, lora, 0.7, 0.7)
    caplog.clear()
    torch.testing.assert_close(comfy.sample(engine_lora, clip), reference, atol=2e-3, rtol=2e-3)
    assert "2 on engines, 0 in PyTorch" in _unet_calls(caplog)
    torch.testing.assert_close(comfy.sample(model, clip), base_torch)  # the parked weights are the base ones
