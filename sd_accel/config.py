"""``AccelConfig``: every choice ``accelerate`` makes, validated when built."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from sd_accel.backends import registry
from sd_accel.core import InvalidValue

ATTENTION = ("auto", "xformers", "sdpa", "sliced")
PRECISION = ("auto", "fp32", "fp16", "bf16")
VAE_PRECISION = ("auto", "fp32", "same")
OFFLOAD = ("none", "medvram", "lowvram")
# "auto" and the names in the backend table (sd_accel/backends/registry.py), for menus and --help
BACKENDS = registry.choices()
ENGINE_PRECISIONS = registry.engine_precisions()  # what some backend builds: the table's ``builds``
ENGINES = (False, True, "auto")  # off, the engines in the cache, the cache plus builds on first use


def _check_choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidValue(f"AccelConfig.{field}={value!r} is not valid; allowed: {', '.join(allowed)}")


@dataclass
class AccelConfig:
    """How to accelerate a pipeline. All fields work without engines, on CPU too.

    - ``precision``: weights and compute dtype. ``auto`` is fp16 on CUDA and fp32 elsewhere.
      ``fp16`` on a device without fp16 support runs fp32 and logs why (bf16 is the CPU's
      reduced precision).
    - ``attention``: ``auto`` picks xFormers on CUDA when it imports, else PyTorch SDPA, else sliced.
    - ``vae_precision``: ``auto`` decodes in fp32 when the VAE's config asks for it (SDXL), else in
      the pipeline's dtype; ``fp32`` always (the WebUI's ``--no-half-vae``); ``same`` never upcasts.
      With ``nan_check`` a decode that yields NaN is redone once in fp32 and logged.
    - ``offload``: ``medvram`` (model CPU offload), ``lowvram`` (sequential offload); CUDA only.
    - ``sampler``: a WebUI sampler name such as ``"DPM++ 2M Karras"`` (see ``sd_accel.samplers``).
    - ``engines``: ``True`` swaps in the engines that ``build_engines`` put in ``engine_dir``
      (default ``SD_ACCEL_ENGINE_DIR`` or ``./engines``) for ``backend``. A call no engine covers
      runs torch, warns once and is counted in ``stats(pipe)``, unless ``engine_fallback=False``.
      ``"auto"``: the same, and a call no engine covers first gets an engine built for its shape
      (static: its batch, height, width, tokens; progress shown; validated; cached), then runs
      on it; later calls of that shape reuse it. Each component is built on its own first
      uncovered call, each shape at most once: a failed build is remembered and that shape
      runs torch, with the reason in ``stats``. Builds use ``engine_precision`` when the backend
      builds it without calibration data, else the backend's default precision, and fp32 where an
      engine of that default misses its accuracy check (said in the log).
    - ``engine_precision``: when engines of several precisions cover a call (an ``int8`` and a
      ``bf16`` UNet, say), use this one first; components without an engine of that precision
      use the others. ``None``: static engines first, then the nearest profile, then the faster
      precision (int8 before bf16/fp16 before fp32).
    - ``step_cache``: ``None`` (the default) runs every step of an SD3 / FLUX.1 transformer in
      full. A threshold (``0.12``) turns on a first-block step cache on its engines: each step
      runs the first block, and where its residual changed by less than that (relative) since the
      last step computed in full, the other blocks' residual from then is reused instead of running
      them. An approximation: check its picture with ``sd_accel.generate.check_step_cache``. It
      needs a transformer engine built for it (``build_engines(pipe, step_cache=True)``;
      ``engines="auto"`` builds one), and does nothing without engines.
    - ``vae``: ``None`` the model's own VAE; ``"tiny:PATH"`` the tiny autoencoder (TAESD/TAESDXL:
      a diffusers folder or ``taesd_decoder.safetensors``) decodes instead, on engines too.

    >>> AccelConfig(precision="fp16", sampler="Euler a").precision
    'fp16'
    >>> AccelConfig(engines="auto").engines
    'auto'
    """

    precision: str = "auto"
    attention: str = "auto"
    vae_precision: str = "auto"
    nan_check: bool = True
    offload: str = "none"
    vae_slicing: bool = False
    vae_tiling: bool = False
    sampler: str | None = None
    device: str = "auto"
    engines: bool | str = False
    engine_dir: str | None = None
    backend: str = "auto"
    engine_fallback: bool = True
    engine_precision: str | None = None
    vae: str | None = None
    step_cache: float | None = None

    def __post_init__(self) -> None:
        _check_choice("precision", self.precision, PRECISION)
        _check_choice("attention", self.attention, ATTENTION)
        _check_choice("vae_precision", self.vae_precision, VAE_PRECISION)
        _check_choice("offload", self.offload, OFFLOAD)
        _check_choice("backend", self.backend, registry.choices())
        if self.engine_precision is not None:
            _check_choice("engine_precision", self.engine_precision, ENGINE_PRECISIONS)
        if not (isinstance(self.engines, bool) or self.engines == "auto"):
            raise InvalidValue(f"AccelConfig.engines={self.engines!r} is not valid; allowed: True, False, 'auto'")
        for flag in ("nan_check", "vae_slicing", "vae_tiling", "engine_fallback"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidValue(f"AccelConfig.{flag} must be True or False, got {getattr(self, flag)!r}")
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda", "mps") or self.device.startswith("cuda:")
        ):
            raise InvalidValue(f"AccelConfig.device={self.device!r} is not valid; allowed: auto, cpu, cuda, cuda:N, mps")
        sc = self.step_cache
        if sc is not None and (isinstance(sc, bool) or not isinstance(sc, int | float) or not math.isfinite(sc)
                               or sc < 0):
            raise InvalidValue(f"AccelConfig.step_cache={sc!r} is not valid; allowed: None (off) or a finite threshold "
                               ">= 0 (0.08-0.12 is usual; 0 caches nothing)")
        if self.vae is not None:
            from sd_accel.optimize.vae_choice import check_vae_choice

            check_vae_choice(self.vae)
        if self.sampler is not None:
            from sd_accel.samplers import resolve

            resolve(self.sampler)  # raises ValueError with the closest names

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
