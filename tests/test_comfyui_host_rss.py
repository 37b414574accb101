"""scripts/comfyui_host_rss.py: what it reads from ComfyUI's log and /proc, and the build graph
it sends (the measurement itself needs a real ComfyUI: scripts/BENCHMARKS.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support.scripts import load  # noqa: E402

rss = load("comfyui_host_rss")


def test_unet_calls_are_read_from_the_pack_lines():
    text = ("got prompt\nsd-accel: UNet calls this run: 8 on engines, 0 in PyTorch (8 with ControlNet residuals)\n"
            "100%|####| 4/4 [00:20<00:00,  5.01s/it]\n"
            "sd-accel: UNet calls this run: 0 on engines, 8 in PyTorch (8x not enough memory)\n")
    assert rss.unet_calls(text) == [
        {"engines": 8, "pytorch": 0, "note": "(8 with ControlNet residuals)"},
        {"engines": 0, "pytorch": 8, "note": "(8x not enough memory)"},
    ]


def test_peak_is_read_and_reset_for_our_own_process():
    ballast = bytearray(64 << 20)  # touched: 64 MiB resident
    ballast[::4096] = b"x" * len(ballast[::4096])
    before = rss.vm_kib(os.getpid(), "VmHWM")
    assert before >= rss.vm_kib(os.getpid(), "VmRSS") - 1024 and before > 64 << 10
    del ballast
    if rss.reset_peak(os.getpid()):  # (a kernel without clear_refs 5 keeps the old mark)
        assert rss.vm_kib(os.getpid(), "VmHWM") <= rss.vm_kib(os.getpid(), "VmRSS") + (16 << 10)
    assert rss.vm_kib(2**22 + 12345, "VmHWM") == 0  # no such process


def test_build_graph_builds_both_unets_per_preset_and_the_decoder_once():
    import argparse

    args = argparse.Namespace(ckpt="sd15.safetensors", presets="static-512,dynamic-512-768", backend="openvino",
                              precision="bf16", control_presets="static-512,dynamic-512-768")
    g = rss.build_graph(args)
    jobs = sorted((n["inputs"]["components"], n["inputs"]["preset"]) for n in g.values()
                  if n["class_type"] == "SdAccelBuildEngines")
    assert jobs == [("unet", "dynamic-512-768"), ("unet", "static-512"), ("unet_control", "dynamic-512-768"),
                    ("unet_control", "static-512"), ("vae_decoder", "static-512")]
    from sd_accel.comfyui.build import COMPONENT_CHOICES
    from sd_accel.profiles import PRESETS

    assert all(c in COMPONENT_CHOICES and p in PRESETS for c, p in jobs)  # what the Build node lists
