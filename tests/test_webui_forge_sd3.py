"""Forge's SD3 / SD3.5 on a transformer engine (issue 45, "Forge runs FLUX (and SD3.5 where its version
does): the transformer on the engine there too").

The stand-in Forge (``tests/webui_stub/forge``) with its loaded model's diffusion model swapped for
``backend.nn.mmditx.MMDiTX`` (Stability's parameter names, a ``pos_embed`` buffer, 3.5 Medium's
x-block self-attention and RMS qk-norm; ``forward(x, t, y, context, control, transformer_options)``;
tiny widths, random weights). The build goes through ``POST /sd-accel/build``; the calls are made
as Forge's ``KModel.apply_model`` makes them (t = sigma x 1000; cond and uncond packed), through the
object patch sd-accel adds before sampling, and compared with Forge's own module; a LoRA merged by
Forge's loader at two strengths refits the engine.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

STUB = Path(__file__).resolve().parent / "webui_stub"
sys.path.insert(0, str(STUB))
import harness  # noqa: E402
from harness import webui_lean  # noqa: E402, F401  (autouse: see its docstring)

# tiny widths of SD3.5 Medium's layout: 2 joint blocks (64 lanes x 2 heads), x-block self-attention in
# block 0, RMS qk-norm, a 16 x 16 position table
CONFIG = dict(in_channels=16, out_channels=16, patch_size=2, depth=2, adm_in_channels=64, pos_embed_max_size=16,
              num_patches=256, qk_norm="rms", x_block_self_attn_layers=[0],
              context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 48, "out_features": 128}})
TEXT = 8  # T5 tokens after CLIP's 77 columns (Forge's own: 256)


def _mmditx(seed: int = 0) -> torch.nn.Module:
    from backend.nn.mmditx import MMDiTX

    torch.manual_seed(seed)
    module = MMDiTX(**CONFIG).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        module.pos_embed.copy_(torch.randn_like(module.pos_embed))
    from backend.operations import forge_linears

    forge_linears(module)  # Forge's own Linear class, inference-tensor weights, as its loader leaves them
    return module.requires_grad_(False)


def _call(seed: int, batch: int = 2, side: int = 8) -> dict:
    """One call's arguments as Forge's ``KModel.apply_model`` passes them: sigma x 1000, the CLIP + T5
    context, both CLIPs' pooled outputs as y (cond and uncond packed: batch 2)."""
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(batch, 16, side, side, generator=g), t=torch.rand(batch, generator=g) * 1000,
                context=torch.randn(batch, 77 + TEXT, 48, generator=g), y=torch.randn(batch, 64, generator=g),
                control=None, transformer_options={})


def _stats():
    from sd_accel.webui.controller import controller

    engines = controller().loaded("transformer")
    return sum(e.stats.engine_calls for e in engines), sum(e.stats.torch_calls for e in engines)


def _sample(model, call: dict, loras: bool = False) -> torch.Tensor:
    """sd-accel's hook before sampling, then Forge's model load (LoRAs merged, object patches in
    place), then KModel's call: ``diffusion_model(x, t, context=..., control=..., transformer_options=..., y=...)``."""
    from sd_accel.webui.forge import patch_for_sampling

    patch_for_sampling(types.SimpleNamespace(sd_model=model))
    patcher = model.forge_objects.unet
    if loras:
        patcher.refresh_loras()
    patcher.patch_model()
    try:
        with torch.no_grad():
            x, t = call["x"], call["t"]
            return patcher.model.diffusion_model(x, t, **{k: v for k, v in call.items() if k not in ("x", "t")})
    finally:
        patcher.unpatch_model()


def test_forge_sd3_builds_runs_and_refits_on_the_transformer_engine(tmp_path):
    webui = harness.start(tmp_path, forge=True, options={"sd_accel_backend": "onnxruntime"})
    model = webui.shared.sd_model
    module = _mmditx()
    base_patcher = model.forge_objects.unet
    base_patcher.model.diffusion_model = module
    from backend.loader import lora_patches

    from sd_accel.webui.controller import controller

    profile = {"batch": [1, 1, 1], "height": [64, 64, 64], "width": [64, 64, 64], "text": [TEXT, TEXT, TEXT]}
    response = webui.client().post("/sd-accel/build", json={"components": ["unet"], "profile": profile})
    assert response.status_code == 200, response.text
    records = [r for r in controller().cache().list() if r.key.component == "transformer"]
    assert len(records) == 1 and records[0].extra["webui"]["family"] == "sd3", records

    ctl = controller()
    ctl.job_started()
    call = _call(1)
    with torch.no_grad():
        base = module(call["x"], call["t"], y=call["y"], context=call["context"])
    got = _sample(model, call)
    assert got.shape == base.shape == (2, 16, 8, 8)
    torch.testing.assert_close(got, base, atol=2e-4, rtol=2e-4)
    # cond and uncond apart (Forge short of memory): batch 1, which this static CFG engine (2 rows)
    # does not take: Forge's module, and the line says what the engines cover
    single = _call(2, batch=1)
    torch.testing.assert_close(_sample(model, single), module(single["x"], single["t"], y=single["y"],
                                                               context=single["context"]))
    assert _stats() == (1, 1)
    line = ctl.job_finished()
    assert "SD3.5 transformer calls this job: 1 on engines, 1 in PyTorch" in line, line
    assert "the engine takes 2" in line, line

    outs = {}
    for strength in (0.7, 1.0):
        ctl.job_started()
        unet = base_patcher.clone()
        name = "/models/Lora/film.safetensors"
        taken = unet.add_patches(filename=name, patches=lora_patches(unet.model, name), strength_patch=strength)
        assert any(k.startswith("diffusion_model.joint_blocks.0.x_block.attn.qkv") for k in taken)
        model.forge_objects.unet = unet
        got = _sample(model, call, loras=True)
        with torch.no_grad():
            want = module(call["x"], call["t"], y=call["y"], context=call["context"])  # its weights merged now
        assert (want - base).abs().max() > 1e-2  # the LoRA moves the output: a stale engine would show
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-3)
        assert _stats() == (1, 0), _stats()
        line = ctl.job_finished()
        assert "SD3.5 transformer on engine" in line and f"film:{strength:g}" in line, line
        outs[strength] = got
    assert (outs[0.7] - outs[1.0]).abs().max() > 1e-3
