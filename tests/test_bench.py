"""The benchmark harness end to end on builtin:tiny-sd15 (``--tiny``): every row, JSON and
Markdown written, ratios and accuracy computed. Timings are never asserted."""

from __future__ import annotations

import importlib.util
import json

import pytest

from support.scripts import load

bench = load("bench")  # scripts/bench.py: the harness lives beside the package, not in it
CPU_VARIANTS, main = bench.CPU_VARIANTS, bench.main

HAS = {name: importlib.util.find_spec(name) is not None for name in ("openvino", "nncf")}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    md = out / "BENCHMARKS.md"
    assert main(["--tiny", "--out", str(out), "--markdown", str(md), "--engine-dir", str(out / "engines")]) == 0
    return out, json.loads((out / "bench.json").read_text()), md.read_text()


@pytest.mark.slow
def test_every_row_is_reported(report):
    _, data, md = report
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == list(CPU_VARIANTS)
    for name in ("diffusers", "sd-accel-torch", "ort-fp32"):
        assert not rows[name]["skipped"], rows[name]["skipped"]
    assert not rows["ort-int8"]["skipped"] and not rows["ort-int8-dynamic"]["skipped"]
    if HAS["openvino"]:
        assert not rows["openvino-fp32"]["skipped"], rows["openvino-fp32"]["skipped"]
    if HAS["openvino"] and HAS["nncf"]:
        assert not rows["openvino-int8"]["skipped"], rows["openvino-int8"]["skipped"]
        # the int8 row quantizes the UNet and keeps CLIP and the VAE decoder as float engines
        assert rows["openvino-int8"]["engine_rel_l2"].keys() >= {"unet.int8", "clip.bf16", "vae_decoder.bf16"} or \
            rows["openvino-int8"]["engine_rel_l2"].keys() >= {"unet.int8", "clip.fp32", "vae_decoder.fp32"}
    for r in rows.values():
        assert r["skipped"] or r["unet_ms"] > 0
        assert r["variant"] in md  # skipped rows say why in the table too


@pytest.mark.slow
def test_ratios_and_accuracy_against_plain_diffusers(report):
    _, data, _ = report
    ref, *others = [r for r in data["rows"] if not r["skipped"]]
    assert ref["variant"] == "diffusers" and ref["unet_speedup"] == 1.0 and ref["latent_rel_l2"] == 0.0
    for r in others:
        assert r["unet_speedup"] == pytest.approx(ref["unet_ms"] / r["unet_ms"])
        assert r["e2e_speedup"] == pytest.approx(ref["s_per_image"] / r["s_per_image"])
        assert 0 <= r["latent_rel_l2"] < 1.0 and r["psnr_db"] > 10
    engine_rows = [r for r in others if r["variant"].startswith(("ort", "openvino"))]
    assert engine_rows
    for r in engine_rows:  # built here (a fresh engine folder), each engine validated against torch
        assert r["build_s"] > 0 and r["engine_rel_l2"], r["variant"]
        assert all(v is not None and 0 <= v < 1.0 for v in r["engine_rel_l2"].values()), r["engine_rel_l2"]


@pytest.mark.slow
def test_timings_add_up(report):
    """Every timing is measured (positive), and the parts fit the whole. --tiny times one run of 3
    steps per row, so the medians are that run's own numbers and the sums are exact."""
    _, data, _ = report
    cfg = data["config"]
    assert (cfg["steps"], cfg["repeats"]) == (3, 1)
    for r in (r for r in data["rows"] if not r["skipped"]):
        for key in ("clip_ms", "unet_ms", "vae_ms", "it_s", "s_per_image", "s_per_image_20", "load_s"):
            assert r[key] > 0, (r["variant"], key, r[key])
        lo, hi = r["unet_ms_spread"]
        assert 0 < lo <= r["unet_ms"] <= hi
        assert r["s_per_image_spread"] == [r["s_per_image"]] * 2
        # the denoising loop (steps / it_s), CLIP and the VAE make up the image's time
        loop = cfg["steps"] / r["it_s"]
        assert loop + (r["clip_ms"] + r["vae_ms"]) / 1e3 == pytest.approx(r["s_per_image"], rel=1e-6)
        assert r["unet_ms"] / 1e3 < loop  # a UNet call is part of one step
        assert r["s_per_image_20"] > r["s_per_image"]  # 20 steps take longer than 3
        assert 0.1 < r["peak_ram_gb"] < 256  # this process's peak resident memory, in GB


@pytest.mark.slow
def test_markdown_has_table_machine_versions_and_command(report):
    _, data, md = report
    assert "| row |" in md and "Machine:" in md and "onnxruntime" in md
    assert "python scripts/bench.py --tiny" in md and data["command"].startswith("python scripts/bench.py")


@pytest.mark.slow
def test_profile_writes_a_chrome_trace(report, capsys):
    out, _, _ = report
    assert main(["--tiny", "--variants", "diffusers,ort-fp32", "--profile", "--out", str(out / "p"),
                 "--engine-dir", str(out / "engines")]) == 0
    trace = json.loads((out / "p" / "trace-ort-fp32.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "sd-accel:unet" in names and "sd-accel:ort-fp32" in names
    assert "UNet ms/call" in capsys.readouterr().out


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit, match="unknown variants"):
        main(["--tiny", "--variants", "nope"])


def test_rounds_run_every_row_again_in_turn_and_report_its_median_round(tmp_path):
    """``--rounds``: after the first pass every row runs again, in turn; each row reports its
    median round, the spread over all rounds and the highest peak RAM."""
    BenchConfig, run_bench = bench.BenchConfig, bench.run_bench

    cfg = BenchConfig(model="builtin:tiny-sd15", device="cpu", height=64, width=64, steps=2, repeats=1, rounds=3,
                      engine_dir=str(tmp_path / "engines"), out_dir=str(tmp_path / "out"))
    said: list[str] = []
    report = run_bench(cfg, ["diffusers", "sd-accel-torch"], inprocess=True, log=said.append)
    rounds = [line for line in said if "round" in line]
    assert rounds == [f"[bench] {v}: round {n} of 3" for n in (2, 3) for v in ("diffusers", "sd-accel-torch")]
    for row in report["rows"]:
        times = [float(t) for t in row["notes"].split("s/image ")[-1].split("/")]
        assert "median of 3 rounds" in row["notes"] and len(times) == 3
        assert f"{row['s_per_image']:.2f}" == f"{sorted(times)[1]:.2f}"
        lo, hi = row["s_per_image_spread"]
        assert lo <= min(times) + 0.005 and hi >= max(times) - 0.005  # notes round to 10 ms
    assert report["rows"][1]["e2e_speedup"] == report["rows"][0]["s_per_image"] / report["rows"][1]["s_per_image"]


def test_arch_picks_the_family_of_the_default_model(monkeypatch):
    """``--arch sdxl``: the SDXL architecture with random weights at 1024 px (``--tiny``: the tiny
    SDXL); without it, SD 1.5 as before."""
    import argparse

    asked: list[str] = []
    monkeypatch.setattr(bench, "default_model", lambda arch="sd15": asked.append(arch) or f"/cache/{arch}")

    def config(*argv: str):
        p = argparse.ArgumentParser()
        bench.add_arguments(p)
        return bench.config_from_args(p.parse_args(["--device", "cpu", *argv]))[0]

    sdxl = config("--arch", "sdxl")
    assert (sdxl.model, sdxl.height, sdxl.width) == ("/cache/sdxl", 1024, 1024)
    sd15 = config()
    assert (sd15.model, sd15.height) == ("/cache/sd15", 256)
    assert asked == ["sdxl", "sd15"]
    assert config("--arch", "sdxl", "--tiny").model == "builtin:tiny-sdxl"
    assert config("--arch", "sdxl", "--size", "768").height == 768


def test_engine_rows_build_the_components_the_pipeline_has():
    """SDXL's second text encoder gets an engine too; SD 1.x has none to build."""
    _engine_jobs = bench._engine_jobs

    sd15 = ("clip", "unet", "vae_decoder", "vae_encoder")
    assert _engine_jobs("openvino-fp32", sd15) == [("openvino", "fp32", ["clip", "unet", "vae_decoder"])]
    assert _engine_jobs("openvino-fp32", ("clip", "clip2", "unet", "vae_decoder", "vae_encoder")) == [
        ("openvino", "fp32", ["clip", "clip2", "unet", "vae_decoder"])]
    jobs = _engine_jobs("ort-int8", ("clip2", "unet", "vae_decoder"))  # a refiner: no first encoder
    assert jobs[0] == ("onnxruntime", "int8", ["unet"]) and jobs[1][2] == ["clip2", "vae_decoder"]
    # OpenVINO's int8 row too: its int8 VAE decoder cost the image 4.9 dB (issue 31)
    jobs = _engine_jobs("openvino-int8", sd15)
    assert jobs[0] == ("openvino", "int8", ["unet"]) and jobs[1][2] == ["clip", "vae_decoder"]
    assert jobs[1][1] in ("bf16", "fp32")


@pytest.mark.slow
def test_tiny_sdxl_rows_time_both_text_encoders_and_build_clip2(tmp_path):
    BenchConfig, run_bench = bench.BenchConfig, bench.run_bench

    cfg = BenchConfig(model="builtin:tiny-sdxl", device="cpu", height=64, width=64, steps=2, repeats=1,
                      engine_dir=str(tmp_path / "engines"), out_dir=str(tmp_path / "out"))
    report = run_bench(cfg, ["diffusers", "ort-fp32"], inprocess=True, log=lambda m: None)
    ref, ort = report["rows"]
    assert not ref["skipped"] and not ort["skipped"], ort["skipped"]
    assert set(ort["engine_rel_l2"]) == {"clip.fp32", "clip2.fp32", "unet.fp32", "vae_decoder.fp32"}
    assert ref["clip_ms"] > 0 and ort["psnr_db"] > 10


def test_recipes_set_the_model_steps_guidance_size_and_tiny_vae(monkeypatch):
    """``--recipe lcm``: the LCM-distilled SD 1.5 architecture at 512 px, 4 steps, guidance 8 embedded
    (no CFG rows), TAESD decoding every row; ``turbo``: SD-Turbo's SD 2.1-base shape, 1 step, CFG 0."""
    import argparse

    asked: list[tuple] = []
    monkeypatch.setattr(bench, "default_model", lambda arch="sd15", recipe="default", tiny=False:
                        asked.append((arch, recipe, tiny)) or f"/cache/{arch}-{recipe}")
    monkeypatch.setattr(bench, "default_tiny_vae", lambda: "/cache/taesd")

    def config(*argv: str):
        p = argparse.ArgumentParser()
        bench.add_arguments(p)
        return bench.config_from_args(p.parse_args(["--device", "cpu", *argv]))[0]

    lcm = config("--recipe", "lcm")
    assert (lcm.model, lcm.height, lcm.steps, lcm.guidance_scale, lcm.tiny_vae) == ("/cache/sd15-lcm", 512, 4, 8.0,
                                                                                   "/cache/taesd")
    assert not lcm.cfg_rows and lcm.recipe == "lcm"
    turbo = config("--recipe", "turbo", "--tiny")
    assert (turbo.model, turbo.height, turbo.steps, turbo.guidance_scale) == ("/cache/sd2-base-turbo", 64, 1, 0.0)
    assert not turbo.cfg_rows and asked[-1] == ("sd2-base", "turbo", True)
    plain = config()
    assert (plain.steps, plain.guidance_scale, plain.tiny_vae, plain.cfg_rows) == (20, 7.5, "", True)
    assert config("--recipe", "lcm", "--guidance-scale", "1.5", "--tiny-vae", "/my/taesd").tiny_vae == "/my/taesd"
    with pytest.raises(SystemExit, match="leave out --arch"):
        config("--recipe", "turbo", "--arch", "sdxl")
    assert bench.markdown_name(["--recipe", "lcm"]) == "BENCHMARKS-lcm.md"
    assert bench.markdown_name(["--recipe=turbo", "--size", "512"]) == "BENCHMARKS-turbo.md"
    assert bench.markdown_name(["--steps", "4"]) == "BENCHMARKS.md"


@pytest.mark.slow
def test_the_lcm_recipe_runs_one_unet_row_per_image_and_decodes_with_taesd(tmp_path):
    """The few-step rows as measured: the LCM UNet (``timestep_cond``) and TAESD, plain diffusers
    and on engines: one UNet row per call, one call per step, the static ``.nocfg`` UNet engine and a
    TAESD decoder engine built, the Markdown saying which recipe it was."""
    import argparse

    from sd_accel import EngineCache

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    cfg, _, _ = bench.config_from_args(p.parse_args(["--device", "cpu", "--tiny", "--recipe", "lcm",
                                                     "--engine-dir", str(tmp_path / "e"), "--out", str(tmp_path)]))
    report = bench.run_bench(cfg, ["diffusers", "ort-fp32"], inprocess=True, log=lambda m: None)
    ref, ort = report["rows"]
    assert not ort["skipped"], ort["skipped"]
    for row in (ref, ort):
        d = row["details"]
        assert d["unet_rows"] == [1] and d["unet_calls_per_image"] == cfg.steps == 3, d
        assert d["scheduler"] == "LCMScheduler" and d["vae"] == "AutoencoderTiny", d
    assert ort["details"]["engine_stats"]["unet"]["torch_calls"] == 0
    assert ort["details"]["engine_stats"]["vae_decoder"]["torch_calls"] == 0 and ort["psnr_db"] > 30
    records = {r.key.component: r for r in EngineCache(tmp_path / "e" / "ort-fp32").list()}
    assert records["unet"].key.profile.endswith(".nocfg") and "timestep_cond" in records["unet"].shapes
    assert records["vae_decoder"].shapes["latent"][0] == (1, 4, 8, 8)  # 64 px
    md = bench.markdown(report, "python scripts/bench.py --tiny --recipe lcm")
    assert "Recipe `lcm`" in md and "tiny autoencoder" in md and "batch 1: no CFG rows" in md


@pytest.mark.slow
def test_the_controlnet_recipe_runs_the_net_and_the_residual_unet_on_engines(tmp_path):
    """``--recipe controlnet`` (issue 28's row): every row runs the ControlNet pipeline with the same
    net and hint; the engine row builds the ControlNet and the residual-taking UNet (no plain UNet),
    serves every call on them and the table has the ControlNet's ms per call; int8 rows quantize the
    residual-taking UNet and the ControlNet; optimum rows are refused."""
    import argparse

    from sd_accel import EngineCache

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = ["--device", "cpu", "--tiny", "--recipe", "controlnet", "--engine-dir", str(tmp_path / "e"),
            "--out", str(tmp_path)]
    cfg, variants, _ = bench.config_from_args(p.parse_args(args))
    assert cfg.controlnet and variants == list(bench.CONTROL_VARIANTS)
    with pytest.raises(SystemExit, match="optimum-intel has no ControlNet pipeline here"):
        bench.config_from_args(p.parse_args([*args, "--variants", "diffusers,optimum-intel-default"]))
    assert bench.config_from_args(p.parse_args([*args, "--variants", "diffusers,openvino-int8"]))[1] == [
        "diffusers", "openvino-int8"]
    int8_jobs = bench._engine_jobs("openvino-int8", ["clip", "unet", "vae_decoder"], control=True)
    assert [(p, c) for _, p, c in int8_jobs][1:] == [("int8", ["unet_control"]), ("int8", ["controlnet"])]
    report = bench.run_bench(cfg, ["diffusers", "ort-fp32"], inprocess=True, log=lambda m: None)
    ref, ort = report["rows"]
    assert not ort["skipped"], ort["skipped"]
    assert ref["controlnet_ms"] > 0 and ort["controlnet_ms"] > 0
    stats = ort["details"]["engine_stats"]
    assert stats["unet_control"]["torch_calls"] == 0  # (the warm-up's calls and the timed run's)
    assert stats["unet_control"]["engine_calls"] > ort["details"]["unet_calls_per_image"] > 0
    assert stats["controlnet"]["torch_calls"] == 0 and stats["controlnet"]["engine_calls"] > 0
    assert {r.key.component for r in EngineCache(tmp_path / "e" / "ort-fp32").list()} == {
        "clip", "controlnet", "unet_control", "vae_decoder"}
    assert "ControlNet ms/call" in bench.text_table(report) and ort["psnr_db"] > 30


def test_a_controlnet_that_misses_its_check_is_built_in_fp32_and_the_row_says_so(monkeypatch, tmp_path):
    """The controlnet recipe's engine row: the ControlNet alone, last; a ValidationFailed of it in the
    row's precision is built again in fp32 (as engines="auto" does) and named in the row's notes;
    any other component's failure ends the row."""
    import sd_accel
    import sd_accel.build
    from sd_accel.core import ValidationFailed

    asked = []

    def fake_build(pipe, profiles, backend, precision, components, engine_dir, progress, validate=True):
        asked.append((tuple(components), precision))
        if "controlnet" in components and precision != "fp32":
            raise ValidationFailed("engine controlnet... failed validation: relative error 6.10e-02 at opt exceeds 5e-02")
        return []

    monkeypatch.setattr(sd_accel, "build_engines", fake_build)
    monkeypatch.setattr(sd_accel.build, "engine_components", lambda pipe: ["clip", "unet", "vae_decoder"])
    monkeypatch.setattr(bench, "load_model", lambda cfg: object())
    cfg = bench.BenchConfig(model="m", device="cpu", height=64, width=64, engine_dir=str(tmp_path), controlnet="cn")
    built = bench.build_row(cfg, "openvino-bf16")
    assert asked == [(("clip", "vae_decoder", "unet_control"), "bf16"), (("controlnet",), "bf16"),
                     (("controlnet",), "fp32")]
    assert built["precision_fallbacks"]["controlnet"].startswith("fp32 (bf16 missed its check")

    def unet_fails(pipe, profiles, backend, precision, components, engine_dir, progress, validate=True):
        if "unet_control" in components:
            raise ValidationFailed("engine unet_control... failed validation")
        return []

    monkeypatch.setattr(sd_accel, "build_engines", unet_fails)
    with pytest.raises(ValidationFailed, match="unet_control"):
        bench.build_row(cfg, "openvino-bf16")


@pytest.mark.parametrize("name, guidance", [("builtin:tiny-flux", 0.0), ("builtin:tiny-sd3", 4.5)])
def test_transformer_family_rows_time_the_transformer_on_engines(tmp_path, name, guidance):
    """SD3 / SD3.5 and FLUX.1 rows (issue 44): the transformer is the timed denoiser (the table says
    so), every text encoder (T5 too) counts as CLIP, engine rows build only ``components`` at the
    ``text_length`` given, run every transformer call on the engine, and the int8 row quantizes the
    transformer; SD3 runs CFG's two rows per call, FLUX.1 one."""
    BenchConfig, run_bench = bench.BenchConfig, bench.run_bench
    variants = ["diffusers", "ort-fp32"] + (["openvino-int8"] if HAS["openvino"] and HAS["nncf"] else [])
    cfg = BenchConfig(model=name, device="cpu", height=64, width=64, steps=2, repeats=1, guidance_scale=guidance,
                      engine_dir=str(tmp_path / "engines"), out_dir=str(tmp_path / "out"), text_length=32,
                      components="transformer", warmup_steps=1)
    report = run_bench(cfg, variants, inprocess=True, log=lambda m: None)
    rows = {r["variant"]: r for r in report["rows"]}
    assert all(not r["skipped"] for r in rows.values()), {k: r["skipped"] for k, r in rows.items()}
    rows_per_call = [2] if guidance > 1 else [1]
    for variant, r in rows.items():
        assert r["details"]["denoiser"] == "transformer" and r["details"]["unet_rows"] == rows_per_call
        assert r["unet_ms"] > 0 and r["clip_ms"] > 0 and r["details"]["unet_calls_per_image"] == 2
        if variant != "diffusers":
            stats = r["details"]["engine_stats"]["transformer"]
            assert stats["engine_calls"] > 0 and not stats["torch_calls"], stats
            assert r["psnr_db"] > 10 and r["disk_gb"] > 0
    assert set(rows["ort-fp32"]["engine_rel_l2"]) == {"transformer.fp32"}
    if "openvino-int8" in rows:
        assert set(rows["openvino-int8"]["engine_rel_l2"]) == {"transformer.int8"}
    head = bench.table(report)[0]
    assert "transformer ms/call" in head and not any("UNet" in h for h in head)
    with pytest.raises(bench.BenchError, match="no unet"):
        bench.build_row(bench.BenchConfig(**{**bench.asdict(cfg), "components": "unet"}), "ort-fp32")
