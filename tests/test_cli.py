"""The sd-accel command, run as a user runs it: in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from PIL import Image


def sd_accel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sd_accel.cli", *args],
        capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )


def test_generate_saves_png_with_parameters_and_reports(tmp_path):
    out = tmp_path / "img.png"
    proc = sd_accel("generate", "--steps", "2", "--size", "64x64", "--sampler", "Euler a",
                    "--precision", "bf16", "--seed", "7", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["model"] == "builtin:tiny-sd15"
    assert report["images"] == [str(out)]
    assert report["dtype"] == "bf16" and report["attention"] == "sdpa"
    assert report["unet_calls"] == 2
    assert report["generate_s"] > 0 and report["it_per_s"] > 0
    image = Image.open(out)
    assert image.size == (64, 64)
    params = image.text["parameters"]
    assert params.startswith("a photo of a cat")
    assert "Steps: 2" in params and "Sampler: Euler a" in params and "Seed: 7" in params


def test_bad_model_path_is_one_clear_line(tmp_path):
    proc = sd_accel("generate", "--model", str(tmp_path / "missing.safetensors"), "--out", str(tmp_path / "x.png"))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("sd-accel: error:")]
    assert len(lines) == 1 and "not found" in lines[0]
    assert "Traceback" not in proc.stderr


def test_bad_size_is_rejected_by_the_parser(tmp_path):
    proc = sd_accel("generate", "--size", "65x64", "--out", str(tmp_path / "x.png"))
    assert proc.returncode == 2
    assert "multiples of 8" in proc.stderr


def test_samplers_lists_presets():
    proc = sd_accel("samplers")
    assert proc.returncode == 0
    names = proc.stdout.splitlines()
    assert "DPM++ 2M Karras" in names
    assert any(line.startswith("Heun") and "2 UNet calls" in line for line in names)
