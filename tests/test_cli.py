"""The sd-accel command, run as a user runs it: in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from PIL import Image


def sd_accel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sd_accel.cli", *args],
        capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )


@pytest.mark.slow
def test_generate_saves_png_with_parameters_and_reports(tmp_path):
    out = tmp_path / "img.png"
    proc = sd_accel("generate", "--steps", "2", "--size", "64x64", "--sampler", "Euler a",
                    "--precision", "bf16", "--seed", "7", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["model"] == "builtin:tiny-sd15"
    assert report["images"] == [str(out)]
    assert report["dtype"] == "bf16" and report["attention"] == "sdpa"
    assert report["unet_calls"] == 2 and report["seed"] == 7
    assert report["generate_s"] > 0 and report["it_per_s"] > 0
    image = Image.open(out)
    assert image.size == (64, 64)
    params = image.text["parameters"]
    assert params.startswith("a photo of a cat")
    assert "Steps: 2" in params and "Sampler: Euler a" in params and "Seed: 7" in params


@pytest.mark.slow
def test_bad_model_path_is_one_clear_line(tmp_path):
    proc = sd_accel("generate", "--model", str(tmp_path / "missing.safetensors"), "--out", str(tmp_path / "x.png"))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("sd-accel: error:")]
    assert len(lines) == 1 and "not found" in lines[0]
    assert "Traceback" not in proc.stderr


def test_unreadable_size_is_rejected_by_the_parser(tmp_path):
    proc = sd_accel("generate", "--size", "64by64", "--out", str(tmp_path / "x.png"))
    assert proc.returncode == 2
    assert "size must look like 512x768" in proc.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--steps", "0"], "GenerationParams.steps=0 is not valid; allowed: an integer from 1 to 150"),
        (["--steps", "-3"], "GenerationParams.steps=-3 is not valid"),
        (["--cfg", "nan"], "GenerationParams.cfg=nan is not valid; allowed: a finite number"),
        (["--batch", "0"], "GenerationParams.batch=0 is not valid"),
        (["--size", "65x64"], "GenerationParams.width=65 is not valid; allowed: a multiple of 8"),
        (["--size", "64x60"], "GenerationParams.height=60 is not valid"),
        (["--sampler", "Eular"], "unknown sampler 'Eular'; closest matches: Euler"),
        (["--seed", "-2"], "GenerationParams.seed=-2 is not valid"),
    ],
)
def test_bad_generation_numbers_are_one_clear_line_before_anything_loads(tmp_path, args, expected):
    out = tmp_path / "x.png"
    proc = sd_accel("generate", *args, "--out", str(out))
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sd-accel: error: ") and expected in lines[0], proc.stderr
    assert not out.exists() and proc.stdout == ""


def test_samplers_lists_presets():
    proc = sd_accel("samplers")
    assert proc.returncode == 0
    names = proc.stdout.splitlines()
    assert "DPM++ 2M Karras" in names
    assert any(line.startswith("Heun") and "2 UNet calls" in line for line in names)


# ---- engine commands --------------------------------------------------------------------


def _json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_doctor_reports_device_versions_and_backends():
    report = _json(sd_accel("doctor", "--json"))
    assert report["arch"].startswith(("cpu-", "sm"))
    assert report["versions"]["torch"] and report["versions"]["onnxruntime"]
    from sd_accel.backends.registry import names

    assert list(report["backends"]) == list(names())  # every backend of the table, OpenVINO included
    ort = report["backends"]["onnxruntime"]
    assert ort["usable"] is True and "fp32" in ort["precisions"] and ort["default_precision"] == "fp32"
    ov = report["backends"]["openvino"]
    assert ov["usable"] is True and ov["default_precision"] in ("bf16", "fp32") and "int8" in ov["precisions"]
    trt = report["backends"]["tensorrt"]
    assert trt["usable"] or ("TensorRT" in trt["why_not"] and trt["install"])
    # auto: OpenVINO on a CPU (a regular dependency), ONNX Runtime where OpenVINO cannot run
    assert [b["name"] for b in report["backends"].values() if b["auto"]] == ["openvino" if ov["usable"] else "onnxruntime"]
    text = sd_accel("doctor").stdout
    assert all(f"backend {name}:" in text for name in names())


@pytest.mark.slow
def test_build_list_generate_delete_prune(tmp_path):
    engines = str(tmp_path / "engines")
    built = _json(sd_accel("build", "--static", "--height", "64", "--width", "64", "--components", "unet,vae",
                           "--engine-dir", engines, "--json"))
    comps = sorted(e["component"] for e in built["engines"])
    assert comps == ["unet", "vae_decoder", "vae_encoder"]
    auto = next(b for b in _json(sd_accel("doctor", "--json"))["backends"].values() if b["auto"])
    assert all(e["backend"].startswith(auto["name"]) for e in built["engines"])  # the default path: auto
    assert {e["precision"] for e in built["engines"]} == {auto["default_precision"]}

    listed = _json(sd_accel("list", "--engine-dir", engines, "--json"))
    assert sorted(e["name"] for e in listed["engines"]) == sorted(e["name"] for e in built["engines"])
    # the ONNX exports are counted beside the engines
    assert sorted(i["component"] for i in listed["intermediates"]) == comps
    assert all(i["kind"] == "onnx" and i["status"] == "kept for 1 engine" for i in listed["intermediates"])
    assert listed["engines_bytes"] == sum(e["size_bytes"] for e in listed["engines"])
    assert listed["intermediates_bytes"] == sum(i["size_bytes"] for i in listed["intermediates"]) > 0
    assert listed["total_bytes"] == listed["engines_bytes"] + listed["intermediates_bytes"]
    text = sd_accel("list", "--engine-dir", engines).stdout
    assert "intermediates" in text and "ONNX export" in text and "3 engines, " in text

    out = tmp_path / "img.png"
    report = _json(sd_accel("generate", "--engines", "--engine-dir", engines, "--size", "64x64", "--steps", "2",
                            "--sampler", "Euler", "--engine-precision", "fp32", "--out", str(out), "--json"))
    assert report["components"]["unet"] == "engine"
    assert report["components"]["vae_decoder"] == "engine"
    assert out.exists()
    # a size no engine covers: the report says torch, and why
    report = _json(sd_accel("generate", "--engines", "--engine-dir", engines, "--size", "72x64", "--steps", "2",
                            "--sampler", "Euler", "--out", str(out), "--json"))
    assert report["components"]["unet"].startswith("torch (no engine covers")

    unet = next(e["name"] for e in built["engines"] if e["component"] == "unet")
    proc = sd_accel("delete", unet, "--engine-dir", engines)
    assert proc.returncode == 0 and unet in proc.stdout
    assert "removed onnx/unet." in proc.stdout  # no engine needs that export any more
    proc = sd_accel("delete", unet, "--engine-dir", engines)
    assert proc.returncode == 2 and "no engine named" in proc.stderr

    proc = sd_accel("prune", "--max-size", "1B", "--engine-dir", engines)
    assert proc.returncode == 0 and "2 engine(s) removed" in proc.stdout and "removed onnx/vae_decoder." in proc.stdout
    listed = _json(sd_accel("list", "--engine-dir", engines, "--json"))
    assert listed["engines"] == [] and listed["intermediates"] == [] and listed["total_bytes"] == 0
    # no hidden gigabytes: nothing but empty lock files is left of the exports
    assert not [p for p in (tmp_path / "engines").rglob("*") if p.is_file() and p.stat().st_size
                and p.name != "index.json"]


@pytest.mark.slow
def test_build_bad_model_and_bad_ranges(tmp_path):
    proc = sd_accel("build", "--model", str(tmp_path / "nope.safetensors"), "--engine-dir", str(tmp_path))
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr
    proc = sd_accel("build", "--static", "--height", "64-128", "--width", "64", "--engine-dir", str(tmp_path))
    assert proc.returncode == 2 and "--static needs single values" in proc.stderr
    proc = sd_accel("build", "--height", "60", "--width", "64", "--engine-dir", str(tmp_path))
    assert proc.returncode == 2 and "multiples of 8" in proc.stderr
    # the one range grammar: N, MIN-MAX or MIN-OPT-MAX (the panel's boxes read the same)
    proc = sd_accel("build", "--height", "64, 128", "--width", "64", "--engine-dir", str(tmp_path))
    assert proc.returncode == 2 and "cannot read the height range '64, 128'" in proc.stderr
    assert "MIN-OPT-MAX" in proc.stderr and "Traceback" not in proc.stderr


def _build_interrupted_at_second_engine(engines, sigint) -> tuple[subprocess.Popen, str]:
    """``sd-accel build`` started with SIGINT set to ``sigint`` (SIG_DFL: a terminal's; SIG_IGN: a
    shell's background job), sent SIGINT once its second engine is being built."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "sd_accel.cli", "build", "--static", "--height", "64", "--width", "64",
         "--engine-dir", str(engines)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ),
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),  # whatever this test run itself was started with
    )
    seen = ""
    deadline = time.time() + 300
    while time.time() < deadline:
        ch = proc.stdout.read(1)
        if not ch:
            break
        seen += ch
        if "[2/" in seen:  # the first engine is done, the second is being built
            proc.send_signal(signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=300)
    return proc, seen + rest


@pytest.mark.slow
def test_a_build_started_with_ctrl_c_ignored_runs_to_its_end(tmp_path):
    import signal

    proc, out = _build_interrupted_at_second_engine(tmp_path / "engines", signal.SIG_IGN)
    assert proc.returncode == 0 and "interrupted" not in out and "4 engine(s) ready" in out, out
    assert len(_json(sd_accel("list", "--engine-dir", str(tmp_path / "engines"), "--json"))["engines"]) == 4


@pytest.mark.slow
def test_ctrl_c_during_build_leaves_no_partial_engine_or_lock(tmp_path):
    import signal

    engines = tmp_path / "engines"
    proc, out = _build_interrupted_at_second_engine(engines, signal.SIG_DFL)
    assert proc.returncode == 130, out
    assert "interrupted" in out
    names = [p.name for p in engines.iterdir()]
    assert not [n for n in names if n.startswith((".tmp", ".trash"))]
    listed = _json(sd_accel("list", "--engine-dir", str(engines), "--json"))
    assert len(listed["engines"]) <= 2  # only whole engines, nothing half-written
    # no stale lock: the same build finishes now
    built = _json(sd_accel("build", "--static", "--height", "64", "--width", "64", "--engine-dir", str(engines),
                           "--json"))
    assert len(built["engines"]) == 4


@pytest.mark.slow
def test_ui_command_serves_the_app_on_localhost(tmp_path):
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "sd_accel.cli", "ui", "--port", str(port),
                             "--engine-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ))
    try:
        deadline = time.time() + 120
        body = None
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as resp:
                    body = resp.read().decode("utf-8", "replace")
                    break
            except OSError:
                time.sleep(1)
        assert body is not None, proc.stdout.read() if proc.poll() is not None else "no answer"
        assert "gradio" in body.lower()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
