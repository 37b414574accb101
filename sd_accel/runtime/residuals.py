"""The residual-taking UNet's runtime entry (component ``unet_control``), for any host.

A host with a UNet's inputs and ControlNet residuals (diffusers' ``EngineUNet``, a ComfyUI or
WebUI adapter) calls :func:`run_control_unet` with the
:class:`~sd_accel.runtime.selection.ComponentEngines` of ``unet_control``
(:func:`sd_accel.runtime.engines_for`). Several ControlNets: pass the sum of their residuals (what
diffusers' ``MultiControlNetModel`` hands the UNet); a net that is off: zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sd_accel.runtime.selection import ComponentEngines

CONTROL_UNET = "unet_control"  # the component name (sd_accel.components.controlnet.CONTROL_UNET)


def control_unet_feed(sample: torch.Tensor, timestep, encoder_hidden_states: torch.Tensor,
                      down: Sequence[torch.Tensor], mid: torch.Tensor,
                      added: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The ``unet_control`` engine's feed: the UNet inputs (float32, the timestep one per row),
    SDXL's ``text_embeds``/``time_ids`` when ``added`` has them, then ``down_0`` .. and ``mid``."""
    batch = sample.shape[0]
    t = torch.as_tensor(timestep, device=sample.device).float().reshape(-1)
    if t.numel() == 1:
        t = t.expand(batch)
    feed = {"sample": sample.float(), "timestep": t.contiguous(), "encoder_hidden_states": encoder_hidden_states.float()}
    if added:
        feed["text_embeds"] = added["text_embeds"].float()
        feed["time_ids"] = added["time_ids"].float()
    for i, r in enumerate(down):
        feed[f"down_{i}"] = r.float()
    feed["mid"] = mid.float()
    return feed


def run_control_unet(engines: ComponentEngines, sample: torch.Tensor, timestep, encoder_hidden_states: torch.Tensor,
                     down: Sequence[torch.Tensor], mid: torch.Tensor,
                     added: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
    """The noise prediction of the residual-taking UNet engine (a copy, in ``sample``'s dtype and
    device), or None: no engine covers the call, which ``engines`` counted as a torch call.

    (Skipped in the test suite: it needs a host's own UNet and ControlNet residuals, ComfyUI's or
    the WebUI's; tests/test_comfyui_pack.py and tests/test_webui_controlnet.py run the hosts' ControlNet paths on stand-ins.)

    >>> eps = run_control_unet(engines, x, t, context, down=[...], mid=m)  # doctest: +SKIP
    >>> eps = eps if eps is not None else torch_unet(x, t, context, ...)  # doctest: +SKIP
    """
    try:
        feed = control_unet_feed(sample, timestep, encoder_hidden_states, down, mid, added)
    except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as exc:
        engines.torch_call(f"inputs the engine cannot take ({type(exc).__name__}: {exc})")
        return None
    out = engines.run(feed, need=("latent",))
    return None if out is None else out["latent"].to(device=sample.device, dtype=sample.dtype, copy=True)
