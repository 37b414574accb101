"""One generation with timings: what the CLI's ``generate`` and the demo run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo


@dataclass
class GenerationResult:
    images: list[Image.Image]
    seconds: float
    steps: int
    unet_calls: int
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def it_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0


def generate(
    pipe,
    prompt: str,
    *,
    negative_prompt: str | None = None,
    steps: int = 20,
    cfg: float = 7.0,
    width: int | None = None,
    height: int | None = None,
    batch: int = 1,
    seed: int = 0,
) -> GenerationResult:
    """Run ``pipe`` once and time it. The UNet calls are counted, so second-order samplers show."""
    calls = {"n": 0}
    hook = pipe.unet.register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    generator = torch.Generator("cpu").manual_seed(seed)
    kwargs: dict[str, Any] = dict(
        prompt=prompt,
        negative_prompt=negative_prompt,
        num_inference_steps=steps,
        guidance_scale=cfg,
        num_images_per_prompt=batch,
        generator=generator,
    )
    if width:
        kwargs["width"] = width
    if height:
        kwargs["height"] = height
    start = time.perf_counter()
    try:
        images = pipe(**kwargs).images
    finally:
        hook.remove()
    return GenerationResult(images, time.perf_counter() - start, steps, calls["n"])


def save_png(image: Image.Image, path: str | Path, parameters: str) -> Path:
    """Save with the generation parameters in the PNG text chunk ``parameters``, as the WebUI does."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = PngInfo()
    info.add_text("parameters", parameters)
    image.save(path, pnginfo=info)
    return path


def parameters_text(prompt: str, negative: str | None, steps: int, sampler: str | None, cfg: float,
                    seed: int, width: int, height: int, model: str) -> str:
    """The WebUI's infotext format: prompt, negative prompt, then ``key: value`` pairs."""
    lines = [prompt]
    if negative:
        lines.append(f"Negative prompt: {negative}")
    lines.append(
        f"Steps: {steps}, Sampler: {sampler or 'default'}, CFG scale: {cfg}, Seed: {seed}, "
        f"Size: {width}x{height}, Model: {model}"
    )
    return "\n".join(lines)
