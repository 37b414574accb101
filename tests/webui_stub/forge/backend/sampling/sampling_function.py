"""``backend/sampling/sampling_function.py``: Forge's cond/uncond batching by free memory.

``calc_cond_uncond_batch`` packs cond and uncond rows into as few UNet calls as
``model.memory_required(shape) < free memory`` allows (ComfyUI's rule), pads context lengths to a
common multiple (``cond_cat``), and calls ``model_options["model_function_wrapper"]`` when set,
else ``model.apply_model(input_x, timestep_, **c)``. The patcher's ControlNet chain
(``controlnet_linked_list``) rides on each cond as ``control``; a call then gets
``c["control"] = control.get_control(input_x, timestep_, c, rows)`` and ``c["control_model"]``, as
Forge's ``calc_cond_uncond_batch`` does.
"""

from __future__ import annotations

import math

import torch

from backend import memory_management

calls: list[tuple] = []  # (batch, height, width, tokens) of every UNet call, for the tests


def _cond_cat(c_list):
    lengths = [c.shape[1] for c in c_list]
    lcm = math.lcm(*lengths)
    return torch.cat([c.repeat(1, lcm // c.shape[1], 1) for c in c_list])


def calc_cond_uncond_batch(model, cond, uncond, x_in, timestep, model_options):
    to_run = [(x_in, cond, 0), (x_in, uncond, 1)]
    out = {0: None, 1: None}
    while to_run:
        first_shape = to_run[0][0].shape
        to_batch = to_run[:1]
        free_memory = memory_management.get_free_memory(x_in.device)
        for i in range(1, len(to_run) + 1):
            batch_amount = to_run[: len(to_run) // i]
            input_shape = [len(batch_amount) * first_shape[0]] + list(first_shape)[1:]
            if model.memory_required(input_shape) < free_memory:
                to_batch = batch_amount
                break
        input_x = torch.cat([b[0] for b in to_batch])
        timestep_ = torch.cat([timestep] * len(to_batch))
        c = {"c_crossattn": _cond_cat([b[1]["crossattn"] for b in to_batch]), "transformer_options": {}}
        if "vector" in to_batch[0][1]:
            c["y"] = torch.cat([b[1]["vector"] for b in to_batch])
        cond_or_uncond = [b[2] for b in to_batch]
        control = to_batch[0][1].get("control")
        if control is not None:
            c["control"] = control.get_control(input_x, timestep_, dict(c), len(cond_or_uncond))
            c["control_model"] = control
        calls.append((input_x.shape[0], input_x.shape[2], input_x.shape[3], c["c_crossattn"].shape[1]))
        if "model_function_wrapper" in model_options:
            output = model_options["model_function_wrapper"](
                model.apply_model, {"input": input_x, "timestep": timestep_, "c": c, "cond_or_uncond": cond_or_uncond})
        else:
            output = model.apply_model(input_x, timestep_, **c)
        for o, chunk in zip(cond_or_uncond, output.chunk(len(to_batch)), strict=True):
            out[o] = chunk
        to_run = to_run[len(to_batch):]
    return out[0], out[1]


def _as_dict(cond, control=None):
    out = dict(cond) if isinstance(cond, dict) else {"crossattn": cond}
    if control is not None:
        out["control"] = control
    return out


def sample_forge(p, x, steps, cond, uncond):
    """Euler over sigmas with Forge's sampling function; the patcher's object patches are applied
    for the duration and its LoRA patches merged into the weights, as Forge's model loading does."""
    unet = p.sd_model.forge_objects.unet
    model = unet.patch_model()
    unet.refresh_loras()  # what Forge's memory management does when it loads the UNet
    try:
        sigmas = torch.linspace(2.0, 0.0, steps + 1)
        for i in range(steps):
            sigma = sigmas[i].expand(x.shape[0])
            control = unet.controlnet_linked_list
            c_out, u_out = calc_cond_uncond_batch(model, _as_dict(cond, control), _as_dict(uncond, control), x, sigma,
                                                  unet.model_options)
            denoised = u_out + (c_out - u_out) * p.cfg_scale
            x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    finally:
        unet.unpatch_model()
    return x
