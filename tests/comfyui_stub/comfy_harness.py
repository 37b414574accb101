"""Start the stand-in ComfyUI with sd-accel's node pack, as ComfyUI's ``load_custom_node`` would;
load the tiny checkpoint, sample, decode.

Not a ComfyUI module: the tests' driver. :func:`start` clears the stub's and the pack's modules
from ``sys.modules`` first, so each test gets a fresh ComfyUI (interrupt flag, wrapped loader).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

STUB = Path(__file__).resolve().parent
REPO = STUB.parents[1]
PACK = REPO / "extension" / "comfyui"
_PREFIXES = ("comfy", "folder_paths", "sd_accel.comfyui", "sd_accel_pack")


def purge() -> None:
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in _PREFIXES):
            del sys.modules[name]
    while str(STUB) in sys.path:
        sys.path.remove(str(STUB))


def load_pack():
    """The pack's ``__init__`` imported from its folder, as ComfyUI imports ``custom_nodes/<pack>``."""
    spec = importlib.util.spec_from_file_location("sd_accel_pack", PACK / "__init__.py",
                                                  submodule_search_locations=[str(PACK)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["sd_accel_pack"] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Comfy:
    """Handles on the started stub: the pack's mappings, the checkpoint file, ComfyUI's modules."""

    nodes: dict
    names: dict
    checkpoint: Path
    sd: Any
    samplers: Any
    model_management: Any
    utils: Any

    def node(self, name: str):
        return self.nodes[name]()

    def load(self):
        """CheckpointLoaderSimple: (MODEL, CLIP, VAE)."""
        return self.sd.load_checkpoint_guess_config(str(self.checkpoint))[:3]

    def sample(self, model, clip, prompt: str = "a cat", steps: int = 2, size: int = 64, seed: int = 0,
               cfg: float = 5.0, control=None) -> torch.Tensor:
        """KSampler (euler, normal, denoise 1): the latent."""
        positive = [{"cross_attn": clip.encode(prompt)}]
        negative = [{"cross_attn": clip.encode("")}]
        if positive[0]["cross_attn"].shape != negative[0]["cross_attn"].shape:  # ComfyUI pads uncond alike
            negative = [{"cross_attn": clip.encode(" ".join(["x"] * (prompt.count(" ") + 1)))}]
        if control is not None:
            positive[0]["control"] = negative[0]["control"] = control
        guider = self.samplers.CFGGuider(model)
        guider.set_conds(positive, negative)
        guider.set_cfg(cfg)
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(1, 4, size // 8, size // 8, generator=g)
        sigmas = self.samplers.normal_sigmas(model.model.model_sampling, steps)
        with torch.inference_mode():  # as ComfyUI runs every node
            return guider.sample(noise, sigmas)


    def sample_dit(self, model, positive: dict, negative: dict, steps: int = 2, size: int = 64, seed: int = 0,
                   cfg: float = 3.0, batch: int = 1) -> torch.Tensor:
        """KSampler (euler, simple) for a transformer model (Flux, SD3): conds given as ComfyUI's
        (``cross_attn``, ``pooled_output``, Flux's ``guidance``): the latent, as KSampler returns it."""
        base = model.model
        guider = self.samplers.CFGGuider(model)
        guider.set_conds([dict(positive)], [dict(negative)])
        guider.set_cfg(cfg)
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(batch, base.latent_format.latent_channels, size // 8, size // 8, generator=g)
        sigmas = self.samplers.simple_sigmas(base.model_sampling, steps)
        with torch.inference_mode():
            return base.process_latent_out(guider.sample(noise, sigmas))


def make_checkpoint(folder: Path, name: str = "tiny-sd15", seed: int = 0, family: str = "sd15",
                    kind: str = "checkpoints") -> Path:
    """A stand-in model file in ``models/<kind>`` (``diffusion_models`` for UNETLoader's)."""
    path = folder / kind / f"{name}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"seed": seed, "family": family}))
    return path


def start(tmp: Path, engine_dir: Path | None = None, backend: str = "onnxruntime", without_sd_accel: bool = False) -> Comfy:
    """The stub ComfyUI with the pack loaded (ONNX Runtime fp32 by default: outputs are compared
    with PyTorch's within 2e-3), the engine folder ``engine_dir`` (default ``tmp/engines``);
    ``without_sd_accel``: as if the package were not installed in ComfyUI's Python."""
    purge()
    if without_sd_accel:
        sys.modules["sd_accel.comfyui.nodes"] = None  # the import fails (purge() takes it out again)
    sys.path.insert(0, str(STUB))
    importlib.invalidate_caches()
    folder_paths = importlib.import_module("folder_paths")
    folder_paths.models_dir = str(tmp / "models")
    mm = importlib.import_module("comfy.model_management")
    mm.interrupt_current_processing(False)
    pack = load_pack()
    if "SdAccelUnavailable" not in pack.NODE_CLASS_MAPPINGS:
        from sd_accel.comfyui.state import reset_state

        reset_state(engine_dir or tmp / "engines", backend)
    utils = importlib.import_module("comfy.utils")
    utils.UPDATES.clear()
    return Comfy(pack.NODE_CLASS_MAPPINGS, pack.NODE_DISPLAY_NAME_MAPPINGS, make_checkpoint(tmp / "models"),
                 importlib.import_module("comfy.sd"), importlib.import_module("comfy.samplers"), mm, utils)
