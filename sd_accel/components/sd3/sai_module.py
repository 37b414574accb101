"""Stability's SD3 / SD3.5 MMDiT module as the hosts hold it (ComfyUI's
``OpenAISignatureMMDITWrapper``, Forge's ``backend.nn.mmditx.MMDiTX``): diffusers'
``SD3Transformer2DModel`` made from its weights, and one of its calls as that engine's feed.

The weights are Stability's layout (``joint_blocks.N.x_block.attn.qkv`` ...), converted by
diffusers' own single-file converter, with the config fitted by :mod:`sd_accel.models.sd3`, as
:func:`sd_accel.load_pipeline` does for the same file.

The call: both hosts hand the MMDiT sigma x 1000 (ComfyUI's ``ModelSamplingDiscreteFlow``,
Forge's ``PredictionDiscreteFlow``: multiplier 1000) and embed it as is; diffusers' SD3 transformer
takes the pipeline's t in [0, 1000) unscaled: the same number. ``y`` (both CLIPs' pooled outputs) is
``pooled_projections``; ``context`` (CLIP columns then T5's) is ``encoder_hidden_states``. The latent
is padded circularly to whole patches and the output cropped, as ComfyUI does (diffusers' patch
embedding would floor an odd side).
"""

from __future__ import annotations

import torch

from sd_accel.core import InvalidValue

FAMILY = "sd3"


def unsupported(module: torch.nn.Module) -> str | None:
    odd = [name for name, bad in (
        ("register tokens", getattr(module, "register_length", 0)),
        ("a context processor", getattr(module, "context_processor", None) is not None),
        ("no position table", getattr(module, "pos_embed", None) is None or module.pos_embed_max_size is None),
        ("no pooled-text input", getattr(module, "y_embedder", None) is None),
        # (a linear layer of any class: Forge's are its own ``ForgeOperations.Linear``, not nn.Linear)
        ("no text input", getattr(getattr(getattr(module, "context_embedder", None), "weight", None), "ndim", 0) != 2),
    ) if bad]
    return f"an MMDiT variant diffusers' SD3Transformer2DModel lacks ({', '.join(odd)})" if odd else None


def to_diffusers(module: torch.nn.Module, copy: bool = True) -> torch.nn.Module:
    """diffusers' ``SD3Transformer2DModel`` with ``module``'s weights (float32). ``copy`` False: the
    host's inference-mode float32 tensors are taken as they are (a refit; such a module cannot be
    exported)."""
    import diffusers
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    from sd_accel.models.families import get_family, load_family_configs
    from sd_accel.models.sd3 import transformer_config

    why = unsupported(module)
    if why is not None:
        raise InvalidValue(why)
    from sd_accel.components.flux.bfl_module import plain

    state = {k: (plain(v) if copy else v.detach()).float() for k, v in module.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    base = load_family_configs(get_family("sd3"))["transformer/config.json"]
    config = transformer_config(base, shapes, "")
    with torch.device("meta"):
        model = diffusers.SD3Transformer2DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    converted = convert_sd3_transformer_checkpoint_to_diffusers(dict(state))
    missing = set(model.state_dict()) - set(converted)
    if missing:
        raise InvalidValue(f"the MMDiT's weights do not map onto diffusers' (missing {sorted(missing)[:3]})")
    with torch.inference_mode(not copy):  # (a Parameter takes an inference tensor only in inference mode)
        model.load_state_dict({k: v.contiguous() for k, v in converted.items()}, assign=True)
    return model.eval()


def unmapped(module: torch.nn.Module, keys: list[str]) -> list[str]:
    """Of ``keys`` (the MODEL's patched weights, ``diffusion_model.``-prefixed), those diffusers'
    converter leaves out (a refit would not carry them): sorted. (The converter on meta tensors:
    it pops each key it takes.)"""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    names = module.state_dict(keep_vars=True)
    state = {k: torch.empty(v.shape, device="meta") for k, v in names.items()}
    convert_sd3_transformer_checkpoint_to_diffusers(state)  # (pops what it converts)
    return sorted(k for k in keys if k.removeprefix("diffusion_model.") in state
                  or k.removeprefix("diffusion_model.") not in names)


def feed(module: torch.nn.Module, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
         y: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """The engine's inputs for ComfyUI's MMDiT call ``(x, timesteps, context, y)``."""
    from torch.nn.functional import pad

    p = module.patch_size
    height, width = x.shape[-2:]
    padded = pad(x.float(), (0, (-width) % p, 0, (-height) % p), mode="circular")
    t = torch.as_tensor(timestep, device=x.device).float().reshape(-1)
    t = (t.expand(x.shape[0]) if t.numel() == 1 else t).contiguous()
    return ({"hidden_states": padded.contiguous(), "encoder_hidden_states": context.float(),
             "pooled_projections": y.float(), "timestep": t}, (height, width))


def control_feed(module: torch.nn.Module, control: dict, hidden_states: torch.Tensor, batch: int,
                 takes: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The residual-taking engine's inputs (``transformer_control``: ``block_{i}``,
    :mod:`sd_accel.components.sd3.controlnet`) for ComfyUI's ControlNet ``control`` dict: joint
    block i adds ``control["output"][i]`` to the image tokens (``MMDiT.forward_core_with_concat``),
    the last, context-pre-only block too; a block none reaches adds zeros. ``hidden_states``: the
    engine's (padded) latent input; ``takes``: the engine's input names. Raises ValueError for a
    residual the engine cannot take (another width, token count or batch; the last block's on an
    engine built before it had an input)."""
    p = module.patch_size
    tokens = (hidden_states.shape[-2] // p) * (hidden_states.shape[-1] // p)
    width = module.hidden_size
    zeros = torch.zeros(batch, tokens, width)
    adds = control.get("output") or []
    out: dict[str, torch.Tensor] = {}
    for i in range(len(module.joint_blocks)):
        name = f"block_{i}"
        add = adds[i] if i < len(adds) else None
        if takes is not None and name not in takes:
            if add is not None:
                raise ValueError(f"the residual-taking engine has no input for block {i}'s ControlNet residual "
                                 "(built before it took one): delete it and build it again")
            continue
        if add is None:
            out[name] = zeros
            continue
        if add.ndim != 3 or tuple(add.shape) != (batch, tokens, width):
            raise ValueError(f"ControlNet residual output[{i}] of shape {tuple(add.shape)} for {batch} x {tokens} "
                             f"image tokens of width {width}")
        out[name] = add.float().contiguous()
    return out


def output(latent: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    height, width = shape
    return latent[:, :, :height, :width]
