"""Check a freshly built engine against torch before it is trusted (dynamic engines far from
their opt shapes have produced NaN in the field)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from sd_accel.onnx.export import fp32_on
from sd_accel.profiles import Profile

TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2, "bf16": 5e-2, "int8": 0.1, "int8-dynamic": 0.1}


@dataclass
class Validation:
    max_abs: float
    rel_l2: float
    points: list[str]
    ok: bool
    why: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _points(spec, profile: Profile) -> dict[str, dict[str, int]]:
    ranges = spec.dim_ranges(profile)
    pts = {"opt": {k: v[1] for k, v in ranges.items()}}
    if not profile.static:
        pts["max"] = {k: v[2] for k, v in ranges.items()}
    return pts


def validate(
    spec, runner, profile: Profile, precision: str, device: str = "cpu", feeds: list[dict] | None = None
) -> Validation:
    """Run engine and torch on the same sample feeds (at opt, and at max for dynamic profiles), or
    on ``feeds``: real inputs (INT8 engines are checked on captured inputs held out of calibration)."""
    worst_abs, worst_rel = 0.0, 0.0
    tol = TOLERANCE.get(precision, 1e-3)
    names = [t.name for t in spec.outputs()]
    points = _points(spec, profile)
    if feeds is not None:
        points = {f"holdout{i}": None for i in range(len(feeds))}
    with fp32_on(spec.torch_module(), device), torch.no_grad():
        ref_module = spec.export_module()
        for i, dims in enumerate(points.values()):
            feed = spec.sample_feed(dims, seed=i, device=device) if feeds is None else {
                k: v.to(device) for k, v in feeds[i].items()
            }
            ref = ref_module(*feed.values())
            ref = ref if isinstance(ref, tuple) else (ref,)
            got = runner.infer(feed)
            for name, r in zip(names, ref, strict=True):
                g = got[name].to(r.device, torch.float32)
                if not torch.isfinite(g).all():
                    return Validation(math.inf, math.inf, list(points), False, f"{name} has NaN/inf")
                diff = (g - r.float())
                worst_abs = max(worst_abs, diff.abs().max().item())
                worst_rel = max(worst_rel, (diff.norm() / r.float().norm().clamp_min(1e-12)).item())
    ok = worst_rel <= tol
    why = "" if ok else f"relative error {worst_rel:.2e} exceeds {tol:.0e} for {precision}"
    return Validation(worst_abs, worst_rel, list(points), ok, why)
