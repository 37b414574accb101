"""A refit reads every weight of the module once (to compare it with the engine's) and runs it once
(its check against torch): with the weights memory-mapped from their file (diffusers loads
``.safetensors`` that way, the runtime parks them so), those reads must not leave the whole module
resident beside the engine (issue 46: SD 1.5's refit peaked at 7.6 GB, 5.0 GB of it file-backed
pages: the torch UNet and engine.bin, where torch's own run peaks at 4.5 GB).

Each case runs in a fresh process over a 128 MB module whose weights are mapped from a file, and
reads ``RssFile`` (the process's file-backed resident memory) before and after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20

_SETUP = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import torch

    def rss_file():
        for line in open("/proc/self/status"):
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024

    n, layers = 2048, 8  # 8 x 16 MB of fp32 weights
    path = sys.argv[1]
    np.random.default_rng(0).standard_normal((layers, n, n), dtype=np.float32).tofile(path)
    mapped = np.memmap(path, dtype=np.float32, mode="c", shape=(layers, n, n))  # private, file-backed
    model = torch.nn.Sequential(*[torch.nn.Linear(n, n, bias=False) for _ in range(layers)])
    for i, layer in enumerate(model):
        layer.weight = torch.nn.Parameter(torch.from_numpy(mapped[i]), requires_grad=False)
    x = torch.randn(1, n)
    before = rss_file()
    """
)

_CHECK = _SETUP + textwrap.dedent(
    """
    from sd_accel.runtime.weights import handed_back_after_use
    with torch.no_grad():
        if sys.argv[2] == "handed-back":
            with handed_back_after_use(model):
                model(x)
        else:
            model(x)
    print("RESULT " + json.dumps({"grew": rss_file() - before}))
    """
)

_COMPARE = _SETUP + textwrap.dedent(
    """
    from sd_accel.refit import _one_at_a_time
    value = lambda name: model[int(name)].weight.detach().numpy()
    if sys.argv[2] == "handed-back":
        value = _one_at_a_time(value)
    total = sum(float(value(str(i)).sum()) for i in range(layers))
    value("0")  # the next ask hands back the last array's pages
    print("RESULT " + json.dumps({"grew": rss_file() - before - 16 * 2**20}))
    """
)


def _grew(script: str, tmp_path: Path, mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / f"weights-{mode}.bin"), mode],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])["grew"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssFile and MADV_PAGEOUT are Linux's")
def test_a_check_against_torch_hands_back_each_layers_weights_after_its_forward(tmp_path):
    plain = _grew(_CHECK, tmp_path, "plain")
    handed = _grew(_CHECK, tmp_path, "handed-back")
    assert plain > 100 * MB, f"the plain forward left {plain / MB:.0f} MB resident: the test reads nothing"
    assert handed < 20 * MB, f"{handed / MB:.0f} MB of the 128 MB of weights stayed resident"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssFile and MADV_PAGEOUT are Linux's")
def test_the_refits_comparison_reads_one_weight_at_a_time(tmp_path):
    plain = _grew(_COMPARE, tmp_path, "plain")
    handed = _grew(_COMPARE, tmp_path, "handed-back")
    assert plain > 90 * MB, f"reading every weight left only {plain / MB:.0f} MB resident: the test reads nothing"
    assert handed < 20 * MB, f"{handed / MB:.0f} MB of the weights stayed resident"
