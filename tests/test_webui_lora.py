"""LoRAs on the checkpoint's engine in the WebUI: refitted per LoRA set, not rebuilt (issue 14.4).

A1111 (the stand-in's built-in Lora extension merges LoRA weights in each layer's forward, as
A1111's does) and Forge 2 (the UNet patcher's LoRA patches, merged when Forge loads the UNet
for sampling). Each job with a LoRA set that has no engine of its own runs on the checkpoint's
engine refitted to the merged weights; its image equals the PyTorch + LoRA image within the
engine's tolerance (ONNX Runtime fp32).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

STUB = Path(__file__).resolve().parent / "webui_stub"
sys.path.insert(0, str(STUB))
import harness  # noqa: E402
from harness import webui_lean  # noqa: E402, F401  (autouse: see its docstring)

from sd_accel.profiles import Profile  # noqa: E402

STATIC = Profile(batch=1, height=64, width=64)
EXACT = {"sd_accel_backend": "onnxruntime"}
TOL = dict(atol=2e-3, rtol=2e-3)


def _counts(component: str = "ldm_unet"):
    from sd_accel.webui.controller import controller

    engines = controller().loaded(component)
    return sum(e.stats.engine_calls for e in engines), sum(e.stats.torch_calls for e in engines)


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() > 0.03  # 15x the tolerance


def _refit_folders(engine_dir: Path) -> list[Path]:
    root = engine_dir / ".refit"
    return sorted(p for p in root.iterdir()) if root.is_dir() else []


def test_a1111_lora_sets_refit_the_checkpoint_engine(tmp_path, capsys):
    # Two sets kept (the setting; one by default: tests/test_refit_memory.py), to switch back for free.
    webui = harness.start(tmp_path, options={**EXACT, "sd_accel_lora_refits": 2}, loras={"lora-a": 1, "lora-b": 2})
    from sd_accel.webui.controller import controller
    from sd_accel.webui.jobs import build_for_checkpoint

    records = build_for_checkpoint(profile=STATIC, components=("unet",))
    assert records[0].key.model.startswith("ckpt-") and "+lora-" not in records[0].key.model
    ckpt = records[0].extra["webui"]["hash"]
    prompts = {"a": "a cat <lora:lora-a:1:0.8>", "b": "a cat <lora:lora-b:1>", "none": "a cat",
               "a half": "a cat <lora:lora-a:1:0.5>"}

    # PyTorch with the LoRAs, as A1111 runs them without engines (the layers merge in forward).
    webui.shared.opts.sd_unet = "None"
    reference = {name: webui.txt2img(prompt=prompt, steps=2).samples for name, prompt in prompts.items()}
    assert _differs(reference["a"], reference["none"]) and _differs(reference["a"], reference["b"])
    assert _differs(reference["a"], reference["a half"])
    capsys.readouterr()

    webui.shared.opts.sd_unet = "Automatic"

    def job(name: str) -> str:
        out = webui.txt2img(prompt=prompts[name], steps=2)
        text = capsys.readouterr().out
        assert _counts() == (2, 0), (name, text)  # every UNet call on an engine
        torch.testing.assert_close(out.samples, reference[name], **TOL)
        return text

    # A LoRA set with no engine of its own: the checkpoint's engine, refitted (the UNet's layers
    # had nothing merged: the extension makes A1111 merge them), with progress and the job's line.
    text = job("a")
    assert "refitting the engine of " + ckpt in text and "validating against torch" in text
    assert f"UNet on engine {records[0].key.name} refitted for lora-a:0.8 (" in text
    assert "kept from an earlier job" not in text
    # What A1111 expects: the layers carry the job's set and their backups (restored on change).
    unet = webui.shared.sd_model.model.diffusion_model
    layer = unet.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2.to_k
    assert layer.network_current_names == (("lora-a", 1.0, 0.8, None),)
    assert layer.network_weights_backup is not None

    # Another set: one refit. Back to no LoRA: the base engine as it is (no refit, no line).
    assert "refitted for lora-b:1 (" in job("b")
    text = job("none")
    assert "refitt" not in text
    # Back to the first set: kept in memory, no refit.
    text = job("a")
    assert "refitting" not in text and "refitted for lora-a:0.8 (kept from an earlier job: no refit)" in text
    # Another strength is another set; the least recently used set (b) gives way (2 kept).
    text = job("a half")
    assert "refitted for lora-a:0.5 (" in text and "dropped the refit for lora-b:1" in text
    assert len(_refit_folders(tmp_path / "engines")) == 2

    # Never new cache entries: the index holds the base engine only.
    assert [r.key.name for r in controller().records_for_checkpoint(ckpt)] == [records[0].key.name]
    # Engines change (a build, a delete): the refits go with their scratch folders.
    controller().engines_changed()
    assert _refit_folders(tmp_path / "engines") == []


def test_a1111_int8_engine_is_not_refitted(tmp_path, capsys):
    webui = harness.start(tmp_path, options=EXACT, loras={"lora-a": 1})
    from sd_accel.webui.jobs import build_for_checkpoint

    records = build_for_checkpoint(profile=STATIC, components=("unet",), precision="int8-dynamic")
    assert records[0].key.precision == "int8-dynamic"
    webui.shared.opts.sd_unet = "Automatic"
    capsys.readouterr()
    webui.txt2img(prompt="a cat <lora:lora-a:1>", steps=2)
    text = capsys.readouterr().out
    assert _counts() == (0, 2)
    assert "int8-dynamic (weights quantized with calibrated scales)" in text
    assert "build one in the sd-accel tab while these LoRAs are applied" in text
    assert "refitting" not in text and not _refit_folders(tmp_path / "engines")
    # Without LoRA the INT8 engine serves as before.
    webui.txt2img(prompt="a cat", steps=2)
    assert _counts() == (2, 0)


def test_a1111_refits_off_in_the_settings(tmp_path, capsys):
    webui = harness.start(tmp_path, options={**EXACT, "sd_accel_lora_refits": 0}, loras={"lora-a": 1})
    from sd_accel.webui.jobs import build_for_checkpoint

    build_for_checkpoint(profile=STATIC, components=("unet",))
    webui.shared.opts.sd_unet = "Automatic"
    capsys.readouterr()
    webui.txt2img(prompt="a cat <lora:lora-a:1>", steps=1)
    assert _counts() == (0, 1) and "refits are off" in capsys.readouterr().out


def test_forge_lora_patches_refit_the_checkpoint_engine(tmp_path, capsys):
    webui = harness.start(tmp_path, forge=True, options={**EXACT, "sd_accel_lora_refits": 2})
    from sd_accel.webui.controller import controller
    from sd_accel.webui.jobs import build_for_checkpoint

    records = build_for_checkpoint(profile=STATIC, components=("unet",))
    prompts = {"film": "a cat <lora:film:0.8>", "ink": "a cat <lora:ink:1>", "none": "a cat"}

    def engines_on(on: bool) -> None:
        webui.shared.opts.data["sd_accel_forge_enabled"] = on
        webui.shared.opts.data["sd_accel_vae_clip_enabled"] = on

    engines_on(False)
    reference = {name: webui.txt2img(prompt=prompt, steps=2).samples for name, prompt in prompts.items()}
    assert _differs(reference["film"], reference["none"]) and _differs(reference["film"], reference["ink"])
    engines_on(True)
    capsys.readouterr()

    def job(name: str) -> str:
        out = webui.txt2img(prompt=prompts[name], steps=2)
        text = capsys.readouterr().out
        assert _counts() == (2, 0), (name, text)
        torch.testing.assert_close(out.samples, reference[name], **TOL)
        return text

    text = job("film")
    assert f"UNet on engine {records[0].key.name} refitted for film:0.8 (" in text
    assert "refitted for ink:1 (" in job("ink")
    assert "refitt" not in job("none")
    assert "kept from an earlier job: no refit" in job("film")
    assert len(controller().records_for_checkpoint(records[0].extra["webui"]["hash"])) == 1


def test_forge_online_loras_are_not_refitted(tmp_path, capsys, monkeypatch):
    webui = harness.start(tmp_path, forge=True, options=EXACT)
    from backend.patcher.base import ModelPatcher

    from sd_accel.webui.jobs import build_for_checkpoint

    build_for_checkpoint(profile=STATIC, components=("unet",))
    add_patches = ModelPatcher.add_patches

    def online(self, **kwargs):  # Forge's "online LoRA" mode (computed in each forward)
        return add_patches(self, **{**kwargs, "online_mode": True})

    monkeypatch.setattr(ModelPatcher, "add_patches", online)
    capsys.readouterr()
    webui.txt2img(prompt="a cat <lora:film:1>", steps=1)
    text = capsys.readouterr().out
    assert "applied online" in text and "refitting" not in text


def test_forge1_patches_id_tells_loras_and_strengths_apart():
    """Forge 1.x's patcher has only ``patches`` (layer key -> [(strength_patch, value,
    strength_model)]): most LoRAs patch the same layers, so the keys alone cannot name the set."""
    from types import SimpleNamespace

    from sd_accel.webui.identity import forge_loras

    g = torch.Generator().manual_seed(0)
    keys = ["diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight",
            "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_v.weight"]

    def lora(strength: float, seed: int):
        g.manual_seed(seed)
        return SimpleNamespace(patches={k: [(strength, (torch.randn(8, 2, generator=g), torch.randn(2, 8, generator=g),
                                                         2.0, None), 1.0)] for k in keys})

    a, a_again, a_half, b = lora(0.8, 1), lora(0.8, 1), lora(0.5, 1), lora(0.8, 2)
    assert forge_loras(a) == forge_loras(a_again)
    assert forge_loras(a)[0][0].startswith("patched-")
    assert len({forge_loras(a), forge_loras(a_half), forge_loras(b)}) == 3
    assert forge_loras(SimpleNamespace(patches={})) == ()


def test_forge_keeps_lora_keys_while_the_stand_in_is_patched_in(tmp_path):
    """Real Forge leaves the object patch in place after sampling (until it unloads the model) and
    matches the next job's LoRA keys against ``named_parameters``: the stand-in must show the
    UNet's own names, or every LoRA key is skipped and the UNet runs without the LoRA."""
    webui = harness.start(tmp_path, forge=True, options=EXACT)
    webui.txt2img(prompt="a cat", steps=1)  # Forge 2 loads the checkpoint when it generates
    from backend.loader import lora_patches

    from sd_accel.webui.forge import EngineDiffusionModel

    patcher = webui.shared.sd_model.forge_objects.unet
    kmodel = patcher.model
    names = [k for k, _ in kmodel.named_parameters()]
    keys = list(kmodel.state_dict())
    torch_unet = kmodel.diffusion_model
    kmodel.diffusion_model = EngineDiffusionModel(torch_unet, None)  # as a finished job leaves it
    assert [k for k, _ in kmodel.named_parameters()] == names and list(kmodel.state_dict()) == keys
    assert kmodel.diffusion_model.torch_unet is torch_unet
    assert kmodel.diffusion_model.model_channels == torch_unet.model_channels
    clone = patcher.clone()
    patches = lora_patches(kmodel, "/models/Lora/film.safetensors")
    assert len(clone.add_patches(filename="film", patches=patches, strength_patch=0.8)) == len(patches) > 0
    key = next(iter(patches))
    before = kmodel.get_parameter(key).clone()
    clone.refresh_loras()  # Forge merges by those names, through the stand-in, into the UNet's weights
    parent, _, child = key.rpartition(".")
    assert not torch.equal(getattr(torch_unet.get_submodule(parent.removeprefix("diffusion_model.")), child), before)
