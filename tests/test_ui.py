"""The panel's logic without a browser (``sd_accel.ui.state``), plus the Blocks it builds.

One build of the tiny SD 1.5 model (clip, unet, vae_decoder at 64x64) serves most tests."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from sd_accel.core import InvalidValue
from sd_accel.profiles import PRESETS, Profile
from sd_accel.ui.state import (
    BuildRequest,
    Busy,
    GenerateRequest,
    PanelState,
    disk_usage,
    engine_names,
    engine_rows,
    preset_fields,
    profile_from_fields,
    usage_text,
)

STATIC_64 = Profile(batch=1, height=64, width=64)
COMPONENTS = ("clip", "clip2", "unet", "vae_decoder")  # clip2 is not in SD 1.5: skipped, and said so


def _drain(updates) -> list:
    out = list(updates)
    assert out and out[-1].done and all(not u.done for u in out[:-1])
    return out


def _tiny_request(**kw) -> GenerateRequest:
    # Euler: one UNet call per step, so call counts are exact.
    return GenerateRequest(prompt="a cat", width=64, height=64, steps=2, sampler="Euler", **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A state whose engine dir holds the three 64x64 engines, and the updates of that build.
    ONNX Runtime fp32 (not auto's OpenVINO bf16 on CPUs): exact engines, so the table's error is ~0."""
    state = PanelState(engine_dir=str(tmp_path_factory.mktemp("ui-engines")), backend="onnxruntime")
    updates = _drain(state.build(BuildRequest(profile=STATIC_64, components=COMPONENTS)))
    return state, updates


# --------------------------------------------------------------------------- fields and profiles


def test_range_fields_read_the_one_range_grammar_and_teach_it():
    # the CLI's grammar (sd_accel.profiles.parse_range): N, MIN-MAX (opt = MIN), MIN-OPT-MAX
    assert profile_from_fields("1-4", "256-512-768", "512-768", "77-154") == Profile(
        batch=(1, 1, 4), height=(256, 512, 768), width=(512, 512, 768), tokens=(77, 77, 154))
    assert profile_from_fields("1", "64", "64", "77") == STATIC_64
    for old_form in ("256, 512, 768", "256/512/768"):
        with pytest.raises(ValueError, match="cannot read the height range .*MIN-OPT-MAX"):
            profile_from_fields("1", old_form, "64", "77")
    with pytest.raises(ValueError, match="multiples of 8"):
        profile_from_fields("1", "60", "64", "77")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_fields_read_back_as_the_preset(name):
    assert profile_from_fields(*preset_fields(name)) == PRESETS[name]


def test_preset_fields_are_written_in_the_grammar():
    assert preset_fields("static-512") == ("1", "512", "512", "77")
    assert preset_fields("dynamic-512-768") == ("1-4", "512-768", "512-768", "77-154")
    assert preset_fields("dynamic-256-512") == ("1-4", "256-512-512", "256-512-512", "77-154")


def test_settings_validate_and_map_to_builds(tmp_path):
    state = PanelState()
    with pytest.raises(ValueError, match="backend"):
        state.apply_settings(str(tmp_path), "cuda", "auto")
    assert "Saved" in state.apply_settings(str(tmp_path), "onnxruntime", "bf16")
    assert state.cache().root == tmp_path and state.backend == "onnxruntime"
    assert state.build_precision() == "auto"  # bf16 is a torch precision, not an engine one
    assert state.build_precision("fp16") == "fp16"
    assert state.build_precision("int8") == "int8"  # the engine dropdown offers the quantized ones too
    state.apply_settings("  ", "auto", "fp32")
    assert state.engine_dir is None and state.build_precision() == "fp32"


def test_usage_text_names_engine_or_torch_per_component():
    before = {"unet": {"engine_calls": 5, "torch_calls": 0, "fallbacks": {}}}
    after = {
        "unet": {"engine_calls": 7, "torch_calls": 1, "fallbacks": {"no engine covers x": 1}},
        "vae_decoder": {"engine_calls": 1, "torch_calls": 0, "fallbacks": {}},
        "vae_encoder": {"engine_calls": 0, "torch_calls": 0, "fallbacks": {}},
    }
    usage = usage_text(before, after, {"clip": 0, "unet": 1, "vae_decoder": 1, "vae_encoder": 0}, True)
    assert usage == {
        "clip": "torch (no engine for this model; build one in the Engines tab)",
        "unet": "engine (2 calls) + torch (1 call: no engine covers x)",
        "vae_decoder": "engine (1 call)",
        "vae_encoder": "not called",
    }
    assert usage_text({}, {}, {}, False) == {"all": "torch (engines off)"}
    # ComfyUI's UNet engine of the checkpoint served the calls: counted as the UNet's, not a row of its own
    shared = usage_text({}, {"unet": after["unet"]}, {"unet": 0, "ldm_unet": 1, "comfy_clip": 1}, True)
    assert shared == {"unet": "engine (7 calls) + torch (1 call: no engine covers x)"}


# --------------------------------------------------------------------------- build, table, generate


def test_build_reports_progress_and_fills_the_table(built):
    state, updates = built
    final = updates[-1]
    assert final.ok and "Done" in final.text and "clip2" in final.text
    assert len(final.records) == 3
    fractions = [u.fraction for u in updates[:-1]]
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)
    assert any("Engine 2 of 3" in u.text and "unet" in u.text for u in updates)
    rows = engine_rows(state.cache())
    engines = [r for r in rows if not r[9].startswith("onnx/")]
    assert sorted(r[0] for r in engines) == ["clip", "unet", "vae_decoder"]
    for row in engines:
        assert row[1] == "static.b1.h64.w64.t77" and row[2] == "fp32" and row[3].startswith("onnxruntime")
        assert row[6] == "ok" and float(row[5]) < 1e-3 and row[4].endswith("B")
    # the ONNX exports they were built from are rows too, and the disk line counts them
    exports = [r for r in rows if r[9].startswith("onnx/")]
    assert sorted(r[0] for r in exports) == ["clip", "unet", "vae_decoder"]
    assert all(r[3] == "ONNX export" and r[6] == "kept for 1 engine" for r in exports)
    line = disk_usage(state.cache())
    assert line.startswith("3 engines, ") and "+ intermediates" in line
    assert not state.building


def test_generation_report_names_engine_or_torch(built):
    state, _ = built
    out = state.generate(_tiny_request())
    assert len(out.images) == 1 and out.images[0].size == (64, 64)
    assert out.usage["unet"] == "engine (2 calls)"
    assert out.usage["clip"] == "engine (2 calls)" and out.usage["vae_decoder"] == "engine (1 call)"
    report = out.report()
    assert "it/s" in report and "| unet | engine (2 calls) |" in report and "seed 0" in report
    # 72 px wide: no engine covers it, so torch runs, and the report says why.
    wide = state.generate(GenerateRequest(prompt="a cat", width=72, height=64, steps=2, sampler="Euler"))
    assert wide.usage["unet"].startswith("torch (2 calls: no engine covers")
    off = state.generate(_tiny_request(engines=False))
    assert off.usage == {"all": "torch (engines off)"} and "torch" in off.report()


def test_delete_removes_the_engine_and_generation_sees_it(built):
    state, _ = built
    state.generate(_tiny_request())  # a cached engine-backed pipeline, swapped before the delete
    unet = next(n for n in engine_names(state.cache()) if n.startswith("unet."))
    assert state.delete(unet).startswith("Deleted")
    assert unet not in engine_names(state.cache()) and len(engine_names(state.cache())) == 2
    # its ONNX export went with it (no engine needs it); the others' stay
    assert sorted(r[0] for r in engine_rows(state.cache()) if r[9].startswith("onnx/")) == ["clip", "vae_decoder"]
    assert "No engine named" in state.delete(unet)
    assert "Pick an engine" in state.delete("")
    out = state.generate(_tiny_request())
    assert out.usage["unet"].startswith("torch (no engine")
    assert out.usage["clip"] == "engine (2 calls)"


def test_rebuild_replaces_the_engine_of_the_same_model_only(built):
    state, _ = built
    name = next(n for n in engine_names(state.cache()) if n.startswith("vae_decoder."))
    old = next(r for r in state.cache().list() if r.name == name)
    updates = _drain(state.rebuild(name, "builtin:tiny-sd15"))
    assert updates[-1].ok, updates[-1].text
    new = next(r for r in state.cache().list() if r.name == name)
    assert new.created > old.created
    other = _drain(state.rebuild(name, "builtin:tiny-sdxl"))
    assert not other[-1].ok and "another model" in other[-1].text
    assert name in engine_names(state.cache())  # refused before anything was deleted
    assert not _drain(state.rebuild("nope", "builtin:tiny-sd15"))[-1].ok


def test_cancel_leaves_nothing(tmp_path):
    state = PanelState(engine_dir=str(tmp_path))
    assert state.cancel_build() == "No build is running."
    updates = []
    for update in state.build(BuildRequest(profile=STATIC_64, components=("unet", "vae_decoder"))):
        updates.append(update)
        if "Engine 1 of 2" in update.text and not state._cancel.is_set():
            assert state.cancel_build().startswith("Cancelling")
    assert updates[-1].done and not updates[-1].ok and "Cancelled" in updates[-1].text
    assert state.cache().list() == []
    assert not [p.name for p in Path(tmp_path).iterdir() if p.name.startswith(".tmp-")]
    assert not state.building
    assert state._lock.acquire(blocking=False)  # released for the next build
    state._lock.release()


def test_one_job_at_a_time(tmp_path):
    state = PanelState(engine_dir=str(tmp_path))
    with state._lock:  # as if a generation ran: a build is refused at once, not queued
        updates = _drain(state.build(BuildRequest(profile=STATIC_64)))
    assert not updates[-1].ok and "Another build" in updates[-1].text
    state._cancel = threading.Event()  # as if a build ran
    with pytest.raises(Busy, match="being built"):
        state.generate(_tiny_request())


def test_a_bad_build_request_is_reported_not_raised(tmp_path):
    state = PanelState(engine_dir=str(tmp_path))
    updates = _drain(state.build(BuildRequest(profile=STATIC_64, components=())))
    assert not updates[-1].ok and "at least one component" in updates[-1].text
    assert not state.building


BAD_GENERATIONS = [
    (dict(steps=0), "GenerationParams.steps=0 is not valid"),
    (dict(steps=-3), "GenerationParams.steps=-3 is not valid"),
    (dict(steps=2.5), "GenerationParams.steps=2.5 is not valid"),
    (dict(cfg=float("nan")), "GenerationParams.cfg=nan is not valid"),
    (dict(batch=0), "GenerationParams.batch=0 is not valid"),
    (dict(width=65), "GenerationParams.width=65 is not valid"),
    (dict(seed=-2), "GenerationParams.seed=-2 is not valid"),
    (dict(sampler="Eular"), "unknown sampler 'Eular'"),
]


def test_a_request_becomes_generation_params():
    params = GenerateRequest(prompt="a cat", negative_prompt="", steps=20.0, cfg=7.5, width=64.0, height=64,
                             batch=1, seed=-1, sampler="Euler").params()
    assert (params.steps, params.cfg, params.width, params.seed) == (20, 7.5, 64, -1)
    assert isinstance(params.steps, int) and params.negative_prompt is None and params.sampler == "Euler"


@pytest.mark.parametrize(("bad", "message"), BAD_GENERATIONS)
def test_bad_generation_numbers_are_refused_before_a_model_loads(tmp_path, bad, message):
    state = PanelState(engine_dir=str(tmp_path))
    fields = {**dict(prompt="a cat", width=64, height=64, steps=2, sampler="Euler"), **bad}
    with pytest.raises(InvalidValue, match=re.escape(message)):
        state.generate(GenerateRequest(**fields))
    assert not state._pipes  # refused before loading anything


# The Generate button's inputs, in the panel's order.
PANEL_VALUES = dict(model="builtin:tiny-sd15", prompt="a cat", negative="", sampler="Euler", steps=2, cfg=7.0,
                    width=64, height=64, batch=1, seed=0, attention="auto", precision="auto", offload="none",
                    engines=True, tiny_vae="", preview="auto")


def _panel_handler(demo, name: str):
    fns = demo.fns.values() if isinstance(demo.fns, dict) else demo.fns  # dict on Gradio >= 4
    return next(f.fn for f in fns if getattr(f.fn, "__name__", "") == name)


@pytest.mark.parametrize(("bad", "message"), BAD_GENERATIONS)
def test_the_panel_shows_a_bad_generation_number_as_an_error(tmp_path, bad, message):
    from sd_accel.ui import build_panel

    state = PanelState(engine_dir=str(tmp_path))
    on_generate = _panel_handler(build_panel(state), "on_generate")
    values = {**PANEL_VALUES, **bad}
    [(images, report)] = list(on_generate(*values.values()))  # one answer: the error
    assert images == [] and report.startswith("**Error**: ") and message in report
    assert not state._pipes


# --------------------------------------------------------------------------- the Blocks


def test_panel_and_app_build_with_their_ids(tmp_path):
    import gradio as gr

    from sd_accel.ui import build_panel, create_app

    demo = build_panel(PanelState(engine_dir=str(tmp_path)))
    assert isinstance(demo, gr.Blocks)
    ids = {getattr(b, "elem_id", None) for b in demo.blocks.values()}
    for wanted in ("sd-accel-generate", "sd-accel-gallery", "sd-accel-report", "sd-accel-build",
                   "sd-accel-cancel", "sd-accel-build-progress", "sd-accel-engines", "sd-accel-delete",
                   "sd-accel-rebuild", "sd-accel-refresh", "sd-accel-engine-dir", "sd-accel-components"):
        assert wanted in ids, wanted
    app = create_app(engine_dir=str(tmp_path))
    assert isinstance(app, gr.Blocks)


def test_launch_listens_locally_unless_asked(tmp_path, monkeypatch):
    from sd_accel.ui import app as app_module

    seen = {}
    monkeypatch.setattr(app_module.gr.Blocks, "launch", lambda self, **kw: seen.update(kw))
    app_module.launch(port=7999, engine_dir=str(tmp_path))
    assert seen["server_name"] == "127.0.0.1" and seen["server_port"] == 7999 and not seen["share"]
    app_module.launch(listen=True, engine_dir=str(tmp_path), block=False)
    assert seen["server_name"] == "0.0.0.0" and seen["prevent_thread_lock"]


def test_cancel_after_the_first_engine_keeps_it_and_says_so(tmp_path):
    state = PanelState(engine_dir=str(tmp_path))
    updates = []
    for update in state.build(BuildRequest(profile=STATIC_64, components=("unet", "vae_decoder"))):
        updates.append(update)
        if "Engine 2 of 2" in update.text and not state._cancel.is_set():
            state.cancel_build()
    final = updates[-1]
    assert final.done and not final.ok and "Cancelled" in final.text
    assert "kept" in final.text and "unet" in final.text.split("kept", 1)[1]
    assert [r.key.component for r in state.cache().list()] == ["unet"]


def test_a_cancel_never_hides_an_engine_already_committed():
    import threading

    from sd_accel.build import BuildCancelled, make_tick

    events, cancel = [], threading.Event()
    tick = make_tick(events.append, cancel, 0, 2, "unet", "static.b1.h64.w64.t77")
    tick(0.5, "building")
    cancel.set()
    tick(1.0, "done")  # the engine is in the cache by now: reported finished, not cancelled
    assert [(e.stage, e.fraction) for e in events] == [("building", 0.5), ("done", 1.0)]
    with pytest.raises(BuildCancelled):
        tick(0.1, "exporting ONNX")


def test_a_host_extends_builds_through_the_public_extension_points(tmp_path):
    """A host (the WebUI tab) overrides ``build_records`` and ``rebuild_request``; the panel keeps
    the worker, the lock and the progress around them."""
    from sd_accel.cache.key import EngineKey

    seen = []

    class Host(PanelState):
        def rebuild_request(self, record, model):
            req = super().rebuild_request(record, model)
            req.model = "host:loaded"
            return req

        def build_records(self, req, replace, cancel, progress):
            seen.append((req.model, req.components, req.profile.tag, replace and replace.name))
            return ["built"], ["vae_encoder"]

    state = Host(engine_dir=str(tmp_path))
    last = _drain(state.build(BuildRequest(profile=STATIC_64, model="host:loaded", components=("unet",))))[-1]
    assert last.ok and last.records == ["built"] and "vae_encoder" in last.text
    key = EngineKey("weights", "unet", "onnxruntime", "1.0", "cpu", "fp32", STATIC_64.tag)
    with state.cache().build_slot(key, timeout=0) as slot:
        (slot.dir / "engine.onnx").write_bytes(b"x")
        slot.commit(["engine.onnx"], {"x": ((1,), (1,), (1,))}, 0.1)
    assert _drain(state.rebuild(key.name, "builtin:tiny-sd15"))[-1].ok
    assert seen == [("host:loaded", ("unet",), STATIC_64.tag, None),
                    ("host:loaded", ("unet",), STATIC_64.tag, key.name)]


# --------------------------------------------------------------------------- tiny VAE and live preview


@pytest.fixture(scope="module")
def taesd(tmp_path_factory) -> dict[str, Path]:
    """A tiny random TAESD in the layouts people download ({layout: path}, support.taesd_files)."""
    from support.taesd_files import tiny_autoencoder, write_layouts

    return write_layouts(tiny_autoencoder(), tmp_path_factory.mktemp("ui-taesd"))


def _loaded(state: PanelState):
    [(pipe, _)] = state._pipes.values()
    return pipe


def _pixels(image):
    import numpy as np

    return np.asarray(image, dtype=np.float32)


def test_the_tiny_vae_field_reaches_the_pipeline_and_the_report(tmp_path, taesd):
    from diffusers import AutoencoderKL, AutoencoderTiny

    from sd_accel.ui import build_panel

    state = PanelState(engine_dir=str(tmp_path))
    on_generate = _panel_handler(build_panel(state), "on_generate")
    out = list(on_generate(*{**PANEL_VALUES, "engines": "off", "tiny_vae": f'"{taesd["single"]}"'}.values()))
    images, report = out[-1]
    assert len(images) == 1 and "Decoded with the tiny VAE (TAESD)" in report and "it/s" in report
    assert isinstance(_loaded(state).vae, AutoencoderTiny)
    assert _loaded(state).sd_accel.config.vae == f"tiny:{taesd['single']}"  # the quotes went
    # an empty field: the model's own VAE again
    state.generate(_tiny_request(engines=False, tiny_vae=" "))
    assert isinstance(_loaded(state).vae, AutoencoderKL)


def test_a_bad_tiny_vae_path_says_what_to_do_and_keeps_the_last_pipeline(tmp_path):
    import torch
    from safetensors.torch import save_file

    from sd_accel.ui import build_panel

    state = PanelState(engine_dir=str(tmp_path))
    first = state.generate(_tiny_request(engines=False))
    pipe = _loaded(state)
    foreign = tmp_path / "x_decoder.safetensors"
    save_file({"conv_in.weight": torch.zeros(4, 3, 3, 3)}, str(foreign))
    for path, why in ((tmp_path / "nope" / "taesd_decoder.safetensors", "no such file or folder"),
                      (foreign, "is not of a TAESD file")):
        with pytest.raises(InvalidValue, match="Tiny VAE") as err:
            state.generate(_tiny_request(engines=False, tiny_vae=str(path)))
        assert why in str(err.value) and "taesd_decoder.safetensors" in str(err.value)
        assert "the model's own VAE" in str(err.value)  # ... or empty the field
        assert _loaded(state) is pipe  # nothing was dropped to make room
        # the panel shows it in the report; a build with it is refused before anything runs
        on_generate = _panel_handler(build_panel(state), "on_generate")
        [(images, report)] = list(on_generate(*{**PANEL_VALUES, "tiny_vae": str(path)}.values()))
        assert images == [] and report.startswith("**Error**: The Tiny VAE (TAESD) field: ") and why in report
        [update] = list(state.build(BuildRequest(profile=STATIC_64, components=("vae_decoder",), vae=str(path))))
        assert update.done and not update.ok and why in update.text
    again = state.generate(_tiny_request(engines=False))
    assert _loaded(state) is pipe
    assert abs(_pixels(again.images[0]) - _pixels(first.images[0])).max() <= 1.0


def test_the_panel_builds_and_runs_tiny_vae_engines(tmp_path, taesd):
    """A build with the field set makes the tiny decoder's engine; a generation with it runs there.
    A build without it is the model's own decoder again (another engine)."""
    from diffusers import AutoencoderTiny

    state = PanelState(engine_dir=str(tmp_path), backend="onnxruntime")
    tiny = str(taesd["single"])
    done = _drain(state.build(BuildRequest(profile=STATIC_64, components=("vae_decoder",), vae=tiny)))[-1]
    assert done.ok, done.text
    [record] = done.records
    assert record.validation["ok"]
    out = state.generate(_tiny_request(tiny_vae=tiny))  # engines on: cached ones only
    assert out.usage["vae_decoder"] == "engine (1 call)" and out.usage["unet"].startswith("torch (no engine")
    assert isinstance(_loaded(state).vae.torch_module, AutoencoderTiny)
    own = _drain(state.build(BuildRequest(profile=STATIC_64, components=("vae_decoder",))))[-1]
    assert own.ok and own.records[0].name != record.name
    assert sorted(engine_names(state.cache())) == sorted([record.name, own.records[0].name])


@pytest.mark.parametrize("tiny", [False, True], ids=["latent2rgb", "tiny-vae"])
def test_live_preview_shows_steps_and_leaves_the_image_as_it_was(tmp_path, taesd, tiny):
    """Previews every few steps, decoded cheaply; the final image equals a run without them. Euler a
    draws noise at every step from the generator: a preview that touched it would change the image."""
    from sd_accel.preview import Preview

    state = PanelState(engine_dir=str(tmp_path))
    fields = dict(prompt="a cat", width=64, height=64, steps=4, batch=2, sampler="Euler a", engines=False,
                  tiny_vae=str(taesd["single"]) if tiny else None)
    items = list(state.generate_stream(GenerateRequest(**fields, preview="auto")))
    previews, final = items[:-1], items[-1]
    assert [(p.step, p.steps) for p in previews] == [(1, 4), (2, 4), (3, 4)]  # none after the last step
    assert all(isinstance(p, Preview) and p.decoder == ("tiny VAE" if tiny else "latent2rgb") for p in previews)
    assert all(len(p.images) == 2 and p.images[0].size == (64, 64) for p in previews)
    assert previews[0].images[0].tobytes() != previews[-1].images[0].tobytes()  # they follow the sampling
    plain = state.generate(GenerateRequest(**fields, preview="off"))
    assert len(final.images) == len(plain.images) == 2
    for a, b in zip(final.images, plain.images, strict=True):
        assert abs(_pixels(a) - _pixels(b)).max() <= 1.0  # uint8 pixels: at most one rounding step apart
    assert [type(i).__name__ for i in state.generate_stream(GenerateRequest(**fields, preview="off"))] == [
        "GenerateOutcome"]
    with pytest.raises(InvalidValue, match="preview 'sometimes'"):
        state.generate_stream(GenerateRequest(**fields, preview="sometimes"))


def test_a_preview_stream_closed_early_frees_the_panel(tmp_path):
    """The page went away: the pipeline skips its remaining steps and the lock is released."""
    state = PanelState(engine_dir=str(tmp_path))
    stream = state.generate_stream(GenerateRequest(prompt="a cat", width=64, height=64, steps=40, sampler="Euler",
                                                   engines=False))
    next(stream)
    stream.close()
    assert state._lock.acquire(timeout=120)  # (a bound for a hung worker, not a timing)
    state._lock.release()
    assert state.generate(_tiny_request(engines=False)).images  # the pipeline runs as before


def test_latent2rgb_maps_latents_to_rgb_per_family():
    import torch

    from sd_accel.preview import LATENT_RGB, latent_to_rgb, preview_every

    zeros = latent_to_rgb(torch.zeros(1, 4, 2, 3))
    assert zeros.shape == (1, 3, 2, 3) and torch.allclose(zeros, torch.full_like(zeros, 0.5))
    bias = torch.tensor(LATENT_RGB["sdxl"][1]).view(1, 3, 1, 1)
    assert torch.allclose(latent_to_rgb(torch.zeros(1, 4, 2, 2), "sdxl"), (bias + 1) / 2)
    one = torch.zeros(1, 4, 1, 1)
    one[0, 3] = 1.0  # SD 1.x's fourth channel is mostly blue, negatively
    rgb = latent_to_rgb(one)[0, :, 0, 0]
    assert torch.allclose(rgb, (torch.tensor(LATENT_RGB["sd15"][0][3]) + 1) / 2)
    assert latent_to_rgb(torch.full((1, 4, 1, 1), 50.0)).max() <= 1.0  # clamped
    assert [preview_every(n) for n in (1, 4, 20, 150)] == [1, 1, 5, 5]


# --------------------------------------------------------------------------- ControlNet units


@pytest.fixture(scope="module")
def controlnet_file(tmp_path_factory) -> Path:
    """A tiny random SD 1.5 ControlNet in the original single-file layout (``control_model.*``)."""
    from sd_accel import load_pipeline
    from sd_accel.models.tiny_controlnet import tiny_controlnet

    from support.controlnet_layout import save_controlnet_file

    folder = tmp_path_factory.mktemp("ui-controlnet")
    return save_controlnet_file(tiny_controlnet(load_pipeline("builtin:tiny-sd15").unet), folder / "cn.safetensors")


def _hint(size: int = 64):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray((rng.random((size, size, 3)) * 255).astype("uint8"))


def test_a_controlnet_unit_reaches_the_pipeline_as_the_api_runs_it(tmp_path, controlnet_file):
    import numpy as np

    from sd_accel import accelerate, load_pipeline
    from sd_accel.generate import generate
    from sd_accel.models.controlnet import with_controlnets
    from sd_accel.ui.state import ControlUnit, control_arguments

    state = PanelState(engine_dir=str(tmp_path / "engines"), backend="onnxruntime")
    unit = ControlUnit(str(controlnet_file), _hint(), scale=0.8, preprocess="canny", start=0.0, end=0.5)
    got = state.generate(_tiny_request(engines=False, controlnets=(unit,)))
    api = with_controlnets(load_pipeline("builtin:tiny-sd15"), [str(controlnet_file)])
    api = accelerate(api, engines=False, sampler="Euler", precision=state.precision)  # the panel's torch options
    want = generate(api, _tiny_request().params(), control_arguments((unit,))).images
    assert np.abs(np.asarray(got.images[0], float) - np.asarray(want[0], float)).max() <= 2
    assert "ControlNet `cn.safetensors` (canny, weight 0.8, steps 0-0.5)" in got.report()
    plain = state.generate(_tiny_request(engines=False)).images[0]
    assert np.abs(np.asarray(plain, float) - np.asarray(got.images[0], float)).mean() > 1  # the net acts


def test_the_panels_preprocessor_names_are_the_hints_ones():
    from sd_accel.models.hints import PREPROCESSORS
    from sd_accel.ui.state import CONTROL_PREPROCESSORS

    assert CONTROL_PREPROCESSORS == PREPROCESSORS


@pytest.mark.parametrize("unit, message", [
    (dict(model="", image="hint"), "has a control image but no ControlNet"),
    (dict(model="cn", image=None), "has no control image"),
    (dict(model="cn", image="hint", start=0.6, end=0.4), "start 0.6 must be below end 0.4"),
    (dict(model="cn", image="hint", scale=3.0), "weight 3.0 must be a number from 0 to 2"),
    (dict(model="cn", image="hint", preprocess="depth"), "preprocessor 'depth' is not one of none, canny"),
])
def test_a_bad_controlnet_unit_is_refused_before_a_model_loads(tmp_path, unit, message):
    from sd_accel.ui.state import ControlUnit

    state = PanelState(engine_dir=str(tmp_path))
    with pytest.raises(InvalidValue, match=re.escape(message)) as err:
        state.generate(_tiny_request(controlnets=(ControlUnit(**unit),)))
    assert "ControlNet unit 1" in str(err.value) and not state._pipes


@pytest.mark.slow
def test_controlnet_units_run_on_engines_built_on_first_use(tmp_path, controlnet_file):
    """engines "auto": the ControlNet and the residual-taking UNet are built on first use and the report
    names them; two units (the same net twice, another weight) share the one residual UNet engine."""
    from sd_accel.ui.state import ControlUnit

    state = PanelState(engine_dir=str(tmp_path / "engines"), backend="onnxruntime")
    units = (ControlUnit(str(controlnet_file), _hint()), ControlUnit(str(controlnet_file), _hint(), scale=0.5))
    out = state.generate(_tiny_request(engines="auto", controlnets=units))
    assert out.usage["unet_control"].startswith("engine (2 calls)"), out.usage
    assert any(k.startswith("controlnet") and v.startswith("engine") for k, v in out.usage.items()), out.usage
    components = {r.key.component for r in state.cache().list()}
    assert {"controlnet", "unet_control"} <= components
