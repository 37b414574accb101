"""A FLUX.1 slice built in segments within memory (issue 44): its real head size, rotary axes and
guidance embedding, half its heads (hidden 1536: the real width's export does not fit beside other
jobs on a shared 24 GB machine in a test: 7.86 GiB in segments against 12.73 GiB whole, 8.5 min,
scripts/BENCHMARKS.md), two double- and two
single-stream blocks, stored in bf16 and loaded from its safetensors as a user's pipeline is, built
on OpenVINO one segment at a time and validated against torch in a fresh process whose peak RSS
(VmHWM: ru_maxrss would carry a big pytest worker's size across exec) is asserted. Random weights. ``scripts/bench_segments.py`` makes the slice and runs the build (it
also runs the whole-module build the bound is compared with)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_segments.py"
GIB = 1 << 30


def _run(*args: str, cwd: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    result["stages"] = "\n".join(x for x in proc.stdout.splitlines() if x.startswith("STAGE "))  # where a peak came
    return result


@pytest.mark.slow
def test_flux_width_slice_builds_in_segments_within_memory(tmp_path):
    pytest.importorskip("openvino")
    made = _run("prepare", str(tmp_path / "model"), "--double", "2", "--single", "2", "--heads", "12", cwd=tmp_path)
    assert 2.0e8 < made["params"] < 3.0e8
    result = _run("build", str(tmp_path / "model"), str(tmp_path / "engines"), "--mode", "segments",
                  "--size", "512", "--text", "512", "--budget-mib", "256", cwd=tmp_path)
    assert result["layout"].startswith("seg4-"), result  # the embeddings and a block, a block, a block, a block and the output
    validation = result["validation"]
    assert validation["ok"] and validation["points"] == ["opt"] and validation["rel_l2"] < 1e-3, validation
    print(f"FLUX slice (half width) in segments at 512 px: {result['params'] / 1e6:.0f}M parameters, peak RSS "
          f"{result['peak'] / GIB:.2f} GiB, {result['seconds']:.0f} s, rel_l2 {validation['rel_l2']:.1e}")
    assert result["peak"] < BOUND, f"peak RSS {result['peak'] / GIB:.1f} GiB; stages:\n{result['stages']}"


# Measured 2.51 GiB in segments, 5.32 GiB built whole (the same slice, one process each; 261M
# parameters, OpenVINO 2026.4.1, a 2-core AMD EPYC Zen 4, 2026-12-07, scripts/BENCHMARKS.md): a
# third above the segmented figure, well under the whole build's.
BOUND = int(3.35 * GIB)
