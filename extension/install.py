"""Install sd-accel into the WebUI's Python; the WebUI's launcher runs this file at each start.

Rules, because a broken WebUI is the worst outcome of an extension install:

- Only the WebUI's own helpers are used (``launch.is_installed``, ``launch.run_pip``), so pip
  runs with the WebUI's Python, index settings and console output.
- sd-accel itself is installed with ``--no-deps``, then only the extra packages its WebUI path
  imports, each only when missing or too old: onnx, onnxruntime, filelock, platformdirs, tqdm
  (:data:`REQUIREMENTS`). Never torch, torchvision, gradio or transformers (A1111 1.x pins Gradio
  3.41, Forge 4.x; both pin their torch), and not diffusers: the WebUI path runs the WebUI's own
  modules and does not import it.
- Every pip call gets a constraints file that pins, at the versions installed now, the packages
  of :data:`PROTECTED` (torch, gradio, transformers, numpy, protobuf ...), every NVIDIA CUDA
  wheel, and every package the WebUI's own requirements file pins exactly
  (``requirements_versions.txt``, or ``$REQS_FILE``): the WebUI re-runs its whole requirements
  install at the next start when one of those moved (Forge pins protobuf 3.20.0; onnx asks for
  >= 3.20.2). When pip cannot install a package under those pins, it is installed once more
  without its dependencies and kept only if it then imports (onnx 1.17 does with protobuf
  3.20.0); otherwise it is removed again and the console and the sd-accel tab say so.
- OpenVINO, the fast CPU backend, for a CPU build of torch (or a WebUI started with
  ``--always-cpu`` / ``--use-cpu all``); ``SD_ACCEL_INSTALL_OPENVINO=0`` skips it, ``=1`` forces
  it. Its only dependency besides openvino-telemetry is numpy (pinned). NNCF is not installed:
  static int8 calibrates on diffusers pipelines, which the WebUI's models are not.
- TensorRT (``tensorrt-cu12`` or ``-cu11`` after torch's CUDA, with polygraphy) is installed only
  for a CUDA build of torch, and not with ``SD_ACCEL_INSTALL_TENSORRT=0``. When it cannot be
  installed or imported the WebUI still starts and the tab says why and what to run.
- Nothing here raises: a failure is printed, and the WebUI starts without sd-accel.

Where sd-accel comes from: ``SD_ACCEL_SOURCE`` (any pip requirement or path) when set, else the
sd-accel checkout this folder belongs to (``extension/`` inside the repository; also through a
symlink or junction), reinstalled whenever its source files change, else an sd-accel already in
the WebUI's Python.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

EXTENSION_DIR = Path(__file__).resolve().parent
STAMP_NAME = ".sd_accel_installed"  # digest of the source installed last (ignored by git)
MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 1)
MIN_GRADIO = (3, 41)

# What sd-accel's WebUI path imports beyond the WebUI's own packages (pyproject's list, minus
# torch/diffusers/transformers/accelerate and what only the standalone app and CLI use).
REQUIREMENTS = ("onnx>=1.16,!=1.16.2", "onnxruntime>=1.17", "filelock>=3.12", "platformdirs>=3", "tqdm>=4.60")
# Never installed, upgraded or downgraded by this script: pinned at what the WebUI has.
PROTECTED = ("torch", "torchvision", "torchaudio", "xformers", "gradio", "gradio_client", "transformers",
             "diffusers", "accelerate", "numpy", "pydantic", "fastapi", "starlette", "safetensors",
             "huggingface_hub", "pillow", "open_clip_torch", "protobuf")
NEVER_INSTALL = ("torch", "torchvision", "torchaudio", "gradio", "transformers", "diffusers")
OPENVINO = ("openvino>=2025.0",)  # as pyproject asks (tests/test_webui_extension.py checks every pin)
# launch_utils' parse of a requirements line (``requirements_met``): name, then an optional ==version
RE_REQUIREMENT = re.compile(r"\s*([-_a-zA-Z0-9]+)\s*(?:==\s*([-+_.a-zA-Z0-9]+))?\s*")
# onnxruntime ships under several distribution names that all provide the same module.
ALIASES = {"onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino")}
TENSORRT = ("polygraphy>=0.49",)


def say(text: str) -> None:
    print(f"sd-accel install: {text}", flush=True)


# --------------------------------------------------------------------------- facts


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(dist: str) -> str | None:
    """The installed version of a distribution (or of any of its aliases), else None."""
    for name in ALIASES.get(_norm(dist), (dist,)):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def satisfied(requirement: str, version: str | None) -> bool:
    """Whether an installed ``version`` meets ``requirement`` (packaging when present)."""
    if version is None:
        return False
    try:
        from packaging.requirements import Requirement

        return Requirement(requirement).specifier.contains(version, prereleases=True)
    except Exception:  # no packaging (unusual): accept what is there rather than reinstall
        return True


def requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]


def torch_cuda_major() -> str | None:
    """The CUDA major version torch was built for ("12"), from its version tag; None for CPU builds.

    Read from the installed metadata (``2.1.2+cu121``) rather than by importing torch, which
    would cost seconds at every start; the NVIDIA wheels torch depends on settle builds without
    a tag (Linux PyPI torch is CUDA 12).
    """
    version = installed_version("torch") or ""
    tag = re.search(r"\+cu(\d+)", version)
    if tag:
        return tag.group(1)[:-1] or None
    if "+" not in version and any(installed_version(n) for n in ("nvidia-cuda-runtime-cu12", "nvidia-cublas-cu12")):
        return "12"
    return None


def webui_pins(requirements_file: Path | None = None) -> list[str]:
    """Names the WebUI's requirements file pins with ``==`` (launch_utils' ``requirements_met``
    compares exactly those with what is installed, and reinstalls everything when one differs)."""
    path = requirements_file or Path(os.environ.get("REQS_FILE", "requirements_versions.txt"))
    try:
        text = path.read_text(encoding="utf8")
    except OSError:
        return []
    names = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        match = RE_REQUIREMENT.match(line) if line.strip() else None
        if match and match.group(2):
            names.append(match.group(1))
    return names


def constraints(protected: Iterable[str] = PROTECTED, requirements_file: Path | None = None) -> list[str]:
    """Constraint lines pinning, at the installed version, ``protected``, what the WebUI's
    requirements file pins, and every NVIDIA wheel."""
    lines = []
    for name in [*protected, *webui_pins(requirements_file)]:
        version = installed_version(name)
        if version is None:
            continue
        lines.append(f"{name}=={version}")
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name") or ""
        if _norm(name).startswith("nvidia-") and not _norm(name).startswith("nvidia-modelopt"):
            lines.append(f"{name}=={dist.version}")
    return sorted(set(lines))


def source_digest(root: Path) -> str:
    """A digest of the package source under ``root`` (``sd_accel/`` and ``pyproject.toml``)."""
    digest = hashlib.sha256()
    files = sorted(p for p in (root / "sd_accel").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in [root / "pyproject.toml", *files]:
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def checkout_root(extension_dir: Path = EXTENSION_DIR) -> Path | None:
    """The sd-accel repository this folder belongs to, when it is one."""
    root = extension_dir.resolve().parent
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and re.search(r'^name\s*=\s*"sd-accel"', pyproject.read_text(), re.M):
        return root
    return None


# --------------------------------------------------------------------------- the plan


def sd_accel_source(extension_dir: Path, stamp: Path) -> tuple[str | None, str]:
    """(what to pip install for sd-accel or None, why)."""
    env = os.environ.get("SD_ACCEL_SOURCE", "").strip()
    if env:
        if stamp.is_file() and stamp.read_text().strip() == f"env:{env}" and installed_version("sd-accel"):
            return None, f"sd-accel from {env} is installed"
        return env, f"SD_ACCEL_SOURCE={env}"
    root = checkout_root(extension_dir)
    if root is not None:
        digest = source_digest(root)
        if stamp.is_file() and stamp.read_text().strip() == digest and installed_version("sd-accel"):
            return None, f"sd-accel from {root} is installed and unchanged"
        return str(root), f"the checkout at {root}"
    if installed_version("sd-accel"):
        return None, f"sd-accel {installed_version('sd-accel')} is installed"
    return None, ("no sd-accel source: set SD_ACCEL_SOURCE to a pip requirement or path "
                  "(e.g. the sd-accel repository), or install this folder from its repository")


def missing(requirements: Iterable[str], is_installed: Callable[[str], bool]) -> list[str]:
    """The requirements to install: absent, or installed at a version that does not satisfy them.

    A module that imports without distribution metadata (``launch.is_installed`` finds it by
    import spec) is left alone: replacing what someone put there is not ours to do.
    """
    todo = []
    for requirement in requirements:
        name = requirement_name(requirement)
        version = installed_version(name)
        if (version is None and not is_installed(name)) or (version is not None and not satisfied(requirement, version)):
            todo.append(requirement)
    return todo


def openvino_requirements() -> tuple[list[str], str]:
    """(OpenVINO packages to install, why / why not): for WebUIs that compute on the CPU."""
    switch = os.environ.get("SD_ACCEL_INSTALL_OPENVINO", "").strip()
    if switch == "0":
        return [], "SD_ACCEL_INSTALL_OPENVINO=0"
    args = os.environ.get("COMMANDLINE_ARGS", "") + " " + " ".join(sys.argv[1:])
    cpu_flags = "--always-cpu" in args or re.search(r"--use-cpu\s+(all|sd)\b", args) is not None
    if switch != "1" and torch_cuda_major() is not None and not cpu_flags:
        return [], "torch is a CUDA build: TensorRT is the fast backend there"
    todo = [r for r in OPENVINO if not satisfied(r, installed_version(requirement_name(r)))]
    return todo, "the WebUI computes on the CPU: OpenVINO is the fast CPU backend"


def tensorrt_requirements() -> tuple[list[str], str]:
    """(TensorRT packages to install, why / why not)."""
    if os.environ.get("SD_ACCEL_INSTALL_TENSORRT", "").strip() == "0":
        return [], "SD_ACCEL_INSTALL_TENSORRT=0"
    cuda = torch_cuda_major()
    if cuda is None:
        return [], "torch is not a CUDA build: engines use ONNX Runtime"
    # 10.x and 11.x are supported; the -cuXX package pins the libraries for torch's CUDA.
    wanted = [f"tensorrt-cu{cuda}>=10.0,<12", *TENSORRT]
    todo = [r for r in wanted if not satisfied(r, installed_version(requirement_name(r)))]
    if todo and installed_version("tensorrt"):  # the meta package or another -cuXX build is there
        version = installed_version("tensorrt") or ""
        if satisfied(">=10.0,<12", version):
            todo = [r for r in todo if not requirement_name(r).startswith("tensorrt")]
    return todo, f"torch is built for CUDA {cuda}"


def check_versions() -> list[str]:
    """Problems that make sd-accel unusable in this WebUI (an empty list: fine)."""
    problems = []
    if sys.version_info[:2] < MIN_PYTHON:
        problems.append(f"Python {sys.version.split()[0]} is older than {'.'.join(map(str, MIN_PYTHON))}")
    torch = installed_version("torch")
    if torch and _release(torch)[:2] < MIN_TORCH:
        problems.append(f"torch {torch} is older than {'.'.join(map(str, MIN_TORCH))}; update the WebUI")
    gradio = installed_version("gradio")
    if gradio and _release(gradio)[:2] < MIN_GRADIO:
        problems.append(f"gradio {gradio} is older than {'.'.join(map(str, MIN_GRADIO))}; update the WebUI")
    return problems


# --------------------------------------------------------------------------- doing it


def _quote(arg: str) -> str:
    return f'"{arg}"'


def _pip(run_pip: Callable, args: list[str], desc: str, constraints_file: Path, quiet: bool = False) -> bool:
    """``launch.run_pip("install ...")``; False (and a message unless ``quiet``) when pip fails."""
    named = [requirement_name(a) for a in args if not a.startswith("-") and not Path(a).exists()]
    bad = [n for n in named if _norm(n) in {_norm(x) for x in NEVER_INSTALL}]
    if bad:  # a guard against this file's own mistakes
        raise AssertionError(f"refusing to install {bad} into the WebUI")
    command = "install " + " ".join(_quote(a) if not a.startswith("-") else a for a in args)
    command += f" -c {_quote(str(constraints_file))}"
    try:
        run_pip(command, desc)
        return True
    except Exception as exc:  # the WebUI's run_pip raises RuntimeError with pip's output
        if not quiet:
            say(f"could not install {desc}: {str(exc).strip()[-2000:]}")
        return False


def imports(module: str) -> str | None:
    """None when ``module`` imports in a fresh interpreter of this Python, else why not (the last
    line of its error). A fresh process, not this one: a failed import leaves half-initialised
    modules (and loaded C extensions) behind here, and the next candidate release was judged on
    them ("partially initialized module 'onnx' has no attribute 'defs'" for an onnx 1.17 that
    imports fine)."""
    import subprocess

    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    if result.returncode == 0:
        return None
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {result.returncode}"


IMPORT_NAME = {"onnxruntime": "onnxruntime", "openvino": "openvino", "onnx": "onnx", "filelock": "filelock",
               "platformdirs": "platformdirs", "tqdm": "tqdm", "polygraphy": "polygraphy"}


# Tried (without dependencies) when the newest release does not import beside the WebUI's pins.
# Forge pins protobuf 3.20.0: onnx 1.23 imports google.protobuf.runtime_version (protobuf >= 5) and
# fails there; onnx 1.17.0 imports, exports and converts with it (checked on a real Forge 2025);
# releases in between are not checked, hence the cap at 1.17.
NO_DEPS_FALLBACK = {"onnx": ("onnx>=1.16,!=1.16.2,<1.18",)}


def install_pinned(launch, requirement: str, desc: str, pins: Path) -> bool:
    """Install ``requirement`` under the pins; when pip cannot (a dependency would have to move),
    once more without dependencies, then older known-good releases (:data:`NO_DEPS_FALLBACK`),
    each kept only if it then imports. True when it is installed."""
    if _pip(launch.run_pip, [requirement], desc, pins, quiet=True):
        return True
    name = requirement_name(requirement)
    say(f"{requirement} cannot be installed without moving a package the WebUI pins; trying it without "
        "its dependencies (the pinned versions stay)")
    why = "pip could not install it"
    for candidate in (requirement, *NO_DEPS_FALLBACK.get(_norm(name), ())):
        if not _pip(launch.run_pip, ["--no-deps", candidate], f"{candidate} for sd-accel (without dependencies)", pins):
            continue
        why = imports(IMPORT_NAME.get(_norm(name), name.replace("-", "_")))
        if why is None:
            say(f"{name} {installed_version(name)} installed without its dependencies; it imports with the "
                "WebUI's pinned packages")
            return True
        say(f"{name} {installed_version(name)} does not import with the WebUI's pinned packages ({why})")
    say(f"{name} does not work with the WebUI's pinned packages ({why}); removing it again. sd-accel runs without "
        "it; the sd-accel tab says what that leaves")
    uninstall(launch, name)
    return False


def uninstall(launch, name: str) -> None:
    """``pip uninstall -y name`` with the WebUI's Python. Not through ``launch.run_pip``: it appends
    ``--prefer-binary`` (and ``--index-url``), which ``pip uninstall`` rejects, so the broken package
    stayed."""
    if not installed_version(name):
        return
    try:
        launch.run(f'"{getattr(launch, "python", sys.executable)}" -m pip uninstall -y {_quote(name)}',
                   f"Removing {name}", f"Couldn't remove {name}")
    except Exception as exc:  # nothing more to do: the message above stands
        say(f"could not remove {name}: {exc}")


def main(extension_dir: Path = EXTENSION_DIR, launch_module=None, stamp: Path | None = None) -> int:
    """Install what is missing; returns 0 always (problems are printed, the WebUI starts).

    ``launch_module`` and ``stamp`` default to the WebUI's ``launch`` and ``<extension>/.sd_accel_installed``.
    """
    try:
        launch = launch_module or __import__("launch")
        problems = check_versions()
        if problems:
            say("sd-accel stays off: " + "; ".join(problems))
            return 0
        stamp = stamp or extension_dir / STAMP_NAME
        with tempfile.TemporaryDirectory(prefix="sd-accel-install-") as tmp:
            pins = Path(tmp) / "constraints.txt"
            pins.write_text("\n".join(constraints()) + "\n")
            source, why = sd_accel_source(extension_dir, stamp)
            if source is not None:
                if _pip(launch.run_pip, ["--no-deps", source], f"sd-accel from {why}", pins):
                    stamp.write_text(f"env:{source}" if os.environ.get("SD_ACCEL_SOURCE") else
                                     source_digest(Path(source)))
            elif not installed_version("sd-accel"):
                say(why)
            for requirement in missing(REQUIREMENTS, launch.is_installed):
                install_pinned(launch, requirement, f"{requirement} for sd-accel", pins)
            openvino, why = openvino_requirements()
            if openvino:
                say(f"installing OpenVINO ({why}); set SD_ACCEL_INSTALL_OPENVINO=0 to skip it")
                for requirement in openvino:
                    install_pinned(launch, requirement, f"{requirement} for sd-accel", pins)
            trt, why = tensorrt_requirements()
            if trt:
                say(f"installing TensorRT ({why}); set SD_ACCEL_INSTALL_TENSORRT=0 to skip it")
                _pip(launch.run_pip, trt, "TensorRT for sd-accel", pins)
        return 0
    except Exception:
        say(f"failed; the WebUI starts without changes from sd-accel:\n{traceback.format_exc()}")
        return 0


if __name__ == "__main__":
    main()
