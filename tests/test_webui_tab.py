"""The sd-accel tab as a WebUI user meets it (issue 15, points 2, 3, 4, 6 and 7).

The tab is built by the stand-in's ``ui.create_ui`` as the WebUI builds it; its events are read
off the built ``gr.Blocks`` (``tests/webui_stub/gradio_events.py``) and run as a browser would
run them, so "on page load" and "after a build" mean what the page does.
"""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest

STUB = Path(__file__).resolve().parent / "webui_stub"
sys.path.insert(0, str(STUB))
import gradio_events  # noqa: E402
import harness  # noqa: E402
from harness import webui_lean  # noqa: E402, F401  (autouse: see its docstring)

from sd_accel.profiles import Profile  # noqa: E402

STATIC = Profile(batch=1, height=64, width=64)
STATUS = "sd-accel-status"




def _page_load(webui) -> dict:
    """What a page (re)load puts in the tab: output elem_id -> value, from every load event."""
    values = {}
    for event in gradio_events.find(webui.demo, "load"):
        out = event.fn()
        out = out if isinstance(out, tuple) else (out,)
        values.update(zip(event.outputs, out, strict=True))
    return values


def test_building_the_tab_never_loads_the_model(tmp_path):
    """--skip-load-model-at-start: the UI (and its status) come up without a checkpoint; the first
    generation loads it, as without the extension."""
    webui = harness.start(tmp_path, argv=("--api", "--skip-load-model-at-start"), load=False)
    from modules import sd_models

    assert sd_models.model_data.loads == []  # tab, settings and routes built: no load
    assert ("sd-accel", "sd_accel") in webui.demo.sd_stub_tabs
    page = _page_load(webui)
    assert "no checkpoint is loaded in the WebUI yet" in page[STATUS]
    assert webui.client().get("/sd-accel/engines").status_code == 200
    assert sd_models.model_data.loads == []  # page load, status and routes: still none
    webui.txt2img(prompt="a cat", steps=1)
    assert sd_models.model_data.loads == [webui.checkpoint.title]
    assert "Loaded: **tiny-sd15.safetensors [" in _page_load(webui)[STATUS]


def test_status_is_fresh_on_every_page_load_and_after_builds_and_deletes(tmp_path):
    webui = harness.start(tmp_path)
    # The status box starts as a placeholder: the load event fills it, never the UI build.
    status_box = next(b for b in webui.demo.blocks.values() if getattr(b, "elem_id", None) == STATUS)
    assert "Reading the status" in status_box.value
    assert "0 UNet engine(s) for these weights" in _page_load(webui)[STATUS]
    response = webui.client().post("/sd-accel/build", json={"profile": STATIC.to_dict()})
    assert response.status_code == 200, response.text
    page = _page_load(webui)  # a page reload after an API build
    assert "1 UNet engine(s) for these weights" in page[STATUS]
    assert "1 VAE decoder" in page[STATUS] and "1 text encoder" in page[STATUS]
    # The tab's own Build and Delete update it too (the events' outputs include the status box).
    for trigger in ("sd-accel-delete", "sd-accel-refresh"):
        assert any(STATUS in e.outputs for e in gradio_events.events(webui.demo) if e.trigger == trigger), trigger
    build = [e for e in gradio_events.events(webui.demo) if e.trigger == "sd-accel-build"]
    assert build and any(STATUS in e.outputs for e in gradio_events.events(webui.demo)
                         if e.event == "then" or (e.trigger is None and STATUS in e.outputs))
    delete = gradio_events.find(webui.demo, "click", trigger="sd-accel-delete")[0]
    name = next(r.name for r in webui_cache(webui).list() if r.key.component == "ldm_unet")
    out = dict(zip(delete.outputs, delete.fn(name), strict=True))
    assert out[STATUS].count("0 UNet engine(s) for these weights") == 1
    assert "Deleted" in out["sd-accel-engine-action"]


def webui_cache(webui):
    from sd_accel.webui.controller import controller

    return controller().cache()


def test_advice_only_names_what_can_work_here(tmp_path, monkeypatch):
    webui = harness.start(tmp_path)
    import torch

    from sd_accel.backends.tensorrt import builder
    from sd_accel.webui import tab

    # CPU build of torch: the CPU backends, no TensorRT package or install switch.
    cpu = tab.status_markdown()
    assert "OpenVINO" in cpu and "ONNX Runtime" in cpu
    assert "tensorrt-cu" not in cpu and "SD_ACCEL_INSTALL_TENSORRT" not in cpu
    # CUDA torch with a GPU, TensorRT missing: the one package for torch's CUDA.
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(builder, "trt_status", lambda: (False, "", "TensorRT is not importable (ModuleNotFoundError: "
                                                                   "no tensorrt); install the build for torch's CUDA 12: "
                                                                   "`pip install tensorrt-cu12 polygraphy`"))
    gpu = tab.status_markdown()
    assert gpu.count("tensorrt-cu12") == 2 and "cu13" not in gpu and "cu11" not in gpu  # the name, and the command
    assert "OpenVINO" not in gpu
    # The same machine told to compute on the CPU (A1111 --use-cpu all, Forge --always-cpu): no TensorRT.
    for argv in (["--use-cpu", "all"], ["--always-cpu"]):
        webui.shared.set_cmd_opts(argv)
        text = tab.status_markdown()
        assert "tensorrt-cu" not in text and "OpenVINO" in text, argv


def test_the_tab_is_shaped_for_the_webui(tmp_path):
    webui = harness.start(tmp_path)
    from sd_accel.webui.tab import WebUIPanelState

    elem_ids = {getattr(b, "elem_id", None) for b in webui.demo.blocks.values()}
    # No Generate sub-tab (the WebUI has its own txt2img): the tab opens on Engines.
    assert "sd-accel-tab-generate" not in elem_ids and "sd-accel-tab-engines" in elem_ids
    tabs = [b for b in webui.demo.blocks.values() if getattr(b, "elem_id", "") in ("sd-accel-tab-engines",
                                                                                    "sd-accel-tab-settings")]
    assert [t.elem_id for t in sorted(tabs, key=lambda b: b._id)][0] == "sd-accel-tab-engines"
    # The component boxes are what the WebUI path builds.
    boxes = next(b for b in webui.demo.blocks.values() if getattr(b, "elem_id", None) == "sd-accel-components")
    choices = [c[0] if isinstance(c, (list, tuple)) else c for c in boxes.choices]
    assert choices == ["unet", "vae_decoder", "vae_encoder", "clip"]
    assert list(boxes.value) == ["unet", "vae_decoder", "clip"]
    # Editing a range makes the preset "custom"; a preset's own fill leaves it alone.
    on_range = gradio_events.find(webui.demo, "change", trigger="sd-accel-range-height")[0]
    assert on_range.outputs == ["sd-accel-preset"]
    assert on_range.fn("static-512", "1", "256-512", "512", "77") == "custom"
    assert not isinstance(on_range.fn("static-512", "1", "512", "512", "77"), str)
    # "Loaded:" names the hash once; the table shows the whole weights id (ckpt-<10 hex>).
    state = WebUIPanelState()
    _build(state, _request())
    status = state.status()
    loaded = next(line for line in status.splitlines() if line.startswith("Loaded:"))
    ckpt = webui.checkpoint.shorthash
    assert loaded.count(ckpt) == 1, loaded
    # engine rows (the rows after them are the intermediates kept beside them: onnx/..., calibration/...)
    models = {row[8] for row in state.engine_rows() if not row[9].startswith(("onnx/", "calibration/"))}
    assert models == {f"ckpt-{ckpt}"} and len(ckpt) == 10
    # The build's report says what was built, never "Skipped (not in this model)".
    final = _build(state, _request(("unet", "clip2")))
    assert "Skipped" not in final.text and "clip2 (not a component of the WebUI's model)" in final.text


def _build(state, request):
    """The last update of a tab build, once its worker has let go of the panel's lock."""
    final = list(state.build(request))[-1]
    assert state._lock.acquire(timeout=30)
    state._lock.release()
    return final


def _request(components=("unet", "vae_decoder", "clip")):
    from sd_accel.ui.state import BuildRequest
    from sd_accel.webui.tab import WEBUI_MODEL

    return BuildRequest(profile=STATIC, model=WEBUI_MODEL, components=components)


def test_console_lines_never_glue_onto_a_progress_bar(tmp_path, monkeypatch):
    harness.start(tmp_path)
    from tqdm import tqdm

    from sd_accel.webui import console

    handler = next(h for h in logging.getLogger("sd_accel").handlers if h.get_name() == console._HANDLER_NAME)
    assert handler.level <= logging.INFO and not logging.getLogger("sd_accel").propagate
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    with tqdm(total=4, file=stream, desc="Sampling") as bar:
        bar.update(1)
        logging.getLogger("sd_accel").warning("ldm_unet: running torch for this call: no engine covers x")
        bar.update(1)
    text = stream.getvalue()
    # The warning is a line of its own: the bar was cleared first, the line ends before the bar redraws.
    line = next(seg for seg in text.replace("\r", "\n").split("\n") if "running torch" in seg)
    assert line == "sd-accel: ldm_unet: running torch for this call: no engine covers x"


def test_the_job_summary_starts_its_own_line_below_a1111s_total_progress_bar(monkeypatch):
    """A1111's "Total progress" bar sits at position 1 and is still open when the job's summary is
    printed: tqdm.write moves up from it with a cursor-up code, which in a console log glued the
    summary onto the bar's line. The summary's line must begin after a line end."""
    from tqdm import tqdm

    from sd_accel.webui.console import say

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    with tqdm(total=3, file=stream, desc="Sampling") as sampling:
        sampling.update(3)
    with tqdm(total=10, position=1, file=stream, desc="Total progress") as total:
        total.update(3)
        say("sd-accel: UNet calls this job: 3 on engines, 0 in PyTorch\nsd-accel: VAE calls this job: 1 on engines")
    text = stream.getvalue()
    start = text.index("sd-accel: UNet calls")
    assert text[start - 1] == "\n", repr(text[max(0, start - 20):start + 10])
    assert "\x1b[Asd-accel" not in text
    # with no bar below, a line is printed as it is (no blank line before it)
    stream.seek(0)
    stream.truncate()
    say("sd-accel: plain")
    assert stream.getvalue() == "sd-accel: plain\n"


def test_auto_backend_is_the_fastest_cpu_backend_on_a_cpu_webui(tmp_path, monkeypatch):
    """Issue 15.8: on a WebUI that computes on the CPU, ``auto`` builds and runs OpenVINO engines
    (install.py installs it there), then ONNX Runtime; on a GPU WebUI it is the library's ``auto``."""
    pytest.importorskip("openvino", reason="OpenVINO is not installed in this environment")
    from types import SimpleNamespace

    from sd_accel.backends import registry
    from sd_accel.webui import controller as ctl_mod
    from sd_accel.webui import host

    harness.start(tmp_path, options={"sd_accel_backend": "auto"})  # the settings' default
    assert host.runs_on_cpu()  # the stand-in runs on CPU torch
    assert ctl_mod.webui_backend("auto").name == "openvino"
    assert ctl_mod.controller().backend().name == "openvino"
    assert ctl_mod.webui_backend("onnxruntime").name == "onnxruntime"  # a named backend is kept

    # OpenVINO unusable (or broken): ONNX Runtime.
    real_create = registry.create

    def no_openvino(name, cache_root=None):
        if name == "openvino":
            return SimpleNamespace(info=lambda: SimpleNamespace(usable=False))
        return real_create(name, cache_root)

    monkeypatch.setattr(registry, "create", no_openvino)
    assert ctl_mod.webui_backend("auto").name == "onnxruntime"
    monkeypatch.setattr(registry, "create", real_create)

    # A WebUI on a GPU: the library's auto (TensorRT where usable; ONNX Runtime on this machine).
    monkeypatch.setattr(host, "runs_on_cpu", lambda: False)
    assert ctl_mod.webui_backend("auto").name == registry.get_backend("auto").name
