"""The WebUI extension on AUTOMATIC1111 (the stand-in WebUI in ``tests/webui_stub``).

One module-wide engine folder: the first test that needs engines builds them (tiny UNet, ONNX
Runtime, one static and one dynamic profile); later tests reuse them from the cache.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

STUB = Path(__file__).resolve().parent / "webui_stub"
sys.path.insert(0, str(STUB))
import harness  # noqa: E402  (the stand-in WebUI's driver, from the folder above)
from harness import webui_lean  # noqa: E402, F401  (autouse: see its docstring)

from sd_accel.profiles import Profile  # noqa: E402

STATIC = Profile(batch=1, height=64, width=64)  # x (2, 4, 8, 8): cond and uncond batched
DYNAMIC = Profile(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96), tokens=(77, 77, 154))
LONG_PROMPT = " ".join(["word"] * 100)  # 100 tokens: 154 context columns
FALLBACK = "running torch for this call"




EXACT = {"sd_accel_backend": "onnxruntime"}


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    """The engines the tests below share: built with ONNX Runtime fp32 (``EXACT``), not auto's
    OpenVINO bf16 on CPUs, so the jobs on them match PyTorch to 2e-3."""
    return tmp_path_factory.mktemp("webui-engines")


def _built(webui) -> None:
    """Static engine through the tab's Build (the panel), dynamic through the HTTP route."""
    from sd_accel.ui.state import BuildRequest
    from sd_accel.webui.tab import WEBUI_MODEL, WebUIPanelState

    updates = list(WebUIPanelState().build(BuildRequest(profile=STATIC, model=WEBUI_MODEL,
                                                        components=("unet", "vae_decoder", "vae_encoder", "clip"))))
    assert updates[-1].done and updates[-1].ok, updates[-1].text
    response = webui.client().post("/sd-accel/build", json={"profile": DYNAMIC.to_dict()})
    assert response.status_code == 200, response.text
    webui.sd_unet.list_unets()


def _counts(webui, component: str = "ldm_unet"):
    """(engine calls, torch calls) of ``component`` in the last job (the counters restart with each job)."""
    from sd_accel.webui.controller import controller

    engines = controller().loaded(component)
    return sum(e.stats.engine_calls for e in engines), sum(e.stats.torch_calls for e in engines)


# --------------------------------------------------------------------------- install.py


def _install_module():
    spec = importlib.util.spec_from_file_location("sd_accel_install", harness.EXTENSION / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _installed_names(command: str) -> list[str]:
    """The requirements a ``pip install`` command names (options and their values left out)."""
    import shlex

    words = shlex.split(command)[3:]  # python -m pip
    names, skip = [], False
    for w in words[1:]:
        if skip:
            skip = False
        elif w in ("-c", "--constraint", "--extra-index-url", "--index-url"):
            skip = True
        elif not w.startswith("-"):
            names.append(w)
    return names


def test_install_never_touches_the_webuis_own_packages(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(STUB))
    import launch

    install = _install_module()
    real_version = install.installed_version
    monkeypatch.setattr(install, "installed_version", lambda d: None if d == "onnx" else real_version(d))
    monkeypatch.setattr(install, "torch_cuda_major", lambda: "12")
    real_installed = launch.is_installed
    monkeypatch.setattr(launch, "is_installed", lambda p: p != "onnx" and real_installed(p))
    launch.pip_commands.clear()
    stamp = tmp_path / "stamp"
    assert install.main(harness.EXTENSION, launch, stamp) == 0
    commands = list(launch.pip_commands)
    named = [n for c in commands for n in _installed_names(c)]
    protected = {"torch", "torchvision", "gradio", "transformers", "diffusers", "numpy"}
    assert not [n for n in named if install.requirement_name(n).lower() in protected], commands
    assert all("install " in c and " -c " in c for c in commands)
    assert any("--no-deps" in c and str(harness.REPO) in c for c in commands), commands  # sd-accel itself
    assert any(n.startswith("onnx>=") for n in named), named
    assert any(n.startswith("tensorrt-cu12") for n in named), named
    # Pins: what the WebUI has of torch, gradio, transformers, numpy stays as it is.
    pins = install.constraints()
    for name in ("torch", "gradio", "transformers", "numpy"):
        assert any(p.startswith(f"{name}==") for p in pins), pins
    # Second start: the checkout is unchanged, so sd-accel is not installed again.
    launch.pip_commands.clear()
    install.main(harness.EXTENSION, launch, stamp)
    assert not any("--no-deps" in c for c in launch.pip_commands)
    # A failing pip (no TensorRT wheel) is reported; the WebUI still starts.
    launch.pip_fail.append("tensorrt")
    try:
        assert install.main(harness.EXTENSION, launch, stamp) == 0
    finally:
        launch.pip_fail.clear()
    assert "could not install TensorRT" in capsys.readouterr().out
    # CPU torch: no TensorRT; SD_ACCEL_INSTALL_TENSORRT=0 also skips it.
    monkeypatch.setattr(install, "torch_cuda_major", lambda: None)
    assert install.tensorrt_requirements()[0] == []
    monkeypatch.setattr(install, "torch_cuda_major", lambda: "12")
    monkeypatch.setenv("SD_ACCEL_INSTALL_TENSORRT", "0")
    assert install.tensorrt_requirements()[0] == []


def _pyproject_pins() -> dict[str, str]:
    """name -> version specifier of every requirement in pyproject.toml (extras included)."""
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]:
        requirement = line.split(";")[0].strip()  # the platform marker is not a pin
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
        pins.setdefault(name.lower(), requirement[len(name):].split("]")[-1].strip())
    return pins


def test_install_asks_for_the_versions_pyproject_asks_for(monkeypatch):
    """A pin moved in pyproject must move here too (the extension once asked openvino>=2024.0 after
    pyproject had moved to >=2025.0)."""
    install = _install_module()
    pins = _pyproject_pins()
    wanted = [*install.REQUIREMENTS, *install.OPENVINO, *install.TENSORRT]
    for requirement in wanted:
        name = install.requirement_name(requirement)
        assert name.lower() in pins, f"{requirement}: not in pyproject.toml"
        assert requirement[len(name):] == pins[name.lower()], f"{requirement}: pyproject asks {name}{pins[name.lower()]}"
    # TensorRT comes as tensorrt-cuXX from NVIDIA's index; its lower bound is pyproject's.
    monkeypatch.setattr(install, "torch_cuda_major", lambda: "12")
    monkeypatch.setattr(install, "installed_version", lambda d: None)
    monkeypatch.delenv("SD_ACCEL_INSTALL_TENSORRT", raising=False)
    trt = [r for r in install.tensorrt_requirements()[0] if r.startswith("tensorrt")]
    assert trt and trt[0].split(",")[0] == "tensorrt-cu12" + pins["tensorrt"], trt


def test_install_keeps_the_webuis_exact_pins_and_adds_openvino_on_cpu(tmp_path, monkeypatch, capsys):
    install = _install_module()
    # Every exact pin of the WebUI's requirements file, at what is installed (launch_utils'
    # requirements_met reinstalls everything when one moved): protobuf too, exactly.
    reqs = tmp_path / "requirements_versions.txt"
    reqs.write_text("setuptools==69.5.1  # temp fix\nprotobuf==3.20.0\ntorch\nPillow==9.5.0\n\n")
    assert install.webui_pins(reqs) == ["setuptools", "protobuf", "Pillow"]
    real_version = install.installed_version
    fake = {"protobuf": "3.20.0", "pillow": "9.5.0", "setuptools": "69.5.1"}
    monkeypatch.setattr(install, "installed_version", lambda d: fake.get(d.lower(), real_version(d)))
    pins = install.constraints(requirements_file=reqs)
    assert "protobuf==3.20.0" in pins and "Pillow==9.5.0" in pins and "setuptools==69.5.1" in pins
    assert not [p for p in pins if p.startswith("protobuf>")]  # no "may move within its major" any more
    # OpenVINO on a CPU build of torch (or a WebUI told to compute on the CPU), not on CUDA.
    monkeypatch.setattr(install, "installed_version", lambda d: None if d == "openvino" else real_version(d))
    monkeypatch.setattr(install, "torch_cuda_major", lambda: None)
    assert install.openvino_requirements()[0] == ["openvino>=2025.0"]
    monkeypatch.setattr(install, "torch_cuda_major", lambda: "12")
    assert install.openvino_requirements()[0] == []
    monkeypatch.setenv("COMMANDLINE_ARGS", "--api --always-cpu")
    assert install.openvino_requirements()[0] == ["openvino>=2025.0"]
    monkeypatch.setenv("SD_ACCEL_INSTALL_OPENVINO", "0")
    assert install.openvino_requirements()[0] == []

    # A package pip cannot install under the pins (onnx wants protobuf >= 3.20.2, Forge pins
    # 3.20.0): installed once more without its dependencies, kept because it imports.
    commands = []

    def run_pip(command, desc=None, live=False):
        commands.append(command)
        if command.startswith("install ") and "--no-deps" not in command:
            raise RuntimeError("ERROR: ResolutionImpossible: protobuf==3.20.0 (from constraints)")
        return ""

    ran = []

    def run(command, desc=None, errdesc=None, live=False):
        ran.append(command)
        return ""

    launch = type("Launch", (), {"run_pip": staticmethod(run_pip), "run": staticmethod(run), "python": "/py"})
    constraints_file = tmp_path / "c.txt"
    constraints_file.write_text("protobuf==3.20.0\n")
    assert install.install_pinned(launch, "onnx>=1.16", "onnx for sd-accel", constraints_file) is True
    assert [c.split(" -c ")[0] for c in commands] == ['install "onnx>=1.16"', 'install --no-deps "onnx>=1.16"']
    assert all(" -c " in c for c in commands)
    # The newest onnx does not import beside protobuf 3.20.0 (a real Forge: onnx 1.23 wants
    # google.protobuf.runtime_version): the known-good older release is tried next, still without deps.
    commands.clear()
    answers = iter(["ImportError: cannot import name 'runtime_version' from 'google.protobuf'", None])
    real_imports = install.imports
    monkeypatch.setattr(install, "imports", lambda module: next(answers))
    assert install.install_pinned(launch, "onnx>=1.16", "onnx for sd-accel", constraints_file) is True
    assert [c.split(" -c ")[0] for c in commands][-1] == 'install --no-deps "onnx>=1.16,!=1.16.2,<1.18"'
    monkeypatch.setattr(install, "imports", real_imports)
    # One that then does not import is removed again with `pip uninstall` itself: the WebUI's
    # run_pip appends --prefer-binary, which `pip uninstall` rejects.
    commands.clear()
    real_version = install.installed_version
    monkeypatch.setattr(install, "installed_version",
                        lambda dist: "1.0" if dist == "no-such-module-xyz" else real_version(dist))
    assert install.install_pinned(launch, "no-such-module-xyz>=1", "x", constraints_file) is False
    assert not any(c.startswith("uninstall") for c in commands)
    assert ran == ['"/py" -m pip uninstall -y "no-such-module-xyz"']
    out = capsys.readouterr().out
    assert "does not work with the WebUI's pinned packages" in out and "removing it again" in out


# --------------------------------------------------------------------------- a whole job


def test_a1111_job_on_engines_with_fallback(tmp_path, engine_dir, caplog, capsys):
    webui = harness.start(tmp_path, engine_dir=engine_dir, options=EXACT)
    from ldm.modules.diffusionmodules import openaimodel
    from modules import sd_hijack

    # Registration: the callbacks the extension uses, the tab, the settings.
    cb = webui.script_callbacks.callback_map
    for kind in ("callbacks_ui_tabs", "callbacks_ui_settings", "callbacks_list_unets", "callbacks_app_started"):
        assert any("sd_accel_webui.py" in c.script for c in cb[kind]), kind
    assert ("sd-accel", "sd_accel") in webui.demo.sd_stub_tabs
    assert webui.shared.opts.data_labels["sd_accel_engine_dir"].section == ("sd_accel", "sd-accel")
    assert {"sd_accel_engine_dir", "sd_accel_fallback", "sd_accel_default_preset"} <= set(webui.demo.sd_stub_settings)
    assert [s.title() for s in webui.scripts.scripts_txt2img.alwayson_scripts] == ["sd-accel"]

    openaimodel.TRACE_LOG.clear()
    _built(webui)
    # The export traced plain attention and gave the WebUI its optimization and flags back.
    assert openaimodel.TRACE_LOG and set(openaimodel.TRACE_LOG) == {"None"}
    assert sd_hijack.current_optimizer.name == "sdp"
    assert webui.shared.sd_model.model.diffusion_model.use_checkpoint is True
    assert [o.label for o in webui.sd_unet.unet_options] == ["[sd-accel] tiny-sd15"]

    # Torch reference first (SD Unet "None"), then the same jobs on engines ("Automatic").
    jobs = {
        "batched 2B": dict(prompt="a cat", steps=2),
        "apart B": dict(prompt="a cat", steps=2),
        "154 tokens + hires": dict(prompt=LONG_PROMPT, steps=2, enable_hr=True, hr_scale=1.5),
        "batch 3: chunks": dict(prompt="a cat", steps=1, batch_size=3),
    }

    def run(name, **kw):
        webui.shared.opts.batch_cond_uncond = name != "apart B"
        out = webui.txt2img(**kw)
        return out.samples, out.images

    # The reference: all of it in PyTorch (SD Unet "None", VAE / text encoder engines off).
    webui.shared.opts.sd_unet = "None"
    webui.shared.opts.data["sd_accel_vae_clip_enabled"] = False
    reference = {name: run(name, **kw) for name, kw in jobs.items()}
    webui.shared.opts.sd_unet = "Automatic"
    webui.shared.opts.data["sd_accel_vae_clip_enabled"] = True
    for name, kw in jobs.items():
        samples, images = run(name, **kw)
        engine, torch_calls = _counts(webui)
        assert torch_calls == 0 and engine > 0, (name, engine, torch_calls)
        # The VAE decoder (one image per call) and CLIP (each 77-token chunk) on engines too.
        assert _counts(webui, "ldm_vae_decoder") == (kw.get("batch_size", 1), 0), name
        clip_engine, clip_torch = _counts(webui, "ldm_clip")
        assert clip_engine >= 2 and clip_torch == 0, name
        torch.testing.assert_close(samples, reference[name][0], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(images, reference[name][1], atol=2e-3, rtol=2e-3)
    assert type(webui.sd_unet.current_unet).__name__ == "SdAccelUnet"  # ours, activated by "Automatic"
    # batch 3 batched = 6 rows > 4 the dynamic engine takes: 4 + 2, both on engines.
    # A size no engine covers: PyTorch for those calls, said once per component in the job, then a summary.
    caplog.clear()
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        webui.txt2img(prompt="a cat", steps=3, width=128, height=128)
    assert _counts(webui) == (0, 3) and _counts(webui, "ldm_vae_decoder") == (0, 1)
    assert sum(FALLBACK in r.getMessage() and "ldm_unet" in r.getMessage() for r in caplog.records) == 1
    out = capsys.readouterr().out
    assert "UNet calls this job: 0 on engines, 3 in PyTorch" in out and "no engine covers" in out
    assert "VAE decoder calls this job: 0 on engines, 1 in PyTorch" in out
    assert "text encoder calls this job: 2 on engines, 0 in PyTorch" in out  # the prompt's size does not matter
    # The next job warns again (once per job, not once per process).
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        webui.txt2img(prompt="a cat", steps=2, width=128, height=128)
    assert sum(FALLBACK in r.getMessage() and "ldm_unet" in r.getMessage() for r in caplog.records) == 1

    # A textual-inversion embedding in the prompt: that CLIP call runs in PyTorch (the engine has
    # no such token), the negative prompt's on the engine; the result is torch's.
    webui.shared.opts.data["sd_accel_vae_clip_enabled"] = False
    ti_reference = webui.txt2img(prompt="a ti-style cat", steps=1).images
    webui.shared.opts.data["sd_accel_vae_clip_enabled"] = True
    capsys.readouterr()
    ti = webui.txt2img(prompt="a ti-style cat", steps=1).images
    assert _counts(webui, "ldm_clip") == (1, 1)
    assert "textual-inversion" in capsys.readouterr().out
    torch.testing.assert_close(ti, ti_reference, atol=2e-3, rtol=2e-3)

    # img2img: the init image is encoded on the encoder engine, one image per call.
    init = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    webui.shared.opts.data["sd_accel_vae_clip_enabled"] = False
    webui.shared.opts.sd_unet = "None"
    i2i_reference = webui.img2img(init, prompt="a cat", steps=2, batch_size=2).images
    webui.shared.opts.data["sd_accel_vae_clip_enabled"] = True
    webui.shared.opts.sd_unet = "Automatic"
    i2i = webui.img2img(init, prompt="a cat", steps=2, batch_size=2).images
    assert _counts(webui, "ldm_vae_encoder") == (2, 0) and _counts(webui, "ldm_vae_decoder") == (2, 0)
    torch.testing.assert_close(i2i, i2i_reference, atol=2e-3, rtol=2e-3)

    # Another VAE file loaded (sd_vae): the checkpoint's VAE engines no longer apply; PyTorch decodes.
    from modules import sd_vae

    sd_vae.loaded_vae_file = str(tmp_path / "other.vae.safetensors")
    try:
        webui.txt2img(prompt="a cat", steps=1)
        assert _counts(webui, "ldm_vae_decoder") == (0, 0) and _counts(webui)[0] > 0
    finally:
        sd_vae.loaded_vae_file = None


def test_api_routes_list_build_delete(tmp_path, engine_dir):
    webui = harness.start(tmp_path, engine_dir=engine_dir, options=EXACT)
    client = webui.client()
    listed = client.get("/sd-accel/engines").json()
    if len(listed["engines"]) < 2:
        _built(webui)
        listed = client.get("/sd-accel/engines").json()
    assert listed["engine_dir"] == str(engine_dir)
    names = [e["name"] for e in listed["engines"]]
    first = next(e for e in listed["engines"] if e["component"] == "ldm_unet")
    assert first["usable_here"] is True
    assert first["webui"]["model_name"] == "tiny-sd15" and first["weights"].startswith("ckpt-")
    assert {e["component"] for e in listed["engines"]} >= {"ldm_unet", "ldm_vae_decoder", "ldm_clip"}
    # Errors answer with a status and a reason, never a crash.
    assert client.post("/sd-accel/build", json={"profile": {"batch": 1, "height": 60, "width": 64}}).status_code == 400
    assert client.post("/sd-accel/build", json={"checkpoint": "nope"}).status_code == 404
    for unknown in ("not-an-engine", "ldm_unet.x.fp32.static.b1.onnxruntime-1.0.ckpt-0.00000000.s1"):
        response = client.delete(f"/sd-accel/engines/{unknown}")
        assert response.status_code == 404 and "GET /sd-accel/engines" in response.json()["detail"]
    # Delete one (a copy: the module's engines stay for the other tests).
    webui.shared.opts.data["sd_accel_engine_dir"] = str(tmp_path / "copy")
    import shutil

    shutil.copytree(engine_dir, tmp_path / "copy")
    response = client.delete(f"/sd-accel/engines/{names[0]}")
    assert response.status_code == 200 and response.json()["deleted"] == names[0]
    assert response.json()["onnx_removed"] == []  # the other engines of these weights still need it
    assert names[0] not in [e["name"] for e in client.get("/sd-accel/engines").json()["engines"]]

    # Disk: the ONNX exports are counted, and go with the last engine that needs them.
    disk = client.get("/sd-accel/engines").json()["disk"]
    assert disk["onnx_bytes"] > 0 and disk["onnx_unused_bytes"] == 0
    assert disk["total_bytes"] == disk["engine_bytes"] + disk["onnx_bytes"] + disk["calibration_bytes"] + disk["refit_bytes"]
    from sd_accel.webui.tab import WebUIPanelState

    assert "ONNX exports" in WebUIPanelState().disk_usage()
    removed = []
    for name in names[1:]:  # every engine: nothing is left of them, the exports included
        response = client.delete(f"/sd-accel/engines/{name}")
        assert response.status_code == 200
        removed += response.json()["onnx_removed"]
    assert removed and all(r.startswith("onnx/") for r in removed)
    after = client.get("/sd-accel/engines").json()
    assert after["engines"] == [] and after["intermediates"] == [] and after["total_bytes"] == 0
    disk = after["disk"]
    assert disk["engines"] == 0 and disk["onnx_bytes"] == 0 and disk["total_bytes"] == 0
    # nothing but empty lock files (removing a lock file another process may wait on is unsafe)
    assert not [p for p in (tmp_path / "copy" / "onnx").iterdir()
                if not p.name.startswith(".") and not (p.name.endswith(".lock") and p.stat().st_size == 0)]


def test_webui_flags_respected_by_the_export(tmp_path):
    """--lowvram hooks lifted during the export (and back after), --xformers restored, status says so."""
    webui = harness.start(tmp_path, argv=("--lowvram", "--xformers", "--no-half-vae"))
    from modules import lowvram, sd_hijack

    from sd_accel.webui.jobs import build_for_checkpoint
    from sd_accel.webui.tab import status_markdown

    assert sd_hijack.current_optimizer.name == "xformers"
    unet = webui.shared.sd_model.model.diffusion_model
    hooked = [m for m in unet.modules() if m._forward_pre_hooks]
    lowvram.calls.clear()
    build_for_checkpoint(profile=STATIC)
    assert lowvram.calls == []  # no block was sent to the "GPU" during trace or validation
    assert [m for m in unet.modules() if m._forward_pre_hooks] == hooked
    assert sd_hijack.current_optimizer.name == "xformers" and sd_hijack.history[-2:] == ["None", "xformers"]
    status = status_markdown()
    assert "--medvram/--lowvram" in status and "--xformers" in status and "--no-half-vae" in status
    webui.txt2img(prompt="a cat", steps=1)
    assert lowvram.calls  # the hooks work again after the export


def test_lora_merged_weights_get_their_own_engines(tmp_path, engine_dir, capsys):
    webui = harness.start(tmp_path, engine_dir=engine_dir, options=EXACT)
    from sd_accel.webui.jobs import build_for_checkpoint

    unet = webui.shared.sd_model.model.diffusion_model
    # What A1111's Lora extension leaves on each layer it merged into.
    layer = unet.unet.conv_in
    layer.network_current_names = (("film", 1.0, 0.8, None),)
    try:
        records = build_for_checkpoint(profile=STATIC)
    finally:
        del layer.network_current_names
    assert "+lora-" in records[0].key.model and records[0].extra["webui"]["loras"] == [["film", 0.8, None]]
    webui.shared.opts.sd_unet = "Automatic"
    webui.txt2img(prompt="a cat <lora:film:1:0.8>", steps=2)
    out = capsys.readouterr().out
    assert "2 on engines, 0 in PyTorch" in out
    webui.txt2img(prompt="a cat <lora:other:1>", steps=2)
    assert "no engine for tiny-sd15" in capsys.readouterr().out
    webui.txt2img(prompt="a cat <hypernet:anime:1>", steps=1)
    assert "hypernet" in capsys.readouterr().out


def test_the_tab_survives_failures(tmp_path, monkeypatch):
    webui = harness.start(tmp_path)
    import sd_accel.ui.panel
    from sd_accel.webui import tab

    def broken(state):
        raise RuntimeError("panel exploded")

    monkeypatch.setattr(sd_accel.ui.panel, "build_panel", broken)
    (blocks, title, elem_id), = tab.on_ui_tabs()
    assert (title, elem_id) == ("sd-accel", "sd_accel")
    assert any("panel exploded" in str(getattr(b, "value", "")) for b in blocks.blocks.values())
    # sd-accel not importable at all (and no checkout beside the extension to fall back to):
    # the script still gives the WebUI a tab that says why.
    import shutil

    lone = tmp_path / "extensions" / "sd-accel"
    shutil.copytree(harness.EXTENSION / "scripts", lone / "scripts")
    monkeypatch.setitem(sys.modules, "sd_accel.webui", None)  # import fails as if not installed
    webui.script_callbacks.clear_callbacks()
    webui.scripts.load_scripts([str(lone)])
    tabs = webui.script_callbacks.ui_tabs_callback()
    assert [t[1:] for t in tabs] == [("sd-accel", "sd_accel")]
    assert not webui.scripts.scripts_data  # no always-on script without sd-accel


def test_the_tabs_rebuild_of_a_webui_engine_exports_the_loaded_checkpoint():
    from types import SimpleNamespace

    from sd_accel.cache.key import EngineKey
    from sd_accel.webui.tab import WEBUI_MODEL, WebUIPanelState

    def record(component: str):
        return SimpleNamespace(key=EngineKey("ckpt-0123", component, "onnxruntime", "1.0", "cpu", "fp32", STATIC.tag))

    state = WebUIPanelState()
    req = state.rebuild_request(record("ldm_unet"), "builtin:tiny-sd15")
    assert (req.model, req.components, req.profile) == (WEBUI_MODEL, ("unet",), STATIC)
    assert state.rebuild_request(record("ldm_vae_decoder"), "x").components == ("vae_decoder",)
    assert state.rebuild_request(record("unet"), "builtin:tiny-sd15").model == "builtin:tiny-sd15"


def test_webui_path_does_not_import_diffusers(tmp_path):
    """The WebUI path (spec, export, runtime, tab) must import without diffusers."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'diffusers':\n"
        "            raise ImportError('diffusers is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import sd_accel.components.ldm_unet, sd_accel.webui.export, sd_accel.webui.tracing, sd_accel.webui.runner\n"
        "import sd_accel.webui.controller, sd_accel.webui.tab, sd_accel.webui.api\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_unusable_backend_never_breaks_a_job(tmp_path, engine_dir, capsys):
    """TensorRT picked where it cannot run: the tab says why and how to fix it; jobs run in PyTorch."""
    webui = harness.start(tmp_path, engine_dir=engine_dir, options=EXACT)
    from sd_accel.webui.tab import status_markdown

    if not webui.sd_unet.unet_options:
        _built(webui)
    webui.shared.opts.sd_unet = "Automatic"
    webui.txt2img(prompt="a cat", steps=1)  # activates the engines' SD-UNet
    assert type(webui.sd_unet.current_unet).__name__ == "SdAccelUnet"  # ours, activated by "Automatic"
    webui.shared.opts.data["sd_accel_backend"] = "tensorrt"
    capsys.readouterr()
    out = webui.txt2img(prompt="a cat", steps=2).samples
    assert torch.isfinite(out).all()
    assert "engines cannot be loaded" in capsys.readouterr().out
    status = status_markdown()
    # CPU torch: no TensorRT advice that cannot work here; the CPU backends are named instead.
    assert "cannot run here" in status and "pip install tensorrt" not in status
    assert "OpenVINO" in status and "ONNX Runtime" in status


@pytest.mark.slow
def test_sdxl_y_input(tmp_path):
    """SDXL: the ADM vector ``y`` is an engine input, passed by keyword as sgm's wrapper does."""
    webui = harness.start(tmp_path, family="sdxl")
    from sd_accel.webui.jobs import build_for_checkpoint

    records = build_for_checkpoint(profile=STATIC)
    assert set(records[0].shapes) == {"x", "timesteps", "context", "y"}
    assert records[0].extra["webui"]["family"] == "sdxl"
    webui.sd_unet.list_unets()
    webui.shared.opts.sd_unet = "None"
    reference = webui.txt2img(prompt="a cat", steps=2).samples
    webui.shared.opts.sd_unet = "Automatic"
    got = webui.txt2img(prompt="a cat", steps=2).samples
    assert _counts(webui) == (2, 0)
    torch.testing.assert_close(got, reference, atol=2e-3, rtol=2e-3)


def test_unet_that_needs_divisible_sizes_is_exported_at_one():
    """A host UNet without a skip-size resize (plain LDM) cannot trace at the odd size: the spec
    says which latent sizes its engines serve, and the runtime keeps other sizes off them."""
    from sd_accel.components.ldm_unet import LdmUNetSpec, latent_ok, ldm_dims

    sys.path.insert(0, str(STUB))
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    class PlainLdm(UNetModel):
        def forward(self, x, timesteps=None, context=None, y=None, **kwargs):
            if x.shape[-1] % 2:
                raise RuntimeError("Sizes of tensors must match except in dimension 1")
            return super().forward(x, timesteps, context, y)

    unet = PlainLdm("sd15")
    dims = ldm_dims(unet)
    assert (dims.context_dim, dims.adm_channels, dims.in_channels, dims.num_upsamplers) == (64, 0, 4, 1)
    spec = LdmUNetSpec(unet, dims)
    assert spec.export_side() % 2 == 0 and spec.latent_multiple == 2
    assert latent_ok((8, 8), 2) and not latent_ok((9, 8), 2) and latent_ok((9, 8), 1)
    assert LdmUNetSpec(UNetModel("sd15")).export_side() % 2 == 1  # the diffusers-style UNet resizes
    harness.purge()


@pytest.mark.slow
def test_default_build_of_a_full_precision_a1111_unet_on_openvino(tmp_path):
    """A real A1111 at full precision (``--no-half``) runs ``h = x.type(self.dtype)`` first: in the
    export ``x`` feeds a Cast, and OpenVINO names the converted input after the Cast's output.
    The default build (backend ``auto``: OpenVINO on a CPU) must build that UNet and run on it."""
    pytest.importorskip("openvino")
    import types

    webui = harness.start(tmp_path, options={"sd_accel_backend": "auto"})
    unet = webui.shared.sd_model.model.diffusion_model
    plain = unet.forward

    def a1111_forward(self, x, timesteps=None, context=None, y=None, **kwargs):
        h = x.type(torch.float32)  # openaimodel.UNetModel.forward with self.dtype = float32
        extra = {"y": y} if y is not None else {}
        return plain(h, timesteps, context, **extra, **kwargs).type(x.dtype)

    unet.forward = types.MethodType(a1111_forward, unet)
    try:
        r = webui.client().post("/sd-accel/build", json={"profile": STATIC.to_dict()})  # the request
        assert r.status_code == 200, r.text
        built = r.json()["built"]
        assert {e["component"] for e in built} >= {"ldm_unet"} and len(built) >= 3, built  # UNet, VAE, CLIP
        assert {e["backend"] for e in built} == {"openvino"}, built
        webui.sd_unet.list_unets()
        webui.shared.opts.sd_unet = "Automatic"
        webui.txt2img(prompt="a cat", steps=1)
        assert _counts(webui)[0] > 0  # the job ran on the engine
    finally:
        harness.purge()


@pytest.mark.slow
def test_engines_of_another_backend_run_under_auto_and_a_pinned_backend_says_why_not(tmp_path, capsys):
    """Built with "backend": "onnxruntime" while the setting says auto (OpenVINO first on a CPU
    WebUI): the SD-UNet option is offered and the job runs on those engines, said once. With the
    setting pinned to OpenVINO, the job's report and the tab say why they are not used."""
    pytest.importorskip("openvino")
    from sd_accel.webui.controller import controller
    from sd_accel.webui.tab import status_markdown

    webui = harness.start(tmp_path, options={"sd_accel_backend": "auto"})
    try:
        assert controller().backend().name == "openvino"
        r = webui.client().post("/sd-accel/build", json={"profile": STATIC.to_dict(), "components": ["unet"],
                                                         "backend": "onnxruntime"})
        assert r.status_code == 200, r.text
        assert [e["backend"] for e in r.json()["built"]] == ["onnxruntime"]
        webui.sd_unet.list_unets()
        assert [o.label for o in webui.sd_unet.unet_options] == ["[sd-accel] tiny-sd15"]
        webui.shared.opts.sd_unet = "Automatic"
        capsys.readouterr()
        webui.txt2img(prompt="a cat", steps=1)
        assert _counts(webui)[0] > 0
        out = capsys.readouterr().out
        assert "using its onnxruntime engines (backend auto; openvino" in out
        assert "jobs run on their onnxruntime engines" in status_markdown()

        webui.shared.opts.data["sd_accel_backend"] = "openvino"
        controller().engines_changed()
        webui.txt2img(prompt="a cat", steps=1)
        assert _counts(webui)[0] == 0
        report = controller().job_finished() or ""
        assert "are onnxruntime engines, but the backend setting is openvino: they are not used" in report
        assert "**Engines not used**" in status_markdown()
    finally:
        harness.purge()
