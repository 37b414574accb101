"""Start the stand-in WebUI with sd-accel's extension, as ``webui.py`` would; run jobs.

Not a WebUI module: the tests' driver. ``start`` clears every stub and sd-accel WebUI module
from ``sys.modules`` first, so each test gets a fresh WebUI (callbacks, options, SD-UNet state).
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

STUB = Path(__file__).resolve().parent
FORGE = STUB / "forge"
REPO = STUB.parents[1]
EXTENSION = REPO / "extension"
_PREFIXES = ("modules", "ldm", "backend", "modules_forge", "launch", "sd_accel.webui", "sd_accel_webui.py",
             "networks")


def purge() -> None:
    networks = sys.modules.get("networks")
    if networks is not None and hasattr(networks, "uninstall"):
        networks.uninstall()  # torch's layer forwards back as they were
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in _PREFIXES):
            del sys.modules[name]
    for path in (str(STUB), str(FORGE)):
        while path in sys.path:
            sys.path.remove(path)


@dataclass
class WebUI:
    """Handles on the started stub: its modules, the UI, the FastAPI app, the checkpoint."""

    shared: Any
    sd_unet: Any
    sd_models: Any
    scripts: Any
    processing: Any
    script_callbacks: Any
    demo: Any
    app: Any
    checkpoint: Any
    forge: bool

    def txt2img(self, **kwargs):
        p = self.processing.StableDiffusionProcessingTxt2Img(scripts=self.scripts.scripts_txt2img, **kwargs)
        return self.processing.process_images(p)

    def img2img(self, init_images, **kwargs):
        p = self.processing.StableDiffusionProcessingImg2Img(init_images=init_images,
                                                            scripts=self.scripts.scripts_txt2img, **kwargs)
        return self.processing.process_images(p)

    def client(self):
        from fastapi.testclient import TestClient

        return TestClient(self.app)


def make_checkpoint(folder: Path, name: str, family: str = "sd15", seed: int = 0) -> Path:
    path = folder / "Stable-diffusion" / f"{name}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"family": family, "seed": seed}))
    return path


def start(tmp: Path, forge: bool = False, argv: tuple[str, ...] = ("--api",), family: str = "sd15",
          engine_dir: Path | None = None, options: dict | None = None, load: bool = True,
          loras: dict[str, int] | None = None) -> WebUI:
    """The stub WebUI with the extension loaded and a tiny checkpoint of ``family`` registered,
    started as ``webui.py`` does: the checkpoint loaded at start unless ``load`` is False
    (``--skip-load-model-at-start``; Forge 2 never loads at start), the UI created, the WebUI's API
    added with ``--api`` / ``--nowebui``, then ``app_started_callback``. ``loras`` (name -> seed):
    A1111's built-in Lora extension loaded with those stub LoRA files (its layer ``forward``
    patches are undone by :func:`purge`)."""
    from fastapi import FastAPI

    purge()
    sys.path.insert(0, str(STUB))
    if forge:
        sys.path.insert(0, str(FORGE))
    importlib.invalidate_caches()
    shared = importlib.import_module("modules.shared")
    shared.set_cmd_opts(list(argv))
    sd_hijack = importlib.import_module("modules.sd_hijack")
    sd_hijack.list_optimizers()
    sd_models = importlib.import_module("modules.sd_models")
    scripts = importlib.import_module("modules.scripts")
    script_callbacks = importlib.import_module("modules.script_callbacks")
    sd_unet = importlib.import_module("modules.sd_unet")
    ui = importlib.import_module("modules.ui")

    if loras is not None and not forge:
        networks = importlib.import_module("networks")
        networks.available_networks.update(loras)
        networks.install()
        importlib.import_module("modules.extra_networks").register_extra_network(networks.ExtraNetworkLora())
    scripts.load_scripts([str(EXTENSION)])
    scripts.scripts_txt2img.initialize_scripts(is_img2img=False)
    shared.opts.data["sd_accel_engine_dir"] = str(engine_dir or tmp / "engines")
    # ONNX Runtime fp32 by default: the tests compare engine outputs with PyTorch's within 2e-3, and
    # ``auto`` on this CPU stand-in would be OpenVINO bf16 (options={"sd_accel_backend": "auto"}).
    shared.opts.data["sd_accel_backend"] = "onnxruntime"
    for key, value in (options or {}).items():
        shared.opts.data[key] = value
    info = sd_models.register_checkpoint(str(make_checkpoint(tmp / "models", f"tiny-{family}", family)))
    shared.opts.data["sd_model_checkpoint"] = info.title
    if forge:
        sd_models.model_data.sd_model = sd_models.FakeInitialModel()
    if load:
        sd_models.load_model(info)
    sd_unet.list_unets()
    demo = None if shared.cmd_opts.nowebui else ui.create_ui()
    app = FastAPI()
    if shared.cmd_opts.api or shared.cmd_opts.nowebui:
        from modules.api.api import Api
        from modules.call_queue import queue_lock

        Api(app, queue_lock)
    script_callbacks.app_started_callback(demo, app)
    return WebUI(shared, sd_unet, sd_models, scripts, importlib.import_module("modules.processing"),
                 script_callbacks, demo, app, info, forge)


@pytest.fixture(autouse=True)
def webui_lean(monkeypatch, caplog):
    """Every WebUI test (imported into each test module, where it is autouse): one ORT thread (the
    machine's two cores are shared), no Gradio analytics, caplog listening on the sd_accel logger
    (in the WebUI it has its own console handler and does not propagate: sd_accel.webui.console),
    and the WebUI's modules purged afterwards."""
    monkeypatch.setenv("SD_ACCEL_ORT_THREADS", "1")
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    logger = logging.getLogger("sd_accel")
    logger.addHandler(caplog.handler)
    yield
    logger.removeHandler(caplog.handler)
    purge()
