"""What a call no engine covers asks for, in the user's words (pixels, batch, tokens), and what
the engines loaded do cover: the fallback's reason ("no engine covers ...") and what to build.

Engines see latent or token shapes (``x=(2, 4, 96, 64)``); users ask for 768x512, batch 1 with
CFG. Each engine's record keeps the profile it was built for (pixels, images) and the tensor
shapes that profile gave, so the scale from one to the other is read off the engine itself:
pixels per latent row (8 for SD's VAE, 1 for the VAE encoder's image input) and rows per image
(2 with CFG). A component whose inputs have no image (CLIP, T5) is told in tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from sd_accel.profiles import Profile

BUILD_HINT = ("build an engine for it (sd-accel build --model MODEL --height {h} --width {w} --batch {b}; the "
              "app's Build; the host's build node or tab), or let engines='auto' build it on first use")


@dataclass(frozen=True)
class _Scale:
    """How one engine's tensors map to its profile: the image input's name, pixels per element
    of its last two dims, tensor rows per image."""

    name: str
    pixels: float
    rows: float


def _image_input(shapes: dict) -> str | None:
    four = [n for n, (lo, _, _) in shapes.items() if len(lo) == 4]
    return four[0] if four else None


def _scale(handle) -> tuple[Profile, _Scale | None] | None:
    try:
        profile = Profile.from_tag(handle.record.key.profile)
    except Exception:  # a record of an older or foreign form: its sizes are not told, the call still falls back
        return None
    name = _image_input(handle.shapes)
    if name is None:
        return profile, None
    opt = handle.shapes[name][1]
    return profile, _Scale(name, profile.height[1] / opt[-2], opt[0] / max(profile.batch[1], 1))


def _span(r: tuple[int, int, int]) -> str:
    return f"{r[0]}" if r[0] == r[2] else f"{r[0]}-{r[2]}"


def covered(handles: Iterable) -> list[str]:
    """Each engine's sizes: ``512x512 px, batch 1`` or ``512-768 x 512-768 px, batch 1-4`` (with
    tokens where the profile has more than one chunk)."""
    seen: list[str] = []
    for handle in handles:
        got = _scale(handle)
        if got is None:
            continue
        p = got[0]
        text = (f"{_span(p.width)}x{_span(p.height)} px" if p.static
                else f"{_span(p.width)} x {_span(p.height)} px") + f", batch {_span(p.batch)}"
        if p.tokens[2] > p.tokens[0]:
            text += f", {_span(p.tokens)} tokens"
        if p.text is not None:  # SD3 / FLUX.1: T5's max_sequence_length
            text += f", T5 length {_span(p.text)}"
        if text not in seen:
            seen.append(text)
    return seen


def _request(feed: dict[str, torch.Tensor], handles: list) -> tuple[str, tuple[int, int, int] | None]:
    """The call in the user's words and (height, width, batch) where it has an image."""
    for handle in handles:
        got = _scale(handle)
        if got is None or got[1] is None or got[1].name not in feed:
            continue
        s = got[1]
        shape = tuple(feed[s.name].shape)
        h, w = round(shape[-2] * s.pixels), round(shape[-1] * s.pixels)
        batch = shape[0] / s.rows if s.rows else shape[0]
        b = int(batch) if batch == int(batch) else None
        images = f"batch {b}" if b is not None else f"{shape[0]} rows"
        return f"{w}x{h} px, {images}", (h, w, b or shape[0])
    tokens = [tuple(v.shape) for v in feed.values() if v.dim() == 2 and not v.is_floating_point()]  # token ids
    if tokens:
        return f"{tokens[0][1]} tokens, batch {tokens[0][0]}", None
    return "", None


def _outside(feed: dict[str, torch.Tensor], handles: list) -> tuple[str, str, int]:
    """The first input dimension of ``feed`` outside every engine's range, said with the nearest
    engine's range (``encoder_hidden_states dim 1 is 512, the engine takes 32-128``): the reason
    where pixels and batch fit (a T5 length, a token count); with the input's name and dimension."""
    for name, value in feed.items():
        for dim, size in enumerate(value.shape):
            ranges = [(h.shapes[name][0][dim], h.shapes[name][2][dim]) for h in handles
                      if name in h.shapes and len(h.shapes[name][0]) == value.dim()]
            if ranges and not any(lo <= size <= hi for lo, hi in ranges):
                lo, hi = min(ranges, key=lambda r: min(abs(size - r[0]), abs(size - r[1])))
                return f"{name} dim {dim} is {size}, the engine takes {_span((lo, lo, hi))}", name, dim
    return "", "", -1


def uncovered(feed: dict[str, torch.Tensor], handles: list) -> str:
    """The fallback's reason for a call none of ``handles`` covers: ``no engine covers 768x512 px,
    batch 2 (x=(4, 4, 64, 96)); the engines cover 512x512 px, batch 1; build ...``."""
    shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in feed.items())
    words, size = _request(feed, handles)
    text = f"no engine covers {words} ({shapes})" if words else f"no engine covers {shapes}"
    sizes = covered(handles)
    if sizes:
        text += "; the engines cover " + "; ".join(sizes)
    outside, name, dim = _outside(feed, handles)
    if outside:
        text += f"; out of their range: {outside}"
        texts = any((got := _scale(h)) is not None and got[0].text is not None for h in handles)
        if size is None and texts and dim == 0:  # a transformer's batch (its feed has no image-shaped input)
            text += (f"; build one whose batch reaches {feed[name].shape[0]} (sd-accel build --batch N; "
                     "Profile(batch=...)), or generate fewer images at once")
        elif size is None and texts:
            text += ("; build one whose T5 length reaches the pipeline's max_sequence_length (sd-accel build "
                     "--text N; Profile(text=N)), or call the pipeline with a max_sequence_length the engines take")
    if size is not None:
        text += "; " + BUILD_HINT.format(h=size[0], w=size[1], b=size[2])
    return text
