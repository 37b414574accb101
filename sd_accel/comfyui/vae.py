"""VAE decode and encode on engines: ComfyUI's own ``VAE.decode`` / ``VAE.encode``, with the
autoencoder's ``decoder`` / ``encoder`` served by engines for the call.

ComfyUI decodes in batches it sizes by free memory and tiles when memory runs out; all of that
stays ComfyUI's. For the node's call the two LDM convolution stacks get the WebUI's stand-in
forwards (:class:`sd_accel.webui.stand_ins.VaeForward`: an instance ``forward``, matched on each
call's real shapes, chunked by batch, the module's own forward where no engine covers), and get
their own back after. The engines are keyed as the WebUI keys a checkpoint's VAE (``ckpt-<hash>``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from sd_accel.comfyui.identity import checkpoint_id
from sd_accel.comfyui.state import State, state
from sd_accel.components.ldm_vae import DECODER, ENCODER

log = logging.getLogger("sd_accel")


@contextlib.contextmanager
def on_engines(vae, component: str, st: State | None = None) -> Iterator[object | None]:
    """``vae``'s decoder (``component`` DECODER) or encoder (ENCODER) on engines for the block;
    yields the engines (their ``stats`` count the calls), or None when there are none."""
    from sd_accel.webui.stand_ins import VaeForward

    st = st or state()
    first = getattr(vae, "first_stage_model", None)
    module = getattr(first, "decoder" if component == DECODER else "encoder", None)
    if module is None:
        yield None
        return
    wid = checkpoint_id(first, st.engine_dir(), fingerprint_of=first)
    engines, why = st.engines_or_reason(wid, component)
    if engines is None:
        st.say_once(f"no {component} engine for {wid} ({why or 'none built'}): the VAE runs in PyTorch")
        yield None
        return
    engines.reset_stats()
    previous = module.__dict__.get("forward")
    st.weights[component] = wid
    module.__dict__["forward"] = VaeForward(component, module, previous if callable(previous) else None, st)
    try:
        yield engines
    finally:
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous
        st.weights.pop(component, None)


def _line(label: str, engines) -> str:
    s = engines.stats
    line = f"sd-accel: {label} calls: {s.engine_calls} on engines, {s.torch_calls} in PyTorch"
    if s.fallbacks:
        line += " (" + "; ".join(f"{n}x {why}" for why, n in s.fallbacks.items()) + ")"
    return line


def decode(vae, latent, st: State | None = None):
    """``vae.decode(latent)`` with the decoder on engines; the images as ComfyUI's VAEDecode gives them."""
    with on_engines(vae, DECODER, st) as engines:
        images = vae.decode(latent)
    if engines is not None:
        log.info("%s", _line("VAE decoder", engines))
    if len(images.shape) == 5:  # ComfyUI's VAEDecode folds a video batch the same way
        images = images.reshape(-1, images.shape[-3], images.shape[-2], images.shape[-1])
    return images


def encode(vae, pixels, st: State | None = None):
    """``vae.encode(pixels[..., :3])`` with the encoder on engines (ComfyUI's VAEEncode)."""
    with on_engines(vae, ENCODER, st) as engines:
        latent = vae.encode(pixels[:, :, :, :3])
    if engines is not None:
        log.info("%s", _line("VAE encoder", engines))
    return latent
