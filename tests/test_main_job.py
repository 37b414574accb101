"""The main job (scripts/run.sh -> scripts/main_job.py): PyTorch, then engines, and what they bought."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB = ROOT / "scripts" / "main_job.py"


def _main_job(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(MAIN_JOB), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)


def test_main_job_refuses_engines_flag_before_any_work():
    proc = _main_job("--engines")
    assert proc.returncode == 2 and "leave out --engines" in proc.stderr
    assert "[1/3]" not in proc.stdout


@pytest.mark.slow
def test_main_job_builds_on_first_run_and_reuses_after(tmp_path):
    args = ("--size", "64x64", "--steps", "2", "--engine-dir", str(tmp_path / "engines"),
            "--out", str(tmp_path / "img.png"))
    first = _main_job(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "speed-up :" in first.stdout and "PyTorch  :" in first.stdout and "engines  :" in first.stdout
    # every component txt2img runs went to an engine (never an empty report), with what built it
    line = next(x for x in first.stdout.splitlines() if "on engines:" in x)
    assert line.split("on engines:")[1].strip().startswith("clip, unet, vae_decoder ("), line
    assert "built 3 engine(s) on this run" in first.stdout
    assert (tmp_path / "img.png").is_file() and (tmp_path / "img-torch.png").is_file()

    second = _main_job(*args)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "engines reused from the cache" in second.stdout


def test_few_step_adds_the_recipe_where_the_command_line_leaves_it_out():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from main_job import few_step_args
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    full = few_step_args([])
    assert dict(zip(full[::2], full[1::2], strict=True)) == {
        "--model": "builtin:tiny-sd15-lcm", "--sampler": "LCM", "--steps": "4", "--cfg": "1",
        "--tiny-vae": "builtin:taesd", "--size": "512x512"}
    mine = few_step_args(["--model", "my.safetensors", "--steps=6"])
    assert "--size" not in mine and mine.count("--steps") == 0 and mine[-2:] == ["my.safetensors", "--steps=6"]


@pytest.mark.slow
def test_main_job_few_step_runs_the_lcm_unet_and_taesd_on_no_cfg_engines(tmp_path):
    """``scripts/run.sh --few-step``: the LCM-distilled built-in model, 4 LCM steps at CFG 1 and the
    built-in TAESD, at 512 px; the build is the no-CFG UNet and TAESD's decoder, and the run uses them."""
    from sd_accel import EngineCache, load_pipeline
    from sd_accel.build import built_from
    from sd_accel.optimize.vae_choice import use_vae

    proc = _main_job("--few-step", "--engine-dir", str(tmp_path / "engines"), "--out", str(tmp_path / "img.png"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "few-step recipe: LCM sampler, CFG 1, tiny VAE builtin:taesd" in proc.stdout
    assert "512x512, 4 steps" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if "on engines:" in x)
    assert line.split("on engines:")[1].strip().startswith("clip, unet, vae_decoder ("), line
    records = {r.key.component: r for r in EngineCache(tmp_path / "engines").list()}
    assert records["unet"].key.profile.endswith(".nocfg") and "timestep_cond" in records["unet"].shapes
    assert records["vae_decoder"].shapes["latent"][0] == (1, 4, 64, 64)
    pipe = load_pipeline("builtin:tiny-sd15-lcm")
    assert not built_from(pipe, records["vae_decoder"])  # not the model's own VAE decoder: TAESD's
    use_vae(pipe, "tiny:builtin:taesd")
    assert built_from(pipe, records["vae_decoder"]) and built_from(pipe, records["unet"])
