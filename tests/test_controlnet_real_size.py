"""ControlNet at the size people run it (issue 28): the tiny SD 1.5 with one tiny ControlNet at
512x512, a 512 px control image, on ONNX Runtime engines built with the defaults (``engines="auto"``:
the ControlNet and the residual-taking UNet, static at the call's shape), each step in its own
process, its peak RSS (VmHWM) held to the plain UNet's bound at that size. Never a timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

# The plain tiny SD 1.5's bound at 512 px (test_engines_real_sizes.BOUNDS_GB) and the headroom over
# torch that test_lcm_real_size allows; the tiny ControlNet's own weights are a few MB.
BOUND_GB = 2.0
OVER_TORCH_GB = 0.3

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    from diffusers import StableDiffusionControlNetPipeline
    from sd_accel import AccelConfig, accelerate, stats
    from sd_accel.models.builtin import build_tiny_pipeline
    from sd_accel.models.tiny_controlnet import tiny_controlnet
    from sd_accel.runtime.swap import set_build_progress

    mode, engine_dir = sys.argv[1], sys.argv[2]
    base = build_tiny_pipeline("sd15")
    parts = {k: v for k, v in base.components.items() if k not in ("safety_checker", "feature_extractor",
                                                                     "image_encoder")}
    pipe = StableDiffusionControlNetPipeline(**parts, controlnet=tiny_controlnet(base.unet, seed=0),
                                             safety_checker=None, feature_extractor=None,
                                             requires_safety_checker=False)
    engines = {"build": "auto", "engines": True, "torch": False}[mode]
    pipe = accelerate(pipe, AccelConfig(precision="fp32", sampler="Euler", engines=engines, backend="onnxruntime",
                                        engine_dir=engine_dir))
    if mode == "build":
        set_build_progress(pipe, False)
    pipe.set_progress_bar_config(disable=True)
    hint = torch.rand(1, 3, 512, 512, generator=torch.Generator().manual_seed(3))
    g = torch.Generator("cpu").manual_seed(0)
    image = pipe("a photo of a cat", image=hint, num_inference_steps=2, height=512, width=512, generator=g,
                 output_type="np").images[0]
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
    print(json.dumps({"shape": list(image.shape), "finite": bool(np.isfinite(image).all()), "stats": stats(pipe),
                      "peak_gb": int(hwm[0].split()[1]) / 1e6, "image": image[::64, ::64].tolist()}))
""")


def run(mode: str, engine_dir) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(engine_dir)], capture_output=True, text=True,
                          env=dict(os.environ), timeout=3000)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_controlnet_and_residual_unet_on_engines_at_512_within_the_plain_unets_memory(tmp_path):
    import numpy as np

    from sd_accel import EngineCache

    built = run("build", tmp_path)  # engines="auto": built on first use, then used
    records = {r.key.component: r for r in EngineCache(tmp_path).list()}
    assert {"controlnet", "unet_control"} <= set(records), list(records)
    assert tuple(records["controlnet"].shapes["controlnet_cond"][1][-2:]) == (512, 512)  # the hint at pixel size
    got = run("engines", tmp_path)
    plain = run("torch", tmp_path)
    print(f"\nControlNet 512 px: peak RSS {got['peak_gb']:.2f} GB on engines, {plain['peak_gb']:.2f} GB in torch")
    assert got["shape"] == [512, 512, 3] and got["finite"]
    s = got["stats"]
    for name in ("controlnet", "unet_control"):
        assert s[name]["engine_calls"] == 2 and s[name]["torch_calls"] == 0, (name, s[name])
    assert got["peak_gb"] <= BOUND_GB and got["peak_gb"] <= plain["peak_gb"] + OVER_TORCH_GB
    assert np.abs(np.array(got["image"]) - np.array(plain["image"])).max() < 2e-3
    assert np.abs(np.array(built["image"]) - np.array(got["image"])).max() < 1e-5
