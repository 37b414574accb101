"""One generation with timings: the parameters every face validates through
(``GenerationParams``), the run itself, and the PNG it is saved as."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from sd_accel.core import InvalidType, InvalidValue

MAX_STEPS = 150  # the WebUI's slider maximum
MAX_BATCH = 64
MAX_SIDE = 4096
MAX_SEED = 2**32 - 1  # the WebUI's seeds; -1 picks one at random


@dataclass(frozen=True)
class GenerationParams:
    """One generation request, validated once for every face (CLI, panel, WebUI API, server).

    ``width``/``height`` None take the model's default size; ``seed=-1`` draws a random seed
    (``resolved_seed``). ``sampler`` is checked here; the faces hand it to
    ``AccelConfig(sampler=...)``, which puts that scheduler on the pipeline that :func:`generate`
    runs. Every invalid value raises ``InvalidValue`` naming the field, as ``AccelConfig`` does.
    Building one imports neither torch nor diffusers, so a face can check a request before it
    loads a model.

    >>> GenerationParams(prompt="a cat", steps=0)
    Traceback (most recent call last):
    ...
    sd_accel.core.InvalidValue: GenerationParams.steps=0 is not valid; allowed: an integer from 1 to 150
    """

    prompt: str = "a photo of a cat"
    negative_prompt: str | None = None
    steps: int = 20
    cfg: float = 7.0
    width: int | None = None
    height: int | None = None
    batch: int = 1
    seed: int = 0
    sampler: str | None = None
    eta: float | None = None  # the stochastic samplers' noise share (TCD: 0.3 is its default); None: the pipeline's

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            _bad("prompt", self.prompt, "a string")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            _bad("negative_prompt", self.negative_prompt, "a string or None")
        _int_in("steps", self.steps, 1, MAX_STEPS)
        _int_in("batch", self.batch, 1, MAX_BATCH)
        _int_in("seed", self.seed, -1, MAX_SEED)
        cfg = self.cfg
        if isinstance(cfg, bool) or not isinstance(cfg, int | float) or not math.isfinite(cfg) or not 0 <= cfg <= 100:
            _bad("cfg", cfg, "a finite number from 0 to 100")
        eta = self.eta
        if eta is not None and (isinstance(eta, bool) or not isinstance(eta, int | float) or not 0 <= eta <= 1):
            _bad("eta", eta, "a number from 0 to 1, or None")
        for side in ("width", "height"):
            value = getattr(self, side)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 8 <= value <= MAX_SIDE or value % 8:
                _bad(side, value, f"a multiple of 8 from 8 to {MAX_SIDE}, or None for the model's default")
        if self.sampler is not None:
            from sd_accel.samplers import resolve

            if not isinstance(self.sampler, str):
                _bad("sampler", self.sampler, "a sampler name such as 'Euler a' (`sd-accel samplers` lists them)")

            resolve(self.sampler)  # raises InvalidValue with the closest names

    def resolved_seed(self) -> int:
        """The seed to run with: ``seed``, or a random one for ``-1``."""
        if self.seed != -1:
            return self.seed
        import random

        return random.randint(0, MAX_SEED)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bad(name: str, value: Any, allowed: str) -> None:
    raise InvalidValue(f"GenerationParams.{name}={value!r} is not valid; allowed: {allowed}")


def _int_in(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        _bad(name, value, f"an integer from {lo} to {hi}")


@dataclass
class GenerationResult:
    images: list[Image.Image]
    seconds: float
    steps: int
    unet_calls: int
    timings: dict[str, float] = field(default_factory=dict)
    seed: int = 0  # the seed the run used (a drawn one for seed=-1)

    @property
    def it_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0


def generate(pipe, params: GenerationParams, extra: dict[str, Any] | None = None) -> GenerationResult:
    """Run ``pipe`` once for ``params`` and time it. The UNet's (or transformer's) calls are
    counted, so second-order samplers show.

    >>> from sd_accel import load_pipeline
    >>> pipe = load_pipeline("builtin:tiny-sd15")
    >>> result = generate(pipe, GenerationParams(prompt="a cat", steps=4, width=64, height=64, seed=1))
    >>> result.steps, result.unet_calls, result.seed     # and result.it_per_s, result.seconds, result.images
    (4, 5, 1)
    """
    import torch

    from sd_accel.prompts import takes_argument

    if not isinstance(params, GenerationParams):
        raise InvalidType(
            f"generate() takes a GenerationParams, got {type(params).__name__}: "
            "generate(pipe, GenerationParams(prompt=..., steps=...))"
        )
    seed = params.resolved_seed()
    calls = {"n": 0}
    denoiser = getattr(pipe, "unet", None) or pipe.transformer  # (SD3 / FLUX.1: the transformer)
    hook = denoiser.register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    generator = torch.Generator("cpu").manual_seed(seed)
    kwargs: dict[str, Any] = dict(
        prompt=params.prompt,
        negative_prompt=params.negative_prompt,
        num_inference_steps=params.steps,
        guidance_scale=params.cfg,
        num_images_per_prompt=params.batch,
        generator=generator,
    )
    if params.negative_prompt is None or not takes_argument(pipe, "negative_prompt"):
        # LatentConsistencyModelPipeline has no negative prompt (no CFG); an unset one stays unset
        if params.negative_prompt:
            logging.getLogger("sd_accel").warning("%s takes no negative prompt (it runs without CFG); "
                                                  "ignoring it", type(pipe).__name__)
        kwargs.pop("negative_prompt")
    if params.eta is not None:
        # the same **kwargs would swallow eta too (LatentConsistencyModelPipeline has none): say so
        if takes_argument(pipe, "eta"):
            kwargs["eta"] = float(params.eta)
        else:
            logging.getLogger("sd_accel").warning("%s takes no eta; ignoring eta=%s", type(pipe).__name__,
                                                  params.eta)
    if params.width:
        kwargs["width"] = params.width
    if params.height:
        kwargs["height"] = params.height
    kwargs.update(extra or {})  # what only some pipelines take: a ControlNet's image and scale
    start = time.perf_counter()
    try:
        images = pipe(**kwargs).images
    finally:
        hook.remove()
    return GenerationResult(images, time.perf_counter() - start, params.steps, calls["n"], seed=seed)


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
