"""ControlNet: the ``controlnet`` component (a diffusers ``ControlNetModel``) and ``unet_control``,
the UNet that takes a ControlNet's residuals as inputs.

``controlnet`` inputs: ``sample`` (B2, C_in, H8, W8), ``timestep`` (B2,), ``encoder_hidden_states``
(B2, T, D), ``controlnet_cond`` (B2, C_cond, H, W: the control image at pixel size, in [0, 1]),
``conditioning_scale`` (B2, R: one scale per residual and batch item, so that guess mode's
per-level scales and any user scale run on the same engine), and for SDXL ``text_embeds`` and
``time_ids``. Outputs: ``down_0`` .. ``down_{R-2}`` and ``mid``.

``unet_control`` is the plain UNet's spec plus those residuals as inputs (its own component in the
engine key: plain ``unet`` engines stay as lean as they were). One such engine serves any number of
ControlNets (their residuals are summed before the UNet, as diffusers' ``MultiControlNetModel``
does), any scale and steps where a net is off (zero residuals).

The residuals' sizes follow from the latent size: level ``k`` is ``ceil(H8 / 2^k)`` (a stride-2
convolution with padding 1 rounds up), symbols ``H8d{k}``/``W8d{k}``; level 0 is ``H8``.
"""

from __future__ import annotations

import torch

from sd_accel.components.flux.controlnet import flux_control_specs, is_flux_controlnet
from sd_accel.components.levels import (
    LevelInputs,
    LevelInputsExport,
    _level,
    _level_dims,
    _level_ranges,
    residual_layout,
)
from sd_accel.components.sd3.controlnet import is_sd3_controlnet, sd3_control_specs
from sd_accel.components.spec import ComponentSpec, TensorSpec
from sd_accel.components.unet import UNetSpec, export_latent_size, to_latent, vae_scale_factor
from sd_accel.core import UnsupportedComponent
from sd_accel.profiles import TOKEN_CHUNK, Profile, Range

CONTROLNET = "controlnet"
CONTROL_UNET = "unet_control"


def residual_names(config) -> list[str]:
    """``down_0`` .. ``down_{n-1}``, ``mid``: the engine names of a layout's residuals."""
    down, _ = residual_layout(config)
    return [f"down_{i}" for i in range(len(down))] + ["mid"]


def _residual_specs(config, batch: str = "B2") -> tuple[TensorSpec, ...]:
    down, (mid_ch, mid_level) = residual_layout(config)
    f32 = torch.float32
    specs = [TensorSpec(f"down_{i}", (batch, ch, _level(lv, "H"), _level(lv, "W")), f32)
             for i, (ch, lv) in enumerate(down)]
    specs.append(TensorSpec("mid", (batch, mid_ch, _level(mid_level, "H"), _level(mid_level, "W")), f32))
    return tuple(specs)


# ---------------------------------------------------------------------------------- ControlNet


class _ControlNetExport(torch.nn.Module):
    """Positional inputs in inputs() order; the residuals, each times its scale column, out."""

    def __init__(self, net: torch.nn.Module, xl: bool) -> None:
        super().__init__()
        self.net = net
        self.xl = xl

    def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale, *added):
        added_cond_kwargs = {"text_embeds": added[0], "time_ids": added[1]} if self.xl else None
        down, mid = self.net(sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale=1.0,
                             added_cond_kwargs=added_cond_kwargs, guess_mode=False, return_dict=False)
        outs = [r * conditioning_scale[:, i].reshape(-1, 1, 1, 1) for i, r in enumerate((*down, mid))]
        return tuple(outs)


class ControlNetSpec(ComponentSpec):
    """One diffusers ``ControlNetModel`` of a ControlNet pipeline (``pipe.controlnet``, or one of
    ``pipe.controlnet.nets`` for several); ``net`` picks it (default: the pipeline's single one)."""

    name = CONTROLNET

    def __init__(self, pipe, net: torch.nn.Module | None = None) -> None:
        super().__init__(pipe)
        self.net = net if net is not None else pipe.controlnet
        self._check_supported()

    def torch_module(self) -> torch.nn.Module:
        return self.net

    @property
    def _cfg(self):
        return self.net.config

    @property
    def xl(self) -> bool:
        return self._cfg.get("addition_embed_type") == "text_time"

    def _check_supported(self) -> None:
        cfg = self._cfg
        if type(self.net).__name__ != "ControlNetModel":
            raise UnsupportedComponent(f"{type(self.net).__name__} is not a diffusers ControlNetModel; "
                                       "it keeps running in torch")
        problems = []
        if cfg.get("addition_embed_type") not in (None, "text_time"):
            problems.append(f"addition_embed_type={cfg.get('addition_embed_type')!r}")
        if cfg.get("class_embed_type") is not None:
            problems.append(f"class_embed_type={cfg.get('class_embed_type')!r}")
        if cfg.get("encoder_hid_dim_type") is not None:
            problems.append(f"encoder_hid_dim_type={cfg.get('encoder_hid_dim_type')!r}")
        if problems:
            raise UnsupportedComponent("this ControlNet has conditioning the exported graph does not carry: "
                                       + ", ".join(problems) + "; it keeps running in torch")

    def _context_dim(self) -> int:
        dim = self._cfg.cross_attention_dim
        return int(dim[0] if isinstance(dim, list | tuple) else dim)

    def _added_dims(self) -> tuple[int, int]:
        cfg = self._cfg
        total, per_id = cfg.projection_class_embeddings_input_dim, cfg.addition_time_embed_dim
        enc2 = getattr(self.pipe, "text_encoder_2", None)
        if enc2 is not None:
            pooled = int(enc2.config.projection_dim)
            return pooled, (total - pooled) // per_id
        return total - 6 * per_id, 6

    @property
    def num_residuals(self) -> int:
        return len(residual_layout(self._cfg)[0]) + 1

    def inputs(self) -> tuple[TensorSpec, ...]:
        cfg, f32 = self._cfg, torch.float32
        base = (
            TensorSpec("sample", ("B2", cfg.in_channels, "H8", "W8"), f32),
            TensorSpec("timestep", ("B2",), f32),
            TensorSpec("encoder_hidden_states", ("B2", "T", self._context_dim()), f32),
            TensorSpec("controlnet_cond", ("B2", cfg.conditioning_channels, "H", "W"), f32),
            TensorSpec("conditioning_scale", ("B2", self.num_residuals), f32),
        )
        if not self.xl:
            return base
        pooled, n_ids = self._added_dims()
        return (*base, TensorSpec("text_embeds", ("B2", pooled), f32), TensorSpec("time_ids", ("B2", n_ids), f32))

    def outputs(self) -> tuple[TensorSpec, ...]:
        return _residual_specs(self._cfg)

    def export_module(self) -> torch.nn.Module:
        return _ControlNetExport(self.net, self.xl)

    def consumer(self) -> ComponentSpec | None:
        """The residual-taking UNet these residuals feed (its inputs are named as this net's
        outputs and share its other inputs), or None when the pipeline has no torch UNet to run:
        validation judges a net whose residuals miss the tolerance by that UNet's output
        (:func:`sd_accel.validate.consumer_error`)."""
        unet = getattr(self.pipe, "unet", None)
        if not isinstance(unet, torch.nn.Module) or type(unet).__name__ != "UNet2DConditionModel":
            return None
        try:
            return ControlUNetSpec(self.pipe)
        except UnsupportedComponent:
            return None

    def dim_ranges(self, profile: Profile) -> dict[str, Range]:
        lo, opt, hi = profile.batch
        b2 = (2 * lo, 2 * opt, 2 * hi) if profile.static else (lo, 2 * opt, 2 * hi)
        scale = vae_scale_factor(self.pipe)
        h8, w8 = to_latent(profile.height, scale), to_latent(profile.width, scale)
        return {"B2": b2, "H8": h8, "W8": w8, "T": profile.tokens,
                "H": tuple(v * scale for v in h8), "W": tuple(v * scale for v in w8),  # type: ignore[dict-item]
                **_level_ranges(self._cfg, h8, w8)}

    def export_dims(self) -> dict[str, int]:
        side = export_latent_size(len(self._cfg.down_block_types) - 1)
        scale = vae_scale_factor(self.pipe)
        dims = {"B2": 2, "H8": side, "W8": side, "T": TOKEN_CHUNK, "H": side * scale, "W": side * scale}
        return {**dims, **_level_dims(self._cfg, dims)}

    def sample_feed(self, dims: dict[str, int], seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
        """As a denoising step sees them: timesteps in range, the control image in [0, 1], scales
        in [0.5, 1.5] (non-zero residuals), SDXL time ids in pixel units."""
        feed = super().sample_feed(dims, seed=seed, device="cpu")
        g = torch.Generator("cpu").manual_seed(seed + 1)
        steps = int(getattr(getattr(getattr(self.pipe, "scheduler", None), "config", None),
                            "num_train_timesteps", 1000) or 1000)
        feed["timestep"] = torch.randint(0, steps, feed["timestep"].shape, generator=g).float()
        feed["controlnet_cond"] = torch.rand(feed["controlnet_cond"].shape, generator=g)
        feed["conditioning_scale"] = 0.5 + torch.rand(feed["conditioning_scale"].shape, generator=g)
        if "time_ids" in feed:
            feed["time_ids"] = torch.randint(0, 1025, feed["time_ids"].shape, generator=g).float()
        return {k: v.to(device) for k, v in feed.items()}


# ---------------------------------------------------------------------------------- the UNet


def _residual_kwargs(residuals: tuple) -> dict:
    return {"down_block_additional_residuals": list(residuals[:-1]), "mid_block_additional_residual": residuals[-1]}


class ControlUNetSpec(LevelInputs, UNetSpec):
    """``pipe.unet`` with the ControlNet residuals as inputs (after the plain UNet's, in
    :func:`residual_names` order)."""

    name = CONTROL_UNET

    def inputs(self) -> tuple[TensorSpec, ...]:
        return (*super().inputs(), *_residual_specs(self._cfg))

    def residual_names(self) -> list[str]:
        return residual_names(self._cfg)

    def export_module(self) -> torch.nn.Module:
        return LevelInputsExport(self.pipe.unet, self.xl, _residual_kwargs)

    extra_names = residual_names


# ---------------------------------------------------------------------------------- the pipeline


def controlnets_of(pipe) -> list[torch.nn.Module]:
    """The ControlNetModels of a ControlNet pipeline (one, or each of a MultiControlNetModel's)."""
    net = getattr(pipe, "controlnet", None)
    if net is None:
        return []
    nets = getattr(net, "nets", None)
    return list(nets) if nets is not None else [net]


def control_key(index: int) -> str:
    """The name of the ``index``-th ControlNet in a pipeline's spec table and stats: ``controlnet``,
    ``controlnet.1``, ... (their engine keys all say ``controlnet``; the weights id tells them apart)."""
    return CONTROLNET if index == 0 else f"{CONTROLNET}.{index}"


def control_specs(pipe) -> dict[str, ComponentSpec]:
    """The specs a ControlNet pipeline adds to :func:`sd_accel.components.specs_for`'s: one per
    ControlNet (:func:`control_key`) and the residual-taking UNet (FLUX.1's: its nets and the
    residual-taking transformer, :mod:`sd_accel.components.flux.controlnet`); a T2I-Adapter pipeline's
    feature-taking UNet (``unet_adapter``, :mod:`sd_accel.components.adapter`); empty for other
    pipelines. One that cannot be exported is left out (it runs in torch) with the reason in the log."""
    import logging

    from sd_accel.components.adapter import adapter_specs

    log = logging.getLogger("sd_accel")
    out: dict[str, ComponentSpec] = dict(adapter_specs(pipe))
    nets = controlnets_of(pipe)
    if not nets:
        return out
    if is_flux_controlnet(nets[0]):  # FLUX.1's nets and residual-taking transformer
        return {**out, **flux_control_specs(pipe, nets, control_key)}
    if is_sd3_controlnet(nets[0]):  # SD3's
        return {**out, **sd3_control_specs(pipe, nets, control_key)}
    for i, net in enumerate(nets):
        try:
            out[control_key(i)] = ControlNetSpec(pipe, net)
        except UnsupportedComponent as exc:
            log.warning("%s: %s", control_key(i), exc)
    if getattr(pipe, "unet", None) is not None:
        try:
            out[CONTROL_UNET] = ControlUNetSpec(pipe)
        except UnsupportedComponent as exc:
            log.warning("%s: %s", CONTROL_UNET, exc)
    return out
