"""The suite's own scheduling on pytest-xdist workers (scripts/test.sh): each file stays on one
worker, so a module fixture (an engine build, a Ray service) is made once, not once per worker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="pytest-xdist is not installed (it is in sd-accel[dev])")

ROOT = Path(__file__).resolve().parent.parent


def test_each_file_runs_on_one_worker():
    files = ["tests/test_profiles.py", "tests/test_units.py"]  # fast, and each has many tests
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2",
                          "--dist", "loadgroup", *files], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300).stdout
    workers = defaultdict(set)
    for worker, file in re.findall(r"\[(gw\d)\][^\n]*?PASSED (tests/[\w.]+)::", out):
        workers[file].add(worker)
    assert set(workers) == set(files), out[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)  # split: module fixtures made twice
