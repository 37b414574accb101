#!/usr/bin/env bash
# Set up sd-accel in ./.venv on a fresh machine. Safe to run again: it only adds what is missing.
#
# torch: a torch that already works (in .venv, or in the Python that makes the venv) is kept.
# Otherwise: with an NVIDIA GPU, the default (CUDA) build from the package index; without one,
# the CPU build (a local wheel when pip's find-links has one, else PyTorch's CPU index).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${SD_ACCEL_VENV:-.venv}
TORCH_CPU_VERSION=${SD_ACCEL_TORCH_CPU_VERSION:-2.13.0}
EXTRAS=${SD_ACCEL_EXTRAS:-dev}

say() { printf 'setup: %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c 'import torch; torch.zeros(1) + 1' >/dev/null 2>&1; then
    say "reusing the torch already installed for $PYTHON ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)

if "$PY" -c 'import torch; torch.zeros(1) + 1' >/dev/null 2>&1; then
  say "torch $("$PY" -c 'import torch; print(torch.__version__)') is installed; keeping it"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "NVIDIA GPU found: installing the CUDA build of torch"
  "${PIP[@]}" torch
else
  say "no NVIDIA GPU: installing the CPU build of torch $TORCH_CPU_VERSION"
  "${PIP[@]}" "torch==${TORCH_CPU_VERSION}+cpu" 2>/dev/null \
    || "${PIP[@]}" "torch==${TORCH_CPU_VERSION}" --index-url https://download.pytorch.org/whl/cpu \
         --extra-index-url https://pypi.org/simple
fi

say "installing sd-accel[$EXTRAS]"
"${PIP[@]}" -e ".[$EXTRAS]"
"$PY" -c 'import torch, diffusers, sd_accel; print("setup: ok: torch", torch.__version__, "diffusers", diffusers.__version__)'
