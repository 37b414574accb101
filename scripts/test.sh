#!/usr/bin/env bash
# Set up, lint, and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check sd_accel extension scripts tests
exec .venv/bin/python -m pytest -q -ra "$@"
