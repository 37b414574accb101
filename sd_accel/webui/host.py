"""The one place that reaches into the WebUI: its modules are imported here, on use.

Real module and attribute names of AUTOMATIC1111 (1.6-1.10) and Forge (both eras) are used;
anything that differs between them is probed with ``getattr`` so that a missing attribute
means "not this WebUI", never a crash. Tests run the same code against ``tests/webui_stub``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from sd_accel.core import SdAccelError


class NoModel(SdAccelError, RuntimeError):
    """No checkpoint is loaded (A1111 before the first load, Forge's ``FakeInitialModel``)."""


def module(name: str):
    """``modules.<name>`` of the running WebUI (``shared``, ``sd_unet``, ``script_callbacks`` ...)."""
    return importlib.import_module(f"modules.{name}")


def is_forge() -> bool:
    """Forge (either era) ships the ``modules_forge`` package beside A1111's ``modules``."""
    return importlib.util.find_spec("modules_forge") is not None


def shared():
    return module("shared")


NO_MODEL_A1111 = ("no checkpoint is loaded in the WebUI yet; it loads with the first generation (or pick one "
                  "in the checkpoint dropdown)")
NO_MODEL_FORGE = ("no checkpoint is loaded in Forge yet (Forge loads the selected checkpoint when it first "
                  "generates); a build loads it first")


def loaded_model():
    """The loaded model, or None, WITHOUT loading one.

    ``shared.sd_model`` is a property on A1111 1.6+ and Forge that loads the selected checkpoint
    when none is loaded (``sd_models.model_data.get_sd_model()``): reading it while the UI is
    built made the UI wait for the model, and broke ``--skip-load-model-at-start``. The model
    data's own attribute is read instead; Forge 2's placeholder (``FakeInitialModel``) counts
    as no model.
    """
    try:
        data = module("sd_models").model_data
        model = data.sd_model
    except (ImportError, AttributeError):  # an older WebUI without model_data: a plain attribute
        model = getattr(shared(), "sd_model", None)
    if model is None or getattr(model, "sd_checkpoint_info", None) is None:
        return None
    return model


def sd_model(required: bool = True):
    """The loaded model (never loads one); :class:`NoModel` when none is loaded and ``required``."""
    model = loaded_model()
    if required and model is None:
        raise NoModel(NO_MODEL_FORGE if is_forge() else NO_MODEL_A1111)
    return model


def forge_unet_patcher(model=None):
    """Forge's ``UnetPatcher`` of the model (``forge_objects.unet``), or None outside Forge."""
    model = model if model is not None else sd_model(required=False)
    objects = getattr(model, "forge_objects", None)
    return getattr(objects, "unet", None)


def loaded_unet(model=None) -> torch.nn.Module:
    """The UNet module the WebUI samples with, as the WebUI has it (LoRA merged included).

    A1111: ``sd_model.model.diffusion_model`` (LDM / SGM ``UNetModel``). Forge:
    ``sd_model.forge_objects.unet.model.diffusion_model``; an sd-accel stand-in that a running
    job patched in is unwrapped to the torch module it wraps.
    """
    model = model if model is not None else sd_model()
    patcher = forge_unet_patcher(model)
    if patcher is not None:
        unet = patcher.model.diffusion_model
    else:
        wrapper = getattr(model, "model", None)
        unet = getattr(wrapper, "diffusion_model", None)
    if unet is None:
        raise NoModel(f"{type(model).__name__} has no UNet (diffusion_model); load an SD checkpoint")
    return getattr(unet, "torch_unet", unet)


# The WebUIs' own transformer-family models, by class name (what their diffusion_model is): Forge 2's
# FLUX.1, Chroma and SD3 / SD3.5, A1111 1.10's SD3.
_TRANSFORMERS = {"IntegratedFluxTransformer2DModel": "FLUX.1", "IntegratedChromaTransformer2DModel": "Chroma",
                 "MMDiTX": "SD3 / SD3.5", "MMDiT": "SD3"}


class NotOnEngines(NoModel):
    """The loaded model is of a family sd-accel does not put on engines inside the WebUI."""


def transformer_family(unet: torch.nn.Module) -> str | None:
    """``FLUX.1``, ``SD3 / SD3.5`` ... where the WebUI's diffusion model is a transformer family's
    (not an LDM UNet), else None."""
    return _TRANSFORMERS.get(type(getattr(unet, "torch_unet", unet)).__name__)


def not_on_engines(unet: torch.nn.Module) -> str | None:
    """What to tell a user whose loaded model is a transformer family's, or None."""
    family = transformer_family(unet)
    if family is None or type(getattr(unet, "torch_unet", unet)).__name__ in ("IntegratedFluxTransformer2DModel", "MMDiTX"):
        return None  # (Forge's FLUX.1 and SD3.5 run on a transformer engine: sd_accel.webui.forge_transformer)
    return (f"the loaded model is {family} ({type(unet).__name__}): sd-accel does not run {family} on engines "
            "inside the WebUI yet, so it runs in the WebUI's own PyTorch. For it on engines use sd-accel's ComfyUI "
            "pack, `sd-accel generate` (or load_pipeline + accelerate) or `sd-accel serve`")


# keyword arguments Forge's sampling passes its diffusion model that the model does not compute with:
# ``control_model``, the ControlNet object beside ``control`` (the model's **kwargs swallow it)
FORGE_INFORMATIONAL = ("control_model",)


def forge_call_reason(options: dict, kwargs: dict, model: str) -> str | None:
    """Why a Forge diffusion-model call (its ``transformer_options`` and extra keyword arguments)
    is not one an engine computes: other extensions' patches, arguments the engine lacks; or None.
    ``model``: how the message names the model (``UNet``, ``transformer``)."""
    patches = [k for k in ("patches", "patches_replace") if options.get(k)]
    if patches:
        names = sorted({n for k in patches for n in options[k]})
        return f"{model} patches from other extensions ({', '.join(names)}) are not in the engine"
    extra = sorted(k for k, v in kwargs.items() if v is not None and k not in FORGE_INFORMATIONAL)
    if extra:
        return f"arguments the engine was not built for: {', '.join(extra)}"
    return None


def checkpoint_info(model=None):
    """``sd_model.sd_checkpoint_info`` (``modules.sd_models.CheckpointInfo``)."""
    return (model if model is not None else sd_model()).sd_checkpoint_info


def cmd_flag(name: str) -> bool:
    """A WebUI command-line flag (``medvram``, ``lowvram``, ``xformers``, ``no_half_vae`` ...)."""
    return bool(getattr(getattr(shared(), "cmd_opts", None), name, False))


def forge_flag(name: str) -> bool:
    """A Forge memory flag (``always_cpu`` ...): Forge 2 parses them in ``backend.args``, Forge 1
    in ``ldm_patched.modules.args_parser``; read only where Forge has imported them already."""
    import sys

    for where in ("backend.args", "ldm_patched.modules.args_parser"):
        args = getattr(sys.modules.get(where), "args", None)
        if args is not None and getattr(args, name, False):
            return True
    return cmd_flag(name)


def runs_on_cpu() -> bool:
    """The WebUI computes on the CPU: Forge's ``--always-cpu``, A1111's ``--use-cpu all``, or a
    torch without a usable CUDA device."""
    if forge_flag("always_cpu"):
        return True
    use_cpu = getattr(getattr(shared(), "cmd_opts", None), "use_cpu", None) or []
    if any(str(m).lower() in ("all", "sd") for m in use_cpu):
        return True
    return not (torch.version.cuda and torch.cuda.is_available())


def opt(key: str, default: Any = None) -> Any:
    """A value from the settings page (``shared.opts``), ``default`` while unset."""
    opts = getattr(shared(), "opts", None)
    data = getattr(opts, "data", None) or {}
    if key in data:
        return data[key]
    try:
        value = getattr(opts, key)
    except (AttributeError, KeyError):
        return default
    return default if value is None else value


def models_dir() -> Path:
    """The WebUI's ``models`` folder (``modules.paths.models_path``), else ``./models``."""
    try:
        return Path(module("paths").models_path)
    except (ImportError, AttributeError):
        return Path.cwd() / "models"


def default_engine_dir() -> Path:
    """``$SD_ACCEL_ENGINE_DIR``, else ``<webui>/models/sd-accel`` beside the WebUI's other models."""
    env = os.environ.get("SD_ACCEL_ENGINE_DIR")
    return Path(env).expanduser() if env else models_dir() / "sd-accel"


def queue_lock():
    """The WebUI's generation lock (``modules.call_queue.queue_lock``): builds hold it, so that
    the UNet is never moved for export while a job samples with it."""
    try:
        return module("call_queue").queue_lock
    except (ImportError, AttributeError):
        import threading

        return threading.Lock()


def first_stage(model=None):
    """The LDM autoencoder the WebUI decodes and encodes with: A1111's ``first_stage_model``,
    Forge's ``forge_objects.vae.first_stage_model``; None when there is none."""
    model = model if model is not None else sd_model()
    vae = getattr(getattr(model, "forge_objects", None), "vae", None)
    if vae is not None and getattr(vae, "first_stage_model", None) is not None:
        return vae.first_stage_model
    return getattr(model, "first_stage_model", None)


def text_encoder_roots(model=None) -> list:
    """Where the WebUI keeps its text encoders: A1111's ``cond_stage_model`` (SD 1.x / 2.x) or
    ``conditioner`` (SDXL), Forge's ``forge_objects.clip.cond_stage_model``."""
    model = model if model is not None else sd_model()
    clip = getattr(getattr(model, "forge_objects", None), "clip", None)
    roots = [getattr(clip, "cond_stage_model", None), getattr(model, "cond_stage_model", None),
             getattr(model, "conditioner", None)]
    return [r for r in roots if isinstance(r, torch.nn.Module)]


def loaded_vae_hash() -> str | None:
    """A1111's separately loaded VAE file (``sd_vae.loaded_vae_file``), as its short sha256 (the
    WebUI's own, cached in its ``cache.json``); None when the checkpoint's own VAE is in use."""
    try:
        sd_vae = module("sd_vae")
    except ImportError:
        return None
    if not getattr(sd_vae, "loaded_vae_file", None):
        return None
    getter = getattr(sd_vae, "get_loaded_vae_hash", None)
    value = getter() if callable(getter) else None
    if not value:  # an older WebUI: name the file instead (size and name are enough to tell two apart)
        path = Path(sd_vae.loaded_vae_file)
        size = path.stat().st_size if path.exists() else 0
        import hashlib

        value = hashlib.sha256(f"{path.name}:{size}".encode()).hexdigest()
    return str(value)[:10].lower()


def additional_modules() -> tuple[str, ...]:
    """Forge 2's extra VAE / text-encoder files loaded with the checkpoint (``forge_additional_modules``)."""
    try:
        params = module("sd_models").model_data.forge_loading_parameters
    except (ImportError, AttributeError):
        return ()
    return tuple(str(m) for m in (params or {}).get("additional_modules") or ())


# Layer types whose ``forward`` A1111's Lora extension patches to merge LoRA weights in place.
_LORA_LAYERS = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.MultiheadAttention)


def a1111_networks():
    """A1111's built-in Lora extension (``extensions-builtin/Lora/networks.py``, imported as
    ``networks``) when it is loaded and merges weights in place (1.5+), else None."""
    import sys

    networks = sys.modules.get("networks")
    if networks is None or not callable(getattr(networks, "network_apply_weights", None)):
        return None
    if not isinstance(getattr(networks, "loaded_networks", None), list):
        return None
    return networks


def apply_a1111_loras(module: torch.nn.Module) -> int:
    """Make ``module``'s layers carry the LoRAs A1111 has loaded for this job
    (``networks.loaded_networks``), as their patched ``forward`` would on the first PyTorch call:
    ``networks.network_apply_weights`` on each layer A1111 named (``network_layer_name``). It
    keeps its own backups (and restores them when the set changes). Returns the layers visited;
    raises :class:`NoModel` without the Lora extension."""
    networks = a1111_networks()
    if networks is None:
        raise NoModel("A1111's built-in Lora extension (networks.network_apply_weights) is not loaded")
    count = 0
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, _LORA_LAYERS) and getattr(layer, "network_layer_name", None) is not None:
                networks.network_apply_weights(layer)
                count += 1
    return count


def forge_lora_state(patcher, merged: bool = True) -> str | None:
    """Why the weights of Forge's UNet do not carry the patcher's LoRA patches now, or None when
    they do: Forge 2 merges them when it loads the UNet for sampling (``LoraLoader.refresh``,
    ``loaded_hash`` = the patches' keys); "online" LoRAs are computed in each forward instead,
    and Forge 1's patcher (``patches``, no ``lora_patches``) is not read. ``merged`` False: only
    whether they can be (before sampling, when Forge has not loaded the UNet yet)."""
    lora_patches = getattr(patcher, "lora_patches", None)
    if not isinstance(lora_patches, dict):
        return "this Forge keeps LoRA patches that sd-accel cannot read as merged weights (Forge 1.x)"
    if any(isinstance(k, tuple) and len(k) > 3 and k[3] for k in lora_patches):
        return "LoRAs applied online (Forge computes them in each forward) are not in the weights"
    if not merged:
        return None
    loader = getattr(getattr(patcher, "model", None), "lora_loader", None)
    loaded = getattr(loader, "loaded_hash", None)
    if loaded != str(list(lora_patches.keys())):
        return "Forge has not merged these LoRA patches into the UNet's weights"
    return None
