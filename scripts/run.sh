#!/usr/bin/env bash
# The main job: set up, then generate one image with the built-in model (or --model M) and print timings.
# Any extra arguments go to `sd-accel generate`, e.g. scripts/run.sh --model my.safetensors --sampler "Euler a"
set -euo pipefail
cd "$(dirname "$0")/.."
SD_ACCEL_EXTRAS=${SD_ACCEL_EXTRAS:-dev} bash scripts/setup.sh
exec .venv/bin/sd-accel generate --out outputs/sd-accel.png "$@"
