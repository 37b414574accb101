"""Shared fixtures. Expensive things (tiny pipelines, checkpoints on disk) are session-scoped."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Keep every test run away from the user's real caches and engines, and off the model hub.
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="sd-accel-tests-"))
# Each run's default cache and engines (~130 MB) would otherwise pile up in /tmp run after run.
atexit.register(shutil.rmtree, _SESSION_TMP, ignore_errors=True)
# pytest-xdist's workers inherit the controller's environment: each takes its own folders instead
# (tests that count what the default folders hold must not see the other worker's engines).
_OURS = os.environ.get("_SD_ACCEL_TESTS_TMP")
for _name, _sub in (("SD_ACCEL_CACHE_DIR", "cache"), ("SD_ACCEL_ENGINE_DIR", "engines")):
    if _OURS and os.environ.get(_name) == str(Path(_OURS) / _sub) and os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[_name] = str(_SESSION_TMP / _sub)
    os.environ.setdefault(_name, str(_SESSION_TMP / _sub))
os.environ.setdefault("_SD_ACCEL_TESTS_TMP", str(_SESSION_TMP))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


# With pytest-xdist (scripts/test.sh: -n 2 --dist loadgroup) each file runs on one worker, so its
# module-scoped fixtures are made once; files that share an expensive session fixture go together.
_XDIST_GROUPS = {
    "test_real_sizes.py": "real-size builds",  # real_size_build's 512 / 1024 px engines
    "test_engines_real_sizes.py": "real-size builds",
    # Real-width transformer slices export GBs of fp32 ONNX under tmp_path (4.4 GB for one): two at
    # once on the two workers ran a CI machine's disk out (3.8 GB free), so they take turns.
    "test_transformer_real_width.py": "real-width transformer exports",
    "test_transformer_segments_memory.py": "real-width transformer exports",
    "test_mapped_file.py": "real-width transformer exports",
}


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist (-p no:xdist) there is no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` by file (and ``_XDIST_GROUPS``), decided on the controller. Marking items
    ``xdist_group`` does not work with pytest 9: the worker renames ``item._nodeid``, which pytest 9
    no longer reads, so every test was scheduled alone and both workers made each module's fixtures."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _XDIST_GROUPS.get(path.rsplit("/", 1)[-1], path)

    return FileGroups(config, log)


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """Each test leaves logging as it found it: the WebUI console's handler on ``sd_accel`` (which
    prints to the stdout of the moment) and the CLI's ``basicConfig`` root handler otherwise stay
    for every later test of the worker, and a CLI's ``--json`` output then had log lines in it."""
    import logging

    loggers = [logging.getLogger(), logging.getLogger("sd_accel")]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for lg, (handlers, level, propagate) in zip(loggers, saved, strict=True):
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


@pytest.fixture(scope="session")
def session_tmp() -> Path:
    return _SESSION_TMP


@pytest.fixture(scope="session")
def tiny_factory():
    """``tiny_factory(family)`` -> a fresh tiny pipeline (random weights, seed fixed)."""
    from sd_accel.models.builtin import build_tiny_pipeline

    return build_tiny_pipeline


@pytest.fixture(scope="session")
def tiny_sd15():
    from sd_accel.models.builtin import build_tiny_pipeline

    return build_tiny_pipeline("sd15")


@pytest.fixture(scope="session")
def tiny_sdxl():
    from sd_accel.models.builtin import build_tiny_pipeline

    return build_tiny_pipeline("sdxl")


@pytest.fixture(scope="session")
def real_size_build(tmp_path_factory):
    """``real_size_build(model, preset, backend, precision="auto")`` -> ``(engine_dir, result)``: engines of every
    component built in a fresh process (``result``: its peak RSS and the cache's records), once per
    session for each arguments (tests/test_real_sizes.py and tests/test_engines_real_sizes.py need
    the same static 512 px / 1024 px ones)."""
    from support.real_sizes import build_in_subprocess

    built: dict[tuple[str, str, str, str], tuple[Path, dict]] = {}

    def build(model: str, preset: str, backend: str, precision: str = "auto") -> tuple[Path, dict]:
        key = (model, preset, backend, precision)
        if key not in built:
            folder = tmp_path_factory.mktemp(f"real-size-{preset}-{backend}")
            result = build_in_subprocess(folder, model=model, preset=preset, backend=backend, precision=precision)
            built[key] = (folder / "engines", result)
        return built[key]

    return build
