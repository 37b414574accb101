"""The first-block step cache (issue 44, part 4) on a scaled FLUX.1 dev transformer engine: the same
28-step generation without and with the cache, its speed-up, the picture's PSNR against the
uncached one, and how many calls were cached at each threshold. **Random weights** (a slice of
FLUX.1 dev at its real width, :func:`bench_segments.prepare`): how much the first block's residual
moves between steps is not a trained model's, so the fraction cached says little about real
checkpoints; the timings say what a cached step costs against a full one.

    python scripts/bench_step_cache.py prepare DIR [--double 1] [--single 3] [--heads 24]
    python scripts/bench_step_cache.py run DIR ENGINES [--size 256] [--text 128] [--steps 28]
        [--thresholds 0.05,0.12,0.25] [--backend onnxruntime] [--precision fp32]

``run`` builds the transformer cut for the cache (``build_engines(..., step_cache=True)``) once,
then generates with the same seed and random text embeddings (the transformer's real widths: T5
4096, CLIP 768; the tiny text encoders are not run) with ``step_cache=None`` and each threshold on
the same engine. It prints one ``RESULT {json}`` line per run and one ``SEGMENTS {json}`` line with
the seconds of each segment of one full call (what a cached step still runs: the first and the
last), from which the speed-up of the whole FLUX.1 (19 double + 38 single blocks) is estimated.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

REAL_DOUBLE, REAL_SINGLE = 19, 38  # FLUX.1's blocks


def _embeddings(text: int, seed: int = 0):
    import torch

    g = torch.Generator("cpu").manual_seed(seed)
    return torch.randn(1, text, 4096, generator=g), torch.randn(1, 768, generator=g)


def run(folder: Path, engines: Path, size: int, text: int, steps: int, thresholds: list[float], backend: str,
        precision: str) -> None:
    import numpy as np
    import torch

    from sd_accel import accelerate, build_engines, load_pipeline, stats
    from sd_accel.profiles import Profile
    from sd_accel.runtime.swap import set_step_cache

    pipe = load_pipeline(str(folder), torch_dtype=torch.float32)
    params = sum(p.numel() for p in pipe.transformer.parameters())
    start = time.perf_counter()
    (record,) = build_engines(pipe, profiles=[Profile(batch=1, height=size, width=size, text=text)], backend=backend,
                              precision=precision, components=["transformer"], engine_dir=str(engines),
                              progress=False, step_cache=True)
    build_s = time.perf_counter() - start
    print("BUILD " + json.dumps({"seconds": round(build_s, 1), "layout": record.key.layout, "params": params,
                                 "rel_l2": record.validation and record.validation["rel_l2"]}), flush=True)
    pipe = accelerate(pipe, engines=True, engine_dir=str(engines), backend=backend, precision="fp32")
    embeds, pooled = _embeddings(text)
    call = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled, height=size, width=size, guidance_scale=3.5,
                max_sequence_length=text, output_type="latent")

    def generate(threshold: float | None, n: int = steps) -> tuple[np.ndarray, torch.Tensor, float, dict]:
        set_step_cache(pipe, threshold)
        t0 = time.perf_counter()
        latents = pipe(generator=torch.Generator("cpu").manual_seed(0), num_inference_steps=n, **call).images
        seconds = time.perf_counter() - t0  # (the denoising loop: the tiny VAE's decode is not timed)
        return _decode(pipe, latents, size), latents, seconds, stats(pipe)["transformer"].get("step_cache", {})

    generate(None, 2)  # load the segment engines (their sessions) before timing
    segs = _segment_seconds(pipe, embeds, pooled, size, text)
    print("SEGMENTS " + json.dumps(segs), flush=True)
    full, full_latents, full_s, _ = generate(None)
    print("RESULT " + json.dumps({"threshold": None, "seconds": round(full_s, 2), "s_per_step": round(full_s / steps, 3)}),
          flush=True)
    for threshold in thresholds:
        images, latents, seconds, counts = generate(threshold)
        mse = float(np.mean((images.astype(np.float64) - full.astype(np.float64)) ** 2))
        psnr = float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)
        rel = float((latents - full_latents).norm() / full_latents.norm())
        print("RESULT " + json.dumps({"threshold": threshold, "seconds": round(seconds, 2),
                                      "speedup": round(full_s / seconds, 3), "psnr_db": round(psnr, 2),
                                      "latent_rel_l2": round(rel, 5),
                                      "cached": counts.get("cached"), "calls": counts.get("calls"),
                                      "changes": pipe.transformer.step_cache.changes}), flush=True)


def _decode(pipe, latents, size: int):
    """The pictures of FLUX.1's packed latents, as the pipeline makes them (0..1, numpy)."""
    import torch

    vae = pipe.vae
    unpacked = type(pipe)._unpack_latents(latents, size, size, pipe.vae_scale_factor)
    with torch.no_grad():
        image = vae.decode(unpacked / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="np")


def _segment_seconds(pipe, embeds, pooled, size: int, text: int) -> dict:
    """Seconds of each segment of one full call of the cut engine (mean of 3), and the estimate for
    the whole FLUX.1: a cached step runs the first and last segment only."""

    from sd_accel.components import specs_for
    from sd_accel.runtime.swap import torch_modules

    with torch_modules(pipe):
        spec = specs_for(pipe)["transformer"]
        dims = {k: v[1] for k, v in spec.dim_ranges(_profile(size, text)).items()}
        feed = spec.sample_feed(dims, seed=1)
    engines = pipe.transformer.engines["transformer"]
    runner = next(h for h in engines.handles if h.record.key.layout.startswith("fbc")).get_runner()
    n = len(runner.links)
    times = [0.0] * n
    for _ in range(3):
        state = dict(feed)
        for k in range(n):
            t0 = time.perf_counter()
            state = runner.run_links(state, k, k + 1)
            times[k] += (time.perf_counter() - t0) / 3
    module = pipe.transformer.torch_module
    double, single = len(module.transformer_blocks), len(module.single_transformer_blocks)
    per_block = times[1:-1]
    first, last = times[0], times[-1]

    def count(block) -> int:
        return sum(p.numel() for p in block.parameters())

    # the whole FLUX.1: the middle's seconds scaled by its parameters (18 double + 38 single blocks)
    dp, sp = count(module.transformer_blocks[0]), count(module.single_transformer_blocks[0])
    middle_real = sum(per_block) * ((REAL_DOUBLE - 1) * dp + REAL_SINGLE * sp) / ((double - 1) * dp + single * sp)
    return {"first_s": round(first, 3), "middle_s": [round(t, 3) for t in per_block], "last_s": round(last, 3),
            "blocks": {"double": double, "single": single},
            "cached_over_full": round((first + last) / sum(times), 3),
            "real_flux_cached_over_full_est": round((first + last) / (first + middle_real + last), 4)}


def _profile(size: int, text: int):
    from sd_accel.profiles import Profile

    return Profile(batch=1, height=size, width=size, text=text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("folder", type=Path)
    p.add_argument("--double", type=int, default=1)
    p.add_argument("--single", type=int, default=3)
    p.add_argument("--heads", type=int, default=None, help="fewer heads than the real 24: a narrower model")
    r = sub.add_parser("run")
    r.add_argument("folder", type=Path)
    r.add_argument("engines", type=Path)
    r.add_argument("--size", type=int, default=256)
    r.add_argument("--text", type=int, default=128)
    r.add_argument("--steps", type=int, default=28)
    r.add_argument("--thresholds", default="0.05,0.12,0.25")
    r.add_argument("--backend", default="onnxruntime")
    r.add_argument("--precision", default="fp32")
    args = ap.parse_args()
    if args.cmd == "prepare":
        from bench_segments import prepare

        prepare(args.folder, args.double, args.single, args.heads)
    else:
        run(args.folder, args.engines, args.size, args.text, args.steps,
            [float(t) for t in args.thresholds.split(",") if t], args.backend, args.precision)


if __name__ == "__main__":
    main()
