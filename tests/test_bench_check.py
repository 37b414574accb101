"""``sd-accel bench``: the quick check that works from an installed wheel (``sd_accel/bench.py``);
the research harness is ``scripts/bench.py`` (tests/test_bench.py). Timings are never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sd_accel import bench
from sd_accel.backends import registry
from sd_accel.cli import main


def test_the_package_holds_nothing_of_the_harness():
    """An installed wheel has no scripts/ and no .venv-optimum beside it: the check must not need them."""
    source = Path(bench.__file__).read_text()
    for needs_a_checkout in ("bench_optimum", ".venv-optimum", "scripts/bench.py --", "parents[1]"):
        assert needs_a_checkout not in source, needs_a_checkout


@pytest.mark.slow
def test_a_row_per_backend_of_the_table(tmp_path):
    rows = bench.check(size=64, steps=2, backends=["onnxruntime", "tensorrt"], engine_dir=tmp_path)
    assert [r["row"] for r in rows] == ["torch", "onnxruntime", "tensorrt"]
    ort = rows[1]
    assert not ort["skipped"] and ort["precision"] == "fp32" and ort["rel_l2"] < 1e-3 and ort["speedup"] > 0
    assert ort["torch_calls"] == 0  # every call ran on the engines
    if not registry.create("tensorrt").info().usable:
        assert rows[2]["skipped"] == registry.create("tensorrt").info().why_not
    text = bench.text_table(rows)
    assert "onnxruntime" in text and "skipped" in text.splitlines()[-1] or registry.create("tensorrt").info().usable


@pytest.mark.slow
def test_the_cli_prints_json_and_refuses_what_a_backend_cannot_build(tmp_path, capsys):
    assert main(["bench", "--backend", "onnxruntime", "--precision", "bf16", "--steps", "1",
                 "--engine-dir", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["row"] for r in rows] == ["torch", "onnxruntime"]
    assert "bf16 engines come from the compile or openvino backend" in rows[1]["skipped"]  # registry.check_precision's words
