"""``load_pipeline``: any model source users have, loaded offline into a diffusers pipeline."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch

from sd_accel.core import CheckpointError, InvalidValue, ModelNotFound
from sd_accel.models.builtin import PREFIX as BUILTIN_PREFIX
from sd_accel.models.builtin import builtin_path
from sd_accel.models.checkpoint import PICKLE_SUFFIXES, SAFE_SUFFIXES, load_pickle_state_dict, read_shapes
from sd_accel.models.detect import Detected, detect
from sd_accel.models.families import get_family, load_family_configs, materialize, merged
from sd_accel.models.fit import fit_configs
from sd_accel.paths import cache_dir

log = logging.getLogger("sd_accel")

PREDICTION_TYPES = ("epsilon", "v_prediction")
_INPAINT_CLASSES = {
    "StableDiffusionPipeline": "StableDiffusionInpaintPipeline",
    "StableDiffusionXLPipeline": "StableDiffusionXLInpaintPipeline",
}


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded and from where; kept on the pipeline as ``pipe.sd_accel_model``."""

    source: str
    family: str
    inpaint: bool
    prediction_type: str


def _sidecar_prediction_type(path: Path) -> str | None:
    """The WebUI convention: ``model.yaml`` beside ``model.safetensors`` holds the original config;
    ``parameterization: "v"`` in it marks a v-prediction model."""
    yaml_path = path.with_suffix(".yaml")
    if not yaml_path.exists():
        return None
    import yaml

    try:
        cfg = yaml.safe_load(yaml_path.read_text())
    except yaml.YAMLError as exc:
        raise CheckpointError(f"{yaml_path} is not valid YAML ({exc})") from exc
    params = ((cfg or {}).get("model") or {}).get("params") or {}
    return "v_prediction" if params.get("parameterization") == "v" else "epsilon"


def _family_for(det: Detected, prediction_type: str | None) -> str:
    if det.family.startswith("sd2") and prediction_type == "epsilon":
        return "sd2-base"
    return det.family


def _configs_for(det: Detected, family: str, shapes: dict, prediction_type: str | None) -> dict[str, Any]:
    base = load_family_configs(get_family(family))
    configs = merged(base, fit_configs(shapes, det, base))
    if prediction_type is not None:
        configs["scheduler/scheduler_config.json"]["prediction_type"] = prediction_type
    if det.inpaint:
        index = configs["model_index.json"]
        index["_class_name"] = _INPAINT_CLASSES[index["_class_name"]]
    if det.guidance_embedded:  # LCM-distilled: its own sampler (the UNet was distilled for it)
        configs["model_index.json"]["scheduler"] = ["diffusers", "LCMScheduler"]
        configs["scheduler/scheduler_config.json"]["_class_name"] = "LCMScheduler"
    return configs


def _load_guidance_embedding(pipe, path: Path) -> None:
    """diffusers' single-file conversion drops ``time_embedding.cond_proj`` (it has no original-layout
    name): the UNet the config built has the layer, filled here from the file."""
    from safetensors import safe_open

    from sd_accel.models.detect import LCM_COND_PROJ

    with safe_open(str(path), framework="pt") as f:
        weight = f.get_tensor(LCM_COND_PROJ)
    layer = pipe.unet.time_embedding.cond_proj
    with torch.no_grad():
        layer.weight.copy_(weight.to(layer.weight.dtype))


def _pickle_to_safetensors(path: Path, allow_pickle: bool) -> Path:
    """Convert a trusted pickle once into a cached ``.safetensors`` so one loading path serves both."""
    from safetensors.torch import save_file

    digest = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode())
    dest = cache_dir() / "converted" / f"{path.stem}-{digest.hexdigest()[:12]}.safetensors"
    if not dest.exists():
        state = load_pickle_state_dict(path, allow_pickle)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
        tmp.replace(dest)
    return dest


def load_single_file(
    path: Path,
    *,
    torch_dtype: torch.dtype | None = None,
    prediction_type: str | None = None,
    allow_pickle: bool = False,
    parts: dict[str, str | Path] | None = None,
) -> diffusers.DiffusionPipeline:
    """Load a WebUI-style single-file checkpoint with the shipped configs (no download); a FLUX.1
    transformer file with its VAE, CLIP-L and T5 files (``parts``, or found beside it)."""
    original = path  # (a pickle is read from a converted copy; the engines of other faces know the file)
    suffix = path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        path = _pickle_to_safetensors(path, allow_pickle)
    elif suffix not in SAFE_SUFFIXES:
        raise CheckpointError(
            f"{path.name}: unknown checkpoint type {suffix!r}; expected .safetensors (or .ckpt with allow_pickle=True)"
        )
    shapes = read_shapes(path)
    from sd_accel.models.flux import flux_prefix, load_flux
    from sd_accel.models.sd3 import load_sd3, sd3_prefix
    from sd_accel.models.source import tag_loaded

    if flux_prefix(shapes) is not None:
        pipe, family, _ = load_flux(path, shapes, parts, torch_dtype)
        pipe.sd_accel_model = ModelInfo(str(path), family, False, "flow")
        tag_loaded(pipe, original, family, ("transformer",))  # ComfyUI's engines of this file serve it
        return pipe
    if sd3_prefix(shapes) is not None:
        pipe = load_sd3(path, shapes, parts, torch_dtype)
        pipe.sd_accel_model = ModelInfo(str(path), "sd3", False, "flow")
        tag_loaded(pipe, original, "sd3", ("transformer",))
        return pipe
    if parts:
        raise InvalidValue(f"parts= is for SD3 / SD3.5 and FLUX.1 files; {path.name} is neither")
    det = detect(shapes, name=path.name)
    prediction_type = prediction_type or _sidecar_prediction_type(path)
    family = _family_for(det, prediction_type)
    configs = _configs_for(det, family, shapes, prediction_type)
    folder = materialize(configs)
    pipe_cls = getattr(diffusers, configs["model_index.json"]["_class_name"])
    kwargs: dict[str, Any] = {"config": str(folder), "local_files_only": True}
    if torch_dtype is not None:
        kwargs["torch_dtype"] = torch_dtype
    if not det.is_xl:
        kwargs.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    if det.guidance_embedded:  # cond_proj is missing from the converted weights: built, not left on meta
        kwargs["low_cpu_mem_usage"] = False
    try:
        pipe = pipe_cls.from_single_file(str(path), **kwargs)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise CheckpointError(
            f"{path.name} looks like {get_family(family).title} but its weights do not fit that "
            f"architecture ({type(exc).__name__}: {str(exc)[:300]}). It may be truncated, merged "
            "wrongly, or a variant sd-accel does not know."
        ) from exc
    if det.guidance_embedded:
        _load_guidance_embedding(pipe, path)
    else:  # (an LCM UNet's guidance embedding is not in the file: no original-layout engine has it)
        from sd_accel.models.source import tag_loaded

        tag_loaded(pipe, original, family)  # the WebUI's and ComfyUI's engines of this file serve it
    pipe.sd_accel_model = ModelInfo(
        str(path), family, det.inpaint, pipe.scheduler.config.get("prediction_type", "epsilon")
    )
    return pipe


def load_diffusers_folder(path: Path, *, torch_dtype: torch.dtype | None = None) -> diffusers.DiffusionPipeline:
    kwargs: dict[str, Any] = {"local_files_only": True}
    if torch_dtype is not None:
        kwargs["torch_dtype"] = torch_dtype
    pipe = diffusers.DiffusionPipeline.from_pretrained(str(path), **kwargs)
    family = _folder_family(pipe)
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    # (SD 1.x/2.x/SDXL inpainting UNets take 9 channels; the transformer families' inpaint pipelines
    # take the plain model, and the pipeline class says so)
    inpaint = getattr(denoiser.config, "in_channels", 4) == 9 if hasattr(pipe, "unet") else \
        "Inpaint" in type(pipe).__name__
    pipe.sd_accel_model = ModelInfo(
        str(path), family, inpaint, pipe.scheduler.config.get("prediction_type", "epsilon")
    )
    return pipe


def _folder_family(pipe: diffusers.DiffusionPipeline) -> str:
    transformer = getattr(pipe, "transformer", None)
    if transformer is not None:
        name = type(transformer).__name__
        if name.startswith("SD3"):
            return "sd3"
        if name.startswith("Flux"):
            return "flux-dev" if transformer.config.get("guidance_embeds") else "flux-schnell"
        raise CheckpointError(f"the pipeline's transformer is a {name}; sd-accel knows SD3 / SD3.5 "
                              "(SD3Transformer2DModel) and FLUX.1 (FluxTransformer2DModel)")
    if hasattr(pipe, "text_encoder_2"):
        return "sdxl"
    te = getattr(pipe, "text_encoder", None)
    if te is not None and te.config.hidden_act == "gelu":
        return "sd2-v" if pipe.scheduler.config.get("prediction_type") == "v_prediction" else "sd2-base"
    return "sd15"


def family_of(source: str | os.PathLike) -> str | None:
    """The model family of ``source`` without loading its weights (a diffusers folder's index, a
    single file's header, a built-in's name), or None when it cannot tell (no such file, a file
    of no known family). For a face that sets its defaults before it loads anything.

    >>> family_of("builtin:tiny-flux"), family_of("builtin:tiny-sd3"), family_of("no/such/file.safetensors")
    ('flux-schnell', 'sd3', None)
    """
    import json

    from sd_accel.models.builtin import BUILTINS

    text = os.fspath(source).strip()
    if text.startswith(BUILTIN_PREFIX):
        return BUILTINS.get(text[len(BUILTIN_PREFIX):])
    path = Path(text).expanduser()
    try:
        if path.is_dir():
            index = json.loads((path / "model_index.json").read_text())
            name = str(index.get("_class_name", ""))
            if name.startswith("StableDiffusion3"):
                return "sd3"
            if name.startswith("Flux"):
                config = json.loads((path / "transformer" / "config.json").read_text())
                return "flux-dev" if config.get("guidance_embeds") else "flux-schnell"
            return "sdxl" if "XL" in name else "sd15"
        if path.is_file() and path.suffix.lower() in SAFE_SUFFIXES:
            from sd_accel.models.flux import family_of as flux_family
            from sd_accel.models.flux import flux_prefix
            from sd_accel.models.sd3 import sd3_prefix

            shapes = read_shapes(path)
            prefix = flux_prefix(shapes)
            if prefix is not None:
                return flux_family(shapes, prefix)
            return "sd3" if sd3_prefix(shapes) is not None else detect(shapes, path.name).family
    except (OSError, ValueError):  # (CheckpointError is a ValueError)
        return None
    return None


def load_pipeline(
    source: str | os.PathLike | diffusers.DiffusionPipeline,
    *,
    torch_dtype: torch.dtype | None = None,
    prediction_type: str | None = None,
    allow_pickle: bool = False,
    parts: dict[str, str | os.PathLike] | None = None,
) -> diffusers.DiffusionPipeline:
    """Load a Stable Diffusion pipeline from what users have, with nothing downloaded.

    ``source`` is a diffusers folder (SD 1.x/2.x/SDXL, SD3 / SD3.5, FLUX.1), a single-file
    checkpoint (``.safetensors``; ``.ckpt`` only with ``allow_pickle=True``), a FLUX.1 transformer
    file (its ``ae.safetensors``, ``clip_l`` and ``t5xxl`` files found beside it or in ComfyUI's
    folders, or named in ``parts={"vae": ..., "clip_l": ..., "t5": ...}``), a built-in tiny model
    (``"builtin:tiny-sd15"``, ``tiny-sdxl``, ``tiny-sd3``, ``tiny-flux`` ...), or a pipeline
    (returned as is). SD 2.x single files are taken as v-prediction (768) unless a WebUI-style
    ``.yaml`` beside the file or ``prediction_type="epsilon"`` says otherwise.

    ``torch_dtype``: the pipeline's dtype; by default float32, except for FLUX.1 and SD3 / SD3.5
    files stored in 16 bits or fp8, which load in bf16 (in float32 FLUX.1 would be 48 GB). Their
    transformer's weights stay on the file's memory mapping in the file's own dtype, each layer
    computing in the pipeline's (:mod:`sd_accel.models.stored_dtype`).

    >>> pipe = load_pipeline("builtin:tiny-sd15")   # or "models/dreamshaper_8.safetensors"
    >>> pipe.sd_accel_model.family
    'sd15'
    """
    if prediction_type is not None and prediction_type not in PREDICTION_TYPES:
        raise InvalidValue(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")
    if isinstance(source, diffusers.DiffusionPipeline):
        return source
    text = os.fspath(source)
    if text.startswith(BUILTIN_PREFIX):
        pipe = load_diffusers_folder(builtin_path(text), torch_dtype=torch_dtype)
        pipe.sd_accel_model = ModelInfo(text, pipe.sd_accel_model.family, False, pipe.sd_accel_model.prediction_type)
        return pipe
    path = Path(text).expanduser()
    if not path.exists():
        raise ModelNotFound(
            f"model {text!r} not found: give a .safetensors file, a diffusers folder, or "
            "builtin:tiny-sd15 / builtin:tiny-sdxl"
        )
    if path.is_dir():
        if not (path / "model_index.json").exists():
            raise CheckpointError(f"{path} is a folder without model_index.json: not a diffusers pipeline folder")
        return load_diffusers_folder(path, torch_dtype=torch_dtype)
    log.info("loading %s", path)
    return load_single_file(path, torch_dtype=torch_dtype, prediction_type=prediction_type, allow_pickle=allow_pickle,
                            parts=parts)
