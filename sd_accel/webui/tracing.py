"""The WebUI's run-time patches of a module, undone for a trace (an export, a refit's
validation) and restored after, whatever happens in between:

- ``sd_unet.current_unet`` (A1111 sends every UNet call to the active SD-UNet, which may be
  ours) is set to None;
- cross-attention optimizations (``--xformers``, SDP, Doggettx ..., set by
  ``sd_hijack.model_hijack.apply_optimizations``) are switched to "None", plain matmul and
  softmax attention, and re-applied from the settings after;
- Forge's attention functions are replaced by plain ones;
- ``--medvram`` / ``--lowvram`` forward pre-hooks (``modules.lowvram``), which move blocks to
  the GPU when called, are lifted, so the trace sees the module on one device (the CPU, fp32);
- gradient checkpointing flags (``use_checkpoint`` / ``checkpoint``) are switched off;
- every weight returns to its own device and dtype (lowvram keeps blocks on several devices).

A module of its own (not part of :mod:`sd_accel.webui.export`): the LoRA refits need these
contexts too, and the export module imports the controller, which imports the LoRA refits.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from sd_accel.webui import host

log = logging.getLogger("sd_accel")


@contextlib.contextmanager
def no_sd_unet() -> Iterator[None]:
    """``sd_unet.current_unet`` None for the block (A1111's UNet forward dispatches to it)."""
    try:
        sd_unet = host.module("sd_unet")
    except ImportError:
        yield
        return
    saved = getattr(sd_unet, "current_unet", None)
    sd_unet.current_unet = None
    try:
        yield
    finally:
        sd_unet.current_unet = saved


@contextlib.contextmanager
def plain_webui_attention() -> Iterator[None]:
    """The WebUI's attention optimization off ("None") for the block, re-applied after."""
    try:
        sd_hijack = host.module("sd_hijack")
        hijack = sd_hijack.model_hijack
    except (ImportError, AttributeError):  # Forge 2 picks attention at start-up; nothing to switch
        yield
        return
    before = getattr(getattr(sd_hijack, "current_optimizer", None), "name", None)
    try:
        hijack.apply_optimizations("None")
    except Exception as exc:  # a WebUI whose hijack works otherwise (Forge 2): trace as it is
        log.warning("could not switch the attention optimization off for the export: %s", exc)
        yield
        return
    try:
        yield
    finally:
        hijack.apply_optimizations()  # no option: what the settings and flags choose, as at start
        after = getattr(getattr(sd_hijack, "current_optimizer", None), "name", None)
        if after != before:
            log.warning("attention optimization was %s before the export and is %s after", before, after)


def plain_heads_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False):
    """Multi-head attention as plain ops: MatMul(Q * scale, K^T) -> Softmax -> MatMul on 4-D
    tensors, the form every backend fuses. The signature of Forge's attention functions
    (ldm_patched's ``optimized_attention``, Forge 2's ``attention_function``)."""
    if skip_reshape:  # (B, heads, N, D) already
        b, _, _, dim_head = q.shape
    else:
        b, _, inner = q.shape
        dim_head = inner // heads
        q, k, v = (t.reshape(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(q * dim_head**-0.5, k.transpose(-1, -2))
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, -torch.finfo(scores.dtype).max)
        else:
            while mask.dim() < 4:
                mask = mask.unsqueeze(1)
            scores = scores + mask
    out = torch.matmul(scores.softmax(dim=-1), v)
    return out.transpose(1, 2).reshape(b, -1, heads * dim_head)


def plain_spatial_attention(q, k, v):
    """The VAE's single-head attention over pixels (q, k, v: B, C, H, W) as plain ops."""
    b, c, h, w = q.shape
    q, k, v = (t.reshape(b, 1, c, h * w).transpose(-1, -2) for t in (q, k, v))
    scores = torch.matmul(q * c**-0.5, k.transpose(-1, -2))
    out = torch.matmul(scores.softmax(dim=-1), v)
    return out.transpose(-1, -2).reshape(b, c, h, w)


# Forge picks its attention at start-up and calls it through module globals; on a CPU without
# --attention-pytorch that is the sub-quadratic one, whose ``baddbmm(torch.empty(1, 1, 1), ...,
# beta=0)`` exports as ``empty * 0 + scores``: the uninitialised constant (NaN or inf as often as
# not) poisons the whole graph. That was Forge 2024's "latent has NaN/inf" validation failure.
_FORGE_ATTENTION = (
    ("ldm_patched.ldm.modules.attention", "optimized_attention", plain_heads_attention),
    ("ldm_patched.ldm.modules.attention", "optimized_attention_masked", plain_heads_attention),
    ("backend.nn.unet", "attention_function", plain_heads_attention),
    ("backend.nn.vae", "attention_function_single_head_spatial", plain_spatial_attention),
)


@contextlib.contextmanager
def replaced_attention(module: torch.nn.Module, replacements: tuple[tuple[str, str, object], ...]) -> Iterator[None]:
    """For the block, each ``(module name, attribute, plain function)`` of ``replacements`` (a
    host's attention, picked at start-up and called through module globals) and the
    ``optimized_attention`` each VAE ``AttnBlock`` of ``module`` keeps (Forge 1, ComfyUI) become
    plain attention; the host's own after. Modules not imported are left alone."""
    import sys

    saved: list[tuple[object, str, object]] = []  # (module or nn.Module, attribute, the host's value)
    for module_name, attr, plain in replacements:
        owner = sys.modules.get(module_name)
        if owner is not None and callable(getattr(owner, attr, None)):
            saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, plain)
    for sub in module.modules():
        if type(sub).__name__ == "AttnBlock" and callable(sub.__dict__.get("optimized_attention")):
            saved.append((sub, "optimized_attention", sub.__dict__["optimized_attention"]))
            sub.__dict__["optimized_attention"] = plain_spatial_attention
    try:
        yield
    finally:
        for owner, attr, old in reversed(saved):
            if isinstance(owner, torch.nn.Module):
                owner.__dict__[attr] = old
            else:
                setattr(owner, attr, old)


def plain_forge_attention(module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """Forge's attention functions (module globals, and the ``optimized_attention`` each Forge 1
    VAE ``AttnBlock`` keeps) replaced by plain ones for the block; Forge's own after."""
    return replaced_attention(module, _FORGE_ATTENTION)


@contextlib.contextmanager
def no_forward_hooks(module: torch.nn.Module) -> Iterator[None]:
    """Forward pre-hooks of ``module`` and its children lifted for the block (lowvram's
    ``send_me_to_gpu`` would move blocks to the GPU in the middle of a CPU trace)."""
    saved = {}
    for sub in module.modules():
        if sub._forward_pre_hooks:
            saved[sub] = dict(sub._forward_pre_hooks)
            sub._forward_pre_hooks.clear()
    try:
        yield
    finally:
        for sub, hooks in saved.items():
            sub._forward_pre_hooks.update(hooks)


@contextlib.contextmanager
def no_checkpointing(module: torch.nn.Module) -> Iterator[None]:
    """Gradient checkpointing flags off (LDM's ``use_checkpoint``, ``checkpoint``) for the block."""
    flipped = []
    for sub in module.modules():
        for attr in ("use_checkpoint", "checkpoint"):
            if getattr(sub, attr, None) is True:
                setattr(sub, attr, False)
                flipped.append((sub, attr))
    try:
        yield
    finally:
        for sub, attr in flipped:
            setattr(sub, attr, True)


@contextlib.contextmanager
def preserve_layout(module: torch.nn.Module) -> Iterator[None]:
    """Every parameter and buffer back on its own device and dtype after the block (the
    validation moves the whole module; lowvram spreads it over devices)."""
    from sd_accel.onnx.export import move_tensor  # here: importing onnx must not be needed to build the tab

    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    before = {name: (t.device, t.dtype) for name, t in tensors.items()}
    try:
        yield
    finally:
        for name, t in {**dict(module.named_parameters()), **dict(module.named_buffers())}.items():
            device, dtype = before.get(name, (t.device, t.dtype))
            if t.device != device or t.dtype != dtype:
                move_tensor(t, device, dtype)


@contextlib.contextmanager
def module_context(module: torch.nn.Module) -> Iterator[None]:
    """What one exported module needs undone: its own forward (not sd-accel's stand-in), plain
    Forge attention, no offload hooks, no checkpointing, and its layout restored after."""
    from sd_accel.webui.stand_ins import own_forward

    with contextlib.ExitStack() as stack:
        stack.enter_context(preserve_layout(module))
        stack.enter_context(own_forward(module))
        stack.enter_context(plain_forge_attention(module))
        stack.enter_context(no_forward_hooks(module))
        stack.enter_context(no_checkpointing(module))
        yield


@contextlib.contextmanager
def export_context(unet: torch.nn.Module) -> Iterator[None]:
    """All of the above for the UNet, in the order that undoes them cleanly."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(no_sd_unet())
        stack.enter_context(plain_webui_attention())
        stack.enter_context(module_context(unet))
        yield
