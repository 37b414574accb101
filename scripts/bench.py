#!/usr/bin/env python
"""Benchmark plain diffusers against sd-accel (torch level, engines, INT8), side by side.

    python scripts/bench.py                  # SD 1.5 architecture, 256 px on CPU / 512 px on CUDA
    python scripts/bench.py --tiny           # builtin:tiny-sd15, a smoke run in seconds
    python scripts/bench.py --arch sdxl --steps 2 --repeats 1   # SDXL architecture at 1024 px (minutes per UNet call on CPU)
    python scripts/bench.py --model path/to/model.safetensors --steps 20 --size 512 --profile

The rows ``optimum-intel-default`` and ``optimum-intel-hybrid-int8`` (what CPU users run today)
run ``scripts/bench_optimum.py`` with the python of the optimum-intel venv (``.venv-optimum`` at the
repository root, ``--optimum-python`` or ``SD_ACCEL_OPTIMUM_PYTHON``); without it they are skipped
with the command that creates it (scripts/BENCHMARKS.md, "optimum-intel").

Prints the table, writes the JSON report, and (unless ``--markdown`` says otherwise)
regenerates ``scripts/BENCHMARKS.md`` next to this file (not for --tiny or --quick smoke runs).
Same as ``sd-accel bench``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    from sd_accel.bench import main

    argv = sys.argv[1:]
    if not {"--markdown", "--worker", "--tiny", "--quick"} & set(argv):
        argv += ["--markdown", str(Path(__file__).resolve().parent / "BENCHMARKS.md")]
    raise SystemExit(main(argv, prog="python scripts/bench.py"))
