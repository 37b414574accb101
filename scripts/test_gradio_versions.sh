#!/usr/bin/env bash
# Build the sd-accel panel and the WebUI extension's tab under the Gradio versions the WebUIs
# ship: 3.41.2 (AUTOMATIC1111 1.x) and 4.44.1 (Forge), plus the project's own Gradio.
#
# A venv cannot share the project venv's packages selectively, so each Gradio venv holds only
# Gradio and the versions it needs (fastapi, pydantic, httpx pins below), and a .pth file appends
# the project venv's site-packages after its own: torch, diffusers, onnx ... come from there,
# Gradio and its dependencies from the small venv, which comes first on sys.path.
#
#   scripts/test_gradio_versions.sh            # creates the venvs once, then reuses them
#   G341_VENV=/tmp/g3 G444_VENV=/tmp/g4 scripts/test_gradio_versions.sh   # existing venvs
#
# Venvs live in $SD_ACCEL_GRADIO_VENVS (default ~/.cache/sd-accel/gradio-venvs). Exit status 0
# when every check passes in every version.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MAIN_PY="$ROOT/.venv/bin/python"
[ -x "$MAIN_PY" ] || { echo "no project venv at .venv: run scripts/setup.sh first" >&2; exit 2; }
BASE=${SD_ACCEL_GRADIO_VENVS:-$HOME/.cache/sd-accel/gradio-venvs}
MAIN_SITE=$("$MAIN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# name|venv|pip requirements
VERSIONS=(
  "3.41.2|${G341_VENV:-$BASE/gradio-3.41.2}|gradio==3.41.2 fastapi==0.104.1 pydantic==2.5.3 httpx==0.24.1"
  "4.44.1|${G444_VENV:-$BASE/gradio-4.44.1}|gradio==4.44.1 fastapi==0.112.2 pydantic==2.10.6"
)

ensure_venv() {  # version venv requirements...
  local version=$1 venv=$2; shift 2
  if [ -x "$venv/bin/python" ]; then
    # The venvs are shared by checkouts: point this one at THIS checkout's project venv before
    # trying it (a venv made from another clone, since removed, left torch ... unimportable).
    echo "$MAIN_SITE" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_main.pth"
  fi
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import gradio, sys; sys.exit(gradio.__version__ != '$version')" 2>/dev/null; then
    echo "gradio $version: reusing $venv"
    return
  fi
  echo "gradio $version: creating $venv"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$MAIN_PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$MAIN_SITE" > "$site/zz_main.pth"  # after the venv's own packages: Gradio's pins win
  # Gradio 4.x imports HfFolder, gone since huggingface_hub 1.0; the project's transformers and
  # diffusers need a newer hub than Gradio 4 pins, so shim the one name instead of pinning.
  cat > "$site/sitecustomize.py" <<'PY'
# Test-only shim: old Gradio imports HfFolder, removed from huggingface_hub 1.0.
try:
    import huggingface_hub as _h
    if not hasattr(_h, "HfFolder"):
        class HfFolder:
            @staticmethod
            def get_token():
                return None
        _h.HfFolder = HfFolder
except Exception:
    pass
PY
}

# Packages the project's own code imports through Gradio's venv: the copy Gradio's install pulled
# in shadows the project's, and a venv reused across project upgrades keeps an old one (a cached
# hub 1.x broke transformers 5, which needs hub 2). Take them from the project venv instead.
SHARED=(huggingface_hub)
use_project_copies() {  # venv
  local venv=$1 name mine theirs
  for name in "${SHARED[@]}"; do
    theirs=$("$MAIN_PY" -c "import importlib.metadata as m; print(m.version('$name'))")
    mine=$("$venv/bin/python" -c "import importlib.metadata as m, sys; d=[x for x in m.distributions(name='$name') if x.locate_file('').as_posix().startswith(sys.prefix)]; print(d[0].version if d else '')")
    if [ -n "$mine" ] && [ "$mine" != "$theirs" ]; then
      echo "gradio venv $venv: $name $mine removed, the project's $theirs is used"
      "$venv/bin/python" -m pip uninstall -q -y "$name"
    fi
  done
}

failed=0
start_all=$SECONDS
for entry in "${VERSIONS[@]}"; do
  IFS='|' read -r version venv reqs <<< "$entry"
  start=$SECONDS
  # shellcheck disable=SC2086  # the requirements are words
  ensure_venv "$version" "$venv" $reqs
  use_project_copies "$venv"
  if PYTHONPATH="$ROOT" "$venv/bin/python" tests/webui_stub/gradio_check.py | grep -v '^Applying\|^Disabling'; then
    echo "gradio $version: ok ($((SECONDS - start)) s)"
  else
    echo "gradio $version: FAILED ($((SECONDS - start)) s)"
    failed=1
  fi
done
start=$SECONDS
if PYTHONPATH="$ROOT" "$MAIN_PY" tests/webui_stub/gradio_check.py | grep -v '^Applying\|^Disabling'; then
  echo "project gradio: ok ($((SECONDS - start)) s)"
else
  echo "project gradio: FAILED"
  failed=1
fi
echo "all gradio versions: $((SECONDS - start_all)) s"
exit $failed
