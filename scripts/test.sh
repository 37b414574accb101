#!/usr/bin/env bash
# Set up, lint, and run the whole test suite. Extra arguments go to pytest.
# The browser tests drive Debian's chromium; as root with apt it is installed here, elsewhere
# those tests skip and say so.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "test: installing Debian's chromium for the browser tests"
  (apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }) \
    || echo "test: could not install chromium; the browser tests will skip"
fi
.venv/bin/ruff check sd_accel extension scripts tests conftest.py
# The panel and the WebUI tab under the Gradio versions the WebUIs ship (3.41, 4.x): own venvs.
bash scripts/test_gradio_versions.sh
# Two workers, each file on one of them (tests/conftest.py groups them): run alone the suite kept
# one core of two busy. SD_ACCEL_TEST_WORKERS=0 runs it in this process.
WORKERS=${SD_ACCEL_TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then XDIST=(); else XDIST=(-n "$WORKERS" --dist loadgroup); fi
exec .venv/bin/python -m pytest -q -ra --durations=25 "${XDIST[@]}" "$@"
