"""A few-step recipe at the size people run it: the tiny LCM-distilled UNet (``time_cond_proj_dim``)
at 512x512 with the tiny autoencoder, on ONNX Runtime engines built with the defaults
(``engines="auto"``: the static one-row-per-image UNet and the TAESD decoder), each step in its
own process, its peak RSS (VmHWM) held to the plain UNet's bound. Never a timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
# The plain tiny SD 1.5's bound at 512 px (test_engines_real_sizes.BOUNDS_GB) and its headroom over torch.
BOUND_GB = 2.0
OVER_TORCH_GB = 0.3

SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[3])
    import numpy as np, torch
    from sd_accel import AccelConfig, accelerate, stats
    from support.lcm import tiny_lcm_pipeline

    mode, engine_dir, taesd = sys.argv[1], sys.argv[2], sys.argv[4]
    engines = {"build": "auto", "engines": True, "torch": False}[mode]
    pipe = accelerate(tiny_lcm_pipeline("sd15"), AccelConfig(precision="fp32", engines=engines, backend="onnxruntime",
                                                             engine_dir=engine_dir, vae=f"tiny:{taesd}"))
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator("cpu").manual_seed(0)
    image = pipe("a photo of a cat", num_inference_steps=2, guidance_scale=8.0, height=512, width=512,
                 generator=g, output_type="np").images[0]
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
    print(json.dumps({"shape": list(image.shape), "finite": bool(np.isfinite(image).all()), "stats": stats(pipe),
                      "peak_gb": int(hwm[0].split()[1]) / 1e6, "image": image[::64, ::64].tolist()}))
""")


def run(mode: str, engine_dir: Path, taesd: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(engine_dir), str(TESTS), str(taesd)],
                          capture_output=True, text=True, env=dict(os.environ), timeout=3000)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_lcm_unet_and_taesd_on_engines_at_512_within_the_plain_unets_memory(tmp_path):
    import numpy as np

    from sd_accel import EngineCache

    from support.taesd_files import tiny_autoencoder, write_layouts

    taesd = write_layouts(tiny_autoencoder(), tmp_path / "taesd")["single"]
    built = run("build", tmp_path / "engines", taesd)  # engines="auto": built on first use, then used
    records = {r.key.component: r for r in EngineCache(tmp_path / "engines").list()}
    assert {"unet", "vae_decoder"} <= set(records), list(records)
    unet = records["unet"]
    assert unet.key.profile.endswith(".nocfg") and unet.shapes["sample"][1][0] == 1  # one row per image
    assert "timestep_cond" in unet.shapes
    got = run("engines", tmp_path / "engines", taesd)
    plain = run("torch", tmp_path / "engines", taesd)
    print(f"\nLCM + TAESD 512 px: peak RSS {got['peak_gb']:.2f} GB on engines, {plain['peak_gb']:.2f} GB in torch")
    assert got["shape"] == [512, 512, 3] and got["finite"]
    s = got["stats"]
    assert s["unet"]["engine_calls"] == 2 and s["unet"]["torch_calls"] == 0, s["unet"]
    assert s["vae_decoder"]["engine_calls"] == 1 and s["vae_decoder"]["torch_calls"] == 0
    assert got["peak_gb"] <= BOUND_GB and got["peak_gb"] <= plain["peak_gb"] + OVER_TORCH_GB
    assert np.abs(np.array(got["image"]) - np.array(plain["image"])).max() < 2e-3
    assert np.abs(np.array(built["image"]) - np.array(got["image"])).max() < 1e-5
