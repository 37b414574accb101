"""Where sd-accel keeps files on disk, and what the cache's intermediates are named. Every
location can be moved by an environment variable."""

from __future__ import annotations

import os
import re
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """Derived files that can be rebuilt at any time: resolved model configs, built-in tiny models.

    ``SD_ACCEL_CACHE_DIR`` overrides the platform's user cache folder.
    """
    env = os.environ.get("SD_ACCEL_CACHE_DIR")
    path = Path(env) if env else Path(platformdirs.user_cache_dir("sd-accel"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_engine_dir() -> Path:
    """The engine cache's default root: ``$SD_ACCEL_ENGINE_DIR``, else ``./engines``.

    ``./engines`` is relative to the current working directory at the time of the call; unlike
    :func:`cache_dir`, the folder is not created here (the cache creates it on its first write).

    >>> saved = os.environ.get("SD_ACCEL_ENGINE_DIR")
    >>> os.environ["SD_ACCEL_ENGINE_DIR"] = "/data/engines"
    >>> default_engine_dir()
    PosixPath('/data/engines')
    >>> del os.environ["SD_ACCEL_ENGINE_DIR"]
    >>> default_engine_dir() == Path.cwd() / "engines"
    True
    >>> if saved is not None: os.environ["SD_ACCEL_ENGINE_DIR"] = saved
    """
    env = os.environ.get("SD_ACCEL_ENGINE_DIR")
    return Path(env).expanduser() if env else Path.cwd() / "engines"


# --------------------------------------------------------------------------- intermediates' names
# The cache keeps two kinds of intermediates beside its engines (sd_accel.cache.intermediates):
# ONNX exports (written by sd_accel.onnx.export) and int8 calibration data (sd_accel.calibration).
# Their names are written and parsed back here, in one place, so the writers and the cache that
# counts and removes them cannot drift apart.

ONNX_DIR = "onnx"
CALIBRATION_DIR = "calibration"
WEIGHTS_DIGITS = 16  # of the weights' fingerprint, in every intermediate's name
CALIBRATION_TEMP = ".tmp.npz"  # appended to a calibration file's name while it is written

_EXPORT = re.compile(r"^(?P<component>[A-Za-z0-9_]+)\.(?P<weights>[0-9a-f]{16})\.s(?P<spec>\d+)$")
_EXPORT_TEMP = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-[^/]+$")
_CALIBRATION = re.compile(r"^(?P<weights>[0-9a-f]{16})-(?P<component>[A-Za-z0-9_]+)-[0-9a-f]{16}\.npz$")


def export_name(component: str, fingerprint: str, spec_version: int) -> str:
    """``unet.0123456789abcdef.s2``: an export's folder name under ``onnx/``.

    >>> export_name("unet", "0123456789abcdef" * 4, 2)
    'unet.0123456789abcdef.s2'
    >>> parse_export(export_name("unet", "0123456789abcdef" * 4, 2))
    ('unet', '0123456789abcdef', 2)
    """
    return f"{component}.{fingerprint[:WEIGHTS_DIGITS]}.s{spec_version}"


def export_dir(cache_root: Path | str, component: str, fingerprint: str, spec_version: int) -> Path:
    """``<cache_root>/onnx/<component>.<fingerprint[:16]>.s<spec_version>``."""
    return Path(cache_root) / ONNX_DIR / export_name(component, fingerprint, spec_version)


def export_lock(folder: Path) -> str:
    """The lock file held while an export folder is written, read for a build, or removed."""
    return str(folder) + ".lock"


def export_temp(folder: Path, kind: str, tag: str) -> Path:
    """A sibling of an export ``folder`` while it is written (``kind="tmp"``) or replaced
    (``"old"``); it counts towards that export.

    >>> export_temp(Path("onnx/unet.0123456789abcdef.s2"), "tmp", "41-ab12").name
    '.unet.0123456789abcdef.s2.tmp-41-ab12'
    >>> parse_export_temp(_)
    'unet.0123456789abcdef.s2'
    """
    if kind not in ("tmp", "old"):
        raise ValueError(f"an export's temporary is 'tmp' or 'old', not {kind!r}")
    return folder.with_name(f".{folder.name}.{kind}-{tag}")


def export_temp_globs(folder: Path) -> tuple[str, ...]:
    """Glob patterns (in ``folder``'s parent) of every temporary of ``folder``."""
    return (f".{folder.name}.tmp-*", f".{folder.name}.old-*")


def parse_export(name: str) -> tuple[str, str, int] | None:
    """``(component, weights16, spec_version)`` of an export's folder name, None for another layout."""
    match = _EXPORT.match(name)
    return (match["component"], match["weights"], int(match["spec"])) if match else None


def parse_export_temp(name: str) -> str | None:
    """The export a temporary's name belongs to, None for anything else."""
    match = _EXPORT_TEMP.match(name)
    return match["name"] if match else None


def calibration_file(cache_root: Path | str, fingerprint: str, component: str, digest: str) -> Path:
    """``<cache_root>/calibration/<fingerprint[:16]>-<component>-<digest>.npz``.

    >>> calibration_file("/c", "0123456789abcdef" * 4, "unet", "fedcba9876543210").name
    '0123456789abcdef-unet-fedcba9876543210.npz'
    >>> parse_calibration(_)
    ('unet', '0123456789abcdef')
    """
    return Path(cache_root) / CALIBRATION_DIR / f"{fingerprint[:WEIGHTS_DIGITS]}-{component}-{digest}.npz"


def calibration_temp(path: Path) -> Path:
    """Where a calibration file is written before it is renamed into place."""
    return path.with_name(path.name + CALIBRATION_TEMP)


def parse_calibration(name: str) -> tuple[str, str] | None:
    """``(component, weights16)`` of a calibration file's name, None for another layout."""
    match = _CALIBRATION.match(name)
    return (match["component"], match["weights"]) if match else None
