"""Calibration data for static INT8 (the backends' quantizers take it): the inputs a component really sees, captured during real
pipeline runs on a few prompts, and kept on disk (one ``.npz`` per model, component and shape)
so a rebuild does not run the pipeline again.

The UNet (SD3's and FLUX.1's transformer) is captured at every denoising step (so early, noisy and
late, clean latents are all represented); the VAE decoder sees each run's final latents; the text
encoder each prompt's ids.
A ControlNet pipeline runs with a made-up edge map per prompt
(:func:`sd_accel.models.hints.synthetic_edges`) at conditioning scale 1: each ControlNet is
captured at every step (latents, timestep, text, control image), and the residual-taking UNet
with the residuals the nets really gave.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from sd_accel.core import CalibrationSet, InvalidValue
from sd_accel.paths import calibration_file, calibration_temp

log = logging.getLogger("sd_accel")

CALIBRATION_PROMPTS: tuple[str, ...] = (
    "a photograph of an astronaut riding a horse on mars, highly detailed",
    "a watercolor painting of a quiet harbour at sunset",
    "portrait of an old fisherman, dramatic lighting, 85mm",
    "a bowl of ramen on a wooden table, studio photo",
    "an isometric pixel-art castle in a snowy forest",
    "a futuristic city skyline at night, neon, rain",
    "a close-up of a red fox in autumn leaves",
    "abstract geometric shapes, bauhaus poster",
)
# pipeline attribute whose forward inputs are captured, per component
_HOOKED = {"unet": "unet", "unet_control": "unet", "clip": "text_encoder", "transformer": "transformer"}


def _np(t: torch.Tensor, like: torch.dtype) -> np.ndarray:
    t = t.detach().to("cpu")
    return (t.to(torch.float32) if like.is_floating_point else t.to(like)).numpy().copy()


def feed_from_call(spec, args: tuple, kwargs: dict) -> dict[str, np.ndarray]:
    """Map one forward call's arguments to the spec's input names (positional first, then kwargs):
    what the engine of ``spec`` would be fed for that call."""
    names = [t.name for t in spec.inputs()]
    dtypes = {t.name: t.dtype for t in spec.inputs()}
    values: dict[str, torch.Tensor] = dict(zip(names, args, strict=False))
    for name in names:
        if name not in values and name in kwargs:
            values[name] = kwargs[name]
    added = kwargs.get("added_cond_kwargs") or {}
    for name in ("text_embeds", "time_ids"):
        if name in names and name in added:
            values[name] = added[name]
    residuals = list(kwargs.get("down_block_additional_residuals") or [])
    if kwargs.get("mid_block_additional_residual") is not None:
        residuals.append(kwargs["mid_block_additional_residual"])
    if residuals and hasattr(spec, "residual_names"):  # the UNet taking ControlNet residuals
        values.update(zip(spec.residual_names(), residuals, strict=True))
    batch = None
    out = {}
    for name in names:
        v = values[name]
        if not torch.is_tensor(v):
            v = torch.tensor(v, dtype=torch.float32)
        if name in ("sample", "hidden_states"):  # (the transformer families' latents)
            batch = v.shape[0]
        if name == "conditioning_scale" and v.dim() < 2:  # one scale per residual and row, as exported
            v = v.reshape(-1)[:1].expand(batch, spec.num_residuals)
        if name == "timestep" and batch is not None:
            v = v.reshape(-1).expand(batch) if v.numel() in (1, batch) else v
        if name == "timestep_cond" and batch is not None and v.shape[0] == 1:
            v = v.expand(batch, -1)  # one row per image even under CFG: the UNet broadcasts it
        out[name] = _np(v, dtypes[name])
    return out


def capture_calibration(
    pipe,
    specs: dict,
    *,
    height: int,
    width: int,
    batch: int = 1,
    prompts: Sequence[str] = CALIBRATION_PROMPTS[:4],
    steps: int = 8,
    guidance_scale: float = 7.5,
    seed: int = 0,
    max_sequence_length: int | None = None,
) -> dict[str, CalibrationSet]:
    """Run ``pipe`` on ``prompts`` and record the inputs of every component in ``specs``.

    ``len(prompts) * steps`` UNet samples (batch 2 * ``batch`` with guidance), one VAE-decoder and
    one text-encoder sample per prompt (two with guidance: the empty negative prompt too).
    """
    from sd_accel.components.controlnet import control_key, controlnets_of

    sets = {name: CalibrationSet(name) for name in specs}
    handles = []

    def capture(module: torch.nn.Module, name: str, only_with_residuals: bool = False) -> None:
        spec = specs[name]

        def hook(_m, args, kwargs):
            if only_with_residuals and kwargs.get("mid_block_additional_residual") is None:
                return
            sets[name].feeds.append(feed_from_call(spec, args, kwargs))

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    for name, attr in _HOOKED.items():
        if name in specs and getattr(pipe, attr, None) is not None:
            capture(getattr(pipe, attr), name, only_with_residuals=name == "unet_control")
    nets = controlnets_of(pipe)
    for i, net in enumerate(nets):
        if control_key(i) in specs:
            capture(net, control_key(i))
    try:
        for i, prompt in enumerate(prompts):
            latents = prompt_run(pipe, prompt, i, height=height, width=width, batch=batch, steps=steps,
                                 guidance_scale=guidance_scale, seed=seed, max_sequence_length=max_sequence_length)
            if "vae_decoder" in specs and latents.dim() == 4:  # (FLUX.1 hands back its latents packed)
                sets["vae_decoder"].feeds.append({"latent": _np(latents / pipe.vae.config.scaling_factor,
                                                                torch.float32)})
    finally:
        for h in handles:
            h.remove()
    return sets


def prompt_run(pipe, prompt: str, index: int, *, height: int, width: int, batch: int = 1, steps: int = 8,
               guidance_scale: float = 7.5, seed: int = 0, max_sequence_length: int | None = None) -> torch.Tensor:
    """The final latents (scaled as the UNet sees them) of calibration run ``index`` on ``prompt``:
    its generator seed, and for a ControlNet pipeline its made-up edge maps, follow from ``index``,
    so the run can be made again (the int8 UNet's image check makes it again on the engine)."""
    from sd_accel.components.controlnet import controlnets_of

    nets = controlnets_of(pipe)
    g = torch.Generator("cpu").manual_seed(seed + index)
    control = {}
    if nets:  # a ControlNet pipeline needs its control image(s)
        from sd_accel.models.hints import synthetic_edges

        hints = [synthetic_edges((width, height), seed=seed + index + 7 * n) for n in range(len(nets))]
        control = {"image": hints[0] if len(nets) == 1 else hints}
    if max_sequence_length is not None:  # SD3's and FLUX.1's T5 length: the profile's
        control["max_sequence_length"] = max_sequence_length
    with torch.no_grad():
        return pipe([prompt] * batch, height=height, width=width, num_inference_steps=steps,
                    guidance_scale=guidance_scale, generator=g, output_type="latent", **control).images


def replay(pipe, profile, prompts: Sequence[str] = CALIBRATION_PROMPTS[:4], steps: int = 8) -> torch.Tensor:
    """The final latents of the last of :func:`calibration_for`'s runs at ``profile``, made again
    with whatever the pipeline holds now (the int8 UNet's image check puts its engine in)."""
    return prompt_run(pipe, prompts[-1], len(prompts) - 1, **run_settings(profile, prompts, steps))


def run_settings(profile, prompts: Sequence[str] = CALIBRATION_PROMPTS[:4], steps: int = 8) -> dict:
    """What :func:`calibration_for` runs the pipeline with at ``profile``: size, batch, steps and
    guidance (``prompt_run``'s keywords). A profile without CFG (``cfg=False``: one UNet row per
    image, the few-step recipes) is calibrated on calls without it: with guidance the captured
    UNet feeds had twice its batch."""
    text = getattr(profile, "text", None)
    return {"height": profile.height[1], "width": profile.width[1], "batch": profile.batch[1], "steps": steps,
            "guidance_scale": 7.5 if getattr(profile, "cfg", True) else 1.0,
            "max_sequence_length": None if text is None else text[1]}


def _cache_file(cache_root: Path, fingerprint: str, component: str, shapes: dict, prompts, steps: int) -> Path:
    tag = repr((sorted((k, v[1]) for k, v in shapes.items()), list(prompts), steps))
    digest = hashlib.sha256(tag.encode()).hexdigest()[:16]
    return calibration_file(cache_root, fingerprint, component, digest)


def calibration_for(
    spec,
    profile,
    cache_root: Path,
    *,
    prompts: Sequence[str] = CALIBRATION_PROMPTS[:4],
    steps: int = 8,
) -> CalibrationSet:
    """Calibration feeds for ``spec`` at ``profile``'s opt shape: loaded from the cache, or captured
    by running the pipeline (all of ``spec.pipe``'s components are captured and cached at once)."""
    from sd_accel.components import specs_for
    from sd_accel.components.controlnet import control_specs
    from sd_accel.onnx.fingerprint import fingerprint

    pipe = spec.pipe
    shapes = spec.shape_ranges(profile)
    path = _cache_file(cache_root, fingerprint(spec.torch_module()), spec.name, shapes, prompts, steps)
    if path.exists():
        return CalibrationSet.load(spec.name, path)
    specs = {n: s for n, s in specs_for(pipe).items() if n in ("unet", "transformer", "vae_decoder", "clip")}
    specs.update(control_specs(pipe))  # a ControlNet pipeline's nets and residual-taking UNet
    settings = run_settings(profile, prompts, steps)
    log.info("capturing calibration data: %d prompts x %d steps at %dx%d", len(prompts), steps, settings["width"],
             settings["height"])
    sets = capture_calibration(pipe, specs, prompts=prompts, **settings)
    mine = None
    for name, cset in sets.items():
        s = specs[name]
        if not cset.feeds:
            continue
        file = _cache_file(cache_root, fingerprint(s.torch_module()), s.name, s.shape_ranges(profile), prompts, steps)
        cset.save(file, calibration_temp(file))
        if file == path:
            mine = cset
    if mine is None:
        raise InvalidValue(f"no calibration data could be captured for {spec.name!r}")
    return mine


def split_holdout(calibration: CalibrationSet, every: int = 4) -> tuple[CalibrationSet, list[dict[str, torch.Tensor]]]:
    """Keep every ``every``-th captured feed out of calibration, as real inputs for the accuracy
    gate: random validation inputs lie outside the ranges an INT8 engine was calibrated for and
    measure clipping of inputs no pipeline produces, not the engine's error in use."""
    if len(calibration) < 2:
        return calibration, []
    held = [i for i in range(len(calibration)) if i % every == every - 1] or [len(calibration) - 1]
    keep = CalibrationSet(calibration.component, [f for i, f in enumerate(calibration.feeds) if i not in held])
    holdout = [{k: torch.from_numpy(v) for k, v in calibration.feeds[i].items()} for i in held]
    return keep, holdout
