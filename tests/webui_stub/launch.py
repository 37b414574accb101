"""``launch.py`` / ``modules/launch_utils.py``: the helpers extensions' ``install.py`` use.

``is_installed`` is the WebUI's (distribution metadata, then import spec). ``run_pip`` records
the command instead of running pip: tests read ``pip_commands``; ``pip_fail`` makes the next
matching command fail as pip would.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

python = sys.executable
index_url_line = ""
pip_commands: list[str] = []
pip_fail: list[str] = []  # substrings: a command containing one raises, as a failing pip does


def is_installed(package):
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:
            return False
        return spec is not None
    return dist is not None


def run(command, desc=None, errdesc=None, custom_env=None, live=False):
    raise RuntimeError("the stub does not run commands")


def run_pip(command, desc=None, live=False):
    full = f'"{python}" -m pip {command} --prefer-binary{index_url_line}'
    pip_commands.append(full)
    if any(s in command for s in pip_fail):
        raise RuntimeError(f"Couldn't install {desc}.\nCommand: {full}\nError code: 1\nstderr: ERROR: stub failure")
    return ""
