"""scripts/forge_host_rss.py: what it reads from Forge's log and the requests it sends (the
measurement itself needs a real Forge: scripts/BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support.scripts import load  # noqa: E402

rss = load("forge_host_rss")


def _args(**kw):
    base = dict(lora="random-lora", strengths="0.7,1.0", controlnet="cn-random-sd15", controlnet_lora="1.0",
                seed=0, steps=4, size=512)
    return argparse.Namespace(**{**base, **kw})


def test_job_lines_are_read_per_component():
    text = ("Total progress: 100%|####| 4/4 [01:00<00:00, 15.0s/it]\n"
            "sd-accel: UNet calls this job: 4 on engines, 0 in PyTorch\n"
            "sd-accel: UNet with ControlNet residuals calls this job: 4 on engines, 0 in PyTorch\n"
            "sd-accel: VAE decoder calls this job: 1 on engines, 0 in PyTorch\n"
            "sd-accel: text encoder calls this job: 0 on engines, 2 in PyTorch (2x no engine covers it)\n")
    assert rss.job_calls(text) == [
        {"component": "UNet", "engines": 4, "pytorch": 0, "note": ""},
        {"component": "UNet with ControlNet residuals", "engines": 4, "pytorch": 0, "note": ""},
        {"component": "VAE decoder", "engines": 1, "pytorch": 0, "note": ""},
        {"component": "text encoder", "engines": 0, "pytorch": 2, "note": "(2x no engine covers it)"},
    ]


def test_runs_plain_each_strength_then_controlnet_with_the_lora():
    assert rss.runs(_args()) == [("plain", {}), ("lora0.7", {"lora": 0.7}), ("lora1", {"lora": 1.0}),
                                 ("controlnet_lora1", {"controlnet": True, "lora": 1.0})]
    assert rss.runs(_args(strengths="", controlnet="")) == [("plain", {})]
    assert rss.runs(_args(controlnet_lora=""))[-1] == ("controlnet", {"controlnet": True, "lora": None})


def test_txt2img_body_carries_the_lora_tag_and_forges_controlnet_unit():
    body = rss.txt2img_body(_args(), lora=0.7, controlnet="cn-random-sd15 [0d46e21c]", hint_b64="aGk=")
    assert body["prompt"].endswith("<lora:random-lora:0.7>")
    assert (body["width"], body["height"], body["steps"], body["seed"]) == (512, 512, 4, 0)
    unit = body["alwayson_scripts"]["ControlNet"]["args"][0]
    assert unit["model"] == "cn-random-sd15 [0d46e21c]" and unit["module"] == "None" and unit["image"] == "aGk="
    assert "alwayson_scripts" not in rss.txt2img_body(_args())


def test_s_per_it_is_the_samplers_bar_not_forges_total_progress():
    text = (" 50%|##   | 2/4 [01:11<01:08, 34.16s/it]\n"
            "Total progress: 100%|####| 4/4 [02:57<00:00, 36.52s/it]\x1b[A100%|####| 4/4 [03:18<00:00, 49.56s/it]\n"
            "Total progress: 100%|####| 4/4 [02:57<00:00, 44.48s/it]\n")
    assert rss.sampler_s_per_it(text) == 49.56
    assert rss.sampler_s_per_it("100%|####| 4/4 [00:02<00:00,  2.00it/s]") == 0.5
    assert rss.sampler_s_per_it("nothing") != rss.sampler_s_per_it("nothing")  # nan
