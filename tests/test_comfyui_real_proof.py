"""scripts/comfyui_real_proof.py needs a real ComfyUI; its pure parts (the pack's log lines, the
sampler's rate from ComfyUI's progress bar, PSNR, what fails the proof) run here."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _script():
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("comfyui_real_proof", ROOT / "scripts" / "comfyui_real_proof.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOG = """got prompt
sd-accel: refitting the flux transformer_control engine of ckpt-0123456789 for tiny-flux-kohya (0.7) at its first call
  0%|          | 0/4 [00:00<?, ?it/s]\r 25%|##5       | 1/4 [00:40<02:00, 40.10s/it]\r100%|##########| 4/4 [00:43<00:00, 10.85s/it]
sd-accel: flux transformer calls this run: 4 on engines, 0 in PyTorch
Prompt executed in 50.00 seconds
"""


def test_the_pack_lines_and_their_call_counts():
    p = _script()
    lines = p.run_lines(LOG)
    assert lines[0].startswith("sd-accel: refitting") and lines[-1].endswith("4 on engines, 0 in PyTorch")
    assert p.calls(lines) == (4, 0)
    assert p.calls(["sd-accel: sd3 transformer calls this run: 6 on engines, 2 in PyTorch (2x why)",
                    "sd-accel: UNet calls this run: 1 on engines, 0 in PyTorch"]) == (7, 2)
    assert p.calls(["got prompt"]) is None


def test_seconds_per_step_from_the_last_finished_bar():
    p = _script()
    assert p.seconds_per_step(LOG) == 10.85
    assert p.seconds_per_step("100%|#| 4/4 [00:01<00:00,  2.50it/s]") == 0.4
    assert p.seconds_per_step("no bar") is None
    assert p.executed_seconds(LOG) == 50.0 and p.executed_seconds("") is None


def test_psnr():
    p = _script()
    a = np.zeros((4, 4, 3), dtype=np.uint8)
    assert math.isinf(p.psnr(a, a))
    b = a.copy()
    b[0, 0, 0] = 255  # mse = 255^2 / 48
    assert abs(p.psnr(a, b) - 10 * math.log10(48)) < 1e-9


def test_verdict_fails_a_pytorch_call_or_a_difference():
    p = _script()
    runs = {"t": {"engines": False, "calls": None}, "e": {"engines": True, "calls": (4, 0)}}
    good = [{"engine": "e", "latent_max_diff": 2e-6, "psnr_db": math.inf}]
    assert p.verdict(runs, good) == []
    assert p.verdict({"e": {"engines": True, "calls": (3, 1)}}, good)
    assert p.verdict({"e": {"engines": True, "calls": None}}, good)
    assert p.verdict(runs, [{"engine": "e", "latent_max_diff": 2e-2, "psnr_db": 60.0}])
    assert p.verdict(runs, [{"engine": "e", "latent_max_diff": 2e-6, "psnr_db": 30.0}])
    assert p.verdict(runs, [{"engine": "e", "latent_max_diff": float("nan"), "psnr_db": None}])
    assert p.verdict(runs, good, {"ControlNet": 0.5}) == []
    assert p.verdict(runs, good, {"ControlNet": 0.0})  # (the net did not reach the latent)


def test_the_graphs_put_the_build_node_before_the_lora_and_the_controlnet_on_the_conditioning():
    p = _script()
    e = p.flux_graph("x", True, 0.7, True)
    assert e["7"]["class_type"] == "SdAccelBuildEngines" and e["7"]["inputs"]["components"] == "unet+unet_control"
    assert e["8"]["inputs"]["model"] == ["7", 0] and e["5"]["inputs"]["model"] == ["8", 0]
    assert e["5"]["inputs"]["positive"] == ["13", 0] and e["13"]["class_type"] == "ControlNetApplyAdvanced"
    t = p.flux_graph("x", False, 0.7, True)
    assert "7" not in t and t["8"]["inputs"]["model"] == ["1", 0]
    assert {k: v for k, v in e.items() if k != "7"} == {**t, "8": e["8"]}  # the same graph but the pack's node
    s = p.sd3_graph("y", True, True)
    assert s["5"]["inputs"]["model"] == ["7", 0] and s["13"]["inputs"]["vae"] == ["20", 0]
    assert set(p.sd3_graph("y", False, True)) == set(s) - {"7"}


def test_saved_takes_exactly_the_prefix(tmp_path):
    p = _script()
    for name in ("s_t_00001_.latent", "s_t_cn_00001_.latent", "s_t_00002_.latent", "s_t_cn_00002_.latent"):
        (tmp_path / name).write_bytes(b"")
    assert p.saved(tmp_path, "s_t", "latent").name == "s_t_00002_.latent"
    assert p.saved(tmp_path, "s_t_cn", "latent").name == "s_t_cn_00002_.latent"
    try:
        p.saved(tmp_path, "s_e", "latent")
    except FileNotFoundError:
        pass
    else:
        raise AssertionError("no s_e file")
