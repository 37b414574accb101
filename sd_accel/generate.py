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


@dataclass
class StepCacheCheck:
    """What :func:`check_step_cache` found: the picture's PSNR (dB) against the uncached one,
    how many transformer calls reused the cached residual, both runs' seconds, and whether the
    step cache passed the gate (``ok``; when not, the check turned it off)."""

    threshold: float
    psnr: float
    gate: float
    calls: int
    cached: int
    seconds_full: float
    seconds_cached: float
    ok: bool
    full: GenerationResult
    result: GenerationResult  # the cached run's

    @property
    def speedup(self) -> float:
        return self.seconds_full / self.seconds_cached if self.seconds_cached else 0.0

    def summary(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "psnr_db": round(self.psnr, 2), "gate_db": self.gate,
                "cached_calls": self.cached, "calls": self.calls, "speedup": round(self.speedup, 3), "ok": self.ok}


def picture_psnr(got: list[Image.Image], want: list[Image.Image]) -> float:
    """PSNR (dB) between two lists of 8-bit pictures (inf when equal)."""
    import numpy as np

    a = np.stack([np.asarray(i.convert("RGB"), dtype=np.float64) / 255 for i in got])
    b = np.stack([np.asarray(i.convert("RGB"), dtype=np.float64) / 255 for i in want])
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def check_step_cache(pipe, params: GenerationParams, threshold: float | None = None, *, gate: float | None = None,
                     refuse: bool = True, extra: dict[str, Any] | None = None) -> StepCacheCheck:
    """Generate ``params`` without and with the step cache (``threshold``, default the one
    ``accelerate`` set: ``AccelConfig.step_cache``) and compare the pictures: the project's picture
    gate for approximations of the denoiser (:data:`sd_accel.validate.STEP_CACHE_PSNR`, 35 dB, as
    for int8) unless ``gate`` says otherwise. Below it the cache is refused, with a warning: turned
    off on ``pipe`` (``refuse=False``: kept, still with the warning). Costs one uncached generation;
    the check's two results are returned (``full``, ``result``), so a face saves one of them.

    (Skipped in the test suite: it needs the transformer on engines cut for the cache;
    tests/test_step_cache.py builds them.)

    >>> check = check_step_cache(pipe, GenerationParams(prompt="a cat", steps=28))  # doctest: +SKIP
    >>> check.psnr, check.cached, check.ok  # doctest: +SKIP
    (36.2, 11, True)
    """
    from sd_accel.runtime import set_step_cache, stats
    from sd_accel.validate import STEP_CACHE_PSNR

    state = getattr(pipe, "sd_accel", None)
    threshold = getattr(state, "step_cache", None) if threshold is None else threshold
    if threshold is None:
        raise InvalidValue("no step cache to check: accelerate(pipe, engines=True, step_cache=0.1) first, or pass "
                           "threshold=")
    gate = STEP_CACHE_PSNR if gate is None else float(gate)
    if params.seed == -1:  # both runs need the same seed
        import dataclasses

        params = dataclasses.replace(params, seed=params.resolved_seed())
    set_step_cache(pipe, None)
    full = generate(pipe, params, extra)
    if not set_step_cache(pipe, threshold):
        raise InvalidValue("step cache: this pipeline's transformer is not on engines (engines=True or 'auto')")
    result = generate(pipe, params, extra)
    counts = stats(pipe).get("transformer", {}).get("step_cache", {})
    calls, cached = int(counts.get("calls", 0)), int(counts.get("cached", 0))
    psnr = picture_psnr(result.images, full.images)
    ok = psnr >= gate
    log = logging.getLogger("sd_accel")
    if ok:
        log.info("step cache (threshold %g): its picture is %.1f dB from the uncached one (gate %.0f dB); %d of %d "
                 "transformer calls cached, %.2fx", threshold, psnr, gate, cached, calls,
                 full.seconds / result.seconds if result.seconds else 0.0)
    else:
        action = "turned off: every step runs in full" if refuse else "kept (refuse=False)"
        log.warning("step cache (threshold %g) below the picture gate: its picture is %.1f dB from the uncached one, "
                    "under %.0f dB (%d of %d transformer calls cached); %s. A lower threshold caches fewer steps "
                    "and keeps the picture closer", threshold, psnr, gate, cached, calls, action)
        if refuse:
            set_step_cache(pipe, None)
    if state is not None and hasattr(state, "step_cache"):
        state.step_cache = threshold if ok or not refuse else None
    return StepCacheCheck(float(threshold), psnr, gate, calls, cached, full.seconds, result.seconds, ok, full, result)


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
