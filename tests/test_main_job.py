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
