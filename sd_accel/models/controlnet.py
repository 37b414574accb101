"""``load_controlnet``: a ControlNet from what users have, offline, and the pipeline that runs it.

Sources: a diffusers folder (``config.json`` + weights; FLUX.1's ``FluxControlNetModel`` and SD3's
``SD3ControlNetModel`` too, as InstantX and the union nets are published), or a single file in the original layout
(``control_model.*`` keys, or the same keys without the prefix, as the ControlNet 1.1 files and
most SD 1.5 / SDXL ControlNets people download are); ``.safetensors``, and pickles (``.pth``,
``.ckpt``) only with ``allow_pickle=True``. A single file's config is the shipped one of its family
(``configs/controlnet-sd15``, ``controlnet-sdxl``) fitted to the file's shapes, so nothing is
downloaded and odd widths (the tiny test models) load the same way. Head counts follow the family
rule (:mod:`sd_accel.models.fit`); a WebUI-style ``.yaml`` beside the file may set
``global_average_pooling`` (the shuffle ControlNet).

:func:`controlnet_pipeline` makes the ControlNet variant of a loaded pipeline (txt2img, img2img or
inpaint; SD 1.x/2.x, SDXL, SD3 or FLUX.1) from its components, after :func:`check_family` has made sure each
net fits that pipeline's UNet.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from sd_accel.core import CheckpointError, InvalidValue, ModelNotFound
from sd_accel.models.checkpoint import PICKLE_SUFFIXES, SAFE_SUFFIXES, load_pickle_state_dict, read_shapes
from sd_accel.models.families import CONFIG_ROOT
from sd_accel.models.fit import HEAD_WIDTH, _need, _unet_levels

log = logging.getLogger("sd_accel")

PREFIX = "control_model."
_UNET = "model.diffusion_model."  # fit.py's UNet prefix: a ControlNet's input/middle blocks are the UNet's
FAMILY_TITLES = {"sd15": "SD 1.x", "sd2": "SD 2.x", "sdxl": "SDXL"}


def controlnet_family(config: Any) -> str:
    """``sd15``, ``sd2`` or ``sdxl`` of a ControlNet or UNet config (by its conditioning: SDXL's
    added text/time embeddings, SD 2.x's 1024-wide text embeddings)."""
    get = config.get if hasattr(config, "get") else (lambda k, d=None: getattr(config, k, d))
    if get("addition_embed_type") == "text_time":
        return "sdxl"
    dim = get("cross_attention_dim")
    dim = dim[0] if isinstance(dim, list | tuple) else dim
    return "sd2" if dim == 1024 else "sd15"


# ---------------------------------------------------------------------------------- single files


def _strip(shapes: dict) -> tuple[str, dict]:
    """(prefix, shapes without it): ``control_model.`` or none (files saved without it)."""
    if any(k.startswith(PREFIX) for k in shapes):
        return PREFIX, {k[len(PREFIX):]: v for k, v in shapes.items() if k.startswith(PREFIX)}
    return "", dict(shapes)


def _is_original(shapes: dict) -> bool:
    return "input_hint_block.0.weight" in shapes and "time_embed.0.weight" in shapes


def fit_controlnet(shapes: dict, pipe=None) -> dict[str, Any]:
    """A ``ControlNetModel`` config for original-layout ``shapes`` (prefix stripped): the family's
    shipped config with what the shapes say. ``pipe``: the pipeline it will run with, for what the
    weights do not hold (SDXL's time-id embedding width)."""
    levels = _unet_levels({_UNET + k: v for k, v in shapes.items()})
    if not levels or levels[0]["channels"] is None:
        raise CheckpointError("the ControlNet has no input blocks; the file is truncated or not a ControlNet")
    xl = "label_emb.0.0.weight" in shapes
    first_attn = next((k for k in shapes if k.endswith("attn2.to_k.weight")), None)
    cross = shapes[first_attn][1] if first_attn else None
    family = "sdxl" if xl else ("sd2" if cross == 1024 else "sd15")
    config = json.loads((CONFIG_ROOT / f"controlnet-{'sdxl' if xl else 'sd15'}" / "config.json").read_text())
    channels = [lvl["channels"] for lvl in levels]
    attn = [lvl["depth"] > 0 for lvl in levels]
    hint = [k for k in range(0, 64, 2) if f"input_hint_block.{k}.weight" in shapes]
    config.update(
        in_channels=_need(shapes, "input_blocks.0.0.weight")[1],
        conditioning_channels=_need(shapes, "input_hint_block.0.weight")[1],
        # conv_in, then pairs (same width, then the next width, stride 2); conv_out is the last
        conditioning_embedding_out_channels=[shapes["input_hint_block.0.weight"][0]]
        + [shapes[f"input_hint_block.{k}.weight"][0] for k in hint[2:-1:2]],
        block_out_channels=channels,
        layers_per_block=levels[0]["blocks"],
        down_block_types=["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attn],
    )
    if cross is not None:
        config["cross_attention_dim"] = cross
    linear = [lvl["linear"] for lvl in levels if lvl["linear"] is not None]
    if linear:
        config["use_linear_projection"] = linear[0]
    if family != "sd15":
        config["attention_head_dim"] = [c // HEAD_WIDTH for c in channels]
    if xl:
        config["transformer_layers_per_block"] = [max(lvl["depth"], 1) for lvl in levels]
        adm = _need(shapes, "label_emb.0.0.weight")[1]
        config["projection_class_embeddings_input_dim"] = adm
        unet_cfg = getattr(getattr(pipe, "unet", None), "config", None)
        if unet_cfg is not None and unet_cfg.get("addition_time_embed_dim"):
            config["addition_time_embed_dim"] = unet_cfg["addition_time_embed_dim"]
    return config


def _sidecar_pooling(path: Path) -> bool | None:
    yaml_path = path.with_suffix(".yaml")
    if not yaml_path.exists():
        return None
    import yaml

    try:
        cfg = yaml.safe_load(yaml_path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise CheckpointError(f"{yaml_path} is not valid YAML ({exc})") from exc
    params = ((cfg.get("model") or {}).get("params") or {}).get("control_stage_config", {}).get("params", {})
    return bool(params["global_average_pooling"]) if "global_average_pooling" in params else None


def _load_state(path: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    suffix = path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        return load_pickle_state_dict(path, allow_pickle)
    if suffix not in SAFE_SUFFIXES:
        raise CheckpointError(f"{path.name}: unknown ControlNet file type {suffix!r}; expected .safetensors "
                              "(or .pth/.ckpt with allow_pickle=True), or a diffusers folder")
    from safetensors.torch import load_file

    read_shapes(path)  # a clear error for a truncated file
    return load_file(str(path))


def load_single_file_controlnet(path: Path, *, pipe=None, allow_pickle: bool = False):
    """An original-layout ControlNet file as a diffusers ``ControlNetModel`` (no download)."""
    from diffusers import ControlNetModel
    from diffusers.loaders.single_file_utils import convert_controlnet_checkpoint

    state = _load_state(path, allow_pickle)
    prefix, stripped = _strip({k: tuple(v.shape) for k, v in state.items()})
    if not _is_original(stripped):
        if "controlnet_cond_embedding.conv_in.weight" in state:
            raise CheckpointError(f"{path.name} is a diffusers-layout ControlNet weights file: load the diffusers "
                                  "folder it came in (with its config.json), not the file alone")
        raise CheckpointError(f"{path.name} is not a ControlNet (no {prefix or PREFIX}input_hint_block / time_embed "
                              f"keys; first keys: {', '.join(list(state)[:3])})")
    config = fit_controlnet(stripped, pipe)
    pooling = _sidecar_pooling(path)
    if pooling is not None:
        config["global_pool_conditions"] = pooling
    tensors = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    converted = convert_controlnet_checkpoint(tensors, config)
    for ldm, ours in (("label_emb.0.0", "add_embedding.linear_1"), ("label_emb.0.2", "add_embedding.linear_2")):
        for param in ("weight", "bias"):  # SDXL's added embedding: diffusers' converter leaves it out
            if f"{ldm}.{param}" in tensors:
                converted.setdefault(f"{ours}.{param}", tensors[f"{ldm}.{param}"])
    init = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        net = ControlNetModel(**init)
    try:
        missing, unexpected = net.load_state_dict(converted, strict=False, assign=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{path.name}: the ControlNet's weights do not fit the architecture read from it "
                              f"({str(exc)[:300]})") from exc
    if not missing and any(t.is_meta for t in (*net.parameters(), *net.buffers())):
        missing = [n for n, t in (*net.named_parameters(), *net.named_buffers()) if t.is_meta]
    if missing or unexpected:
        raise CheckpointError(f"{path.name}: not a ControlNet sd-accel can read: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]} (a ControlNet-LoRA, T2I-Adapter or another variant?)")
    return net.eval()


# ---------------------------------------------------------------------------------- the entry


def load_controlnet(source: str | os.PathLike, *, pipe=None, torch_dtype: torch.dtype | None = None,
                    allow_pickle: bool = False):
    """Load a ControlNet offline: a diffusers folder or an original-layout single file.

    ``pipe``: the pipeline it will run with; the net must fit its UNet (:func:`check_family`:
    an SDXL ControlNet with an SD 1.5 checkpoint is a clear error). The net's ``sd_accel_source``
    says where it came from.

    A file of your own: ``load_controlnet("models/control_v11p_sd15_canny.safetensors", pipe=pipe)``.
    Here a random tiny ControlNet, saved as a diffusers folder:

    >>> import tempfile
    >>> from sd_accel import load_pipeline
    >>> from sd_accel.models.tiny_controlnet import tiny_controlnet
    >>> pipe = load_pipeline("builtin:tiny-sd15")
    >>> folder = tempfile.mkdtemp()
    >>> tiny_controlnet(pipe.unet).save_pretrained(folder)
    >>> net = load_controlnet(folder, pipe=pipe)
    >>> net.sd_accel_source == folder
    True
    """
    from diffusers import ControlNetModel

    path = Path(os.fspath(source)).expanduser()
    if not path.exists():
        raise ModelNotFound(f"ControlNet {os.fspath(source)!r} not found: give a diffusers ControlNet folder or an "
                            "original-layout .safetensors file")
    if path.is_dir() or (path.parent / "config.json").exists() and path.name.startswith("diffusion_pytorch_model"):
        folder = path if path.is_dir() else path.parent
        cfg_file = folder / "config.json"
        if not cfg_file.exists():
            raise CheckpointError(f"{folder} is a folder without config.json: not a diffusers ControlNet folder")
        kind = json.loads(cfg_file.read_text()).get("_class_name")
        if kind not in _FOLDER_CLASSES:
            raise CheckpointError(f"{folder}/config.json is not the config of a ControlNet sd-accel loads "
                                  f"({', '.join(_FOLDER_CLASSES)})")
        net = (ControlNetModel if kind == "ControlNetModel" else _net_class(kind)).from_pretrained(
            str(folder), local_files_only=True)
    elif _transformer_family(pipe):
        raise CheckpointError(f"{path} is a single file: {_TITLES[_transformer_family(pipe)]} ControlNets load "
                              "from a diffusers folder (config.json and the weights), as their authors publish them")
    else:
        net = load_single_file_controlnet(path, pipe=pipe, allow_pickle=allow_pickle)
    if torch_dtype is not None:
        net = net.to(dtype=torch_dtype)
    object.__setattr__(net, "sd_accel_source", str(path))
    if pipe is not None:
        check_family(net, pipe)
    return net


# a ControlNet folder's class -> the family it serves (None: the UNet families, told apart by shape)
_FOLDER_CLASSES = {"ControlNetModel": None, "FluxControlNetModel": "flux", "SD3ControlNetModel": "sd3"}
_TRANSFORMERS = {"FluxTransformer2DModel": "flux", "SD3Transformer2DModel": "sd3"}
_TITLES = {"flux": "FLUX.1", "sd3": "SD3 / SD3.5", None: "SD 1.x / SDXL"}


def _net_class(kind: str):
    import diffusers

    return getattr(diffusers, kind)


def _transformer_family(pipe) -> str | None:
    """``flux`` or ``sd3`` for the transformer families' pipelines, None for the UNet ones."""
    transformer = getattr(pipe, "transformer", None)
    return _TRANSFORMERS.get(type(getattr(transformer, "torch_module", transformer)).__name__)


def _is_flux(pipe) -> bool:
    return _transformer_family(pipe) == "flux"


def _check_transformer_net(net, pipe) -> None:
    """A FLUX.1 / SD3 ControlNet for a transformer of its family and widths, nothing else."""
    name = getattr(net, "sd_accel_source", "the ControlNet")
    have, want = _FOLDER_CLASSES.get(type(net).__name__), _transformer_family(pipe)
    if have != want:
        article = "an" if _TITLES[have].startswith("S") else "a"
        raise InvalidValue(f"{name} is {article} {_TITLES[have]} ControlNet and the checkpoint is {_TITLES[want]}: "
                           "use a ControlNet made for this model's family")
    tcfg, ncfg = getattr(pipe.transformer, "torch_module", pipe.transformer).config, net.config
    fields = ("in_channels", "joint_attention_dim", "pooled_projection_dim")
    widths = [(f, ncfg.get(f), tcfg.get(f)) for f in fields if ncfg.get(f) not in (None, tcfg.get(f))]
    if widths:
        raise InvalidValue(f"{name} does not fit this {_TITLES[want]} transformer ("
                           + ", ".join(f"{f} {a} vs {b}" for f, a, b in widths)
                           + "): use a ControlNet made for this model")


def check_family(net, pipe) -> None:
    """Refuse a ControlNet that does not fit ``pipe``'s UNet (FLUX.1: its transformer), saying
    which family each is."""
    if _transformer_family(pipe) or _FOLDER_CLASSES.get(type(net).__name__):
        _check_transformer_net(net, pipe)
        return
    unet = pipe.unet
    ucfg, ncfg = unet.config, net.config
    have, want = controlnet_family(ncfg), controlnet_family(ucfg)
    name = getattr(net, "sd_accel_source", "the ControlNet")
    if have != want:
        raise InvalidValue(f"{name} is an {FAMILY_TITLES[have]} ControlNet and the checkpoint is "
                           f"{FAMILY_TITLES[want]}: use a ControlNet made for {FAMILY_TITLES[want]}")
    unet_down = [b.replace("CrossAttn", "") for b in ucfg.down_block_types]
    fits = (list(ncfg.block_out_channels) == list(ucfg.block_out_channels)
            and ncfg.layers_per_block == ucfg.layers_per_block
            and [b.replace("CrossAttn", "") for b in ncfg.down_block_types] == unet_down
            and ncfg.cross_attention_dim == ucfg.cross_attention_dim)
    if not fits:
        raise InvalidValue(f"{name} does not fit this checkpoint's UNet (widths {list(ncfg.block_out_channels)} vs "
                           f"{list(ucfg.block_out_channels)}, text width {ncfg.cross_attention_dim} vs "
                           f"{ucfg.cross_attention_dim}): use a ControlNet made for this model's family")


_KINDS = ("txt2img", "img2img", "inpaint")


def controlnet_pipeline(pipe, nets, kind: str = "txt2img"):
    """The ControlNet pipeline of ``kind`` built from ``pipe``'s components and ``nets`` (one
    ``ControlNetModel`` or a list: several become a ``MultiControlNetModel``, their residuals summed;
    FLUX.1: ``FluxControlNetModel`` nets, a ``FluxControlNet*Pipeline``; SD3: ``SD3ControlNetModel``
    nets, ``StableDiffusion3ControlNet(Inpainting)Pipeline``)."""
    import diffusers
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    if kind not in _KINDS:
        raise InvalidValue(f"kind={kind!r}: use one of {', '.join(_KINDS)}")
    nets = list(nets) if isinstance(nets, list | tuple) else [nets]
    if not nets:
        raise InvalidValue("no ControlNet given")
    for net in nets:
        check_family(net, pipe)
    suffix = {"txt2img": "", "img2img": "Img2Img", "inpaint": "Inpaint"}[kind]
    if _is_flux(pipe):
        return _transformer_pipeline(pipe, nets, getattr(diffusers, f"FluxControlNet{suffix}Pipeline"),
                                     diffusers.FluxMultiControlNetModel)
    if _transformer_family(pipe) == "sd3":
        if kind == "img2img":
            raise InvalidValue("diffusers has no SD3 ControlNet img2img pipeline: use txt2img or inpaint")
        cls = getattr(diffusers, "StableDiffusion3ControlNet" + ("InpaintingPipeline" if suffix else "Pipeline"))
        return _transformer_pipeline(pipe, nets, cls, diffusers.SD3MultiControlNetModel)
    xl = "XL" if getattr(pipe, "text_encoder_2", None) is not None else ""
    cls = getattr(diffusers, f"StableDiffusion{xl}ControlNet{suffix}Pipeline")
    # An accelerated pipeline holds engine stand-ins: the new pipeline takes their torch modules
    # (diffusers would record the stand-in's class); accelerate() the new pipeline for engines.
    parts = {k: getattr(v, "torch_module", v) for k, v in pipe.components.items()
             if k not in ("safety_checker", "feature_extractor", "image_encoder", "controlnet")}
    extra = {} if xl else {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    out = cls(**parts, controlnet=nets[0] if len(nets) == 1 else MultiControlNetModel(nets), **extra)
    if hasattr(pipe, "sd_accel_model"):
        out.sd_accel_model = pipe.sd_accel_model
    return out


def _transformer_pipeline(pipe, nets: list, cls, multi):
    import inspect

    wanted = set(inspect.signature(cls.__init__).parameters) - {"self", "controlnet"}
    parts = {k: getattr(v, "torch_module", v) for k, v in pipe.components.items() if k in wanted}
    out = cls(**parts, controlnet=nets[0] if len(nets) == 1 else multi(nets))
    if hasattr(pipe, "sd_accel_model"):
        out.sd_accel_model = pipe.sd_accel_model
    return out


def with_controlnets(pipe, sources, *, kind: str = "txt2img", allow_pickle: bool = False):
    """``pipe`` as its ControlNet pipeline of ``kind``, with each ControlNet of ``sources`` (paths, or
    loaded ``ControlNetModel``) loaded offline and checked against its UNet.

    With files of your own: ``with_controlnets(load_pipeline("sd15.safetensors"), ["control_v11p_sd15_canny.safetensors"])``.
    Here with a random tiny ControlNet:

    >>> from sd_accel import load_pipeline
    >>> from sd_accel.models.tiny_controlnet import tiny_controlnet
    >>> pipe = load_pipeline("builtin:tiny-sd15")
    >>> type(with_controlnets(pipe, [tiny_controlnet(pipe.unet)])).__name__
    'StableDiffusionControlNetPipeline'
    """
    nets = [s if isinstance(s, torch.nn.Module) else load_controlnet(s, pipe=pipe, allow_pickle=allow_pickle)
            for s in sources]
    return controlnet_pipeline(pipe, nets, kind)


def residual_component(pipe) -> str:
    """The component that takes a ControlNet's residuals in ``pipe``'s family: the transformer's
    twin (``transformer_control``) for FLUX.1 / SD3, the UNet's (``unet_control``) otherwise."""
    return "transformer_control" if getattr(pipe, "transformer", None) is not None else "unet_control"


def call_arguments(hints: list, scales: list[float], starts: list[float] | None = None,
                   ends: list[float] | None = None, *, pipe=None,
                   modes: list[int | None] | None = None) -> dict[str, Any]:
    """A ControlNet pipeline's call arguments for one hint per net: plain values for one net (what
    a single ``ControlNetModel`` takes), lists for several; start/end only when given. With
    ``pipe`` a FLUX.1 / SD3 ControlNet pipeline the hint is ``control_image`` (their name for it),
    and ``modes`` (a union net's control type per net, None for a plain net) is ``control_mode``.

    >>> call_arguments(["hint"], [0.8])                                # "hint": the control image
    {'image': 'hint', 'controlnet_conditioning_scale': 0.8}
    """
    one = len(hints) == 1

    def value(items: list) -> Any:
        return items[0] if one else list(items)

    transformer = pipe is not None and getattr(pipe, "transformer", None) is not None
    out = {"control_image" if transformer else "image": value(hints), "controlnet_conditioning_scale": value(scales)}
    if starts is not None:
        out["control_guidance_start"] = value(starts)
    if ends is not None:
        out["control_guidance_end"] = value(ends)
    if modes is not None and any(m is not None for m in modes):
        if not (transformer and _is_flux(pipe)):
            raise InvalidValue("a control mode is for FLUX.1 union ControlNets; SD 1.x / SDXL / SD3 ControlNets "
                               "take none: leave it out")
        out["control_mode"] = value(modes)
    return out
