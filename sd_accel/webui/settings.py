"""sd-accel's section of the WebUI's settings page (``script_callbacks.on_ui_settings``)."""

from __future__ import annotations

from sd_accel.config import BACKENDS
from sd_accel.profiles import PRESETS
from sd_accel.webui import host
from sd_accel.webui.controller import (
    AUTO_PRESET,
    OPT_BACKEND,
    OPT_ENGINE_DIR,
    OPT_FALLBACK,
    OPT_FORGE,
    OPT_LORA_REFITS,
    OPT_PRESET,
    OPT_VAE_CLIP,
)
from sd_accel.webui.lora import DEFAULT_KEPT

SECTION = ("sd_accel", "sd-accel")


def on_ui_settings() -> None:
    """Register the options with ``shared.opts.add_option(key, shared.OptionInfo(...))``."""
    import gradio as gr

    shared = host.shared()
    info = shared.OptionInfo
    options = [
        (OPT_ENGINE_DIR, info("", f"Engine directory (empty: {host.default_engine_dir()})", section=SECTION)),
        (OPT_FALLBACK, info(True, "Run the PyTorch UNet for calls no engine covers (off: such a call "
                                  "stops the job with the reason)", section=SECTION)),
        (OPT_VAE_CLIP, info(True, "Use engines for the VAE and the CLIP text encoder where they cover the call",
                            section=SECTION)),
        (OPT_LORA_REFITS, info(DEFAULT_KEPT, "LoRA sets kept refitted per checkpoint: a job's LoRAs are refitted "
                                             "into the checkpoint's engine instead of needing an engine per LoRA "
                                             "set; each kept set holds a patched copy of the engines in memory (0: off)",
                               gr.Slider, {"minimum": 0, "maximum": 8, "step": 1}, section=SECTION)),
        (OPT_PRESET, info(AUTO_PRESET, "Default engine preset (tab and API)", gr.Dropdown,
                          {"choices": [AUTO_PRESET, *PRESETS]}, section=SECTION)),
        (OPT_BACKEND, info("auto", "Engine backend (auto: TensorRT on NVIDIA GPUs where it imports, "
                                   "on CPUs OpenVINO where installed, else ONNX Runtime)", gr.Dropdown, {"choices": list(BACKENDS)},
                           section=SECTION)),
    ]
    if host.is_forge():
        options.append((OPT_FORGE, info(True, "Use engines when sampling (Forge)", section=SECTION)))
    for key, option in options:
        shared.opts.add_option(key, option)
