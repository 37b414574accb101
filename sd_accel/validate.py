"""Check a freshly built engine against torch before it is trusted (dynamic engines far from
their opt shapes have produced NaN in the field).

Points: the profile's opt shape, and for dynamic profiles its max shape too, where dynamic
engines go wrong. Validation must fit in memory at the biggest profiles (batch 4 x 2 for
guidance, 768 px, 154 tokens), so:

- the torch reference runs attention with ``F.scaled_dot_product_attention``
  (:func:`sd_accel.onnx.attention.sdpa_attention`; no N x N scores, whatever processor the user's
  pipeline has) and one batch item at a time (every input and output is batch-first), so it
  costs what a batch-1 call costs;
- the engine runs the full max shape (that is what is being checked); its attention is fused on
  every backend, so its memory grows linearly with the shape;
- before the max point, the memory the opt point took (engine and reference, RSS sampled while
  it runs) is split in two: what stayed held after it, up to the size of the weights (the engine's
  first call copies its weights into the runtime's own buffers; the runner says how much:
  ``once_bytes``, OpenVINO's engine.bin), which a bigger shape does not take again, and
  the rest (activations, the reference's and the engine's), which grows with the shape. Only the
  rest is scaled by the max/opt size ratio, with headroom (:func:`max_point_need`): 7.5 GiB for
  SD 1.5's dynamic-512-768 max (batch 8, 768 px, 154 tokens) in OpenVINO bf16, which took 3.4 GiB
  and was checked in full. Scaling the whole growth, weights included, gave 36.5 GiB in a
  ComfyUI with 10.9 GiB available, so the max shape was never checked. When the max shape does not fit in the memory available
  now, a smaller batch at the max image size is checked, else a smaller image size at the max
  tokens and smallest batch, and the record says which (``reduced``: the dims used and why);
  only when none fits is max skipped (``skipped``) instead of the kernel's OOM killer ending
  the build.

A check of a narrower change can ask for less (``items``, ``points``): a refit that only wrote new
weights into a copy of an already validated engine (:func:`sd_accel.refit._patched`) can get the
weights wrong and nothing else, so one batch item at the opt shape checks it (see ``validate``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from sd_accel.device import available_memory
from sd_accel.onnx.attention import sdpa_attention
from sd_accel.onnx.export import fp32_on
from sd_accel.pages import trim_heap
from sd_accel.profiles import Profile

log = logging.getLogger("sd_accel")

TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2, "bf16": 5e-2, "int8": 0.1, "int8-dynamic": 0.1, "int4": 0.1}
# A decoder's check is also judged by the image the user sees (its ``images`` output mapped to
# 0..1 as diffusers' postprocess does), in PSNR against torch fp32 on the same latents. Relative
# error alone let through an int8 VAE decoder (3.7%, 42.6 dB on the captured final latents) that
# took a 20-step SD 1.5 image from 40.7 to 35.8 dB (scripts/BENCHMARKS.md, issue 31's rows). At
# 45 dB a decoder adds at most 1.4 dB of error to an image already 40 dB from fp32 (int8 UNets):
# errors add as mean squares, 10*log10(1 + 10**((40 - 45) / 10)) = 1.2 dB.
IMAGE_PSNR = {"int8": 45.0, "int8-dynamic": 45.0}
# An int8 UNet is judged by the image as well: per call it is 3-8% off on SD 1.5 (random weights),
# which says little about what many steps of it do to a picture. The last calibration prompt is
# generated again with the engine in place of the torch UNet (same seed, steps, guidance:
# ``calibration.replay``), both final latents decoded by the pipeline's VAE in torch fp32, and the
# pictures compared. Measured at 20 steps (scripts/BENCHMARKS.md): sd-accel's int8 UNets 38-41 dB,
# optimum-intel's hybrid int8 34.6-40.3 dB (what CPU users run as int8), bf16 48 dB. Below 35 dB
# the build tries the next int8 scope, then refuses int8 (build bf16).
UNET_IMAGE_PSNR = {"int8": 35.0, "int8-dynamic": 35.0}
# A step cache (``AccelConfig.step_cache``: later steps reuse the transformer's residual) is an
# approximation of the denoiser as int8 is, held to the same picture gate, against the uncached
# picture of the same request (``sd_accel.generate.check_step_cache``). Unlike an engine it is not
# checked at build time: it depends on the request (steps, size, prompt), and a check costs one
# uncached generation. Below it, the check turns the cache off and says so.
STEP_CACHE_PSNR = UNET_IMAGE_PSNR["int8"]
# A bf16 / fp16 (or int4, below) denoiser that misses its per-call tolerance by a little is judged
# by the picture instead: per call, random-weight UNets sit at the edge of bf16's gate (the LCM SD 1.5
# UNet at 5.26e-2 against 5e-2 on both CPU kinds measured, so the few-step recipe ran its UNet in
# torch), while the picture of bf16's rounding is 47-55 dB from fp32's. 40 dB keeps a margin
# below that and above what a wrong engine makes (the tiny LCM UNet with its sign flipped at the
# last steps' noise levels: 34.5 dB). Past the ceiling no picture is tried: that is not rounding.
# int4 weights (groups of 64, weights only: ``sd_accel.backends.openvino.quantize``) are judged the
# same way, at int8's picture gate: per call they are further off than int8 (their rounding is 16
# times coarser), which says little about a picture made over many steps; past 0.35 per call no
# picture is tried.
PICTURE_PSNR = {"bf16": 40.0, "fp16": 40.0, "int4": UNET_IMAGE_PSNR["int8"]}
PICTURE_CEILING = {"bf16": 0.1, "fp16": 0.06, "int4": 0.35}
# A component whose outputs only feed another one (a ControlNet's residuals feed the UNet) and
# misses the tolerance on those outputs is judged again by what it does to its consumer's output:
# the consumer in torch fp32 fed the engine's outputs vs fed torch's, against the same tolerance.
# Per residual, a bf16 ControlNet (SD 1.5 architecture, random weights, 512 px) is 6.1e-2 off at
# its deepest levels (0.4e-2 at the first), over the 5e-2 gate; the UNet it feeds moves by 1.3e-2,
# and 8 steps of it cost the image 0.1 dB against the fp32 ControlNet (48.93 vs 49.04 dB).
# Max-point memory estimate = the part of the opt point's growth that grows with the shape x size
# ratio x this, against what is available (max_point_need).
HEADROOM = 1.5
# A copy of a validated engine with new weights (``baseline``) may be this much further from torch
# on a batch item than the base engine was on the same item (see ``validate``).
BASELINE_SLACK = 0.1


@dataclass
class Validation:
    max_abs: float
    rel_l2: float
    points: list[str]
    ok: bool
    why: str = ""
    skipped: dict[str, str] = field(default_factory=dict)  # point -> why it was not checked
    # point -> each compared batch item's relative L2 error (its worst output): what a copy of this
    # engine with new weights is held to (validate's ``baseline``)
    item_rel: dict[str, list[float]] = field(default_factory=dict)
    # a decoder's worst image PSNR (dB) over the points checked, against torch fp32; an int8 UNet's
    # picture PSNR (``unet_image_psnr``); None: neither
    image_psnr: float | None = None
    # for a component judged by its consumer (``spec.consumer()``): the worst relative error of the
    # consumer's output fed this engine's outputs, where its own outputs missed the tolerance
    consumer_rel: float | None = None
    # point -> {"dims": the dims checked instead of the point's own, "why": the memory estimate};
    # the max point of a dynamic profile whose full shape would not fit in memory
    reduced: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _points(spec, profile: Profile) -> dict[str, dict[str, int]]:
    ranges = spec.dim_ranges(profile)
    pts = {"opt": {k: v[1] for k, v in ranges.items()}}
    if not profile.static:
        pts["max"] = {k: v[2] for k, v in ranges.items()}
    return pts


def reference(module: torch.nn.Module, feed: dict[str, torch.Tensor], items: int | None = None,
              start: int = 0, whole: frozenset[str] = frozenset()) -> tuple[torch.Tensor, ...]:
    """``module``'s outputs for ``feed``, computed one batch item at a time and concatenated: items
    ``start`` to the end, or to ``start + items`` when given. The inputs named in ``whole`` have no
    batch axis (FLUX.1's positions): every item gets them whole."""
    batch = next(iter(feed.values())).shape[0]
    parts = []
    for i in range(start, batch if items is None else min(start + items, batch)):
        out = module(*(v if k in whole else v[i : i + 1] for k, v in feed.items()))
        parts.append(out if isinstance(out, tuple) else (out,))
    return tuple(torch.cat(chunks) for chunks in zip(*parts, strict=True))


def _errors(names: list[str], got: dict, ref: tuple[torch.Tensor, ...]) -> tuple[float, float, list[float], str]:
    """(max abs, worst relative L2, each item's worst relative L2, the output with NaN/inf or "")
    of the first items of ``got`` against ``ref`` (as many items as it has)."""
    worst_abs, worst_rel, per_item = 0.0, 0.0, [0.0] * ref[0].shape[0]
    for name, r in zip(names, ref, strict=True):
        g = got[name][: r.shape[0]].to(r.device, torch.float32)
        if not torch.isfinite(g).all():
            return math.inf, math.inf, [], name
        diff = g - r.float()
        worst_abs = max(worst_abs, diff.abs().max().item())
        worst_rel = max(worst_rel, (diff.norm() / r.float().norm().clamp_min(1e-12)).item())
        for i in range(r.shape[0]):
            rel = (diff[i].norm() / r[i].float().norm().clamp_min(1e-12)).item()
            per_item[i] = max(per_item[i], rel)
    return worst_abs, worst_rel, per_item, ""


def consumer_error(spec, feed: dict[str, torch.Tensor], got: dict, ref: tuple[torch.Tensor, ...],
                   device: str = "cpu") -> float | None:
    """The relative L2 error of ``spec.consumer()``'s output (torch fp32, one batch item at a
    time) when fed the engine's outputs ``got`` instead of torch's ``ref``, its other inputs taken
    from ``feed`` by name; None when the spec has no consumer. Only the items ``ref`` has."""
    consumer = spec.consumer() if hasattr(spec, "consumer") else None
    if consumer is None:
        return None
    names = [t.name for t in spec.outputs()]
    items = ref[0].shape[0]
    ours = dict(zip(names, ref, strict=True))

    def fed(outputs: dict) -> dict[str, torch.Tensor]:
        return {t.name: (outputs[t.name] if t.name in outputs else feed[t.name])[:items].to(device, torch.float32)
                for t in consumer.inputs()}

    module = consumer.torch_module()
    with fp32_on(module, device), sdpa_attention(module):
        call = consumer.export_module()
        want = reference(call, fed(ours))
        have = reference(call, fed({n: torch.as_tensor(got[n]) for n in names}))
    return max(((h - w).norm() / w.norm().clamp_min(1e-12)).item() for h, w in zip(have, want, strict=True))


def image_psnr(got: torch.Tensor, ref: torch.Tensor) -> float:
    """PSNR (dB) between two decoded images in the VAE's -1..1 range, after the clamp to 0..1 that
    diffusers' image postprocessing applies: what the user's picture differs by."""
    a = (got.float() / 2 + 0.5).clamp(0, 1)
    b = (ref.float() / 2 + 0.5).clamp(0, 1)
    mse = torch.mean((a - b) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


# ---- memory: Linux's /proc (elsewhere the estimate is skipped and max always runs) ---------------


def unet_image_psnr(spec, runner, profile: Profile, memo: dict | None = None) -> float | None:
    """PSNR (dB) of the picture the pipeline makes with ``runner`` as its UNet (or SD3's / FLUX.1's
    transformer) against the one its torch module makes, on the last calibration prompt
    (:func:`sd_accel.calibration.replay`), both decoded by the pipeline's VAE in torch fp32.
    ``memo`` keeps the torch picture between the int8 scopes one build tries. None where ``spec``
    is not a diffusers pipeline's denoiser (the WebUI's and ComfyUI's have no pipeline to run)."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

    from sd_accel.calibration import feed_from_call, replay, run_settings
    from sd_accel.components.controlnet import controlnets_of

    pipe = getattr(spec, "pipe", None)
    module, vae = getattr(pipe, spec.name, None), getattr(pipe, "vae", None)
    # (a ControlNet pipeline's UNet calls carry residuals, which are another engine's: unet_control)
    if spec.name not in ("unet", "transformer") or module is None or vae is None or not callable(pipe) \
            or controlnets_of(pipe):
        return None
    memo = {} if memo is None else memo
    out_name = spec.outputs()[0].name
    output = UNet2DConditionOutput if spec.name == "unet" else Transformer2DModelOutput
    settings = run_settings(profile)

    def picture(latents: torch.Tensor) -> torch.Tensor:
        if latents.dim() == 3:  # FLUX.1's latents come back packed in 2x2 patches
            latents = type(pipe)._unpack_latents(latents, settings["height"], settings["width"],
                                                 pipe.vae_scale_factor)
        shift = float(vae.config.get("shift_factor") or 0.0)  # (SD3's and FLUX.1's VAEs have one)
        with fp32_on(vae), torch.no_grad():
            return vae.decode(latents.float() / vae.config.scaling_factor + shift).sample

    def on_engine(*args, **kwargs):
        feed = {k: torch.from_numpy(v) for k, v in feed_from_call(spec, args, kwargs).items()}
        like = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
        sample = runner.infer(feed)[out_name].to(like.dtype)
        return output(sample=sample) if kwargs.get("return_dict", True) else (sample,)

    if "torch" not in memo:
        memo["torch"] = picture(replay(pipe, profile))
    own = module.__dict__.get("forward")  # accelerate's hooks set one; put it back after
    module.forward = on_engine
    try:
        got = picture(replay(pipe, profile))
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
    return image_psnr(got, memo["torch"])


def _rss_bytes() -> int | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _PeakSampler:
    """The highest RSS seen while the block runs, sampled by a thread every few milliseconds.

    Sampling, not the kernel's peak counter: resetting that (``/proc/self/clear_refs``) would
    also hide earlier peaks from ``getrusage``, which benchmarks and tests read."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.start = _rss_bytes()
        self.peak = self.start
        self.end: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = _rss_bytes()
            if rss is not None and self.peak is not None:
                self.peak = max(self.peak, rss)

    def __enter__(self) -> _PeakSampler:
        if self.start is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        rss = _rss_bytes()
        self.end = rss
        if rss is not None and self.peak is not None:
            self.peak = max(self.peak, rss)

    @property
    def growth(self) -> int | None:
        return None if self.start is None or self.peak is None else max(0, self.peak - self.start)

    @property
    def kept(self) -> int | None:
        """What the block still held when it ended (RSS then less RSS before)."""
        return None if self.start is None or self.end is None else max(0, self.end - self.start)


def _judged_by_picture(spec, precision: str, rel: float) -> bool:
    """Whether a float denoiser's per-call miss of ``rel`` is left to its picture to judge."""
    ceiling = PICTURE_CEILING.get(precision)
    return ceiling is not None and spec.name in ("unet", "transformer") and rel <= ceiling \
        and callable(getattr(spec, "pipe", None))


def _float_picture(spec, runner, profile: Profile, precision: str, misses: list[str],
                   memo: dict | None) -> tuple[float | None, str]:
    """(picture PSNR, why refused or "") for a float denoiser that missed its per-call tolerance:
    the calibration prompt's picture made on ``runner`` against torch's (:func:`unet_image_psnr`)."""
    gate = PICTURE_PSNR[precision]
    psnr = unet_image_psnr(spec, runner, profile, memo)
    if psnr is None:  # (a ControlNet pipeline's UNet: its picture needs the net's residuals)
        return None, "; ".join(misses) + " (no picture to judge it by in this pipeline)"
    if psnr < gate:
        return psnr, (f"{'; '.join(misses)}, and the picture its pipeline makes on it is {psnr:.1f} dB from "
                      f"torch's (last calibration prompt), below {gate:.0f} dB for {precision}")
    log.info("validation of %s: %s, but the picture its pipeline makes on it is %.1f dB from torch's "
             "(at least %.0f dB for %s): accepted", spec.name, "; ".join(misses), psnr, gate, precision)
    return psnr, ""


def _elements(spec, dims: dict[str, int]) -> int:
    return sum(math.prod(shape) for shape in spec.shapes(dims).values())


def max_point_need(opt_growth: int, opt_kept: int | None, weights: int, ratio: float, per_shape: int = 0) -> int:
    """Bytes the max point is expected to take: the opt point's RSS growth less what it kept, up to
    ``weights`` (what the engine's first call loads once, as its runner says: it is held already
    and a bigger shape does not load it again), scaled by the max/opt size ratio, with
    :data:`HEADROOM`; plus ``per_shape`` (what a call at a new shape loads besides: OpenVINO's
    fixed shapes compile another copy of the weights).

    Kept memory past the weights (a runtime's pooled activations) is counted as growing with
    the shape; ``opt_kept`` None (not measured) scales the whole growth. Measured on SD 1.5's
    UNet, OpenVINO bf16, dynamic-512-768 (scripts/BENCHMARKS.md): the opt point grew 2.21 GiB
    and kept 2.08 GiB, 1.60 GiB of it the weights (engine.bin); estimate 7.5 GiB for the max
    (batch 8, 768 px, 154 tokens), which grew 3.36 GiB. The cap matters: a runtime keeps its
    activations' buffers too (3.06 GiB of those 3.36 stayed held), so counting all that the opt
    point kept as weights (an fp32-size cap of 3.2 GiB did) estimated 1.6 GiB.

    >>> GiB = 2**30
    >>> max_point_need(3 * GiB, 2 * GiB, 2 * GiB, 2.0) / GiB  # 1 GiB of activations, x2, x1.5
    3.0
    >>> max_point_need(3 * GiB, 2.5 * GiB, 2 * GiB, 2.0) / GiB  # the 0.5 GiB kept past the weights scales
    3.0
    >>> max_point_need(3 * GiB, 0, 2 * GiB, 2.0) / GiB  # nothing kept (weights loaded before): all scales
    9.0
    >>> max_point_need(3 * GiB, None, 2 * GiB, 2.0) / GiB
    9.0
    """
    fixed = 0 if opt_kept is None else min(max(0, int(opt_kept)), max(0, int(weights)), opt_growth)
    return int((opt_growth - fixed) * ratio * HEADROOM) + max(0, int(per_shape))


def _batch_keys(dims: dict[str, int]) -> list[str]:
    return [k for k in ("B", "B2") if k in dims]


def _shrunk(spec, profile: Profile, fraction: float) -> dict[str, int] | None:
    """The dims of an image ``fraction`` of the way from the opt size to the max (8 px steps), at
    the max tokens and the smallest batch; None where that is the opt shape."""
    def size(r) -> int:
        return max(r[0], (r[1] + int((r[2] - r[1]) * fraction)) // 8 * 8)

    height, width = size(profile.height), size(profile.width)
    if (height, width) == (profile.height[1], profile.width[1]) and profile.tokens[1] == profile.tokens[2]:
        return None
    text = None if profile.text is None else profile.text[2]
    try:
        point = Profile(batch=profile.batch[0], height=height, width=width, tokens=profile.tokens[2], text=text,
                        cfg=profile.cfg)
        dims = dict(_points(spec, point)["opt"])
    except Exception:  # (a spec that cannot take this size: no smaller point)
        return None
    ranges = spec.dim_ranges(profile)
    for key in _batch_keys(dims):
        dims[key] = ranges[key][0]
    return dims


def _max_plan(spec, profile: Profile, opt_dims: dict | None, max_dims: dict, opt_growth: int | None,
              opt_kept: int | None, weights: int, per_shape: int = 0) -> tuple[dict | None, str]:
    """(the dims to check the max point at, why they are not the max shape's ("" when they are));
    (None, why) when nothing fits in the memory available now. Unjudged (no /proc): the max shape.

    Tried in turn: the max shape; the max image size at smaller batches (halved down to the
    profile's smallest); images 3/4, 1/2 and 1/4 of the way from the opt size to the max, at the
    max tokens and the smallest batch."""
    free = available_memory()
    if opt_growth is None or free is None:
        return max_dims, ""
    base = max(1, _elements(spec, opt_dims))

    def need(dims: dict) -> tuple[int, float]:
        ratio = _elements(spec, dims) / base
        return max_point_need(opt_growth, opt_kept, weights, ratio, per_shape), ratio

    full, ratio = need(max_dims)
    why = (f"estimated {full / 2**30:.1f} GiB for the max shape (the opt shape took {opt_growth / 2**30:.2f} GiB, "
           f"{min(opt_kept or 0, weights, opt_growth) / 2**30:.2f} GiB of it held after it (weights), the rest "
           f"x{ratio:.1f} the size), {free / 2**30:.1f} GiB available")
    if full <= free:
        log.info("validation of %s at the max shape: %s", spec.name, why)
        return max_dims, ""
    candidates = []
    keys = _batch_keys(max_dims)
    if keys:
        ranges = spec.dim_ranges(profile)
        batch, least = max_dims[keys[0]], max(ranges[k][0] for k in keys)
        while batch > least:
            batch = max(least, batch // 2)
            candidates.append({**max_dims, **{k: batch for k in keys}})
    for fraction in (0.75, 0.5, 0.25):
        dims = _shrunk(spec, profile, fraction)
        if dims is not None and dims != opt_dims:
            candidates.append(dims)
    for dims in candidates:
        got, _ = need(dims)
        if got <= free:
            return dims, f"{why}; checked at {dims} instead (estimated {got / 2**30:.1f} GiB)"
    return None, why


def validate(
    spec, runner, profile: Profile, precision: str, device: str = "cpu", feeds: list[dict] | None = None,
    items: int | None = None, points: tuple[str, ...] | None = None, baseline: dict | None = None,
    memo: dict | None = None,
) -> Validation:
    """Run engine and torch on the same sample feeds (at opt, and at max for dynamic profiles), or
    on ``feeds``: real inputs (INT8 engines are checked on captured inputs held out of calibration).

    ``items``: compare only the first ``items`` batch items of each output (the engine still runs
    its full batch; torch computes only those items); when they are off by more than the
    tolerance, the rest are computed too and the verdict is the whole batch's, as for a new
    engine (one item's precision error can exceed a tolerance set for a batch). ``points``: check only these of the profile's
    points (``"opt"``, ``"max"``). Both are for checks of what cannot differ between batch items
    or shapes: a new engine, or a refit that builds one, is checked in full (its graph, shapes and
    kernels are new); a copy of a validated engine with only its weights rewritten (the fast refit)
    can only have wrong weights, and a weight is the same for every batch item (the UNet, text
    encoder and VAE compute each item on its own) and every shape, so one item at the opt shape
    sees a wrong or unread weight as surely as the full batch at every point, at a fraction of the
    cost (the torch fp32 reference is most of it: one item of SD 1.5's UNet at 512 px is ~5 s on
    2 cores, and the engine runs batch 2 for guidance).

    ``baseline``: with ``items``, the validation record (:meth:`Validation.to_dict`) of the
    engine that this one copies with new weights; an item is also within bounds when it is no
    more than :data:`BASELINE_SLACK` further from torch than the base engine's same item was on
    the same feed. The base engine's precision error on one item can exceed the tolerance its
    batch met (SD 1.5 with random weights in bf16: item 0 at 5.6e-2 where the batch is at 4.2e-2,
    against 5e-2); new weights leave that error about as it was, a wrong weight adds its own to
    it. As strict as judging the batch: there, the room for a wrong weight's error is
    sqrt(5e-2^2 - 4.2e-2^2) = 2.8e-2; here sqrt(1.1^2 - 1) x 5.6e-2 = 2.6e-2.

    An int8 UNet checked on captured ``feeds`` that passes is also judged by the picture its
    pipeline makes (:func:`unet_image_psnr`, :data:`UNET_IMAGE_PSNR`); ``memo`` keeps the torch
    picture for the next scope's check. A bf16 / fp16 UNet or transformer of a diffusers pipeline
    that misses its per-call tolerance, but by no more than :data:`PICTURE_CEILING`, is
    judged by that picture instead (:data:`PICTURE_PSNR`): accepted when the picture is close
    to torch's, refused (both reasons given) when it is not."""
    if items is not None and items < 1:
        raise ValueError(f"items must be at least 1 (or None: every batch item), not {items}")
    worst_abs, worst_rel = 0.0, 0.0
    tol = TOLERANCE.get(precision, 1e-3)
    names = [t.name for t in spec.outputs()]
    wanted = points
    points: dict[str, dict | None] = dict(_points(spec, profile))
    if wanted is not None:
        points = {label: dims for label, dims in points.items() if label in wanted}
        if not points:
            raise ValueError(f"none of the points {wanted} is a point of {profile.tag} ({list(_points(spec, profile))})")
    if feeds is not None:
        points = {f"holdout{i}": None for i in range(len(feeds))}
    checked: list[str] = []
    skipped: dict[str, str] = {}
    item_rel: dict[str, list[float]] = {}
    refused: list[str] = []
    opt_growth: int | None = None
    opt_kept: int | None = None
    reduced: dict[str, dict] = {}
    worst_psnr: float | None = None
    worst_consumer: float | None = None
    by_picture: list[str] = []  # per-call misses a float denoiser's picture decides (PICTURE_PSNR)
    psnr_gate = IMAGE_PSNR.get(precision) if "images" in names else None
    seeds = {label: i for i, label in enumerate(_points(spec, profile))}
    module = spec.torch_module()
    with fp32_on(module, device), sdpa_attention(module), torch.no_grad():
        ref_module = spec.export_module()
        # what the engine's first call loads once, whatever the shape (its weights, where the runner
        # says: OpenVINO's copies engine.bin's), and what a call at a new shape loads besides
        weights, per_shape = int(getattr(runner, "once_bytes", 0) or 0), int(getattr(runner, "per_shape_bytes", 0) or 0)
        for i, (label, dims) in enumerate(points.items()):
            if label == "max" and device == "cpu":
                dims, why = _max_plan(spec, profile, points.get("opt"), dims, opt_growth, opt_kept, weights, per_shape)
                if dims is None:
                    log.warning("validation of %s at the max shape skipped: %s", spec.name, why)
                    skipped[label] = why
                    continue
                if why:
                    log.warning("validation of %s at the max shape reduced: %s", spec.name, why)
                    reduced[label] = {"dims": dict(dims), "why": why}
            feed = spec.sample_feed(dims, seed=seeds.get(label, i), device=device) if feeds is None else {
                k: v.to(device) for k, v in feeds[i].items()
            }
            trim_heap()  # freed heap glibc keeps would hide what the point allocates from RSS
            with _PeakSampler() as sampler:
                got = runner.infer(feed)
                ref = reference(ref_module, feed, items, whole=spec.unbatched())
            if label == "opt":
                opt_growth, opt_kept = sampler.growth, sampler.kept
            if sampler.growth is not None and label in ("opt", "max"):
                log.info("validation of %s at %s: RSS grew %.2f GiB while it ran (%.2f GiB still held after)",
                         spec.name, label, sampler.growth / 2**30, (sampler.kept or 0) / 2**30)
            checked.append(label)
            err_abs, err_rel, per_item, bad = _errors(names, got, ref)
            base = ((baseline or {}).get("item_rel") or {}).get(label) or []
            within = err_rel <= tol or (items is not None and len(base) >= len(per_item) and all(
                rel <= max(tol, b * (1 + BASELINE_SLACK)) for rel, b in zip(per_item, base, strict=False)))
            if not bad and not within and items is not None and len(per_item) < next(iter(feed.values())).shape[0]:
                # The engine's own precision error differs between batch items, and the tolerance
                # is set for (and new engines are judged on) the whole batch: SD 1.5 (random
                # weights) in bf16 at 512 px is 4.2e-2 over its batch of 2 and 5.7e-2 on item 0
                # alone, against 5e-2. Before refusing, judge on every item, as a new engine is.
                log.info("validation of %s: batch item(s) %s at %s off by %s (tolerance %.0e, base engine %s); "
                         "judging on the whole batch", spec.name, list(range(len(per_item))), label,
                         [f"{x:.2e}" for x in per_item], tol, base or "not recorded")
                rest = reference(ref_module, feed, start=len(per_item), whole=spec.unbatched())
                ref = tuple(torch.cat(pair) for pair in zip(ref, rest, strict=True))
                err_abs, err_rel, per_item, bad = _errors(names, got, ref)
                within = err_rel <= tol
            if bad:
                return Validation(math.inf, math.inf, checked, False, f"{bad} has NaN/inf at {label}", skipped,
                                  reduced=reduced)
            downstream = None
            if not within:
                downstream = consumer_error(spec, feed, got, ref, device)
                if downstream is not None:
                    log.info("validation of %s at %s: its outputs are %.2e off (tolerance %.0e); the %s they "
                             "feed is %.2e off", spec.name, label, err_rel, tol, spec.consumer().name, downstream)
                    worst_consumer = downstream if worst_consumer is None else max(worst_consumer, downstream)
                    within = downstream <= tol
                    if not within:
                        refused.append(f"the {spec.consumer().name} it feeds is {downstream:.2e} off at {label}, "
                                       f"over {tol:.0e} for {precision} (its own outputs {err_rel:.2e})")
            item_rel[label] = [round(x, 6) for x in per_item]
            if items is not None:
                log.info("validation of %s at %s: %s batch item(s) checked, relative error %s (tolerance %.0e, "
                         "base engine %s)", spec.name, label, len(per_item), [f"{x:.2e}" for x in per_item], tol,
                         base or "not recorded")
            if not within and downstream is None:
                miss = f"relative error {err_rel:.2e} at {label} exceeds {tol:.0e} for {precision}"
                if items is None and feeds is None and _judged_by_picture(spec, precision, err_rel):
                    by_picture.append(miss)
                else:
                    refused.append(miss)
            if "images" in names:
                r = ref[names.index("images")]
                psnr = image_psnr(got["images"][: r.shape[0]], r)
                worst_psnr = psnr if worst_psnr is None else min(worst_psnr, psnr)
                if psnr_gate is not None and psnr < psnr_gate:
                    refused.append(f"image PSNR {psnr:.1f} dB at {label} is below {psnr_gate:.0f} dB for {precision}")
            worst_abs, worst_rel = max(worst_abs, err_abs), max(worst_rel, err_rel)
            del got, ref, feed
    if by_picture and not refused:
        worst_psnr, why = _float_picture(spec, runner, profile, precision, by_picture, memo)
        if why:
            refused.append(why)
    elif by_picture:
        refused.extend(by_picture)
    unet_gate = UNET_IMAGE_PSNR.get(precision) if feeds is not None and items is None else None
    if unet_gate is not None and not refused:
        psnr = unet_image_psnr(spec, runner, profile, memo)
        if psnr is not None:
            log.info("validation of %s: the calibration prompt's picture on the engine is %.1f dB from torch's",
                     spec.name, psnr)
            worst_psnr = psnr
            if psnr < unet_gate:
                refused.append(f"the picture its pipeline makes on it is {psnr:.1f} dB from torch's (last "
                               f"calibration prompt), below {unet_gate:.0f} dB for {precision}")
    ok = not refused
    why = "; ".join(refused)
    return Validation(worst_abs, worst_rel, checked, ok, why, skipped, item_rel,
                      None if worst_psnr is None else round(worst_psnr, 2),
                      None if worst_consumer is None else round(worst_consumer, 6), reduced)
