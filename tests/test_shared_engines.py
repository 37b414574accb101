"""Engines built by the WebUI or ComfyUI for a checkpoint file serve a pipeline loaded from that file.

Both hosts export their original-layout modules (``ldm_unet``: ``(x, timesteps, context[, y])``;
``ldm_vae_decoder`` / ``ldm_vae_encoder``: the VAE's convolution stacks) keyed by the file's
``ckpt-<sha256[:10]>``. Here a second load of the same file plays the host (its UNet called the
original way, as the stand-ins of tests/webui_stub and tests/comfyui_stub do), its engines are
built with the hosts' own specs and :class:`~sd_accel.build.EngineJob`, and then ``load_pipeline`` +
``accelerate`` (what the CLI and the app run) must use them: images within tolerance of torch, calls
counted as the UNet's and VAE's, no build of their own with ``engines="auto"``, and never once the
weights or the file change. ONNX Runtime fp32 at 512 px (SD 1.5) and 256 px (SDXL, its ADM vector).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from diffusers import UNet2DConditionModel

from sd_accel import accelerate, load_pipeline
from sd_accel.build import EngineJob, run_jobs
from sd_accel.cache.store import EngineCache
from sd_accel.components.comfy_clip import ComfyClipSpec
from sd_accel.components.ldm_clip import LdmClipSpec
from sd_accel.components.ldm_unet import LdmUNetSpec
from sd_accel.components.ldm_vae import LdmVaeDecoderSpec, LdmVaeEncoderSpec
from sd_accel.models.file_hashes import checkpoint_id
from sd_accel.profiles import Profile
from sd_accel.runtime.swap import stats

from support.ldm_layout import save_single_file

pytestmark = pytest.mark.slow


class _AdmUNet(UNet2DConditionModel):
    """SDXL's UNet taking the original layout's ADM vector ``y`` (pooled text + embedded sizes)
    where diffusers takes ``text_embeds`` and ``time_ids``: what ComfyUI's and the WebUI's call."""

    def get_aug_embed(self, emb, encoder_hidden_states, added_cond_kwargs):
        if "y" in added_cond_kwargs:
            return self.add_embedding(added_cond_kwargs["y"].to(emb.dtype))
        return super().get_aug_embed(emb=emb, encoder_hidden_states=encoder_hidden_states,
                                     added_cond_kwargs=added_cond_kwargs)


class HostUNet(torch.nn.Module):
    """A host's UNet: ``diffusion_model(x, timesteps, context=..., y=...)`` over the same weights."""

    def __init__(self, unet: UNet2DConditionModel) -> None:
        super().__init__()
        if unet.config.addition_embed_type == "text_time":
            unet.__class__ = _AdmUNet
        self.unet = unet
        self.in_channels = unet.config.in_channels
        self.out_channels = unet.config.out_channels

    @property
    def label_emb(self):  # where ldm_dims reads the ADM width
        emb = getattr(self.unet, "add_embedding", None)
        return None if emb is None else torch.nn.Sequential(torch.nn.Sequential(emb.linear_1, emb.act, emb.linear_2))

    def forward(self, x, timesteps, context=None, y=None):
        added = {"y": y} if y is not None else None
        return self.unet(x, timesteps, context, added_cond_kwargs=added).sample


class _HostLayer(torch.nn.Module):
    """ComfyUI's CLIP layer call ``layer(x, mask, optimized_attention)`` over a transformers layer."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x, mask=None, optimized_attention=None):
        attn = self.layer.self_attn
        h = self.layer.layer_norm1(x)
        x = x + attn.out_proj(optimized_attention(attn.q_proj(h), attn.k_proj(h), attn.v_proj(h), attn.num_heads, mask))
        return x + self.layer.mlp(self.layer.layer_norm2(x))


class HostClip(torch.nn.Module):
    """ComfyUI's ``CLIPTextModel`` shape (``text_model.embeddings / encoder.layers / final_layer_norm``,
    ``num_layers``) over a transformers text encoder's modules."""

    def __init__(self, encoder) -> None:
        super().__init__()
        tm = getattr(encoder, "text_model", encoder)  # (transformers 5: CLIPTextModel is the transformer)
        self.num_layers = len(tm.encoder.layers)
        self.text_model = torch.nn.Module()
        self.text_model.embeddings = tm.embeddings
        self.text_model.encoder = torch.nn.Module()
        self.text_model.encoder.layers = torch.nn.ModuleList(_HostLayer(layer) for layer in tm.encoder.layers)
        self.text_model.final_layer_norm = tm.final_layer_norm


def host_build(path, engine_dir, size: int, vae: bool) -> list:
    """Engines of ``path`` as the WebUI and ComfyUI build them: the host's modules, the file's id
    (ComfyUI's text encoders: the id plus the encoder's name)."""
    host = load_pipeline(str(path))
    ckpt = checkpoint_id(path, engine_dir)
    profile = Profile(batch=1, height=size, width=size)
    specs = [(LdmUNetSpec(HostUNet(host.unet).eval()), ckpt), (ComfyClipSpec(HostClip(host.text_encoder)), f"{ckpt}.clip_l")]
    if getattr(host, "text_encoder_2", None) is not None:
        specs.append((ComfyClipSpec(HostClip(host.text_encoder_2)), f"{ckpt}.clip_g"))
    if vae:
        specs += [(LdmVaeDecoderSpec(host.vae.decoder), ckpt), (LdmVaeEncoderSpec(host.vae.encoder), ckpt)]
    jobs = [EngineJob(spec, profile, "fp32", model_id=wid) for spec, wid in specs]
    return run_jobs(jobs, EngineCache(engine_dir), _backend(engine_dir), progress=False)


def _backend(engine_dir):
    from sd_accel.backends.registry import get_backend

    return get_backend("onnxruntime", cache_root=engine_dir)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("SD_ACCEL_ORT_THREADS", "1")


@pytest.fixture(scope="module")
def sd15_file(tmp_path_factory, tiny_factory):
    """A tiny SD 1.5 single file and the host's engines of it (UNet, VAE halves; 512 px)."""
    root = tmp_path_factory.mktemp("shared")
    path = save_single_file(tiny_factory("sd15"), root / "tiny-sd15.safetensors")
    records = host_build(path, root / "engines", 512, vae=True)
    assert [r.key.component for r in records] == ["ldm_unet", "comfy_clip", "ldm_vae_decoder", "ldm_vae_encoder"]
    return path, root / "engines"


def _run(pipe, **kw):
    g = torch.Generator().manual_seed(0)
    return pipe("a cat", num_inference_steps=3, guidance_scale=7.0, generator=g, output_type="pt", **kw).images


def test_engines_of_the_checkpoint_file_serve_the_pipeline(sd15_file, caplog):
    path, engine_dir = sd15_file
    names = {r.key.component: r.name for r in EngineCache(engine_dir).list()}
    assert EngineCache(engine_dir).find(model=checkpoint_id(path, engine_dir), component="ldm_unet")

    reference = _run(load_pipeline(str(path)), height=512, width=512)
    pipe = accelerate(load_pipeline(str(path)), engines=True, backend="onnxruntime", engine_dir=engine_dir)
    assert pipe.sd_accel.engines["unet"] == 0 and pipe.sd_accel.engines["ldm_unet"] == 1
    assert pipe.sd_accel.engines["ldm_vae_decoder"] == 1 and pipe.sd_accel.engines["comfy_clip"] == 1
    got = _run(pipe, height=512, width=512)
    torch.testing.assert_close(got, reference, atol=2e-3, rtol=0)
    s = stats(pipe)
    # counted as the UNet's and the VAE's calls, on the host's engines
    calls = s["unet"]["engine_calls"]  # (PNDM, the default: one more call than steps)
    assert calls >= 3 and s["unet"]["torch_calls"] == 0
    assert s["unet"]["engines_used"] == {names["ldm_unet"]: calls}
    assert s["vae_decoder"]["engines_used"] == {names["ldm_vae_decoder"]: 1}
    assert s["clip"]["engines_used"] == {names["comfy_clip"]: 2} and s["clip"]["torch_calls"] == 0  # prompt, negative

    # img2img: the encoder engine gives moments, quant_conv runs here, the distribution as torch's
    image = reference.clamp(0, 1)
    ref_latent = load_pipeline(str(path)).vae.encode(image * 2 - 1).latent_dist.mean
    latent = pipe.vae.encode(image * 2 - 1).latent_dist.mean
    torch.testing.assert_close(latent, ref_latent, atol=1e-3, rtol=0)
    assert stats(pipe)["vae_encoder"]["engines_used"] == {names["ldm_vae_encoder"]: 1}

    # a size the host's engines do not cover: torch, counted with the reason
    _run(pipe, height=256, width=256)
    s = stats(pipe)["unet"]
    assert s["torch_calls"] == calls and any("no engine covers" in r for r in s["fallbacks"])


def test_the_app_generates_on_the_hosts_engines(sd15_file):
    """The panel / standalone app (PanelState: load_pipeline + accelerate) on the same engine folder."""
    from sd_accel.ui.state import GenerateRequest, PanelState

    path, engine_dir = sd15_file
    state = PanelState(engine_dir=str(engine_dir), backend="onnxruntime")
    out = state.generate(GenerateRequest(prompt="a cat", model=str(path), width=512, height=512, steps=2,
                                         sampler="Euler", engines="cached"))
    assert out.usage["unet"] == "engine (2 calls)" and out.usage["vae_decoder"] == "engine (1 call)", out.usage
    assert out.usage["clip"] == "engine (2 calls)" and not any(k.startswith(("ldm_", "comfy_")) for k in out.usage)


def test_auto_builds_nothing_where_the_hosts_engines_cover(sd15_file):
    path, engine_dir = sd15_file
    before = {r.name for r in EngineCache(engine_dir).list()}
    pipe = accelerate(load_pipeline(str(path)), engines="auto", backend="onnxruntime", engine_dir=engine_dir)
    pipe.vae.encode(torch.zeros(1, 3, 512, 512))  # (the encoder too)
    _run(pipe, height=512, width=512)
    assert {r.name for r in EngineCache(engine_dir).list()} == before  # no engine of its own
    assert stats(pipe)["unet"]["engine_calls"] >= 3 and stats(pipe)["unet"]["torch_calls"] == 0


def test_changed_weights_or_file_never_run_the_hosts_engines(sd15_file, tmp_path, caplog):
    path, engine_dir = sd15_file
    caplog.set_level(logging.INFO, logger="sd_accel")
    logging.getLogger("sd_accel").addHandler(caplog.handler)

    # weights changed after the swap (a LoRA fused, load_state_dict): torch from then on, said
    pipe = accelerate(load_pipeline(str(path)), engines=True, backend="onnxruntime", engine_dir=engine_dir)
    edited = {k: (v * 1.1 if k.endswith("attn2.to_v.weight") else v) for k, v in pipe.unet.state_dict().items()}
    pipe.unet.load_state_dict(edited)
    got = _run(pipe, height=512, width=512)
    plain = load_pipeline(str(path))
    plain.unet.load_state_dict(edited)
    torch.testing.assert_close(got, _run(plain, height=512, width=512), atol=1e-4, rtol=0)
    assert stats(pipe)["unet"]["engine_calls"] == 0
    assert "the engines of its checkpoint file serve it no more" in caplog.text
    _run(pipe, height=512, width=512)  # and stays so (a refit of the pipeline's own engines never revives them)
    assert stats(pipe)["unet"]["engine_calls"] == 0

    # weights changed before accelerate: not named by the file
    pipe = load_pipeline(str(path))
    pipe.unet.load_state_dict(edited)
    pipe = accelerate(pipe, engines=True, backend="onnxruntime", engine_dir=engine_dir)
    engines = pipe.sd_accel.engines
    assert "ldm_unet" not in engines and engines["ldm_vae_decoder"] == 1 and engines["comfy_clip"] == 1
    assert "its weights changed since loading" in caplog.text

    # the file overwritten after loading (same size, new mtime): the loaded weights are not the file's
    pipe = load_pipeline(str(path))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        pipe = accelerate(pipe, engines=True, backend="onnxruntime", engine_dir=engine_dir)
        assert not any(k.startswith("ldm_") for k in pipe.sd_accel.engines)
        assert "changed on disk since it was loaded" in caplog.text
    finally:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    logging.getLogger("sd_accel").removeHandler(caplog.handler)


def test_sdxl_adm_vector_is_fed_as_the_hosts_take_it(tmp_path, tiny_factory):
    """SDXL: ``y`` = pooled text embedding + ``add_time_proj`` of the six size/crop values."""
    path = save_single_file(tiny_factory("sdxl"), tmp_path / "tiny-sdxl.safetensors")
    records = host_build(path, tmp_path / "engines", 256, vae=False)
    assert records[0].key.component == "ldm_unet"
    g = torch.Generator().manual_seed(0)
    kw = dict(num_inference_steps=2, guidance_scale=5.0, height=256, width=256, output_type="latent")
    reference = load_pipeline(str(path))("a cat", generator=g, **kw).images
    pipe = accelerate(load_pipeline(str(path)), engines=True, backend="onnxruntime", engine_dir=tmp_path / "engines")
    got = pipe("a cat", generator=torch.Generator().manual_seed(0), **kw).images
    torch.testing.assert_close(got, reference, atol=2e-3, rtol=0)
    s = stats(pipe)
    assert s["unet"]["engine_calls"] >= 2 and s["unet"]["torch_calls"] == 0
    # clip_l's penultimate layer and clip_g's with its projected pooled row, from ComfyUI's engines
    # (SDXL zeroes an empty negative prompt instead of encoding it: one call each)
    assert s["clip"]["engine_calls"] == 1 and s["clip2"]["engine_calls"] == 1
    assert s["clip"]["torch_calls"] == 0 and s["clip2"]["torch_calls"] == 0
    assert next(iter(s["clip2"]["engines_used"])).startswith("comfy_clip.")


def test_the_webuis_text_encoder_engine_serves_the_pipeline(tmp_path, tiny_factory):
    """A1111's ``ldm_clip`` (the transformers CLIP, keyed by the checkpoint) takes the same inputs."""
    path = save_single_file(tiny_factory("sd15"), tmp_path / "tiny.safetensors")
    host = load_pipeline(str(path))
    job = EngineJob(LdmClipSpec(host.text_encoder), Profile(batch=1, height=64, width=64), "fp32",
                    model_id=checkpoint_id(path, tmp_path / "engines"))
    run_jobs([job], EngineCache(tmp_path / "engines"), _backend(tmp_path / "engines"), progress=False)
    pipe = accelerate(load_pipeline(str(path)), engines=True, backend="onnxruntime", engine_dir=tmp_path / "engines")
    ids = host.tokenizer("a cat", padding="max_length", max_length=77, return_tensors="pt").input_ids
    want = host.text_encoder(ids, output_hidden_states=True)
    got = pipe.text_encoder(ids, output_hidden_states=True)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.hidden_states[-2], want.hidden_states[-2], atol=1e-4, rtol=0)
    assert next(iter(stats(pipe)["clip"]["engines_used"])).startswith("ldm_clip.")


def test_probes_of_a_large_tensor_stay_inside_it():
    """SDXL's second text encoder's token table has 49408 x 1280 elements, past float32's exact
    integers: the probe positions must still end at its last element, not one past it."""
    from sd_accel.models.source import _probe

    table = torch.zeros(49408, 1280)
    table[-1, -1] = 7.0
    assert _probe(table).tolist() == [0.0, 0.0, 0.0, 0.0, 7.0]
