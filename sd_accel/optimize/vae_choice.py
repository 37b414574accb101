"""Which autoencoder decodes: the pipeline's own, or the tiny one (TAESD) on request.

``AccelConfig(vae="tiny:PATH")`` swaps an ``AutoencoderTiny`` (loaded by
:func:`sd_accel.models.taesd.load_tiny_vae`) in for ``pipe.vae``; the pipeline's own VAE is kept
on the pipeline, so a later ``accelerate`` without ``vae`` puts it back. At one to four steps the
full VAE decoder costs more than the UNet; TAESD costs a few percent of it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sd_accel.core import InvalidValue

log = logging.getLogger("sd_accel")

TINY_PREFIX = "tiny:"
_OWN = "_sd_accel_own_vae"  # the pipeline's own VAE while a tiny one stands in
_TINY = "_sd_accel_tiny_vae"  # (source, module): loaded once per pipeline and path


def check_vae_choice(choice: str | None) -> None:
    """Raise :class:`InvalidValue` unless ``choice`` is None or ``"tiny:PATH"``."""
    if choice is None:
        return
    if not isinstance(choice, str) or not choice.startswith(TINY_PREFIX) or not choice[len(TINY_PREFIX):].strip():
        raise InvalidValue(f"AccelConfig.vae={choice!r} is not valid: use None (the model's own VAE) or "
                           "'tiny:PATH' (a TAESD folder or taesd_decoder.safetensors)")


def use_vae(pipe, choice: str | None) -> None:
    """Put the VAE ``choice`` names into ``pipe`` (its torch modules, engines not swapped in)."""
    check_vae_choice(choice)
    own = pipe.__dict__.get(_OWN)
    if choice is None:
        if own is not None:
            pipe.register_modules(vae=own)
            del pipe.__dict__[_OWN]
            log.info("VAE: the model's own again")
        return
    from sd_accel.models.taesd import load_tiny_vae

    source = str(Path(choice[len(TINY_PREFIX):].strip()).expanduser())
    cached = pipe.__dict__.get(_TINY)
    if cached is not None and cached[0] == source:
        tiny = cached[1]
    else:
        tiny = load_tiny_vae(source)
        object.__setattr__(pipe, _TINY, (source, tiny))
    if own is None:
        object.__setattr__(pipe, _OWN, pipe.vae)
    if pipe.vae is not tiny:  # (accelerate moves it to the pipeline's device and dtype next)
        pipe.register_modules(vae=tiny)
    log.info("VAE: tiny autoencoder from %s", source)
