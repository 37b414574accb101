#!/usr/bin/env python3
"""Random-weight FLUX.1-dev files for a real Stable Diffusion WebUI Forge (docs/dev/forge-real.md,
"FLUX.1 in a real Forge"): **all weights are random** (seeded), the real widths, nothing downloaded.

    PYTHONPATH=. .venv/bin/python scripts/random_flux_files.py OUT [--double 1 --single 1]

writes into ``OUT`` (each file tensor by tensor, so the script's peak RSS stays about 1.3 GB (measured: 1.27 GiB, 73 s on 2 cores)):

- ``flux1-dev-random.safetensors`` (``flux1-schnell-random.safetensors`` with ``--schnell``: no
  ``guidance_in``): the FLUX.1-dev transformer in Black Forest Labs' layout
  (``double_blocks.0.img_attn.qkv.weight``, ``single_blocks.0.linear1.weight``, ``guidance_in.*``,
  ``final_layer.*``) at FLUX's real width (hidden 3072, 24 heads, context_in_dim 4096, vec_in_dim
  768, in_channels 64) with ``--double`` double and ``--single`` single blocks (1 and 1: 0.66 G
  parameters), bf16, weights N(0, ``--std``) (0.02), biases 0, the QK-norm scales 1;
- ``clip_l-random.safetensors``: CLIP-L (transformers' ``CLIPTextModel`` keys, ``text_model.*``,
  12 layers, width 768), fp16;
- ``t5xxl-random-fp8_e4m3fn.safetensors``: T5-XXL's encoder at its real config (24 layers, d_model
  4096, d_ff 10240, 64 heads, vocabulary 32128: 4.76 G parameters, transformers' ``T5EncoderModel``
  keys), every tensor float8_e4m3fn (4.8 GB);
- ``ae-random.safetensors``: the FLUX VAE in the ``ae.safetensors`` layout (``encoder.down.0.block.0...``,
  ``decoder.up...``, 16 latent channels, no quant convs), fp32;
- ``flux-lora-random.safetensors``: a kohya LoRA (``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``,
  ``.lora_up.weight``, ``.alpha``) of rank ``--rank`` (8, alpha = rank) on every linear layer of the
  double blocks (img/txt attn qkv and proj, mlp.0 and mlp.2, mod.lin) and of the single blocks
  (linear1, linear2, modulation.lin), bf16; down N(0, 1/in), up N(0, ``--std``).
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import torch

HIDDEN, HEADS, CONTEXT, VEC, IN_CH, MLP = 3072, 24, 4096, 768, 64, 4 * 3072
_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}

# (name, shape, init): init is "w" (N(0, std)), "zeros", "ones", "emb" (N(0, 1)) or a float std.
Spec = list[tuple[str, tuple[int, ...], object]]


def _linear(spec: Spec, name: str, out_f: int, in_f: int, bias: bool = True) -> None:
    spec.append((f"{name}.weight", (out_f, in_f), "w"))
    if bias:
        spec.append((f"{name}.bias", (out_f,), "zeros"))


def flux_spec(double: int, single: int, guidance: bool = True) -> Spec:
    """BFL FLUX.1-dev transformer keys and shapes (backend/nn/flux.py in Forge); schnell is the
    same without ``guidance_in`` (``guidance=False``)."""
    s: Spec = []
    _linear(s, "img_in", HIDDEN, IN_CH)
    embeddings = (("time_in", 256), ("vector_in", VEC)) + ((("guidance_in", 256),) if guidance else ())
    for emb, in_dim in embeddings:
        _linear(s, f"{emb}.in_layer", HIDDEN, in_dim)
        _linear(s, f"{emb}.out_layer", HIDDEN, HIDDEN)
    _linear(s, "txt_in", HIDDEN, CONTEXT)
    head = HIDDEN // HEADS
    for i in range(double):
        for side in ("img", "txt"):
            p = f"double_blocks.{i}.{side}"
            _linear(s, f"{p}_mod.lin", 6 * HIDDEN, HIDDEN)
            _linear(s, f"{p}_attn.qkv", 3 * HIDDEN, HIDDEN)
            s.append((f"{p}_attn.norm.query_norm.scale", (head,), "ones"))
            s.append((f"{p}_attn.norm.key_norm.scale", (head,), "ones"))
            _linear(s, f"{p}_attn.proj", HIDDEN, HIDDEN)
            _linear(s, f"{p}_mlp.0", MLP, HIDDEN)
            _linear(s, f"{p}_mlp.2", HIDDEN, MLP)
    for i in range(single):
        p = f"single_blocks.{i}"
        _linear(s, f"{p}.linear1", 3 * HIDDEN + MLP, HIDDEN)
        _linear(s, f"{p}.linear2", HIDDEN, HIDDEN + MLP)
        s.append((f"{p}.norm.query_norm.scale", (head,), "ones"))
        s.append((f"{p}.norm.key_norm.scale", (head,), "ones"))
        _linear(s, f"{p}.modulation.lin", 3 * HIDDEN, HIDDEN)
    _linear(s, "final_layer.linear", IN_CH, HIDDEN)
    _linear(s, "final_layer.adaLN_modulation.1", 2 * HIDDEN, HIDDEN)
    return s


def clip_l_spec() -> Spec:
    """transformers' CLIPTextModel (CLIP ViT-L/14 text tower) keys."""
    s: Spec = [("text_model.embeddings.token_embedding.weight", (49408, 768), "w"),
               ("text_model.embeddings.position_embedding.weight", (77, 768), "w")]
    for i in range(12):
        p = f"text_model.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            _linear(s, f"{p}.self_attn.{proj}", 768, 768)
        for norm in ("layer_norm1", "layer_norm2"):
            s += [(f"{p}.{norm}.weight", (768,), "ones"), (f"{p}.{norm}.bias", (768,), "zeros")]
        _linear(s, f"{p}.mlp.fc1", 3072, 768)
        _linear(s, f"{p}.mlp.fc2", 768, 3072)
    s += [("text_model.final_layer_norm.weight", (768,), "ones"),
          ("text_model.final_layer_norm.bias", (768,), "zeros")]
    return s


def t5xxl_spec(layers: int = 24, d_model: int = 4096, d_ff: int = 10240, heads: int = 64, vocab: int = 32128) -> Spec:
    """transformers' T5EncoderModel keys at T5-v1.1-XXL's config (gated GELU)."""
    s: Spec = [("shared.weight", (vocab, d_model), "emb")]
    for i in range(layers):
        p = f"encoder.block.{i}.layer"
        for proj in ("q", "k", "v", "o"):
            s.append((f"{p}.0.SelfAttention.{proj}.weight", (d_model, d_model), "w"))
        if i == 0:
            s.append((f"{p}.0.SelfAttention.relative_attention_bias.weight", (32, heads), 0.1))
        s.append((f"{p}.0.layer_norm.weight", (d_model,), "ones"))
        s += [(f"{p}.1.DenseReluDense.wi_0.weight", (d_ff, d_model), "w"),
              (f"{p}.1.DenseReluDense.wi_1.weight", (d_ff, d_model), "w"),
              (f"{p}.1.DenseReluDense.wo.weight", (d_model, d_ff), "w"),
              (f"{p}.1.layer_norm.weight", (d_model,), "ones")]
    s.append(("encoder.final_layer_norm.weight", (d_model,), "ones"))
    return s


def _conv(s: Spec, name: str, out_c: int, in_c: int, k: int) -> None:
    s += [(f"{name}.weight", (out_c, in_c, k, k), "w"), (f"{name}.bias", (out_c,), "zeros")]


def _norm(s: Spec, name: str, c: int) -> None:
    s += [(f"{name}.weight", (c,), "ones"), (f"{name}.bias", (c,), "zeros")]


def _resnet(s: Spec, name: str, in_c: int, out_c: int) -> None:
    _norm(s, f"{name}.norm1", in_c)
    _conv(s, f"{name}.conv1", out_c, in_c, 3)
    _norm(s, f"{name}.norm2", out_c)
    _conv(s, f"{name}.conv2", out_c, out_c, 3)
    if in_c != out_c:
        _conv(s, f"{name}.nin_shortcut", out_c, in_c, 1)


def _mid(s: Spec, name: str, c: int) -> None:
    _resnet(s, f"{name}.block_1", c, c)
    _norm(s, f"{name}.attn_1.norm", c)
    for proj in ("q", "k", "v", "proj_out"):
        _conv(s, f"{name}.attn_1.{proj}", c, c, 1)
    _resnet(s, f"{name}.block_2", c, c)


def flux_vae_spec(ch: int = 128, mult: tuple[int, ...] = (1, 2, 4, 4), res_blocks: int = 2, z: int = 16) -> Spec:
    """The FLUX autoencoder's ``ae.safetensors`` (ldm) keys."""
    s: Spec = []
    _conv(s, "encoder.conv_in", ch, 3, 3)
    block_in = ch
    for level, m in enumerate(mult):
        for b in range(res_blocks):
            _resnet(s, f"encoder.down.{level}.block.{b}", block_in, ch * m)
            block_in = ch * m
        if level != len(mult) - 1:
            _conv(s, f"encoder.down.{level}.downsample.conv", block_in, block_in, 3)
    _mid(s, "encoder.mid", block_in)
    _norm(s, "encoder.norm_out", block_in)
    _conv(s, "encoder.conv_out", 2 * z, block_in, 3)
    block_in = ch * mult[-1]
    _conv(s, "decoder.conv_in", block_in, z, 3)
    _mid(s, "decoder.mid", block_in)
    for level in reversed(range(len(mult))):
        for b in range(res_blocks + 1):
            _resnet(s, f"decoder.up.{level}.block.{b}", block_in, ch * mult[level])
            block_in = ch * mult[level]
        if level != 0:
            _conv(s, f"decoder.up.{level}.upsample.conv", block_in, block_in, 3)
    _norm(s, "decoder.norm_out", block_in)
    _conv(s, "decoder.conv_out", 3, block_in, 3)
    return s


def lora_spec(transformer: Spec, rank: int) -> Spec:
    """Kohya keys for every block linear of ``transformer`` (``lora_unet_<BFL path with _>``)."""
    s: Spec = []
    for name, shape, _ in transformer:
        if not name.endswith(".weight") or len(shape) != 2 or "_blocks." not in name:
            continue
        base = "lora_unet_" + name[:-len(".weight")].replace(".", "_")
        out_f, in_f = shape
        s += [(f"{base}.lora_down.weight", (rank, in_f), in_f ** -0.5),
              (f"{base}.lora_up.weight", (out_f, rank), "w"),
              (f"{base}.alpha", (), float(rank))]
    return s


def _tensor(shape: tuple[int, ...], init: object, std: float, gen: torch.Generator) -> torch.Tensor:
    if init == "zeros":
        return torch.zeros(shape)
    if init == "ones":
        return torch.ones(shape)
    if isinstance(init, float) and shape == ():
        return torch.tensor(init)
    scale = std if init == "w" else 1.0 if init == "emb" else float(init)
    return torch.randn(shape, generator=gen) * scale


def write_safetensors(path: Path, spec: Spec, dtype: torch.dtype, std: float, seed: int,
                      metadata: dict[str, str] | None = None) -> int:
    """Write ``spec`` as a safetensors file one tensor at a time; returns the parameter count.
    ``.alpha`` scalars are stored as float32 (as kohya does)."""
    header: dict = {"__metadata__": metadata or {}}
    offset = 0
    for name, shape, _ in spec:
        dt = torch.float32 if name.endswith(".alpha") else dtype
        n = 1
        for d in shape:
            n *= d
        size = n * torch.tensor([], dtype=dt).element_size()
        header[name] = {"dtype": _DTYPES[dt], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    gen = torch.Generator().manual_seed(seed)
    params = 0
    tmp = path.with_suffix(".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, init in spec:
            dt = torch.float32 if name.endswith(".alpha") else dtype
            t = _tensor(shape, init, std, gen).to(dt).contiguous()
            params += t.numel()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            del t
    tmp.replace(path)
    return params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--double", type=int, default=1, help="double blocks (FLUX.1 has 19)")
    ap.add_argument("--single", type=int, default=1, help="single blocks (FLUX.1 has 38)")
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-t5", action="store_true", help="leave T5-XXL (4.8 GB) out")
    ap.add_argument("--skip-lora", action="store_true", help="leave the LoRA out")
    ap.add_argument("--schnell", action="store_true",
                    help="FLUX.1-schnell (no guidance embedding): flux1-schnell-random.safetensors")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    transformer = flux_spec(args.double, args.single, guidance=not args.schnell)
    meta = {"sd_accel": "random weights (scripts/random_flux_files.py)"}
    variant = "schnell" if args.schnell else "dev"
    jobs = [(f"flux1-{variant}-random.safetensors", transformer, torch.bfloat16, args.seed),
            ("clip_l-random.safetensors", clip_l_spec(), torch.float16, args.seed + 1),
            ("ae-random.safetensors", flux_vae_spec(), torch.float32, args.seed + 2)]
    if not args.skip_lora:
        jobs.append(("flux-lora-random.safetensors", lora_spec(transformer, args.rank), torch.bfloat16, args.seed + 3))
    if not args.skip_t5:
        jobs.append(("t5xxl-random-fp8_e4m3fn.safetensors", t5xxl_spec(), torch.float8_e4m3fn, args.seed + 4))
    for name, spec, dtype, seed in jobs:
        n = write_safetensors(args.out / name, spec, dtype, args.std, seed, meta)
        print(f"{name}: {len(spec)} tensors, {n / 1e6:.1f} M parameters, {dtype}", flush=True)


if __name__ == "__main__":
    main()
