"""SD3.5 and FLUX.1 at their real size on this machine (issue 44): build the transformer's engine
from the files users download, then generate end to end on it, each in a fresh process whose
peak RSS (VmHWM) is the figure. **Random weights**: the files come from
``scripts/random_sd35_files.py --blocks 24`` (SD3.5 Medium, 2.2B) or ``scripts/random_flux_files.py``
(FLUX.1), at the real widths and depths, CLIP-L/G, T5-XXL (fp8 as published) and the VAE beside.

    python scripts/bench_full_size.py build FILE ENGINES [--size 1024] [--min-size 512] [--text 256]
        [--precision int8] [--components transformer]
    python scripts/bench_full_size.py run FILE ENGINES [--size 1024] [--steps 2] [--cfg 4.5]
        [--t5 torch|drop] [--out IMAGE.npy] [--torch]
    python scripts/bench_full_size.py encode FILE [--repeats 3]    # SD_ACCEL_PAGED_ENCODERS=off: T5 resident
    python scripts/bench_full_size.py psnr A.npy B.npy

``build`` prints ``STAGE`` lines (seconds, RSS now, peak so far, the build's stage) and one ``RESULT
{json}`` line. ``run`` loads the pipeline, puts the engines in (``accelerate(engines=True)``),
generates one image (the prompt's T5 pass included) and prints ``RESULT {json}``: peak RSS, seconds,
transformer ms per call, the engine's share of the calls. ``--t5 drop`` encodes the prompt first and
frees T5 before denoising; by default (`torch`) accelerate() pages T5 (SD_ACCEL_PAGED_ENCODERS).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "a lighthouse on a cliff at dusk, oil painting"


def _status() -> dict[str, float]:
    """RSS now and the peak so far (VmHWM: Linux carries ru_maxrss across exec), in GiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 2**20 for k in ("VmRSS", "VmHWM")}


def build(file: Path, engines: Path, size: int, text: int, precision: str, components: list[str],
          backend: str, validate: bool, min_size: int | None = None) -> None:
    import torch

    from sd_accel import build_engines, load_pipeline
    from sd_accel.profiles import Profile

    start = time.perf_counter()
    pipe = load_pipeline(str(file), torch_dtype=torch.bfloat16)
    loaded = _status()
    print(f"LOADED {time.perf_counter() - start:.1f}s rss {loaded['VmRSS']:.2f} GiB", flush=True)
    start = time.perf_counter()

    def stage(ev) -> None:
        s = _status()
        print(f"STAGE {time.perf_counter() - start:7.1f}s rss {s['VmRSS']:5.2f} GiB peak {s['VmHWM']:5.2f} GiB  "
              f"{ev.component} {ev.stage}", flush=True)

    records = build_engines(pipe, profiles=[Profile(batch=1, height=(min_size or size, size, size),
                                                       width=(min_size or size, size, size), text=text)], backend=backend,
                            precision=precision, components=components, engine_dir=str(engines), progress=stage,
                            validate=validate)
    seconds = time.perf_counter() - start
    print("RESULT " + json.dumps({
        "peak_gib": round(_status()["VmHWM"], 2), "loaded_rss_gib": round(loaded["VmRSS"], 2),
        "seconds": round(seconds, 1),
        "engines": [{"component": r.key.component, "layout": r.key.layout, "precision": r.key.precision,
                     "size_gib": round(r.size_bytes / 2**30, 2), "validation": r.validation} for r in records]}),
        flush=True)


def run(file: Path, engines: Path, size: int, steps: int, cfg: float, text: int, t5: str, backend: str,
        out: Path | None, torch_only: bool, engine_precision: str | None = None) -> None:
    import torch

    from sd_accel import accelerate, load_pipeline, stats

    start = time.perf_counter()
    pipe = load_pipeline(str(file), torch_dtype=torch.bfloat16)
    if not torch_only:
        pipe = accelerate(pipe, engines=True, engine_dir=str(engines), backend=backend, precision="bf16",
                          engine_precision=engine_precision)
    elif "Flux" in type(pipe).__name__:
        # FLUX.1's 24 GB of bf16 do not fit in this machine's memory: the reference runs on the file's
        # mapping (models.mapped_file), each layer's pages handed back after its forward
        from sd_accel.pages import PageDropper
        from sd_accel.runtime.weights import hand_back_hooks

        hand_back_hooks(pipe.transformer, PageDropper())
    load_s = time.perf_counter() - start
    flux = "Flux" in type(pipe).__name__
    call = dict(height=size, width=size, num_inference_steps=steps, guidance_scale=cfg,
                max_sequence_length=text, generator=torch.Generator("cpu").manual_seed(0))
    t0 = time.perf_counter()
    if t5 == "drop":  # encode first, then free T5 (it runs once per prompt)
        with torch.no_grad():
            if flux:
                embeds, pooled, _ = pipe.encode_prompt(PROMPT, PROMPT, max_sequence_length=text)
                call.update(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
            else:
                embeds, neg, pooled, neg_pooled = pipe.encode_prompt(PROMPT, PROMPT, PROMPT, max_sequence_length=text,
                                                                     do_classifier_free_guidance=cfg > 1)
                call.update(prompt_embeds=embeds, negative_prompt_embeds=neg, pooled_prompt_embeds=pooled,
                            negative_pooled_prompt_embeds=neg_pooled)
        if flux:
            pipe.text_encoder_2 = None
        else:
            pipe.text_encoder_3 = None
        from sd_accel.pages import trim_heap

        trim_heap()
    else:
        call["prompt"] = PROMPT
    encode_s = time.perf_counter() - t0
    image = pipe(**call, output_type="np").images[0]
    seconds = time.perf_counter() - t0
    denoiser = {} if torch_only else stats(pipe).get("transformer", {})
    if out is not None:
        import numpy as np

        np.save(out, image)
    print("RESULT " + json.dumps({
        "peak_gib": round(_status()["VmHWM"], 2), "load_s": round(load_s, 1), "encode_s": round(encode_s, 1),
        "seconds": round(seconds, 1), "steps": steps, "size": size, "t5": t5, "torch_only": torch_only,
        "transformer": denoiser,
        "threads": os.cpu_count()}), flush=True)


def encode(file: Path, text: int, repeats: int) -> None:
    """What paging T5 costs a prompt: seconds of ``encode_prompt`` (CLIPs + T5) and RSS after each,
    paged (``SD_ACCEL_PAGED_ENCODERS`` unset) or resident (``=off``)."""
    import torch

    from sd_accel import accelerate, load_pipeline

    pipe = accelerate(load_pipeline(str(file), torch_dtype=torch.bfloat16), precision="bf16")
    flux = "Flux" in type(pipe).__name__
    rows = []
    for i in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            if flux:
                pipe.encode_prompt(f"{PROMPT} {i}", None, max_sequence_length=text)
            else:
                pipe.encode_prompt(f"{PROMPT} {i}", None, None, max_sequence_length=text,
                                   do_classifier_free_guidance=False)
        rows.append({"seconds": round(time.perf_counter() - t0, 2), "rss_gib": round(_status()["VmRSS"], 2)})
    print("RESULT " + json.dumps({"paged": os.environ.get("SD_ACCEL_PAGED_ENCODERS", "auto"), "prompts": rows,
                                  "peak_gib": round(_status()["VmHWM"], 2)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("build", "run"):
        p = sub.add_parser(name)
        p.add_argument("file", type=Path)
        p.add_argument("engines", type=Path)
        p.add_argument("--size", type=int, default=1024)
        p.add_argument("--text", type=int, default=256, help="T5 tokens (SD3: 256, FLUX.1-schnell: 256, dev: 512)")
        p.add_argument("--backend", default="openvino")
    b = sub.choices["build"]
    b.add_argument("--precision", default="int8")
    b.add_argument("--components", default="transformer")
    b.add_argument("--no-validate", action="store_true", help="skip the check against torch")
    b.add_argument("--min-size", type=int, default=None, help="one engine for sizes from this up to --size")
    r = sub.choices["run"]
    r.add_argument("--steps", type=int, default=2)
    r.add_argument("--cfg", type=float, default=4.5)
    r.add_argument("--t5", choices=("torch", "drop"), default="drop")
    r.add_argument("--out", type=Path, default=None, help="save the image (float 0..1, .npy) here")
    r.add_argument("--torch", action="store_true", help="plain diffusers bf16, no engines: the reference")
    r.add_argument("--engine-precision", default=None, help="which engine when several cover the call (int4, int8)")
    e = sub.add_parser("encode")
    e.add_argument("file", type=Path)
    e.add_argument("--text", type=int, default=256)
    e.add_argument("--repeats", type=int, default=3)
    q = sub.add_parser("psnr")
    q.add_argument("a", type=Path)
    q.add_argument("b", type=Path)
    args = ap.parse_args()
    # sd-accel's own progress lines (which segments of a chain stay loaded, which stream)
    logging.basicConfig(format="LOG %(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("sd_accel").setLevel(logging.INFO)
    if args.cmd == "build":
        build(args.file, args.engines, args.size, args.text, args.precision, args.components.split(","), args.backend,
              not args.no_validate, args.min_size)
    elif args.cmd == "encode":
        encode(args.file, args.text, args.repeats)
    elif args.cmd == "run":
        run(args.file, args.engines, args.size, args.steps, args.cfg, args.text, args.t5, args.backend, args.out,
            args.torch, args.engine_precision)
    else:
        import numpy as np

        a, b = np.load(args.a).astype(np.float64), np.load(args.b).astype(np.float64)
        mse = float(np.mean((a - b) ** 2))
        print("RESULT " + json.dumps({"psnr_db": round(10 * np.log10(1 / mse), 2) if mse else None}))


if __name__ == "__main__":
    main()
