"""``sd-accel serve`` arguments. Each option left out keeps the config file's value, else the default."""

from __future__ import annotations

import argparse
from typing import Any

from sd_accel.config import BACKENDS, ENGINE_PRECISIONS, PRECISION


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="a YAML or JSON file of ServeConfig fields (options below override it)")
    p.add_argument("--model", default=None, help="checkpoint, diffusers folder or builtin:tiny-sd15 (default)")
    p.add_argument("--allow-pickle", action="store_true", default=None, help="allow .ckpt pickle checkpoints")
    p.add_argument("--engine-dir", default=None, help="the engine folder every replica reads (shared storage on a cluster)")
    p.add_argument("--backend", choices=BACKENDS, default=None)
    p.add_argument("--precision", choices=PRECISION, default=None)
    p.add_argument("--engine-precision", choices=ENGINE_PRECISIONS, default=None)
    p.add_argument("--sampler", default=None, help="the default sampler, e.g. 'DPM++ 2M Karras'")
    p.add_argument("--no-engines", action="store_true", help="serve torch only, without engines")
    p.add_argument("--tiny-vae", default=None, metavar="PATH",
                   help="decode with the tiny autoencoder (TAESD): a diffusers folder or taesd_decoder.safetensors")
    p.add_argument("--controlnet-dir", default=None, metavar="DIR",
                   help="a folder of ControlNets that requests name in alwayson_scripts.controlnet (by file name)")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1; 0.0.0.0 opens it)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    p.add_argument("--token", default=None, help="bearer token every route checks (default $SD_ACCEL_SERVE_TOKEN)")
    p.add_argument("--num-replicas", type=int, default=None)
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs Ray reserves per replica (default 1)")
    p.add_argument("--num-gpus", type=float, default=None, help="GPUs per replica (1: one replica per GPU)")
    p.add_argument("--max-batch-size", type=int, default=None, help="images per pipeline call at most (default 4)")
    p.add_argument("--batch-wait-ms", type=float, default=None,
                   help="how long a request waits for company (default: 50 on a GPU or ONNX Runtime engines, else 0)")
    p.add_argument("--max-ongoing-requests", type=int, default=None, help="requests one replica holds (default 8)")
    p.add_argument("--max-queued-requests", type=int, default=None, help="requests waiting for a replica (default 16)")
    p.add_argument("--request-timeout-s", type=float, default=None)
    p.add_argument("--retry-after-s", type=float, default=None)
    p.add_argument("--shutdown-grace-s", type=float, default=None,
                   help="on Ctrl-C / SIGTERM, how long running requests may take to finish (default 30)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body taken; larger ones get 413 (default 1048576)")
    p.add_argument("--build-missing", action="store_true", default=None, help="build missing engines once before serving")
    p.add_argument("--build-preset", default=None, help="the preset --build-missing builds (default: the family's, batch 1 to --max-batch-size)")
    p.add_argument("--address", default=None, help="Ray cluster address (default $RAY_ADDRESS, else a local Ray)")


def config_from_args(args: argparse.Namespace):
    from sd_accel.serve.config import make_config

    accel: dict[str, Any] = {"backend": args.backend, "precision": args.precision,
                             "engine_precision": args.engine_precision, "sampler": args.sampler}
    if args.no_engines:
        accel["engines"] = False
    if args.tiny_vae:
        accel["vae"] = f"tiny:{args.tiny_vae}"
    fields = {name: getattr(args, name) for name in (
        "model", "allow_pickle", "engine_dir", "host", "port", "token", "num_replicas", "num_cpus", "num_gpus",
        "max_batch_size", "batch_wait_ms", "max_ongoing_requests", "max_queued_requests", "request_timeout_s",
        "retry_after_s", "max_request_bytes", "shutdown_grace_s", "build_missing", "build_preset", "address",
        "controlnet_dir")}
    return make_config(args.config, accel=accel, **fields)


def run_from_args(args: argparse.Namespace) -> int:
    from sd_accel.serve.deployment import serve

    serve(config_from_args(args), blocking=True)
    return 0
