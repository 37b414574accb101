"""What we run on: the device arch key that is part of every engine key, library versions, and the
memory a new allocation can get."""

from __future__ import annotations

import importlib.metadata
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_int8_dot() -> bool:
    """Whether this x86 CPU has int8 dot-product instructions (VNNI or AMX). Without them int8
    kernels multiply u8 by s8 into int16 pairs (``vpmaddubsw``), which saturate: quantized weights
    must then keep to 7 bits (NNCF's overflow fix) or the engine's error grows."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


def cpu_class() -> str:
    """A key for CPU engines, e.g. ``cpu-x86_64-avx512-vnni-bf16``: ORT's optimized models bake in
    ISA-specific layouts (NCHWc blocks), and int8/bf16 kernels depend on VNNI/BF16/AMX."""
    machine = platform.machine().lower() or "cpu"
    flags = cpu_flags()
    if "avx512f" in flags:
        parts = ["avx512"]
    elif "avx2" in flags:
        parts = ["avx2"]
    elif "asimd" in flags or machine in ("arm64", "aarch64"):
        parts = ["neon"]
    else:
        parts = ["generic"]
    for flag, tag in (("avx512_vnni", "vnni"), ("avx_vnni", "vnni"), ("avx512_bf16", "bf16"), ("amx_bf16", "amx")):
        if flag in flags and tag not in parts:
            parts.append(tag)
    return "-".join(["cpu", machine, *parts])


def gpu_arch(index: int = 0) -> str:
    """``sm89`` for an RTX 4090, ``sm90`` for an H100: TensorRT engines are tied to it."""
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def arch_for(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_arch(device.index or 0)
    return cpu_class()


def version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class DeviceInfo:
    device: str
    name: str
    arch: str
    memory_gb: float | None


def describe(device: torch.device | str = "cuda" if torch.cuda.is_available() else "cpu") -> DeviceInfo:
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device.index or 0)
        return DeviceInfo(str(device), props.name, arch_for(device), round(props.total_memory / 2**30, 1))
    return DeviceInfo(str(device), platform.processor() or platform.machine(), arch_for(device), None)


def versions() -> dict[str, str | None]:
    return {
        name: version_of(pkg)
        for name, pkg in (
            ("torch", "torch"),
            ("diffusers", "diffusers"),
            ("transformers", "transformers"),
            ("onnx", "onnx"),
            ("onnxruntime", "onnxruntime"),
            ("openvino", "openvino"),
            ("nncf", "nncf"),
            ("tensorrt", "tensorrt"),
            ("polygraphy", "polygraphy"),
            ("xformers", "xformers"),
        )
    }


def available_memory() -> int | None:
    """Bytes a new allocation can get now: ``MemAvailable`` plus free swap (``/proc/meminfo``), or
    None where that cannot be told (no such file: then nothing is refused for memory). The one
    reading of it that the build's checks, refits and chained engines share."""
    fields = _meminfo()
    try:
        return (int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0])) * 1024
    except (KeyError, ValueError):
        return None


def total_memory() -> int | None:
    """The machine's memory in bytes (``MemTotal``), or None where that cannot be told."""
    try:
        return int(_meminfo()["MemTotal"].split()[0]) * 1024
    except (KeyError, ValueError):
        return None


def _meminfo() -> dict[str, str]:
    try:
        return dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    except OSError:
        return {}
