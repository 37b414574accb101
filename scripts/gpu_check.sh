#!/usr/bin/env bash
# Check the TensorRT backend on a machine with an NVIDIA GPU, once: set up, install TensorRT,
# run the TensorRT tests (their GPU tests run here), then build, run and compare with torch an
# engine for every component of the tiny built-in models. Prints PASS/FAIL; exit status 0 on PASS.
#
#   bash scripts/gpu_check.sh                                      # newest TensorRT for torch's CUDA
#   SD_ACCEL_TRT='tensorrt-cu12==10.16.1.11' bash scripts/gpu_check.sh   # a given TensorRT (10.x here)
#   SD_ACCEL_GPU_CHECK_ARGS='--models tiny-sd15 --precisions fp16' bash scripts/gpu_check.sh
#
# TensorRT is installed as tensorrt-cu<N> for torch's CUDA major N, not through the `tensorrt`
# extra: the plain `tensorrt` package resolves TensorRT 11 to its CUDA 13 build whatever torch uses.
# The report is written to test-artifacts/gpu_check.json. Needs the package index (pip) on first run.
set -uo pipefail
cd "$(dirname "$0")/.."

say() { printf 'gpu_check: %s\n' "$*"; }
fail() { say "FAIL: $*"; exit 2; }

command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L || fail "no NVIDIA GPU here (nvidia-smi -L failed)"

SD_ACCEL_EXTRAS=${SD_ACCEL_EXTRAS:-dev} bash scripts/setup.sh || fail "scripts/setup.sh failed"
PY=${SD_ACCEL_VENV:-.venv}/bin/python

CUDA_MAJOR=$("$PY" -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
[ -n "$CUDA_MAJOR" ] || fail "torch in ${SD_ACCEL_VENV:-.venv} is a CPU build; remove the venv and run again"
"$PY" -c 'import torch; assert torch.cuda.is_available()' || fail "torch sees no GPU (driver too old for CUDA $CUDA_MAJOR?)"

TRT_SPEC=${SD_ACCEL_TRT:-tensorrt-cu${CUDA_MAJOR}}
if [ -n "${SD_ACCEL_TRT:-}" ] || ! "$PY" -c 'import tensorrt' >/dev/null 2>&1; then
  say "installing $TRT_SPEC"
  "$PY" -m pip install --quiet --disable-pip-version-check "$TRT_SPEC" polygraphy || fail "pip install $TRT_SPEC failed"
fi
"$PY" - <<'EOF' || fail "TensorRT is not usable"
from sd_accel.backends.tensorrt.builder import trt_status
ok, version, why = trt_status()
print(f"gpu_check: TensorRT {version or '?'}: {'usable' if ok else why}")
raise SystemExit(0 if ok else 1)
EOF

say "pytest tests/test_tensorrt_backend.py tests/test_trt_names.py"
"$PY" -m pytest -q -ra -p no:cacheprovider tests/test_tensorrt_backend.py tests/test_trt_names.py
TESTS=$?

mkdir -p test-artifacts
say "building and comparing engines (scripts/gpu_check.py ${SD_ACCEL_GPU_CHECK_ARGS:-})"
# shellcheck disable=SC2086
"$PY" scripts/gpu_check.py --json test-artifacts/gpu_check.json ${SD_ACCEL_GPU_CHECK_ARGS:-}
CHECK=$?

if [ "$TESTS" -eq 0 ] && [ "$CHECK" -eq 0 ]; then
  say "PASS (tests and engines; report in test-artifacts/gpu_check.json)"
  exit 0
fi
say "FAIL (pytest exit $TESTS, engine check exit $CHECK; report in test-artifacts/gpu_check.json)"
exit 1
