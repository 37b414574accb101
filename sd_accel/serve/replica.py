"""One serving replica: an accelerated pipeline, its batch queue and what it has done.

A plain class (no Ray import): ``deployment.py`` makes it a Ray Serve deployment, and the tests
run it in-process too.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import io
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from sd_accel.core import InvalidValue
from sd_accel.generate import GenerationParams, parameters_text
from sd_accel.serve.batching import Batcher, BatchKey, Job, engine_batch_limit, run_pipeline, runs_cfg
from sd_accel.serve.config import ServeConfig

log = logging.getLogger("sd_accel")

# A prompt past this many characters is tokenized only up to its last whitespace before it: enough
# for CLIP's 75 tokens (a token is rarely more than 20 characters), and a 1 MB prompt then costs
# milliseconds, not the seconds diffusers spends tokenizing all of it twice.
PROMPT_SCAN_CHARS = 4096
_DIFFUSERS_TRUNCATION = "The following part of your input was truncated because CLIP"


def clip_prompt(tokenizer, text: str | None) -> tuple[str | None, bool]:
    """``(text for the pipeline, whether CLIP drops part of it)``.

    The text given back is cut at a whitespace (a word boundary for CLIP's tokenizer), only when
    what is kept still holds more tokens than CLIP reads, so the pipeline sees the same token ids
    as for the whole prompt.
    """
    if tokenizer is None or not text:
        return text, False
    keep = getattr(tokenizer, "model_max_length", 77) - 2  # less the start and end tokens

    def count(s: str) -> int:
        return len(tokenizer(s, add_special_tokens=False, truncation=False).input_ids)

    if len(text) > PROMPT_SCAN_CHARS:
        scan = text[:PROMPT_SCAN_CHARS]
        cut = max(scan.rfind(c) for c in " \t\n\r")
        if cut > 0 and count(scan[:cut]) > keep:
            return scan[:cut], True
    return text, count(text) > keep


# Measured (scripts/BENCHMARKS.md, "Serving"): waiting for company raised images/min 1.4-1.8x on
# ONNX Runtime engines of the tiny model at 128 px, where per-call overhead dominates; with
# OpenVINO engines on 2 CPU cores (issue 27) batching and the wait gained nothing, since each call
# is compute-bound there. GPUs run a batch in about the time of one image.
BATCH_WAIT_MS = {"gpu": 50.0, "onnxruntime": 50.0, "cpu": 0.0}


def default_batch_wait_ms(pipe) -> tuple[float, str]:
    """``(batch_wait_ms, why)`` when the config leaves it to the replica: a wait only where
    batching was measured to help (a GPU, ONNX Runtime engines); elsewhere (OpenVINO engines,
    PyTorch on CPU) none: concurrent requests still share a call when they are queued together."""
    device = str(getattr(pipe, "device", "cpu"))
    if device.startswith("cuda"):
        return BATCH_WAIT_MS["gpu"], "the UNet runs on a GPU"
    engines = getattr(getattr(pipe, "unet", None), "engines", None)
    backends: set[str] = set()
    for component in (engines or {}).values():
        for handle in getattr(component, "handles", []):
            record = getattr(handle, "record", None)
            if record is not None:
                backends.add(record.key.backend)
    if backends == {"onnxruntime"}:
        return BATCH_WAIT_MS["onnxruntime"], "ONNX Runtime engines, where batching was measured to help"
    what = f"{'/'.join(sorted(backends))} engines" if backends else "PyTorch"
    return BATCH_WAIT_MS["cpu"], f"{what} on the CPU, where batching was not measured to help"


class _DropTruncationWarning(logging.Filter):
    """diffusers warns on every call that a long prompt was truncated; the replica says it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_DIFFUSERS_TRUNCATION)


def model_label(model: str) -> str:
    """The model as named in infotexts: a file's stem, never the server's folders."""
    if model.startswith("builtin:"):
        return model
    return Path(model).stem or model


def encode_png(image, parameters: str) -> bytes:
    """PNG bytes with the WebUI's ``parameters`` text chunk (as ``sd_accel.generate.save_png``)."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("parameters", parameters)
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


class ModelServer:
    """Loads ``config.model``, accelerates it (engines from ``config.engine_dir``) and serves
    ``generate`` requests through a ``Batcher``."""

    def __init__(self, config: dict[str, Any] | ServeConfig, pipe=None) -> None:
        self.config = config if isinstance(config, ServeConfig) else ServeConfig.from_dict(config)
        self.replica_id = _replica_id()
        threads = max(1, int(self.config.num_cpus)) if self.config.num_cpus else None
        if threads:
            # One replica per reserved core count: ORT and torch would otherwise each take every core.
            os.environ.setdefault("SD_ACCEL_ORT_THREADS", str(threads))
        import torch

        if threads:
            torch.set_num_threads(threads)
        if pipe is None:
            from sd_accel import accelerate, load_pipeline

            pipe = load_pipeline(self.config.model, allow_pickle=self.config.allow_pickle)
            pipe = accelerate(pipe, self.config.accel)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe
        self.tokenizer = getattr(pipe, "tokenizer", None) or getattr(pipe, "tokenizer_2", None)
        self._said_truncation = False
        for name in ("diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion",
                     "diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl"):
            logging.getLogger(name).addFilter(_DropTruncationWarning())
        self.model = model_label(self.config.model)
        self.default_sampler = getattr(getattr(pipe, "sd_accel", None), "sampler", None)
        self._base_scheduler = pipe.scheduler
        from sd_accel.samplers import webui_name

        # What the model's own scheduler is called in the WebUI (PLMS for SD 1.5's PNDM config).
        self.model_sampler = webui_name(pipe.scheduler) or type(pipe.scheduler).__name__
        self._schedulers: dict[str, Any] = {}
        self._limits: dict[BatchKey, int] = {}
        from sd_accel.serve.controlnet_units import controlnet_files

        self.controlnets = controlnet_files(self.config.controlnet_dir)  # name -> file; loaded on first use
        self._control_pipes: dict[tuple[str, ...], Any] = {}
        self._control_lock = threading.Lock()  # two first requests for one set of nets load it once
        self._control_units: collections.OrderedDict[tuple, list] = collections.OrderedDict()
        self._inits: collections.OrderedDict[str, bytes] = collections.OrderedDict()  # img2img: digest -> image
        self._img2img = None  # the img2img pipeline over this replica's model, made on first use
        self._lock = threading.Lock()
        self.unet_batches: collections.Counter[int] = collections.Counter()
        self.requests = 0
        # the UNet, or the transformer of SD3 / FLUX.1: its batches are what the engines' ranges bound
        self.denoiser = getattr(pipe, "unet", None) or pipe.transformer
        self.flow = not hasattr(pipe, "unet")  # SD3 / FLUX.1 run their own flow-matching scheduler
        self.denoiser.register_forward_pre_hook(self._count_unet_batch, with_kwargs=True)
        wait_ms = self.config.batch_wait_ms
        if wait_ms is None:
            wait_ms, why = default_batch_wait_ms(pipe)
            log.info("sd-accel serve: batch_wait_ms %g (%s; --batch-wait-ms sets it)", wait_ms, why)
        self.batch_wait_ms = wait_ms
        self.batcher = Batcher(
            run=self._run,
            limit=self._limit,
            wait_s=wait_ms / 1000.0,
            # Ray bounds the requests a replica holds (max_ongoing_requests); this bounds images,
            # which is what costs memory: at most that many requests of the largest batch.
            max_pending_images=self.config.max_ongoing_requests * self.config.max_batch_size,
            retry_after_s=self.config.retry_after_s,
        )
        note = self.batch_cap_note()
        if note:
            log.warning("sd-accel serve: %s", note)
        log.info("sd-accel serve: replica %s ready (%s)", self.replica_id, self.model)

    def batch_cap_note(self) -> str | None:
        """Said at start-up when the engines at the model's default size take fewer images per call
        than ``max_batch_size``: batching is capped there, silently otherwise."""
        width, height = self.default_size()
        key = BatchKey(width=width, height=height, steps=20, cfg=7.0, sampler=None)
        cap = engine_batch_limit(self.pipe, key)
        if cap is None or cap >= self.config.max_batch_size:
            return None
        return (f"batching is capped at {cap} image(s) per call at {width}x{height} by the engines' batch range "
                f"(max_batch_size is {self.config.max_batch_size}): build engines whose batch reaches "
                f"{self.config.max_batch_size} (build_profiles with batch [1, 1, {self.config.max_batch_size}], "
                "or --build-missing without --build-preset), or lower --max-batch-size")

    # ------------------------------------------------------------------ requests

    def default_size(self) -> tuple[int, int]:
        if self.flow:  # SD3's and FLUX.1's pipelines say theirs (1024 px for the real models)
            side = int(getattr(self.pipe, "default_sample_size", 128)) * getattr(self.pipe, "vae_scale_factor", 8)
        else:
            side = self.pipe.unet.config.sample_size * getattr(self.pipe, "vae_scale_factor", 8)
        return side, side

    def job_for(self, params: GenerationParams, control: tuple = (), init: tuple[str, float] | None = None) -> Job:
        """The job for one validated request; a seed of -1 is drawn here. ``control``: its
        ControlNet units' keys (:meth:`control_for`); ``init``: img2img's (image digest, strength)."""
        width, height = params.width, params.height
        if width is None or height is None:
            dw, dh = self.default_size()
            width, height = width or dw, height or dh
        sampler = params.sampler or self.default_sampler
        if sampler is not None:
            from sd_accel.samplers import resolve

            sampler = resolve(sampler).name  # one spelling, so "euler a" batches with "Euler a"
        if self.flow and sampler is not None:
            if sampler != "Euler":
                raise InvalidValue(f"sampler_name {params.sampler!r}: {type(self.pipe).__name__} runs its own "
                                   "flow-matching Euler scheduler; leave sampler_name out (or send \"Euler\")")
            sampler = None  # the model's own: the flow-matching Euler
        if self.flow and params.negative_prompt and not runs_cfg(self.pipe):
            raise InvalidValue(f"negative_prompt: {type(self.pipe).__name__} runs no classifier-free guidance "
                               "(cfg_scale is FLUX.1's guidance input), so it takes no negative prompt; leave it out")
        seed = params.resolved_seed()
        key = BatchKey(width=width, height=height, steps=params.steps, cfg=float(params.cfg), sampler=sampler,
                       control=control, strength=init[1] if init else None, init=init[0] if init else "")
        prompt, _ = clip_prompt(self.tokenizer, params.prompt)
        negative, _ = clip_prompt(self.tokenizer, params.negative_prompt)
        return Job(key, prompt, negative, [seed + i for i in range(params.batch)])

    def prompt_warnings(self, params: GenerationParams) -> list[str]:
        """What the request is told about its prompts: the part CLIP does not read."""
        warnings = []
        for field_name, text in (("prompt", params.prompt), ("negative_prompt", params.negative_prompt)):
            if clip_prompt(self.tokenizer, text)[1]:
                keep = getattr(self.tokenizer, "model_max_length", 77) - 2
                warnings.append(
                    f"{field_name} is longer than the {keep} tokens CLIP reads; the rest was ignored "
                    "(the WebUI encodes long prompts in 75-token chunks; sd-accel serve does not yet)"
                )
        if warnings and not self._said_truncation:
            self._said_truncation = True  # once per replica: the answers carry it every time
            log.warning("sd-accel serve: %s (said once; each answer's info.sd_accel.warnings says it)", warnings[0])
        return warnings

    # ------------------------------------------------------------------ ControlNet

    def control_for(self, units: list) -> tuple:
        """The batch key part of ``units`` (ControlUnit), after checking that this service has
        each named ControlNet; the units are kept for the call that runs them."""
        if not units:
            return ()
        for unit in units:
            if unit.model not in self.controlnets:
                if not self.controlnets:
                    raise InvalidValue(f"ControlNet {unit.model!r} was asked for, but this service has no "
                                       "ControlNets: start it with --controlnet-dir DIR (a folder of ControlNet files)")
                raise InvalidValue(f"ControlNet {unit.model!r} is not in this service's controlnet_dir; it has: "
                                   f"{', '.join(sorted(self.controlnets))}")
        control = tuple(unit.key() for unit in units)
        with self._lock:
            self._control_units[control] = list(units)
            self._control_units.move_to_end(control)
            while len(self._control_units) > 4 * self.config.max_ongoing_requests:  # hint images: bounded
                self._control_units.popitem(last=False)
        return control

    def control_pipe(self, models: tuple[str, ...]):
        """The ControlNet pipeline over this replica's model for ``models`` (loaded once, accelerated
        as the replica is: ControlNet and residual UNet engines where they are cached, torch otherwise)."""
        with self._control_lock:
            if models not in self._control_pipes:
                from sd_accel import accelerate, with_controlnets

                pipe = with_controlnets(self.pipe, [self.controlnets[m] for m in models],
                                        allow_pickle=self.config.allow_pickle)
                pipe = accelerate(pipe, self.config.accel)
                pipe.set_progress_bar_config(disable=True)
                denoiser = getattr(pipe, "unet", None) or pipe.transformer
                denoiser.register_forward_pre_hook(self._count_unet_batch, with_kwargs=True)
                self._control_pipes[models] = pipe
                log.info("sd-accel serve: ControlNet pipeline ready for %s", ", ".join(models))
            return self._control_pipes[models]

    def init_for(self, image: bytes | None, strength: float | None) -> tuple[str, float] | None:
        """img2img: the batch key part of an init image (its digest, and the strength), after
        keeping the image for the call that runs it; None for txt2img."""
        if image is None:
            return None
        import hashlib

        digest = hashlib.sha256(image).hexdigest()[:16]
        with self._lock:
            self._inits[digest] = image
            self._inits.move_to_end(digest)
            while len(self._inits) > 4 * self.config.max_ongoing_requests:  # images: bounded
                self._inits.popitem(last=False)
        return digest, float(strength if strength is not None else 0.75)

    def img2img_pipe(self):
        """The img2img pipeline over this replica's model (``AutoPipelineForImage2Image.from_pipe``:
        the same modules, engines included; made once)."""
        with self._control_lock:
            if self._img2img is None:
                from diffusers import AutoPipelineForImage2Image

                pipe = AutoPipelineForImage2Image.from_pipe(self.pipe)
                pipe.set_progress_bar_config(disable=True)
                self._img2img = pipe
                log.info("sd-accel serve: img2img pipeline ready (%s)", type(pipe).__name__)
            return self._img2img

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """``request``: ``GenerationParams`` fields, and ``controlnet``: ControlUnit dicts (from
        ``alwayson_scripts``). Returns PNG bytes (with infotexts), seeds, the size and sampler
        used, and the size of each call the images were made in."""
        from sd_accel.serve.controlnet_units import ControlUnit

        request = dict(request)
        units = [ControlUnit(**u) for u in request.pop("controlnet", None) or []]
        image, strength = request.pop("init_image", None), request.pop("strength", None)
        params = GenerationParams(**request)  # the same validation the HTTP route ran
        if units and image is not None:
            raise InvalidValue("ControlNet units with an init image (img2img) are not served yet; send one or the "
                               "other")
        control = self.control_for(units)
        if units:  # loading a ControlNet takes seconds: not on the event loop
            from sd_accel.serve.controlnet_units import check_union_modes

            check_union_modes(units, await asyncio.to_thread(self.control_pipe, tuple(u.model for u in units)))
        init = self.init_for(image, strength)
        if init:
            await asyncio.to_thread(self.img2img_pipe)
        job = self.job_for(params, control, init)
        warnings = self.prompt_warnings(params)
        with self._lock:
            self.requests += 1
        start = time.perf_counter()
        await self.batcher.submit(job)
        seconds = time.perf_counter() - start
        key = job.key
        sampler_label = key.sampler or self.model_sampler
        # As sd-webui-controlnet writes its units into the infotext.
        control_text = "".join(
            f", ControlNet {i}: \"Module: {u.module}, Model: {u.model}, Weight: {u.weight:g}, "
            f"Guidance Start: {u.guidance_start:g}, Guidance End: {u.guidance_end:g}\"" for i, u in enumerate(units))
        strength_text = f", Denoising strength: {key.strength:g}" if key.strength is not None else ""
        infotexts = [
            parameters_text(params.prompt, params.negative_prompt, key.steps, sampler_label, key.cfg, seed,
                            key.width, key.height, self.model) + control_text + strength_text
            for seed in job.seeds
        ]
        pngs = await asyncio.to_thread(
            lambda: [encode_png(img, text) for img, text in zip(job.images, infotexts, strict=True)]
        )
        return {
            "images": pngs,
            "seeds": job.seeds,
            "infotexts": infotexts,
            "width": key.width,
            "height": key.height,
            "sampler": sampler_label,
            "model": self.model,
            "call_sizes": job.call_sizes,
            "replica": self.replica_id,
            "seconds": round(seconds, 4),
            "warnings": warnings,
        }

    # ------------------------------------------------------------------ the worker

    def _pipe_for(self, key: BatchKey):
        if key.strength is not None:
            return self.img2img_pipe()
        if not key.control:
            return self.pipe
        from sd_accel.serve.controlnet_units import ControlUnit

        return self.control_pipe(ControlUnit.models(key.control))

    def _limit(self, key: BatchKey) -> int:
        # The engines' limit depends on the ControlNets, not on their images: one entry per set of models.
        from sd_accel.serve.controlnet_units import ControlUnit

        same = dataclasses.replace(key, control=ControlUnit.models(key.control))
        if same not in self._limits:
            engines = engine_batch_limit(self._pipe_for(key), key)
            self._limits[same] = max(1, min(self.config.max_batch_size, engines or self.config.max_batch_size))
        return self._limits[same]

    def _scheduler(self, sampler: str | None):
        if sampler is None or sampler == self.default_sampler:
            return self._base_scheduler
        if sampler not in self._schedulers:
            from sd_accel.samplers import make_scheduler

            self._schedulers[sampler] = make_scheduler(sampler, self._base_scheduler)
        return self._schedulers[sampler]

    def _run(self, key: BatchKey, items, should_stop) -> list:
        extra = None
        if key.control:
            from sd_accel.serve.controlnet_units import pipeline_arguments

            with self._lock:
                units = self._control_units.get(key.control)
            if units is None:  # evicted while it waited: only under far more distinct units than requests held
                raise InvalidValue("this request's ControlNet units were dropped from the replica; send it again")
            extra = pipeline_arguments(units, pipe=self._pipe_for(key))
        if key.strength is not None:
            from PIL import Image

            with self._lock:
                data = self._inits.get(key.init)
            if data is None:  # evicted while it waited: only under far more distinct images than requests held
                raise InvalidValue("this request's init image was dropped from the replica; send it again")
            image = Image.open(io.BytesIO(data)).convert("RGB").resize((key.width, key.height), Image.LANCZOS)
            extra = {"image": [image] * len(items), "strength": key.strength}
        return run_pipeline(self._pipe_for(key), key, items, should_stop, scheduler=self._scheduler(key.sampler),
                            extra=extra)

    def _count_unet_batch(self, _module, args, kwargs) -> None:
        sample = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
        if sample is not None:
            with self._lock:
                self.unet_batches[int(sample.shape[0])] += 1

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, Any]:
        """What this replica did: requests, calls and their sizes, UNet batches, engine use."""
        from sd_accel import stats as engine_stats

        with self._lock:
            unet = dict(sorted(self.unet_batches.items()))
            requests = self.requests
        return {
            "replica": self.replica_id,
            "pid": os.getpid(),
            "model": self.model,
            "requests": requests,
            "unet_batches": unet,
            "batch_limits": {f"{k.width}x{k.height}/{k.steps}/{k.cfg}/{k.sampler}": v for k, v in self._limits.items()},
            **self.batcher.stats(),
            "engines": engine_stats(self.pipe),
        }

    def check_health(self) -> None:
        """Ray calls this; raising marks the replica unhealthy and Ray replaces it."""
        if not self.batcher.alive:
            raise RuntimeError("the batch loop of this replica stopped")

    def __del__(self) -> None:
        batcher = getattr(self, "batcher", None)
        if batcher is not None:
            batcher.close()


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not in a Ray Serve replica (tests, direct use)
        return f"local-{os.getpid()}"
