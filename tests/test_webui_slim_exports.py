"""The WebUI's builds keep slim ONNX exports (issue 46, disk), as ``build_engines`` does: once its
engines are built, an export keeps its graph only (``weights.json`` names the module's weights; no
``model.onnx.data``), and the next profile is built from that graph with the loaded UNet's weights,
with no new export, on engines that match PyTorch. In the stand-in A1111 (tests/webui_stub), ONNX
Runtime fp32, tiny checkpoint."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

STUB = Path(__file__).resolve().parent / "webui_stub"
sys.path.insert(0, str(STUB))
import harness  # noqa: E402  (the stand-in WebUI's driver, from the folder above)
from harness import webui_lean  # noqa: E402, F401  (autouse: see its docstring)

from sd_accel.profiles import Profile  # noqa: E402

STATIC = Profile(batch=1, height=64, width=64)
DYNAMIC = Profile(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96))


def _exports(engine_dir: Path) -> list[Path]:
    return sorted(p for p in (engine_dir / "onnx").iterdir() if p.is_dir() and not p.name.startswith("."))


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.slow
def test_webui_builds_keep_only_the_graphs_and_rebuild_from_them(tmp_path, caplog):
    from sd_accel.cache.store import EngineCache
    from sd_accel.onnx.weights import WEIGHTS_FILE, is_slim

    engine_dir = tmp_path / "engines"
    webui = harness.start(tmp_path, engine_dir=engine_dir)
    from sd_accel.webui.jobs import build_for_checkpoint

    records = build_for_checkpoint(profile=STATIC, components=["unet", "vae_decoder", "clip"])
    assert {r.key.component for r in records} == {"ldm_unet", "ldm_vae_decoder", "ldm_clip"}
    exports = _exports(engine_dir)
    assert {p.name.split(".")[0] for p in exports} == {"ldm_unet", "ldm_vae_decoder", "ldm_clip"}
    unet = webui.shared.sd_model.model.diffusion_model
    weights_bytes = sum(t.numel() * t.element_size() for t in unet.state_dict().values())
    for folder in exports:
        assert is_slim(folder) and (folder / WEIGHTS_FILE).is_file(), folder.name
        assert not list(folder.glob("*.data")), folder.name  # the weights are gone from the export
    unet_export = next(p for p in exports if p.name.startswith("ldm_unet."))
    assert _bytes(unet_export) < 0.25 * weights_bytes
    # The exports are still counted, and kept for their engines.
    usage = EngineCache(engine_dir).disk_usage()
    assert all(i.engines for i in usage.intermediates) and usage.intermediates_bytes == sum(map(_bytes, exports))
    graph = unet_export / "model.onnx"
    written = (graph.stat().st_ino, graph.stat().st_mtime_ns)

    # Another profile: built from the slim graph with the module's weights, no export.
    caplog.set_level(logging.INFO, logger="sd_accel")
    caplog.clear()
    (dynamic,) = build_for_checkpoint(profile=DYNAMIC, components=["unet"])
    assert dynamic.status == "ok" and dynamic.validation["ok"]
    assert "weights into the graph of ldm_unet" in caplog.text, caplog.text[-2000:]
    assert (graph.stat().st_ino, graph.stat().st_mtime_ns) == written  # not exported again
    assert _exports(engine_dir) == exports and all(is_slim(p) for p in exports)

    # Jobs on the engines match PyTorch, at a size only the dynamic engine covers too.
    for size in (64, 80):
        webui.shared.opts.sd_unet = "None"
        reference = webui.txt2img(prompt="a cat", steps=2, width=size, height=size).samples
        webui.shared.opts.sd_unet = "Automatic"
        got = webui.txt2img(prompt="a cat", steps=2, width=size, height=size).samples
        from sd_accel.webui.controller import controller

        engines = controller().loaded("ldm_unet")
        assert sum(e.stats.engine_calls for e in engines) > 0 and sum(e.stats.torch_calls for e in engines) == 0
        torch.testing.assert_close(got, reference, atol=2e-3, rtol=2e-3)
