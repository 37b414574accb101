"""The pack's FLUX.1 / SD3 path against a real ComfyUI's own classes, no engine build needed.

Runs ComfyUI's ``BaseModel.apply_model`` twice on tiny FLUX.1 dev / schnell and SD3.5-Medium-like
models (ComfyUI's ``supported_models`` configs, random weights): once as ComfyUI runs it, once with
the pack's ``apply_model`` wrapper, whose engine is stood in for by diffusers' transformer made
from ComfyUI's weights (what the engine is exported from), at an even and an odd latent size.
Prints the largest difference; fails above 1e-4.

    COMFYUI=/path/to/ComfyUI PYTHONDONTWRITEBYTECODE=1 /path/to/ComfyUI/venv/bin/python \
        scripts/comfyui_real_transformer_check.py

(that venv needs diffusers; this repository goes on sys.path first, ahead of any installed sd-accel).
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, os.environ.get("COMFYUI", "ComfyUI"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from comfy.cli_args import args  # noqa: E402  (ComfyUI's modules need args.cpu before model_management)

args.cpu = True
import comfy.model_patcher  # noqa: E402
import comfy.patcher_extension as pe  # noqa: E402
import comfy.supported_models as sm  # noqa: E402
import torch  # noqa: E402

from sd_accel.comfyui import flux  # noqa: E402
from sd_accel.comfyui.transformer import KEY, EngineTransformer, Run, family_module  # noqa: E402


def randomize(m, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in list(m.named_parameters()) + [(n, b) for n, b in m.named_buffers() if n.endswith("pos_embed")]:
            if n.endswith(("scale", "ln_q.weight", "ln_k.weight")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / max(1, p.shape[-1]) ** 0.5))


class Stats:
    engine_calls = torch_calls = 0
    fallbacks = {}


class Fake:
    """Engines stand-in: diffusers' transformer run on the feed (what the ONNX engine computes)."""
    def __init__(self, ref):
        self.ref, self.stats, self.calls = ref, Stats(), 0

    def run(self, feed, need=()):
        self.calls += 1
        with torch.no_grad():
            return {"latent": self.ref(**feed, return_dict=False)[0]}

    def torch_call(self, reason):
        raise AssertionError(reason)


def check(name, mc, kwargs_for):
    base = mc.get_model({})
    dm = base.diffusion_model
    randomize(dm, 5)
    dm.eval()
    fam = family_module(dm)
    ref = fam.to_diffusers(dm)
    patcher = comfy.model_patcher.ModelPatcher(base, torch.device("cpu"), torch.device("cpu"))
    binding = EngineTransformer("fp-test", fam.FAMILY)
    fake = Fake(ref)
    binding.run = Run(patcher, engines=fake)
    for hw in ((8, 8), (9, 7)):
        g = torch.Generator().manual_seed(2)
        x = torch.randn(2, 16, *hw, generator=g)
        sigma = torch.tensor([0.9, 0.4])
        ctx = torch.randn(2, 12 if fam is flux else 89, 48, generator=g)
        extra = kwargs_for(g)
        with torch.no_grad():
            want = base.apply_model(x, sigma, c_crossattn=ctx, transformer_options={}, **extra)
            opts = {"wrappers": {pe.WrappersMP.APPLY_MODEL: {KEY: [binding.apply_model]}}}
            got = base.apply_model(x, sigma, c_crossattn=ctx, transformer_options=opts, **extra)
        print(f"{name} {hw}: timestep(sigma)={base.model_sampling.timestep(sigma).tolist()} max|comfy - engine path|="
              f"{(want - got).abs().max().item():.2e} (|out| max {want.abs().max().item():.2f}), engine calls {fake.calls}")
        assert torch.allclose(want, got, atol=1e-4, rtol=1e-4)


flux_cfg = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=48, hidden_size=64,
                mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[4, 14, 14], theta=10000,
                patch_size=2, qkv_bias=True, guidance_embed=True, txt_ids_dims=[])
for guided in (True, False):
    mc = (sm.Flux if guided else sm.FluxSchnell)(dict(flux_cfg, guidance_embed=guided))
    mc.set_inference_dtype(torch.float32, None)
    check("flux-dev" if guided else "flux-schnell", mc,
          lambda g: {"y": torch.randn(2, 32, generator=g), "guidance": torch.tensor([3.5, 3.5])})

sd3_cfg = dict(in_channels=16, out_channels=16, patch_size=2, depth=2, input_size=None, adm_in_channels=64,
               num_patches=256, pos_embed_max_size=16, pos_embed_scaling_factor=None, qk_norm="rms",
               x_block_self_attn_layers=[0],
               context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 48, "out_features": 128}})
mc = sm.SD3(sd3_cfg)
mc.set_inference_dtype(torch.float32, None)
check("sd3.5-medium-like", mc, lambda g: {"y": torch.randn(2, 64, generator=g)})
print("OK")
