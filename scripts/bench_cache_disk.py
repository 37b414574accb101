#!/usr/bin/env python
"""What the engine cache holds on disk for one checkpoint (issue 46, disk), before and after weights
are shared across engines and exports are kept slim.

    python scripts/bench_cache_disk.py                                     # tiny SD 1.5, 64 px: seconds
    flock /work/bigmem.lock python scripts/bench_cache_disk.py --real-size # SD 1.5 width, 512 px, bf16

Builds, with OpenVINO (``--backend``), into a fresh engine folder: the UNet at two profiles (static
and dynamic: 512 and 512-768 px at real size, 64 and 64-96 px tiny), the residual-taking UNet
(ControlNet's, static), the text encoder and both VAE halves (static), in ``--precision`` (default
bf16 where the CPU has it, else fp32). Engines are not validated unless ``--validate`` (disk use
does not depend on it). Then it reports, in bytes with each inode counted once:

- ``before``: what the same cache held before this layout: every engine's files as its own copy,
  and the full ONNX exports (the WebUI and ComfyUI paths kept them whole);
- ``after``: the cache as it is now on disk (every file under the root, each inode once): weights
  stored once under ``weights/`` and hard-linked, exports slimmed to their graphs
  (:func:`sd_accel.build.keep_graphs_only`);
- ``one copy``: one copy of each distinct weight set in the engines' storage precision (fp16 for
  bf16 engines, as OpenVINO stores them): the initializers of the UNet's, text encoder's and VAE
  halves' exports (the residual UNet has the UNet's weights); the goal is ``after`` <= 1.2x this;
- ``optimum-style``: one saved OpenVINO model per plain component (UNet, text encoder, VAE decoder,
  VAE encoder) at the same storage precision, as optimum-intel's ``save_pretrained`` writes: what a
  user of that tool keeps for the same checkpoint with one profile and no ControlNet;
- ``with LoRA at 0.7`` / ``at 1.0`` (``--lora``): the cache while a pipeline on these engines holds
  a LoRA (rank 4 on the UNet's attention, random) refitted at that strength (``refit_engines``, one
  set kept, unchecked): what a host that changes a LoRA's strength keeps on disk, refit copies
  included.

The model has random weights (the SD 1.5 architecture from its shipped configs at ``--real-size``,
``builtin:tiny-sd15`` otherwise). Writes ``report.json`` into ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def tree_bytes(root: Path) -> int:
    """Bytes of every file under ``root``, each inode once."""
    from sd_accel.cache.shared import unique_bytes

    return unique_bytes(p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink())


def initializer_bytes(model_path: Path, storage: int) -> int:
    """The bytes of the initializers of the ONNX model at ``model_path`` with float ones stored in
    ``storage`` bytes per element (4: fp32, 2: fp16)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    total = 0
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            size = int({e.key: e.value for e in init.external_data}.get("length", 0))
        else:
            size = len(init.raw_data) or len(init.float_data) * 4 or len(init.int64_data) * 8
        if init.data_type == onnx.TensorProto.FLOAT:
            size = size * storage // 4
        total += size
    return total


def optimum_style_bytes(model_path: Path, precision: str, scratch: Path) -> int:
    """One saved OpenVINO model of the ONNX model (``openvino_model.xml`` / ``.bin``), as optimum-intel
    keeps one per component: fp16 weights for bf16 and fp16, fp32 for fp32."""
    import openvino as ov

    scratch.mkdir(parents=True, exist_ok=True)
    ov.save_model(ov.convert_model(str(model_path)), str(scratch / "openvino_model.xml"),
                  compress_to_fp16=precision != "fp32")
    size = tree_bytes(scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    return size


def with_lora(model: str, engine_dir: Path, backend: str, precision: str) -> list[tuple[float, int]]:
    """(strength, bytes on disk under ``engine_dir``) while a pipeline on its engines holds a random
    rank-4 LoRA on the UNet refitted at 0.7, then at 1.0 (one set kept, as every host does)."""
    import torch
    from peft import LoraConfig

    from sd_accel import AccelConfig, accelerate, load_pipeline, refit_engines

    pipe = accelerate(load_pipeline(model), AccelConfig(engines=True, engine_dir=str(engine_dir), backend=backend,
                                                        precision="fp32", engine_precision=precision))
    unet = pipe.unet.torch_module if hasattr(pipe.unet, "torch_module") else pipe.unet
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
                     adapter_name="random")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in unet.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: a LoRA that changes nothing
                param.copy_(torch.randn(param.shape, generator=gen) * 0.01)
    out = []
    for strength in (0.7, 1.0):
        unet.set_adapters(["random"], weights=[strength])
        refit_engines(pipe, validate=False, progress=False)
        out.append((strength, tree_bytes(engine_dir)))
    del pipe
    return out


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--real-size", action="store_true", help="the SD 1.5 architecture at its real width, 512 px")
    p.add_argument("--model", help="a model folder or builtin: name (default: tiny SD 1.5, or SD 1.5 random weights)")
    p.add_argument("--backend", default="openvino")
    p.add_argument("--precision", default="auto", help="auto: the backend's default (bf16 on CPUs with it)")
    p.add_argument("--validate", action="store_true", help="validate each engine against torch (slower)")
    p.add_argument("--work", help="work folder (default: a temp folder, removed after unless --keep)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--out", help="folder for report.json")
    p.add_argument("--lora", action="store_true", help="then refit a LoRA at two strengths and measure again")
    args = p.parse_args(argv)

    from sd_accel import load_pipeline
    from sd_accel.backends.registry import get_backend
    from sd_accel.build import EngineJob, keep_graphs_only, run_jobs
    from sd_accel.cache.store import EngineCache
    from sd_accel.components import specs_for
    from sd_accel.components.controlnet import ControlUNetSpec
    from sd_accel.profiles import Profile
    from sd_accel.runtime.swap import torch_modules

    if args.model:
        model = args.model
    elif args.real_size:
        from bench import default_model

        model = default_model("sd15")
    else:
        model = "builtin:tiny-sd15"
    px, hi = (512, 768) if args.real_size else (64, 96)
    static = Profile(batch=1, height=px, width=px)
    dynamic = Profile(batch=1, height=(px, px, hi), width=(px, px, hi))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-cache-disk-"))
    engine_dir = work / "engines"
    shutil.rmtree(engine_dir, ignore_errors=True)
    cache = EngineCache(engine_dir)
    be = get_backend(args.backend, cache_root=cache.root)
    precision = be.default_precision() if args.precision == "auto" else args.precision
    storage = 4 if precision == "fp32" else 2

    start = time.perf_counter()
    pipe = load_pipeline(model)
    with torch_modules(pipe):
        specs = specs_for(pipe)
        control = ControlUNetSpec(pipe)
        jobs = [EngineJob(specs["unet"], static, precision), EngineJob(specs["unet"], dynamic, precision),
                EngineJob(control, static, precision)]
        jobs += [EngineJob(specs[name], static, precision) for name in ("clip", "vae_decoder", "vae_encoder")]
        records = run_jobs(jobs, cache, be, progress=False, validate=args.validate)
        build_s = time.perf_counter() - start
        usage_full = cache.disk_usage()
        exports = {i.component: engine_dir / i.name for i in usage_full.intermediates if i.kind == "onnx"}
        plain = [c for c in ("unet", "clip", "vae_decoder", "vae_encoder") if c in exports]
        one_copy = sum(initializer_bytes(exports[c] / "model.onnx", storage) for c in plain)
        optimum = None
        if args.backend == "openvino":
            optimum = sum(optimum_style_bytes(exports[c] / "model.onnx", precision, work / "optimum" / c)
                          for c in plain)
        before = usage_full.engines_file_bytes + usage_full.intermediates_bytes  # own copies, whole exports
        keep_graphs_only(cache, records, [specs["unet"], control, *(specs[n] for n in ("clip", "vae_decoder",
                                                                                       "vae_encoder"))])
    usage = cache.disk_usage()
    after = tree_bytes(engine_dir)
    report = {
        "model": model, "backend": f"{be.name} {be.info().version}", "precision": precision,
        "profiles": [static.tag, dynamic.tag], "engines": [r.name for r in records],
        "build_seconds": round(build_s, 1),
        "before_bytes": before, "before_engines_bytes": usage_full.engines_file_bytes,
        "before_exports_bytes": usage_full.intermediates_bytes,
        "after_bytes": after, "after_engines_bytes": usage.engines_bytes,
        "after_exports_bytes": usage.intermediates_bytes, "shared_weight_files": len(cache.stored_weights()),
        "one_copy_bytes": one_copy, "optimum_style_bytes": optimum,
        "after_vs_one_copy": round(after / one_copy, 3) if one_copy else None,
        "after_vs_optimum_style": round(after / optimum, 3) if optimum else None,
        "disk_usage_line": usage.describe(),
    }
    rows = [("before (own copies, whole exports)", before), ("after (shared weights, slim exports)", after),
            ("one copy of each distinct weight set", one_copy)]
    if args.lora:
        for strength, size in with_lora(model, engine_dir, args.backend, precision):
            report[f"lora_{strength}_bytes"] = size
            report[f"lora_{strength}_vs_one_copy"] = round(size / one_copy, 3) if one_copy else None
            rows.append((f"after, with a LoRA refitted at {strength}", size))
    if optimum:
        rows.append(("optimum-style saved model (plain components)", optimum))
    print(f"{model}, {report['backend']} {precision}, engines: {', '.join(r.key.component + ' ' + r.key.profile for r in records)}")
    print("| what | bytes on disk | vs one copy |")
    print("|---|---|---|")
    for name, size in rows:
        print(f"| {name} | {gb(size)} | {size / one_copy:.2f}x |")
    print(f"sd-accel list: {usage.describe()}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "report.json").write_text(json.dumps(report, indent=1))
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if os.environ.get("SD_ACCEL_BENCH_STRICT") is None or after <= 1.2 * one_copy else 1


if __name__ == "__main__":
    raise SystemExit(main())
