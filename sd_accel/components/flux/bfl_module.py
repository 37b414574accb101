"""Black Forest Labs' FLUX.1 module as the hosts hold it (ComfyUI's ``comfy.ldm.flux.model.Flux``,
Forge's ``backend.nn.flux.IntegratedFluxTransformer2DModel``): diffusers' ``FluxTransformer2DModel``
made from its weights, and one of its calls as that engine's feed.

The weights are Black Forest Labs' layout, the one :mod:`sd_accel.models.flux` reads from files:
the same converter (fused q/k/v and single-block ``linear1`` split, the final modulation's halves
swapped) makes the diffusers module the engine is exported from, so an engine built from a host's
module is the one :func:`sd_accel.load_pipeline` of the same file would build.

The call (both hosts' ``forward(x, timestep, context, y, guidance)``): the latent (B, 16, H, W) is
padded to even sides (circular, as both pad), cut into 2x2 patches, tokens (B, H/2 * W/2, 64);
image ids are (0, row, column), text ids zeros. The timestep both hand the model is the sigma itself
(ComfyUI's ``ModelSamplingFlux.timestep``, Forge's ``PredictionFlux.timestep``), and their
``timestep_embedding`` multiplies by 1000; diffusers' transformer multiplies its ``timestep`` by
1000 too, so the engine takes the sigma as it is (the pipeline's t / 1000). Guidance alike: all
embed guidance x 1000, so the engine takes the host's guidance (3.5 by default) unchanged.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sd_accel.core import InvalidValue

FAMILY = "flux"


def params_of(module: torch.nn.Module):
    """The module's hyperparameters: ComfyUI's ``params`` (a ``FluxParams``); for Forge's class,
    which keeps them as attributes and layer sizes, the same fields read from those."""
    p = getattr(module, "params", None)
    if p is not None:
        return p
    block = module.double_blocks[0] if len(module.double_blocks) else None
    hidden = int(module.hidden_size)
    return SimpleNamespace(
        hidden_size=hidden, num_heads=int(module.num_heads), guidance_embed=bool(module.guidance_embed),
        vec_in_dim=int(module.vector_in.in_layer.in_features), context_in_dim=int(module.txt_in.in_features),
        in_channels=int(module.img_in.in_features), patch_size=2, axes_dim=list(module.pe_embedder.axes_dim),
        theta=int(module.pe_embedder.theta),
        qkv_bias=block is None or block.img_attn.qkv.bias is not None,
        mlp_ratio=(block.img_mlp[0].out_features / hidden) if block is not None else 4.0)


def unsupported(module: torch.nn.Module) -> str | None:
    """Why this Flux has no diffusers counterpart (a FLUX.1 variant diffusers' class lacks), or None."""
    p = params_of(module)
    odd = [name for name, bad in (
        ("global modulation", getattr(p, "global_modulation", False)),
        ("SiLU-gated MLPs", getattr(p, "mlp_silu_act", False) or getattr(p, "yak_mlp", False)),
        ("text norm", getattr(p, "txt_norm", False)),
        ("text rotary ids", bool(getattr(p, "txt_ids_dims", []))),
        ("layers without bias", not getattr(p, "ops_bias", True) or not p.qkv_bias),
        ("patch size other than 2", p.patch_size != 2),
        ("MLP ratio other than 4", float(p.mlp_ratio) != 4.0),
        ("rotary theta other than 10000", int(p.theta) != 10000),
        ("no pooled-text input", p.vec_in_dim is None),
        ("no final layer", not hasattr(module, "final_layer")),
    ) if bad]
    return f"a FLUX variant diffusers' FluxTransformer2DModel lacks ({', '.join(odd)})" if odd else None


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor a module may hold as a parameter: ComfyUI runs its nodes in inference
    mode, so the weights its loaders make are inference tensors, which an ``nn.Parameter`` (and so
    the export) cannot take: those are copied once."""
    t = t.detach()
    return t.clone() if t.is_inference() else t


def to_diffusers(module: torch.nn.Module, copy: bool = True) -> torch.nn.Module:
    """diffusers' ``FluxTransformer2DModel`` with ``module``'s weights (float32; views where they
    already are). ``copy`` False: the host's inference-mode tensors are taken as they are, not
    copied (a refit's weights and its check against torch: at FLUX.1's size the copy is what does
    not fit); such a module runs, but cannot be exported."""
    import diffusers

    from sd_accel.models.families import get_family, load_family_configs
    from sd_accel.models.flux import to_diffusers as convert
    from sd_accel.models.flux import transformer_config

    why = unsupported(module)
    if why is not None:
        raise InvalidValue(why)
    state = {k: plain(v) if copy else v.detach() for k, v in module.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    family = "flux-dev" if params_of(module).guidance_embed else "flux-schnell"
    base = load_family_configs(get_family(family))["transformer/config.json"]
    config = transformer_config(base, shapes, "")
    config["out_channels"] = shapes["final_layer.linear.weight"][0]
    config["axes_dims_rope"] = list(params_of(module).axes_dim)
    with torch.device("meta"):
        model = diffusers.FluxTransformer2DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    hidden = int(params_of(module).hidden_size)
    converted: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        for name, t in convert(key, tensor, hidden):
            converted[name] = t.float().contiguous()
    missing = set(model.state_dict()) - set(converted)
    if missing:
        raise InvalidValue(f"the Flux model's weights do not map onto diffusers' (missing {sorted(missing)[:3]})")
    with torch.inference_mode(not copy):  # (a Parameter takes an inference tensor only in inference mode)
        model.load_state_dict(converted, assign=True)
    return model.eval()


def unmapped(module: torch.nn.Module, keys: list[str]) -> list[str]:
    """Of ``keys`` (the MODEL's patched weights, ``diffusion_model.``-prefixed), those no weight of
    diffusers' transformer is made from (a refit would leave them out): sorted."""
    from sd_accel.core import CheckpointError
    from sd_accel.models.flux import to_diffusers as convert

    state = dict(module.state_dict(keep_vars=True))
    hidden = int(params_of(module).hidden_size)
    bad = set()
    for key in keys:
        name = key.removeprefix("diffusion_model.")
        t = state.get(name)
        try:
            if t is None or not convert(name, torch.empty(t.shape, device="meta"), hidden):
                bad.add(key)
        except CheckpointError:
            bad.add(key)
    return sorted(bad)


def patchify(x: torch.Tensor, patch: int = 2) -> tuple[torch.Tensor, int, int]:
    """(B, C, H, W) -> tokens (B, rows * cols, C * patch^2), as ComfyUI's ``process_img`` (padded
    circularly to whole patches); returns the token grid's rows and cols too."""
    from torch.nn.functional import pad

    h, w = x.shape[-2:]
    x = pad(x, (0, (-w) % patch, 0, (-h) % patch), mode="circular")
    b, c, hp, wp = x.shape[0], x.shape[1], x.shape[-2] // patch, x.shape[-1] // patch
    tokens = x.reshape(b, c, hp, patch, wp, patch).permute(0, 2, 4, 1, 3, 5).reshape(b, hp * wp, c * patch * patch)
    return tokens, hp, wp


def unpatchify(tokens: torch.Tensor, rows: int, cols: int, height: int, width: int, patch: int = 2) -> torch.Tensor:
    """Tokens (B, rows * cols, C * patch^2) -> (B, C, height, width), the padding cropped off."""
    b = tokens.shape[0]
    c = tokens.shape[-1] // (patch * patch)
    x = tokens.reshape(b, rows, cols, c, patch, patch).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, rows * patch, cols * patch)[:, :, :height, :width]


def _rows(value, batch: int, device) -> torch.Tensor:
    t = torch.as_tensor(value, device=device).float().reshape(-1)
    return (t.expand(batch) if t.numel() == 1 else t).contiguous()


def feed(module: torch.nn.Module, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
         y: torch.Tensor | None, guidance: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """The engine's inputs for ComfyUI's ``Flux._forward(x, timestep, context, y, guidance)``, and
    what :func:`output` needs to give ComfyUI's shape back."""
    from sd_accel.components.flux import image_ids

    p = params_of(module)
    batch, height, width = x.shape[0], x.shape[-2], x.shape[-1]
    tokens, rows, cols = patchify(x.float(), p.patch_size)
    if y is None:  # (ComfyUI: zeros when no pooled output came)
        y = torch.zeros(batch, p.vec_in_dim, device=x.device)
    out = {"hidden_states": tokens, "encoder_hidden_states": context.float(),
           "pooled_projections": y[:, :p.vec_in_dim].float().contiguous(), "timestep": _rows(timestep, batch, x.device),
           "img_ids": image_ids(rows, cols).to(x.device), "txt_ids": torch.zeros(context.shape[1], 3, device=x.device)}
    if p.guidance_embed:
        out["guidance"] = _rows(guidance, batch, x.device)
    return out, (rows, cols, height, width)


def output(latent: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    rows, cols, height, width = shape
    return unpatchify(latent, rows, cols, height, width)


def control_feed(module: torch.nn.Module, control: dict, tokens: int, batch: int) -> dict[str, torch.Tensor]:
    """The residual-taking engine's inputs (``transformer_control``: ``block_{i}``, ``single_{i}``,
    :mod:`sd_accel.components.flux.controlnet`) for ComfyUI's ControlNet ``control`` dict: double
    block i adds ``control["input"][i]`` to the image tokens, single block i ``control["output"][i]``
    (``Flux.forward_orig``); a block none reaches, or a shorter residual's missing tokens, adds zeros.
    Raises ValueError for a residual the engine cannot take (another width, more tokens, another batch)."""
    width = module.hidden_size
    zeros = torch.zeros(batch, tokens, width)
    out: dict[str, torch.Tensor] = {}
    for key, name, count in (("input", "block", len(module.double_blocks)), ("output", "single", len(module.single_blocks))):
        adds = control.get(key) or []
        for i in range(count):
            add = adds[i] if i < len(adds) else None
            if add is None:
                out[f"{name}_{i}"] = zeros
                continue
            if add.ndim != 3 or add.shape[0] != batch or add.shape[1] > tokens or add.shape[2] != width:
                raise ValueError(f"ControlNet residual {key}[{i}] of shape {tuple(add.shape)} for {batch} x {tokens} "
                                 f"image tokens of width {width}")
            add = add.float()
            if add.shape[1] < tokens:  # (ComfyUI adds it to the first tokens only)
                add = torch.cat([add, zeros[:, add.shape[1]:]], dim=1)
            out[f"{name}_{i}"] = add.contiguous()
    return out
