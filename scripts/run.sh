#!/usr/bin/env bash
# The main job: set up, then generate the same image twice with the built-in model (or --model M),
# plain PyTorch and on engines (built on the first run, reused after), and print both times, the
# speed-up and which components ran on engines (scripts/main_job.py).
# Any extra arguments go to `sd-accel generate`, e.g. scripts/run.sh --model my.safetensors --size 512x512
# SD_ACCEL_SETUP=0 skips the set-up (an environment that is already set up; SD_ACCEL_VENV names it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SD_ACCEL_VENV:-.venv}
if [ "${SD_ACCEL_SETUP:-1}" != 0 ]; then
  SD_ACCEL_EXTRAS=${SD_ACCEL_EXTRAS:-dev} SD_ACCEL_VENV="$VENV" bash scripts/setup.sh
fi
exec "$VENV/bin/python" scripts/main_job.py "$@"
