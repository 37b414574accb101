#!/usr/bin/env bash
# Build the documentation site (mkdocs.yml, docs/) in strict mode into site/: a broken link or
# anchor, a page left out of the nav or an API reference that does not resolve fails the build.
#   scripts/docs.sh          build into site/
#   scripts/docs.sh serve    a live preview on http://127.0.0.1:8000
# The figures tables are rendered from docs/figures/*.json first (scripts/figures.py).
# The tools come with the dev extra (scripts/setup.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${SD_ACCEL_VENV:-.venv}/bin/python
export NO_MKDOCS_2_WARNING=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" scripts/figures.py
if [ "${1:-build}" = serve ]; then
  exec "$PY" -m mkdocs serve
fi
[ "${1:-}" = build ] && shift
exec "$PY" -m mkdocs build --strict "$@"
