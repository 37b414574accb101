"""scripts/bench_dynamic.py's tiny mode: a dynamic engine's speed against torch at min / opt / max."""

from __future__ import annotations

import json

import pytest

from support.scripts import load

pytest.importorskip("openvino")


@pytest.mark.slow
def test_tiny_bench_times_each_point_against_torch_with_fixed_and_static_rows(tmp_path, monkeypatch):
    monkeypatch.delenv("SD_ACCEL_OV_FIXED_SHAPES", raising=False)
    bench = load("bench_dynamic")
    out = tmp_path / "report.json"
    report = bench.main(["--repeats", "1", "--precision", "fp32", "--engine-dir", str(tmp_path / "engines"),
                         "--out", str(out)])
    assert json.loads(out.read_text())["points"].keys() == {"min", "opt", "max"}
    points = report["points"]
    assert points["opt"]["same_as"] == "min"  # the tiny profile's min is its opt: measured once
    assert (points["max"]["height"], points["max"]["tokens"], points["max"]["unet_batch"]) == (96, 154, 2)
    for point in ("min", "max"):
        row = points[point]
        assert row["torch_ms"] > 0
        for label in ("dynamic", "fixed"):
            assert row[label]["x_torch"] == pytest.approx(row["torch_ms"] / row[label]["ms"])
            assert row[label]["x_torch_fastest"] == pytest.approx(min(row["torch_times_ms"]) / min(row[label]["times_ms"]))
            assert row[label]["rel_l2"] < 1e-3  # fp32 engines compute what torch does
    assert "static" in points["max"] and "static" not in points["min"]
    assert points["max"]["static"]["rel_l2"] < 1e-3
    table = bench.table(report)
    assert "| max | 96x96 px, 154 (2) |" in table and "x torch" in table
