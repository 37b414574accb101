"""Component specs: which apply to a pipeline, their I/O, profile mapping, export dims, sample feeds.

Everything here runs torch only (fast); ONNX export and ONNX Runtime comparisons of the same specs
are in test_onnx_export.py.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
from diffusers import AutoencoderKL, StableDiffusionInpaintPipeline, UNet2DConditionModel

from sd_accel.components import (
    COMPONENTS,
    ClipSpec,
    UNetSpec,
    UnsupportedComponent,
    VaeDecoderSpec,
    VaeEncoderSpec,
    export_latent_size,
    specs_for,
)
from sd_accel.models.families import CONFIG_ROOT
from sd_accel.profiles import Profile, preset


@pytest.fixture(scope="module")
def sd2(tiny_factory):
    return tiny_factory("sd2-v")


@pytest.fixture(scope="module")
def inpaint(tiny_factory):
    """A tiny SD 1.5 inpainting pipeline: the tiny UNet with 9 input channels."""
    pipe = tiny_factory("sd15")
    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config(pipe.unet.config, in_channels=9).eval()
    return StableDiffusionInpaintPipeline(**{**pipe.components, "unet": unet})


def out_shapes(spec, dims: dict[str, int]) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(d if isinstance(d, int) else dims[d] for d in t.dims) for t in spec.outputs()}


def test_components_names():
    assert COMPONENTS == ("clip", "clip2", "t5", "unet", "transformer", "vae_decoder", "vae_encoder")


def test_specs_for_each_family(tiny_sd15, sd2, tiny_sdxl, inpaint):
    assert list(specs_for(tiny_sd15)) == ["clip", "unet", "vae_decoder", "vae_encoder"]
    assert list(specs_for(sd2)) == ["clip", "unet", "vae_decoder", "vae_encoder"]
    assert list(specs_for(tiny_sdxl)) == ["clip", "clip2", "unet", "vae_decoder", "vae_encoder"]
    specs = specs_for(tiny_sdxl)
    assert specs["clip"].torch_module() is tiny_sdxl.text_encoder
    assert specs["clip2"].torch_module() is tiny_sdxl.text_encoder_2
    assert specs["vae_decoder"].torch_module() is tiny_sdxl.vae
    assert specs_for(inpaint)["unet"].inputs()[0].dims == ("B2", 9, "H8", "W8")


def test_clip_io(tiny_sd15, tiny_sdxl):
    clip = specs_for(tiny_sd15)["clip"]
    (ids,) = clip.inputs()
    assert (ids.name, ids.dims, ids.dtype) == ("input_ids", ("B", 77), torch.int32)
    layers = tiny_sd15.text_encoder.config.num_hidden_layers
    names = [t.name for t in clip.outputs()]
    assert names == ["last_hidden_state", "pooler_output", *[f"hidden_states.{i}" for i in range(layers + 1)]]
    clip2 = specs_for(tiny_sdxl)["clip2"]
    assert [t.name for t in clip2.outputs()][:2] == ["last_hidden_state", "text_embeds"]
    assert clip2.outputs()[1].dims == ("B", tiny_sdxl.text_encoder_2.config.projection_dim)
    assert clip2.outputs()[0].dims == ("B", 77, tiny_sdxl.text_encoder_2.config.hidden_size)


@pytest.mark.parametrize("component", ["clip", "clip2"])
def test_clip_wrapper_matches_encoder(tiny_sdxl, component):
    spec = specs_for(tiny_sdxl)[component]
    feed = spec.sample_feed({"B": 3}, seed=5)
    encoder = spec.torch_module()
    with torch.no_grad():
        got = spec.export_module()(*feed.values())
        ref = encoder(feed["input_ids"].long(), output_hidden_states=True)
    assert [tuple(g.shape) for g in got] == list(out_shapes(spec, {"B": 3}).values())
    pooled = ref.text_embeds if component == "clip2" else ref.pooler_output
    for a, b in zip(got, (ref.last_hidden_state, pooled, *ref.hidden_states), strict=True):
        torch.testing.assert_close(a, b)
    # hidden_states.N is the last layer before the final norm; last_hidden_state is after it.
    assert not torch.allclose(got[0], got[-1])


def test_unet_io(tiny_sd15, tiny_sdxl):
    sd = specs_for(tiny_sd15)["unet"]
    cross = tiny_sd15.unet.config.cross_attention_dim
    assert [(t.name, t.dims) for t in sd.inputs()] == [
        ("sample", ("B2", 4, "H8", "W8")),
        ("timestep", ("B2",)),
        ("encoder_hidden_states", ("B2", "T", cross)),
    ]
    assert [(t.name, t.dims) for t in sd.outputs()] == [("latent", ("B2", 4, "H8", "W8"))]
    xl = specs_for(tiny_sdxl)["unet"]
    pooled = tiny_sdxl.text_encoder_2.config.projection_dim
    assert [(t.name, t.dims) for t in xl.inputs()][3:] == [("text_embeds", ("B2", pooled)), ("time_ids", ("B2", 6))]
    assert all(t.dtype == torch.float32 for t in xl.inputs())


@pytest.mark.parametrize("family", ["sd15", "sdxl", "inpaint"])
def test_unet_wrapper_matches_unet(tiny_sd15, tiny_sdxl, inpaint, family):
    pipe = {"sd15": tiny_sd15, "sdxl": tiny_sdxl, "inpaint": inpaint}[family]
    spec = specs_for(pipe)["unet"]
    dims = {"B2": 2, "H8": 9, "W8": 13, "T": 154}
    feed = spec.sample_feed(dims, seed=2)
    names = [t.name for t in spec.inputs()]
    with torch.no_grad():
        (got,) = spec.export_module()(*feed.values())
        extra = {"added_cond_kwargs": {k: feed[k] for k in names[3:]}} if len(names) > 3 else {}
        ref = pipe.unet(feed["sample"], feed["timestep"], feed["encoder_hidden_states"], **extra).sample
    assert tuple(got.shape) == out_shapes(spec, dims)["latent"]
    torch.testing.assert_close(got, ref)


def test_vae_wrappers_match_vae(tiny_sd15):
    specs = specs_for(tiny_sd15)
    vae = tiny_sd15.vae
    z = torch.randn(2, 4, 9, 13)
    x = torch.rand(2, 3, 72, 104) * 2 - 1
    with torch.no_grad():
        (images,) = specs["vae_decoder"].export_module()(z)
        (moments,) = specs["vae_encoder"].export_module()(x)
        torch.testing.assert_close(images, vae.decode(z).sample)
        torch.testing.assert_close(moments[:, :4], vae.encode(x).latent_dist.mean)
    assert tuple(images.shape) == (2, 3, 72, 104)
    assert tuple(moments.shape) == (2, 8, 9, 13)


def test_dynamic_profile_mapping(tiny_sd15):
    specs = specs_for(tiny_sd15)
    profile = preset("dynamic-512-768")
    assert specs["unet"].dim_ranges(profile) == {
        "B2": (1, 2, 8),
        "H8": (64, 64, 96),
        "W8": (64, 64, 96),
        "T": (77, 77, 154),
    }
    assert specs["unet"].shape_ranges(profile)["sample"] == ((1, 4, 64, 64), (2, 4, 64, 64), (8, 4, 96, 96))
    assert specs["unet"].shape_ranges(profile)["encoder_hidden_states"] == ((1, 77, 64), (2, 77, 64), (8, 154, 64))
    assert specs["clip"].shape_ranges(profile) == {"input_ids": ((1, 77), (1, 77), (4, 77))}
    assert specs["vae_decoder"].shape_ranges(profile) == {"latent": ((1, 4, 64, 64), (1, 4, 64, 64), (4, 4, 96, 96))}
    assert specs["vae_encoder"].shape_ranges(profile) == {
        "images": ((1, 3, 512, 512), (1, 3, 512, 512), (4, 3, 768, 768))
    }


def test_static_profile_mapping(tiny_sd15):
    specs = specs_for(tiny_sd15)
    profile = preset("static-512")
    assert specs["unet"].dim_ranges(profile) == {"B2": (2, 2, 2), "H8": (64,) * 3, "W8": (64,) * 3, "T": (77,) * 3}
    assert specs["clip"].dim_ranges(profile) == {"B": (1, 1, 1)}
    assert specs["vae_decoder"].dim_ranges(profile)["B"] == (1, 1, 1)
    two = Profile(batch=2, height=768, width=512)
    assert specs["unet"].dim_ranges(two)["B2"] == (4, 4, 4)
    assert specs["unet"].shape_ranges(two)["sample"] == ((4, 4, 96, 64),) * 3
    # CLIP still serves batch 1 (prompt and negative prompt are encoded separately).
    assert specs["clip"].dim_ranges(two) == {"B": (1, 2, 2)}
    assert specs["vae_decoder"].dim_ranges(two)["B"] == (2, 2, 2)


def test_export_latent_size_does_not_divide():
    for ups in range(6):
        side = export_latent_size(ups)
        assert side % (2**ups) != 0 or ups == 0
        assert side >= 16


def test_export_dims_real_sd15_unet():
    """The real SD 1.5 UNet (3 upsamplers) is traced at a latent size that does not divide by 8."""
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(CONFIG_ROOT / "sd15" / "unet"))
    spec = UNetSpec(types.SimpleNamespace(unet=unet, vae=None))
    dims = spec.export_dims()
    assert unet.num_upsamplers == 3
    assert dims["H8"] % 8 != 0 and dims["W8"] % 8 != 0
    assert dims["B2"] == 2 and dims["T"] == 77
    assert spec.inputs()[2].dims == ("B2", "T", 768)


def test_tiny_export_dims(tiny_sd15, tiny_sdxl):
    for pipe in (tiny_sd15, tiny_sdxl):
        specs = specs_for(pipe)
        ups = pipe.unet.num_upsamplers
        dims = specs["unet"].export_dims()
        assert dims["H8"] % (2**ups) != 0
        assert specs["clip"].export_dims() == {"B": 2}
        vae = specs["vae_encoder"].export_dims()
        assert vae["H"] == 8 * vae["H8"]


def test_sample_feeds_are_realistic(tiny_sd15, tiny_sdxl):
    clip = specs_for(tiny_sd15)["clip"]
    ids = clip.sample_feed({"B": 64})["input_ids"]
    assert ids.dtype == torch.int32
    assert 0 <= int(ids.min()) and int(ids.max()) < tiny_sd15.text_encoder.config.vocab_size
    assert int(ids.max()) > 1000  # drawn from the whole vocabulary, not {0, 1}

    unet = specs_for(tiny_sdxl)["unet"]
    feed = unet.sample_feed({"B2": 64, "H8": 8, "W8": 8, "T": 77})
    t = feed["timestep"]
    assert t.dtype == torch.float32 and 0 <= float(t.min()) and float(t.max()) < 1000
    assert len(t.unique()) > 10
    assert 0.8 < float(feed["sample"].std()) < 1.2
    assert 0 <= float(feed["time_ids"].min()) and float(feed["time_ids"].max()) <= 1024
    assert not torch.equal(feed["sample"], unet.sample_feed({"B2": 64, "H8": 8, "W8": 8, "T": 77}, seed=1)["sample"])

    images = specs_for(tiny_sd15)["vae_encoder"].sample_feed({"B": 2, "H": 64, "W": 64})["images"]
    assert float(images.min()) >= -1 and float(images.max()) <= 1 and float(images.std()) > 0.3


def test_vae_scale_factor_from_config():
    """A VAE with three levels has latents 1/4 of the image; nothing assumes 8."""
    torch.manual_seed(0)
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(32, 32, 32),
        latent_channels=4,
    ).eval()
    pipe = types.SimpleNamespace(vae=vae)
    dec, enc = VaeDecoderSpec(pipe), VaeEncoderSpec(pipe)
    profile = Profile(batch=1, height=64, width=96)
    assert dec.dim_ranges(profile)["H8"] == (16, 16, 16)
    assert dec.dim_ranges(profile)["W8"] == (24, 24, 24)
    dims = enc.export_dims()
    assert dims["H"] == 4 * dims["H8"]
    with torch.no_grad():
        (moments,) = enc.export_module()(*enc.sample_feed(dims).values())
        (images,) = dec.export_module()(torch.randn(1, 4, 5, 7))
    assert tuple(moments.shape) == (2, 8, dims["H8"], dims["W8"])
    assert tuple(images.shape) == (1, 3, 20, 28)


def test_unsupported_unet_is_left_out(tiny_sd15, caplog):
    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config(tiny_sd15.unet.config, class_embed_type="timestep")
    pipe = types.SimpleNamespace(unet=unet, vae=tiny_sd15.vae, text_encoder=tiny_sd15.text_encoder)
    with pytest.raises(UnsupportedComponent, match="class_embed_type"):
        UNetSpec(pipe)
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        specs = specs_for(pipe)
    assert list(specs) == ["clip", "vae_decoder", "vae_encoder"]
    assert "class_embed_type" in caplog.text


def test_missing_module_is_left_out(tiny_sdxl):
    refiner_like = types.SimpleNamespace(
        text_encoder=None, text_encoder_2=tiny_sdxl.text_encoder_2, unet=tiny_sdxl.unet, vae=tiny_sdxl.vae
    )
    assert list(specs_for(refiner_like)) == ["clip2", "unet", "vae_decoder", "vae_encoder"]
    with pytest.raises(ValueError, match="text_encoder"):
        ClipSpec(refiner_like).torch_module()


def test_every_face_uses_the_one_component_vocabulary():
    """core.py names the components once; the specs, the runtime's slots, the CLI's aliases, the
    panel and the WebUI read those names (the WebUI's model has no clip2; it has unet_control on Forge)."""
    from sd_accel import core
    from sd_accel.components import COMPONENTS
    from sd_accel.runtime.swap import SLOTS
    from sd_accel.ui import state
    from sd_accel.webui import jobs, stand_ins

    assert COMPONENTS == core.COMPONENTS == state.COMPONENT_CHOICES
    assert SLOTS == {"text_encoder": ("clip",), "text_encoder_2": ("clip2", "t5"), "text_encoder_3": ("t5",),
                     "unet": ("unet",), "transformer": ("transformer",), "vae": ("vae_decoder", "vae_encoder")}
    assert core.COMPONENT_ALIASES["vae"] == SLOTS["vae"]
    assert state.DEFAULT_COMPONENTS == core.DEFAULT_COMPONENTS == ("clip", "clip2", "t5", "unet", "transformer",
                                                                   "vae_decoder")
    from sd_accel.components.controlnet import CONTROL_UNET

    # (the WebUI's ControlNet UNet is the same name as a diffusers ControlNet pipeline's)
    assert set(stand_ins.COMPONENTS) <= {*core.COMPONENTS, CONTROL_UNET}
    assert jobs.DEFAULT_COMPONENTS == ("unet", "vae_decoder", "clip")  # the WebUI builds the UNet first
