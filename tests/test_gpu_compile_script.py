"""scripts/gpu_compile.py (issue 47's GPU measurement) cannot run without a GPU; its dry run (tiny
models on the CPU, Dynamo without code generation) runs every part of it here, so it does not rot
before a GPU is lent: the three rows, the compiled engines built and swapped in, the second
process's warm start, the FLUX-width slice through the compiled runner, the JSON and the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_script_dry_run_runs_every_part(tmp_path):
    out, table = tmp_path / "dry.json", tmp_path / "dry.md"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_compile.py"), "--dry-run", "--sections", "sd15,flux",
         "--warm-sections", "sd15", "--engine-dir", str(tmp_path / "engines"), "--out", str(out), "--table", str(table)],
        capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and not report["errors"], report["errors"]
    runs = report["runs"]
    for row in ("sd15.eager", "sd15.torch_compile", "sd15.sdaccel"):
        assert runs[row]["s_per_image"] > 0 and runs[row]["finite"]
    accel = runs["sd15.sdaccel"]
    assert accel["stats"]["unet"]["engine_calls"] > 0 and accel["stats"]["unet"]["torch_calls"] == 0
    assert {"clip", "unet", "vae_decoder"} <= set(accel["runners"])
    warm = accel["warm_start"]
    assert warm["returncode"] == 0 and warm["unet_engine_calls"] > 0 and warm["unet_torch_calls"] == 0, warm
    assert runs["flux_slice.sdaccel"]["runner"]["calls"] > 0
    assert runs["flux_slice.sdaccel"]["max_abs_diff_vs_eager"] < 1e-3
    text = table.read_text()
    assert "sd15.sdaccel" in text and "flux_slice.sdaccel" in text and "Goals:" in text
