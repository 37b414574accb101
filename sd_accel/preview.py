"""Live previews while a pipeline samples: a cheap picture of the latents every few steps.

Two decoders, both far cheaper than the model's VAE:

- the tiny autoencoder (TAESD / TAESDXL), when the pipeline decodes with one
  (``AccelConfig(vae="tiny:PATH")``);
- else "latent2rgb": a fixed linear map of the 4 latent channels to RGB (plus a bias for SDXL),
  the factors ComfyUI's ``latent_formats.py`` uses for SD 1.x and SDXL latents, at latent size
  (1/8 of the image), resized to the image's size.

:func:`preview_callback` makes a diffusers ``callback_on_step_end`` that hands the previews to a
function. It only reads the latents and the scheduler: it never touches the generator or the
latents, so the final image is the same with or without previews.

>>> from sd_accel import load_pipeline
>>> pipe = load_pipeline("builtin:tiny-sd15")
>>> shown = []
>>> cb = preview_callback(shown.append, steps=4)
>>> image = pipe("a cat", height=64, width=64, num_inference_steps=4, callback_on_step_end=cb).images[0]
>>> [(p.step, p.decoder) for p in shown]
[(1, 'latent2rgb'), (2, 'latent2rgb'), (3, 'latent2rgb'), (4, 'latent2rgb')]
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image

from sd_accel.core import InvalidValue

if TYPE_CHECKING:
    import torch

log = logging.getLogger("sd_accel")

PREVIEW_MODES = ("auto", "latent2rgb", "off")  # auto: the tiny VAE when the pipeline has one, else latent2rgb
TINY, LATENT2RGB = "tiny VAE", "latent2rgb"

# (R, G, B) per latent channel, and a bias, for latents as the UNet sees them (scaled by the VAE's
# scaling_factor): ComfyUI's SD15 and SDXL LatentFormat factors. SD 2.x shares SD 1.x's VAE.
LATENT_RGB: dict[str, tuple[tuple[tuple[float, float, float], ...], tuple[float, float, float]]] = {
    "sd15": (((0.3512, 0.2297, 0.3227), (0.3250, 0.4974, 0.2350), (-0.2829, 0.1762, 0.2721),
              (-0.2120, -0.2616, -0.7177)), (0.0, 0.0, 0.0)),
    "sdxl": (((0.3651, 0.4232, 0.4341), (-0.2533, -0.0042, 0.1068), (0.1076, 0.1111, -0.0362),
              (-0.3165, -0.2492, -0.2188)), (0.1084, -0.0175, -0.0011)),
}


@dataclass
class Preview:
    """One preview: an image per latent in the batch, after ``step`` of ``steps`` sampling steps."""

    images: list[Image.Image]
    step: int
    steps: int
    decoder: str  # TINY or LATENT2RGB


def preview_every(steps: int) -> int:
    """Steps between previews: about four per run, at least every 5 steps (1 for few-step models).

    >>> preview_every(2), preview_every(4), preview_every(8), preview_every(20), preview_every(50)
    (1, 1, 2, 5, 5)
    """
    return max(1, min(5, steps // 4))


def latent_family(pipe) -> str:
    """``sdxl`` or ``sd15``: which latent2rgb factors fit the pipeline's latents."""
    family = getattr(getattr(pipe, "sd_accel_model", None), "family", None)
    if family is None:
        family = "sdxl" if getattr(pipe, "text_encoder_2", None) is not None else "sd15"
    return "sdxl" if str(family).startswith("sdxl") else "sd15"


def latent_to_rgb(latents: torch.Tensor, family: str = "sd15") -> torch.Tensor:
    """``(B, 4, h, w)`` latents -> ``(B, 3, h, w)`` RGB in [0, 1], by the linear factors above."""
    import torch

    factors, bias = LATENT_RGB[family]
    weight = torch.tensor(factors, dtype=torch.float32)
    rgb = torch.einsum("bchw,cr->brhw", latents.detach().float().cpu(), weight)
    rgb = rgb + torch.tensor(bias, dtype=torch.float32).view(1, 3, 1, 1)
    return ((rgb + 1.0) / 2.0).clamp(0.0, 1.0)


def _to_images(rgb: torch.Tensor, size: tuple[int, int] | None) -> list[Image.Image]:
    """``(B, 3, h, w)`` in [0, 1] -> PIL images, resized to ``size`` (width, height) when given."""
    import torch

    arrays = rgb.permute(0, 2, 3, 1).mul(255).round().to(torch.uint8).numpy()
    images = [Image.fromarray(a) for a in arrays]
    if size is not None and images and images[0].size != size:
        images = [im.resize(size, Image.BILINEAR) for im in images]
    return images


def _tiny_vae(pipe):
    """The pipeline's torch ``AutoencoderTiny`` (behind an engine stand-in too), or None."""
    from sd_accel.components.tiny_vae import is_tiny_vae

    vae = getattr(pipe, "vae", None)
    vae = getattr(vae, "torch_module", vae)  # the engine stand-in keeps its torch module
    return vae if vae is not None and is_tiny_vae(vae) else None


def _as_the_unet_sees_them(pipe, latents: torch.Tensor) -> torch.Tensor:
    """Sigma-based schedulers (Euler, DPM++ SDE, ...) keep latents at x0 + sigma * noise, so early
    on they are many times too large for either decoder; divide by sqrt(sigma^2 + 1), as their
    ``scale_model_input`` does, reading the scheduler's state without calling it (that call sets
    flags). After a step, ``step_index`` points at the sigma the latents are now at."""
    scheduler = getattr(pipe, "scheduler", None)
    sigmas, index = getattr(scheduler, "sigmas", None), getattr(scheduler, "step_index", None)
    if float(getattr(scheduler, "init_noise_sigma", 1.0)) <= 1.0 or sigmas is None or index is None:
        return latents
    sigma = float(sigmas[min(int(index), len(sigmas) - 1)])
    return latents / math.sqrt(sigma * sigma + 1.0)


def decode_preview(pipe, latents: torch.Tensor, mode: str = "auto",
                   size: tuple[int, int] | None = None) -> tuple[list[Image.Image], str]:
    """Preview images of ``latents`` and the decoder used: the pipeline's tiny VAE under ``auto``
    when it has one, else latent2rgb. Runs without gradients and leaves ``latents`` unchanged."""
    import torch

    if mode not in ("auto", "latent2rgb"):
        raise InvalidValue(f"preview mode {mode!r} decodes nothing; use auto or latent2rgb")
    with torch.no_grad():
        z = _as_the_unet_sees_them(pipe, latents.detach())
        tiny = _tiny_vae(pipe) if mode == "auto" else None
        if tiny is not None:
            param = next(tiny.parameters())
            z = z.to(device=param.device, dtype=param.dtype) / tiny.config.scaling_factor
            # The class's decode, not the instance's: the NaN guard (accelerate) would count a
            # preview's redecode as the image's.
            out = type(tiny).decode(tiny, z).sample
            return _to_images((out.float().cpu() / 2 + 0.5).clamp(0, 1), size), TINY
        if z.shape[1] != 4:
            raise InvalidValue(f"latent2rgb takes 4 latent channels, these latents have {z.shape[1]}")
        return _to_images(latent_to_rgb(z, latent_family(pipe)), size), LATENT2RGB


def takes_step_callback(pipe) -> bool:
    """Whether ``pipe`` takes diffusers' ``callback_on_step_end``."""
    return "callback_on_step_end" in inspect.signature(pipe.__call__).parameters


def preview_callback(sink: Callable[[Preview], None], *, mode: str = "auto", steps: int | None = None,
                     every: int | None = None, size: tuple[int, int] | None = None,
                     stop: threading.Event | None = None) -> Callable[..., dict[str, Any]]:
    """A ``callback_on_step_end`` that hands ``sink`` a :class:`Preview` every ``every`` loop steps
    (default :func:`preview_every` of the scheduler's loop), never after the last one: the image
    itself comes then. ``mode``: one of :data:`PREVIEW_MODES` (``off`` sends none).

    ``steps``: the steps to report (the request's; second-order samplers run more loop steps);
    ``size``: (width, height) of the previews; ``stop``: once set, the pipeline skips its remaining
    steps (diffusers' ``interrupt``). A preview that fails is logged and previews stop for the
    run; the image is unaffected.
    """
    if mode not in PREVIEW_MODES:
        raise InvalidValue(f"preview {mode!r} is not one of {', '.join(PREVIEW_MODES)}")
    failed = False

    def callback(p, i: int, t, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        nonlocal failed
        if stop is not None and stop.is_set():
            p._interrupt = True  # what the pipelines' `interrupt` property reads: the rest is skipped
            return callback_kwargs
        done = i + 1
        timesteps = getattr(p.scheduler, "timesteps", None)  # what the loop runs over (2n-1 for Heun)
        total = len(timesteps) if timesteps is not None else (steps or done)
        if mode == "off" or failed or done % (every or preview_every(total)) or done >= total:
            return callback_kwargs
        latents = callback_kwargs.get("latents")
        if latents is None:
            return callback_kwargs
        try:
            images, used = decode_preview(p, latents, mode, size)
        except Exception as exc:  # a preview must never cost the image
            failed = True
            log.warning("live preview off for this run: %s", exc)
            return callback_kwargs
        shown = steps or total
        sink(Preview(images, max(1, min(shown, math.ceil(done * shown / total))), shown, used))
        return callback_kwargs

    return callback
