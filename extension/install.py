"""Install sd-accel into the WebUI's Python; the WebUI's launcher runs this file at each start.

Rules, because a broken WebUI is the worst outcome of an extension install:

- Only the WebUI's own helpers are used (``launch.is_installed``, ``launch.run_pip``), so pip
  runs with the WebUI's Python, index settings and console output.
- sd-accel itself is installed with ``--no-deps``, then only the extra packages its WebUI path
  imports, each only when missing or too old: onnx, onnxruntime, filelock, platformdirs, tqdm
  (:data:`REQUIREMENTS`). Never torch, torchvision, gradio or transformers (A1111 1.x pins Gradio
  3.41, Forge 4.x; both pin their torch), and not diffusers: the WebUI path runs the WebUI's own
  UNet and does not import it (only the tab's Generate-with-a-diffusers-model does).
- Every pip call gets a constraints file that pins what is installed of torch, gradio,
  transformers, numpy, the NVIDIA CUDA wheels and the rest of :data:`PROTECTED` (protobuf may
  move within its major version: onnx needs >= 3.20.2, A1111 pins 3.20.0). A package that would
  need any of them changed is not installed; the console and the sd-accel tab say so.
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


def constraints(protected: Iterable[str] = PROTECTED) -> list[str]:
    """Constraint lines pinning what is installed of ``protected`` and of every NVIDIA wheel."""
    lines = []
    for name in protected:
        version = installed_version(name)
        if version is None:
            continue
        if _norm(name) == "protobuf":
            major = _release(version)[0]
            lines.append(f"protobuf>={version.split('+')[0]},<{major + 1}")
        else:
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


def _pip(run_pip: Callable, args: list[str], desc: str, constraints_file: Path) -> bool:
    """``launch.run_pip("install ...")``; False (and a message) when pip fails."""
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
        say(f"could not install {desc}: {str(exc).strip()[-2000:]}")
        return False


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
                _pip(launch.run_pip, [requirement], f"{requirement} for sd-accel", pins)
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
