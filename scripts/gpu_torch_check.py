"""Torch-level acceleration on a CUDA GPU, side by side with plain diffusers, in one run.

Builds the real SD 1.5 architecture (its shipped configs, random weights: the timings are real,
the images are noise) and measures, at the same seed, prompt and size, per section:

``txt2img``: (a) plain diffusers, fp32, its default attention (SDPA): what a user has today;
  (b) sd-accel accelerate(precision="fp16", attention="auto"); (c) sd-accel accelerate(precision="bf16");
  plus the medvram / lowvram offload modes (peak VRAM) and the fp16 VAE NaN guard.
``controlnet``: the same three rows on a ControlNet pipeline (``with_controlnets``): one ControlNet of
  the shipped SD 1.5 ControlNet config, random weights, its zero convolutions given small random
  weights so its residuals are not zero (as ``tiny_controlnet`` does), a random control image.
``lcm``: the few-step recipe: an LCM-distilled UNet (``time_cond_proj_dim`` 256, the LCM scheduler),
  TAESD (``AutoencoderTiny``, ``builtin:taesd``'s random weights) decoding, 4 steps, guidance 8
  embedded (one UNet row per image, no CFG). Plain diffusers decodes with the same TAESD set as
  ``pipe.vae``; sd-accel swaps it in with ``AccelConfig(vae="tiny:builtin:taesd")``.

Each row: s/image (best of ``--repeats`` after one warm-up), it/s, peak VRAM, whether the image is
finite, its max abs difference to the plain fp32 image, the speed-up over plain fp32. A section that
fails is recorded with its traceback and the others still run. Writes a JSON report (after each
section) and prints a table.
Run: python scripts/gpu_torch_check.py --out report.json [--sections txt2img,controlnet,lcm]
CPU self-check (tiny models): python scripts/gpu_torch_check.py --tiny --steps 2 --size 64 --repeats 1
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time
import traceback

import numpy as np
import torch

SECTIONS = ("txt2img", "controlnet", "lcm")
PROMPT = "a photo of a cat"
# the few-step recipe's changes to the SD 1.5 configs (scripts/bench.py RECIPES["lcm"], builtin:tiny-sd15-lcm)
LCM_UNET = {"time_cond_proj_dim": 256}
LCM_SCHEDULER = {"timestep_spacing": "leading", "original_inference_steps": 50}
LCM_GUIDANCE = 8.0
TAESD = "builtin:taesd"

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def build(family: str, tiny: bool):
    from sd_accel.models.builtin import build_tiny_pipeline
    from sd_accel.models.components import random_pipeline
    from sd_accel.models.families import FAMILIES, load_family_configs

    if tiny:
        return build_tiny_pipeline(family)
    return random_pipeline(load_family_configs(FAMILIES[family]), seed=0)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def free() -> None:
    """Drop what the last row left, so the next row's peak VRAM is its own."""
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def run(pipe, steps: int, size: int, repeats: int, **call) -> dict:
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)

    def once():
        g = torch.Generator("cpu").manual_seed(0)
        sync()
        t = time.perf_counter()
        out = pipe(PROMPT, num_inference_steps=steps, height=size, width=size, generator=g,
                   output_type="np", **call).images
        sync()
        return time.perf_counter() - t, out

    once()  # warm-up: cuDNN/cuBLAS autotuning, allocator growth
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    times, out = [], None
    for _ in range(repeats):
        dt, out = once()
        times.append(dt)
    best = min(times)
    return {
        "s_per_image": round(best, 4),
        "it_per_s": round(steps / best, 2),
        "peak_vram_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if CUDA else None,
        "finite": bool(np.isfinite(out).all()),
        "image": out,
    }


def fresh(base):
    return type(base)(**{k: copy.deepcopy(v) for k, v in base.components.items()})


def compare(pipe_factory, prefix: str, runs: dict, steps: int, size: int, repeats: int, **call) -> None:
    """Rows a (plain diffusers fp32), b (sd-accel fp16), c (sd-accel bf16) of one pipeline kind.
    ``pipe_factory(accel)``: a fresh pipeline; ``accel`` None for plain diffusers, else the
    ``accelerate`` keywords (the factory applies them, since some pipelines need more)."""
    plain = pipe_factory(None)
    a = f"{prefix}a_plain_fp32"
    runs[a] = run(plain, steps, size, repeats, **call)
    runs[a]["steps"] = steps
    ref = runs[a].pop("image")
    print(a, json.dumps(runs[a]), flush=True)
    del plain
    free()

    for label, precision in ((f"{prefix}b_sdaccel_fp16", "fp16"), (f"{prefix}c_sdaccel_bf16", "bf16")):
        pipe = pipe_factory(dict(precision=precision, attention="auto"))
        r = run(pipe, steps, size, repeats, **call)
        r["steps"] = steps
        img = r.pop("image")
        r["attention"] = pipe.sd_accel.attention
        r["vae_dtype"] = pipe.sd_accel.vae_dtype
        r["vae_class"] = type(pipe.vae).__name__
        net = getattr(pipe, "controlnet", None)
        if net is not None:
            r["controlnet_dtype"] = str(net.dtype).replace("torch.", "")
            procs = {type(p).__name__ for p in net.attn_processors.values()}
            r["controlnet_attn_processors"] = sorted(procs)
        r["speedup_vs_a"] = round(runs[a]["s_per_image"] / r["s_per_image"], 2)
        r["image_max_abs_diff_vs_a"] = round(float(np.abs(img - ref).max()), 4)
        r["image_mean_abs_diff_vs_a"] = round(float(np.abs(img - ref).mean()), 4)
        runs[label] = r
        print(label, json.dumps(r), flush=True)
        del pipe
        free()


# ---- sections ------------------------------------------------------------------------------


def section_txt2img(base, args, runs: dict) -> None:
    from sd_accel import accelerate

    def factory(accel):
        return fresh(base).to(DEVICE) if accel is None else accelerate(fresh(base), **accel)

    compare(factory, "", runs, args.steps, args.size, args.repeats)

    for mode in ("medvram", "lowvram"):
        pipe = accelerate(fresh(base), precision="fp16", offload=mode)
        r = run(pipe, min(args.steps, 5), args.size, 1)
        r.pop("image")
        r["steps"] = min(args.steps, 5)
        r["offload_active"] = pipe.sd_accel.offload_active
        runs[f"d_fp16_{mode}"] = r
        print(mode, json.dumps(r), flush=True)
        del pipe
        free()

    # The fp16 VAE guard on CUDA: a decode that overflows to NaN is redone in fp32.
    pipe = accelerate(fresh(base), precision="fp16" if CUDA else "bf16")
    hook = pipe.vae.decoder.conv_out.register_forward_hook(
        lambda m, i, o: o * float("nan") if o.dtype != torch.float32 else o
    )
    r = run(pipe, 2, args.size, 1)
    hook.remove()
    runs["e_nan_guard"] = {"finite": r["finite"], "redecodes": pipe.vae._sd_accel_guard.redecodes}
    print("nan guard", json.dumps(runs["e_nan_guard"]), flush=True)
    del pipe
    free()


def random_controlnet(base, tiny: bool, seed: int = 0) -> torch.nn.Module:
    """One ControlNet fitting ``base``'s UNet: the tiny test net, or the shipped SD 1.5 config
    (``configs/controlnet-sd15``) with random weights; either way its zero convolutions get small
    random weights (as ``tiny_controlnet``), so its residuals change the image."""
    if tiny:
        from sd_accel.models.tiny_controlnet import tiny_controlnet

        return tiny_controlnet(base.unet, seed=seed)
    from diffusers import ControlNetModel

    from sd_accel.models.families import CONFIG_ROOT

    torch.manual_seed(seed)
    net = ControlNetModel.from_config(ControlNetModel.load_config(str(CONFIG_ROOT / "controlnet-sd15")))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        zero_convs = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]
        for conv in zero_convs:
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * 0.2 / conv.weight[0].numel() ** 0.5)
    return net.eval()


def section_controlnet(base, args, runs: dict) -> None:
    from sd_accel import accelerate, with_controlnets

    t = time.perf_counter()
    net = random_controlnet(base, args.tiny)
    runs["cn_build_s"] = round(time.perf_counter() - t, 1)
    hint = torch.rand(1, 3, args.size, args.size, generator=torch.Generator().manual_seed(3))

    def factory(accel):
        pipe = with_controlnets(fresh(base), [copy.deepcopy(net)])
        return pipe.to(DEVICE) if accel is None else accelerate(pipe, **accel)

    compare(factory, "cn_", runs, args.steps, args.size, args.repeats, image=hint)


def own(config) -> dict:
    """A diffusers config without its bookkeeping keys (``_use_default_values`` would drop a key
    set here that the original left at its default)."""
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}


def section_lcm(base, args, runs: dict) -> None:
    from diffusers import LatentConsistencyModelPipeline, LCMScheduler, UNet2DConditionModel

    from sd_accel import accelerate
    from sd_accel.models.taesd import load_tiny_vae

    t = time.perf_counter()
    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config({**own(base.unet.config), **LCM_UNET}).eval()
    scheduler_config = {**own(base.scheduler.config), **LCM_SCHEDULER}
    taesd = load_tiny_vae(TAESD)
    runs["lcm_build_s"] = round(time.perf_counter() - t, 1)

    def factory(accel):
        pipe = LatentConsistencyModelPipeline(
            vae=copy.deepcopy(taesd if accel is None else base.vae),  # sd-accel: the model's VAE, swapped
            text_encoder=copy.deepcopy(base.text_encoder), tokenizer=base.tokenizer, unet=copy.deepcopy(unet),
            scheduler=LCMScheduler.from_config(scheduler_config), safety_checker=None, feature_extractor=None,
            requires_safety_checker=False)
        return pipe.to(DEVICE) if accel is None else accelerate(pipe, vae=f"tiny:{TAESD}", **accel)

    compare(factory, "lcm_", runs, args.lcm_steps, args.size, args.repeats, guidance_scale=LCM_GUIDANCE)


# ---- report --------------------------------------------------------------------------------


def table(runs: dict) -> str:
    rows = ["| row | steps | s/image | it/s | speed-up | peak VRAM GB | finite | max abs diff | mean abs diff |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        if not isinstance(r, dict) or "s_per_image" not in r:
            continue
        rows.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            name, r.get("steps", ""), r["s_per_image"], r["it_per_s"], r.get("speedup_vs_a", ""),
            r["peak_vram_gb"], r["finite"], r.get("image_max_abs_diff_vs_a", ""), r.get("image_mean_abs_diff_vs_a", "")))
    return "\n".join(rows)


def main() -> None:
    from sd_accel.device import describe, versions

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_report.json")
    ap.add_argument("--steps", type=int, default=20, help="txt2img and ControlNet steps")
    ap.add_argument("--lcm-steps", type=int, default=4, help="steps of the few-step (LCM) section")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--tiny", action="store_true", help="tiny model: a quick check that the script runs")
    args = ap.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {', '.join(unknown)}; use {', '.join(SECTIONS)}")
    report: dict = {"device": describe().__dict__, "versions": versions(), "args": vars(args), "runs": {},
                    "section_s": {}, "errors": {}}
    print(json.dumps(report["device"]), json.dumps(report["versions"]), flush=True)

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    t = time.perf_counter()
    base = build("sd15", args.tiny)
    base.set_progress_bar_config(disable=True)
    report["build_model_s"] = round(time.perf_counter() - t, 1)
    print("built sd15 in", report["build_model_s"], "s", flush=True)

    funcs = {"txt2img": section_txt2img, "controlnet": section_controlnet, "lcm": section_lcm}
    for name in sections:
        t = time.perf_counter()
        try:
            funcs[name](base, args, report["runs"])
        except Exception:  # record it; the other sections still run
            report["errors"][name] = traceback.format_exc()
            print(f"section {name} FAILED:\n{report['errors'][name]}", flush=True)
        free()
        report["section_s"][name] = round(time.perf_counter() - t, 1)
        print(f"section {name}: {report['section_s'][name]} s", flush=True)
        save()

    report["table"] = table(report["runs"])
    save()
    print(json.dumps(report, indent=2))
    print(report["table"])
    if report["errors"]:
        raise SystemExit(f"failed sections: {', '.join(report['errors'])}")


if __name__ == "__main__":
    main()
