"""The optimum-intel rows of the benchmark, without optimum-intel: they are in the row list, a
missing venv skips them with the command that creates it, the worker calls the in-repo script
with the venv's python, and the bench model's text encoder is saved in the layout older
transformers read. Nothing here imports optimum (it lives in its own venv)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from support.scripts import load

bench = load("bench")  # scripts/bench.py: the harness lives beside the package, not in it
CPU_VARIANTS, OPTIMUM, OPTIMUM_SETUP, BenchConfig = bench.CPU_VARIANTS, bench.OPTIMUM, bench.OPTIMUM_SETUP, bench.BenchConfig
prefix_text_encoder, run_bench = bench.prefix_text_encoder, bench.run_bench

ROWS = ("optimum-intel-default", "optimum-intel-hybrid-int8", "optimum-intel-int8", "optimum-intel-int4")


def test_the_default_cpu_rows_include_optimum_intel():
    assert set(ROWS) <= set(CPU_VARIANTS) and set(OPTIMUM) == set(ROWS)
    assert bench.OPTIMUM_SCRIPT.exists()  # scripts/bench_optimum.py, run by the worker


def test_a_missing_venv_skips_the_rows_and_names_the_command(tmp_path, monkeypatch):
    monkeypatch.delenv("SD_ACCEL_OPTIMUM_PYTHON", raising=False)
    cfg = BenchConfig(model="builtin:tiny-sd15", device="cpu", height=64, width=64, steps=2, repeats=1,
                      engine_dir=str(tmp_path / "engines"), out_dir=str(tmp_path),
                      optimum_python=str(tmp_path / "nowhere" / "bin" / "python"))
    lines: list[str] = []
    report = run_bench(cfg, list(ROWS), log=lines.append)
    rows = {r["variant"]: r for r in report["rows"]}
    for name in ROWS:
        why = rows[name]["skipped"]
        assert "nowhere/bin/python is missing" in why and OPTIMUM_SETUP in why, why
        assert any(line.startswith(f"[bench] {name}: skipped") and OPTIMUM_SETUP in line for line in lines)
    assert "torch==2.13.0" in OPTIMUM_SETUP and "uninstall -y torchvision" in OPTIMUM_SETUP
    assert "optimum" not in {m.split(".")[0] for m in sys.modules}  # nothing imported it here


def test_a_python_without_optimum_is_refused_too(tmp_path):
    """The main venv's python exists but has no optimum-intel: the skip line says so."""
    cfg = BenchConfig(model="m", device="cpu", height=64, width=64, optimum_python=sys.executable)
    why = bench._optimum_availability(cfg)
    assert "has no optimum-intel" in why and OPTIMUM_SETUP in why
    assert "cpu runs" in bench._optimum_availability(BenchConfig(model="m", device="cuda", height=64, width=64))


def test_the_worker_runs_the_script_with_the_venvs_python(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    cfg = BenchConfig(model=str(model), device="cpu", height=96, width=64, steps=4, repeats=2, seed=7,
                      prompt="a cat", engine_dir=str(tmp_path / "e"), optimum_python="/opt/venv/bin/python")
    cmd = bench._optimum_cmd(cfg, "optimum-intel-hybrid-int8", "run", tmp_path / "work")
    assert cmd[:2] == ["/opt/venv/bin/python", str(bench.OPTIMUM_SCRIPT)]
    args = dict(zip(cmd[2::2], cmd[3::2], strict=True))
    assert args["--phase"] == "run" and args["--mode"] == "hybrid-int8"
    assert args["--result"] == str(tmp_path / "work" / "optimum-intel-hybrid-int8.run.json")
    assert args["--model-dir"] == str(model.resolve())
    assert (args["--height"], args["--width"], args["--steps"], args["--repeats"], args["--seed"],
            args["--prompt"]) == ("96", "64", "4", "2", "7", "a cat")
    assert Path(args["--export-dir"]).is_relative_to(tmp_path / "e" / "optimum-intel-hybrid-int8")


def test_the_few_step_recipes_reach_the_script(tmp_path):
    """Guidance and the tiny autoencoder go to bench_optimum.py; a TAESD decoder makes another export."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text('{"_class_name": "LatentConsistencyModelPipeline"}')
    base = dict(model=str(model), device="cpu", height=512, width=512, engine_dir=str(tmp_path / "e"))
    cmd = bench._optimum_cmd(BenchConfig(**base), "optimum-intel-default", "run", tmp_path)
    plain = dict(zip(cmd[2::2], cmd[3::2], strict=True))
    cfg = BenchConfig(**base, recipe="lcm", guidance_scale=8.0, tiny_vae="/c/taesd-random-seed0")
    cmd = bench._optimum_cmd(cfg, "optimum-intel-default", "run", tmp_path)
    args = dict(zip(cmd[2::2], cmd[3::2], strict=True))
    assert args["--guidance-scale"] == "8.0" and args["--tiny-vae"] == "/c/taesd-random-seed0"
    assert plain["--guidance-scale"] == "7.5" and "--tiny-vae" not in plain
    assert args["--export-dir"] != plain["--export-dir"] and args["--export-dir"].endswith("+taesd-random-seed0")
    script = load("bench_optimum")
    assert script._is_lcm(model) and script.OV_PIPELINES["LatentConsistencyModelPipeline"] == \
        "OVLatentConsistencyModelPipeline"
    (model / "model_index.json").write_text('{"_class_name": "OVLatentConsistencyModelPipeline"}')  # an export
    assert script._is_lcm(model)
    (model / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    assert not script._is_lcm(model)


def test_unknown_variants_list_the_optimum_rows():
    with pytest.raises(SystemExit, match="optimum-intel-default"):
        bench.main(["--tiny", "--variants", "nope"])


def test_the_text_encoder_is_saved_with_the_prefix_older_transformers_need(tmp_path):
    te = tmp_path / "text_encoder"
    te.mkdir()
    weights = {"embeddings.token_embedding.weight": torch.randn(4, 2), "final_layer_norm.bias": torch.zeros(2)}
    save_file(weights, str(te / "model.safetensors"))
    assert prefix_text_encoder(te) is True
    with safe_open(str(te / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == {"text_model." + k for k in weights}
        assert torch.equal(f.get_tensor("text_model.embeddings.token_embedding.weight"),
                           weights["embeddings.token_embedding.weight"])
    assert prefix_text_encoder(te) is False  # already prefixed: left alone


def test_a_clip_with_projection_keeps_its_projection_at_the_top(tmp_path):
    """SDXL's and SD3's second CLIP (and SD3's first) carry ``text_projection`` beside
    ``text_model``: prefixing it too would leave the projection at random init in optimum's venv."""
    te = tmp_path / "text_encoder_2"
    te.mkdir()
    save_file({"embeddings.token_embedding.weight": torch.randn(4, 2), "text_projection.weight": torch.randn(2, 2)},
              str(te / "model.safetensors"))
    assert prefix_text_encoder(te) is True
    with safe_open(str(te / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == {"text_model.embeddings.token_embedding.weight", "text_projection.weight"}


def test_transformer_families_reach_optimum_intels_pipelines(tmp_path):
    """SD3 / FLUX.1 folders map to optimum-intel's own classes; the text length goes to the script;
    the timer and the row-shape readout find the transformer where an SD pipeline has its UNet."""
    from types import SimpleNamespace

    script = load("bench_optimum")
    assert script.OV_PIPELINES["StableDiffusion3Pipeline"] == "OVStableDiffusion3Pipeline"
    assert script.OV_PIPELINES["FluxPipeline"] == "OVFluxPipeline"
    assert script.WEIGHT_BITS == {"int8": 8, "int4": 4} and set(script.VARIANTS) == {OPTIMUM[r] for r in ROWS}
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    cfg = BenchConfig(model=str(model), device="cpu", height=1024, width=1024, engine_dir=str(tmp_path / "e"),
                      text_length=256, guidance_scale=4.5)
    args = dict(zip(*[iter(bench._optimum_cmd(cfg, "optimum-intel-int8", "run", tmp_path)[2:])] * 2, strict=True))
    assert args["--mode"] == "int8" and args["--text"] == "256" and args["--guidance-scale"] == "4.5"
    unet_pipe, dit_pipe = SimpleNamespace(unet="u"), SimpleNamespace(unet=None, transformer="t")
    assert script.denoiser(unet_pipe) == "u" and script.denoiser(dit_pipe) == "t"
    for name, arch in (("text_encoder", "CLIPTextModelWithProjection"), ("text_encoder_2", "CLIPTextModelWithProjection"),
                       ("text_encoder_3", "T5EncoderModel")):
        (model / name).mkdir()
        (model / name / "config.json").write_text(f'{{"architectures": ["{arch}"]}}')
    assert [d.name for d in script._te_folders(model)] == ["text_encoder", "text_encoder_2"]


def test_a_cfg_0_unet_is_reshaped_to_one_row_per_image():
    """optimum-intel's ``reshape`` gives a UNet without ``timestep_cond`` two rows per image (CFG);
    at CFG 0 (SD-Turbo) diffusers calls it with one, which a static two-row model refuses:
    ``unet_rows`` makes it one row, leaving the timestep alone."""
    ov = pytest.importorskip("openvino")
    from types import SimpleNamespace

    import openvino.opset13 as ops

    params = {}
    for name, shape in (("sample", [2, 4, 8, 8]), ("timestep", [1]), ("encoder_hidden_states", [2, 77, 16])):
        params[name] = ops.parameter(shape, ov.Type.f32, name=name)
        params[name].output(0).get_tensor().set_names({name})
    text = ops.unsqueeze(ops.reduce_mean(params["encoder_hidden_states"], [1, 2], keep_dims=False), [1, 2, 3])
    out = ops.add(ops.add(params["sample"], text), params["timestep"])
    model = ov.Model([out], list(params.values()))
    pipe = SimpleNamespace(unet=SimpleNamespace(model=model))
    script = load("bench_optimum")
    script.unet_rows(pipe, 1)
    shapes = {i.get_any_name(): i.get_partial_shape().to_shape() for i in model.inputs}
    assert shapes == {"sample": [1, 4, 8, 8], "timestep": [1], "encoder_hidden_states": [1, 77, 16]}
    assert script._unet_rows_now(pipe) == "[1,4,8,8]"


def test_every_clip_folder_is_re_saved_in_the_layout_the_venv_expects(tmp_path):
    """A SD3-like folder with two CLIPs with projection saved without the ``text_model.`` prefix
    (what newer transformers write for CLIPTextModel): the folder optimum-intel exports from has
    both re-saved with it, ``text_projection`` at the top, T5 and the rest linked as they are."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    script = load("bench_optimum")
    model = tmp_path / "model"
    config = CLIPTextConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                            projection_dim=4, vocab_size=32, max_position_embeddings=8)
    for name in ("text_encoder", "text_encoder_2"):
        te = CLIPTextModelWithProjection(config)
        te.config.architectures = ["CLIPTextModelWithProjection"]
        te.save_pretrained(model / name)
        state = {k.removeprefix("text_model."): v.contiguous() for k, v in te.state_dict().items()}
        for old in (model / name).glob("*.safetensors"):
            old.unlink()
        save_file(state, str(model / name / "model.safetensors"))
    (model / "text_encoder_3").mkdir()
    (model / "text_encoder_3" / "config.json").write_text('{"architectures": ["T5EncoderModel"]}')
    (model / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    prep = script.prepare_source(model, tmp_path / "src")
    src = Path(prep["source"])
    assert src == tmp_path / "src" and set(prep["te_folders"]) == {"text_encoder", "text_encoder_2"}
    for name in ("text_encoder", "text_encoder_2"):
        assert prep["te_folders"][name]["te_layout"] == "added the 'text_model.' prefix"
        with safe_open(str(src / name / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert "text_projection.weight" in keys and "text_model.final_layer_norm.weight" in keys
        assert not (src / name).is_symlink()
    assert (src / "text_encoder_3").is_symlink() and (src / "model_index.json").is_symlink()
