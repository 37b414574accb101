#!/usr/bin/env python3
"""Regenerate the TensorRT API name lists in ``tests/support/trt/names/`` from the real binding
wheels, so ``tests/test_trt_names.py`` can check the backend against them offline.

TensorRT cannot be imported without its CUDA libraries, but the compiled binding module
(``tensorrt_bindings/tensorrt.so`` in ``tensorrt-cu12-bindings`` / ``tensorrt-cu13-bindings``, about
1.3 MB each) stores every class, method, property and enum name that pybind11 registers as a
C string in its ``.rodata`` section. This script downloads the wheels with pip (into
``~/.cache/sd-accel/trt-wheels``), reads ``.rodata`` with a small ELF reader, keeps the strings that
look like Python identifiers (mangled C++ type names dropped), adds the names that the wheel's
``__init__.py`` defines in Python (``__version__``, ``volume`` ...), and writes one sorted list per
version with the wheels' file names and sha256 in its header.

The linker merges strings that are tails of other strings (``set_named_weights`` lives inside
``unset_named_weights``), so readers look a name up as "equal to, or a suffix of, a listed name"
(``NameList.has`` in ``tests/support/trt/api_names.py``).

    python scripts/trt_names.py                    # the pinned versions below
    python scripts/trt_names.py --latest           # ask the index for the newest 10.x and 11.x
    python scripts/trt_names.py 10.0.1 --out /tmp  # any other version, somewhere else
    python scripts/trt_names.py --check            # regenerate in memory, compare, exit 1 on a diff
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "tests" / "support" / "trt" / "names"
WHEEL_DIR = Path.home() / ".cache" / "sd-accel" / "trt-wheels"
# The newest 10.x and 11.x on PyPI when the lists were last generated (pip index versions
# tensorrt-cu12-bindings; --latest finds them again), and the oldest 10.x sd-accel accepts.
PINNED = ("10.0.1", "10.16.1.11", "11.4.0.106")
FLAVOURS = ("tensorrt-cu12-bindings", "tensorrt-cu13-bindings")
# One fixed wheel per flavour: names do not depend on the CPython tag, and a fixed file keeps the
# recorded sha256 reproducible.
# Older 10.x wheels are manylinux_2_17 only.
PY_TAG, PLATFORMS = "3.11", ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64")

# A whole identifier, or the identifier ending a qualified name ("nvinfer1::DataType").
TAIL = re.compile(rb"(?:\A|(?<=::)|(?<=\.))[A-Za-z_][A-Za-z0-9_]*\Z")
# Itanium-mangled type names that pybind11 keeps in .rodata (typeid names): N8nvinfer..E,
# St6vector.., PFvRN..E, FiiE. Real API names never look like these.
MANGLED = re.compile(r"^(_Z|N\d|St\d|P*F(?:[a-z]|[PKRNS][A-Za-z0-9]).*E$)|\dnvinfer|\dnvonnxparser|\dpybind11|^_*pybind11|^_M_|cxx11")
MAX_LEN = 64


def rodata(blob: bytes) -> bytes:
    """The ``.rodata`` section of a 64-bit ELF shared object."""
    if blob[:4] != b"\x7fELF" or blob[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    end = "<" if blob[5] == 1 else ">"
    (shoff,) = struct.unpack_from(end + "Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from(end + "HHH", blob, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, offset, size = struct.unpack_from(end + "IIQQQQ", blob, shoff + i * shentsize)
        return name, offset, size

    _, str_off, _ = section(shstrndx)
    for i in range(shnum):
        name, offset, size = section(i)
        label = blob[str_off + name: blob.index(b"\0", str_off + name)]
        if label == b".rodata":
            return blob[offset: offset + size]
    raise ValueError("no .rodata section")


def names_from_so(blob: bytes) -> set[str]:
    out = set()
    for raw in rodata(blob).split(b"\0"):
        # The linker may store "DataType" only as the tail of "nvinfer1::DataType" (older 10.x
        # wheels do); tails of other strings (docstrings) would add English words, not names.
        tail = TAIL.search(raw)
        if tail is None:
            continue
        name = tail.group().decode()
        if len(name) <= MAX_LEN and not MANGLED.search(name):
            out.add(name)
    return out


def names_from_init(source: str) -> set[str]:
    """Top-level names the wheel's ``__init__.py`` defines in Python (``__version__``, ``volume``)."""
    out = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in out if not n.startswith("_") or (n.startswith("__") and n.endswith("__"))}


def names_from_wheel(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as zf:
        members = zf.namelist()
        so = [m for m in members if re.fullmatch(r"tensorrt[^/]*/tensorrt[^/]*\.so", m)]
        init = [m for m in members if re.fullmatch(r"tensorrt[^/]*/__init__\.py", m)]
        if len(so) != 1 or len(init) != 1:
            raise ValueError(f"{path.name}: expected one binding module and one __init__.py, got {so} {init}")
        return names_from_so(zf.read(so[0])) | names_from_init(zf.read(init[0]).decode())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wheel_for(flavour: str, version: str, wheel_dir: Path, download: bool) -> Path | None:
    stem = flavour.replace("-", "_")
    pattern = f"{stem}-{version}-cp{PY_TAG.replace('.', '')}-*manylinux*_x86_64.whl"
    found = sorted(wheel_dir.glob(pattern))
    if found or not download:
        return found[0] if found else None
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", PY_TAG, *(a for p in PLATFORMS for a in ("--platform", p)),
           f"{flavour}=={version}", "-d", str(wheel_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"trt_names: {flavour}=={version}: not downloaded ({proc.stderr.strip().splitlines()[-1:]})",
              file=sys.stderr)
        return None
    found = sorted(wheel_dir.glob(pattern))
    return found[0] if found else None


def render(version: str, wheels: list[Path], names: set[str], identical: bool) -> str:
    lines = [
        "# TensorRT Python API names, for tests/test_trt_names.py. Generated by scripts/trt_names.py; do not edit.",
        f"# version: {version}",
        *(f"# wheel: {w.name} sha256={sha256(w)}" for w in wheels),
        "# source: identifier-like strings in the .rodata of tensorrt_bindings/tensorrt.so (mangled C++ type",
        "#   names dropped), plus the top-level names tensorrt_bindings/__init__.py defines",
        f"# flavours: {'the wheels above hold the same names' if identical else 'union of the wheels above'}",
        "# lookup: the linker merges string tails, so a name is present when it equals or ends a listed name",
        *sorted(names),
    ]
    return "\n".join(lines) + "\n"


def generate(version: str, wheel_dir: Path, download: bool) -> str | None:
    wheels = [w for f in FLAVOURS if (w := wheel_for(f, version, wheel_dir, download)) is not None]
    if not wheels:
        return None
    sets = [names_from_wheel(w) for w in wheels]
    union = set().union(*sets)
    return render(version, wheels, union, all(s == sets[0] for s in sets))


def latest() -> list[str]:
    """The newest 10.x and 11.x of tensorrt-cu12-bindings, from ``pip index versions``."""
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", FLAVOURS[0]],
                          capture_output=True, text=True, check=True)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("Available versions:"))
    versions = [v.strip() for v in line.split(":", 1)[1].split(",")]

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", v))

    out = []
    for major in ("10", "11"):
        mine = [v for v in versions if v.split(".")[0] == major and re.fullmatch(r"[\d.]+(\.post\d+)?", v)]
        if mine:
            out.append(max(mine, key=key))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*", help=f"TensorRT versions (default: {' '.join(PINNED)})")
    ap.add_argument("--latest", action="store_true", help="the newest 10.x and 11.x on the index")
    ap.add_argument("--wheel-dir", type=Path, default=WHEEL_DIR)
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--check", action="store_true", help="compare with the lists in --out; write nothing")
    args = ap.parse_args(argv)
    versions = args.versions or (latest() if args.latest else list(PINNED))
    status = 0
    for version in versions:
        text = generate(version, args.wheel_dir, download=True)
        if text is None:
            print(f"trt_names: no wheel for {version}", file=sys.stderr)
            status = 1
            continue
        path = args.out / f"trt-{version}.txt"
        if args.check:
            same = path.exists() and path.read_text() == text
            print(f"trt_names: {path.name}: {'up to date' if same else 'DIFFERS'}")
            status |= 0 if same else 1
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"trt_names: wrote {path} ({len(text.splitlines())} lines, {len(text.encode())} bytes)")
    return status


if __name__ == "__main__":
    sys.exit(main())
