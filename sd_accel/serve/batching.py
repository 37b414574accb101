"""Dynamic batching: concurrent compatible requests share one pipeline call.

Requests are *compatible* when they share a ``BatchKey`` (size, steps, guidance, sampler): only
the prompts and seeds differ, and diffusers takes those per image. Each image gets its own
``torch.Generator`` seeded from its request (seed, seed+1, ... within a request, as the WebUI
does), so an image made in a batch equals the one the same request makes alone. Incompatible
requests are never mixed: each call holds one key.

``Batcher`` is the replica-side queue (asyncio, no Ray): bounded, first come first served by
key, one call at a time in a worker thread; a request whose caller goes away leaves the queue at
once, and a running call whose every request went away stops at the next step.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sd_accel.core import SdAccelError

log = logging.getLogger("sd_accel")


class QueueFull(SdAccelError, RuntimeError):
    """The replica holds as many images as it may; the caller should retry later (HTTP 503)."""


class Abandoned(SdAccelError, RuntimeError):
    """Every request of a running call went away; the call stopped early."""


@dataclass(frozen=True)
class BatchKey:
    """What a pipeline call fixes for all its images; requests with equal keys can share a call."""

    width: int
    height: int
    steps: int
    cfg: float
    sampler: str | None  # None: the replica's default scheduler
    control: tuple = ()  # the ControlNet units' keys (ControlUnit.key), in order; () without ControlNet
    strength: float | None = None  # img2img: the denoising strength; None: txt2img
    init: str = ""  # img2img: the init image's digest (one image per call)


@dataclass(eq=False)
class Job:
    """One request: its images are ``seeds`` (one per image), filled in as calls finish."""

    key: BatchKey
    prompt: str
    negative_prompt: str | None
    seeds: list[int]
    future: asyncio.Future | None = None
    enqueued: float = 0.0
    next_index: int = 0  # first image not yet handed to a call
    images: list[Any] = field(default_factory=list)
    call_sizes: list[int] = field(default_factory=list)  # images in each call this job was part of

    def __post_init__(self) -> None:
        self.images = [None] * len(self.seeds)

    @property
    def gone(self) -> bool:
        """Finished, failed or cancelled (its caller went away)."""
        return self.future is not None and self.future.done()

    @property
    def unscheduled(self) -> int:
        return len(self.seeds) - self.next_index


@dataclass(frozen=True)
class WorkItem:
    """One image of one job, in one call."""

    job: Job
    index: int

    @property
    def prompt(self) -> str:
        return self.job.prompt

    @property
    def negative_prompt(self) -> str:
        return self.job.negative_prompt or ""  # diffusers: None and "" are the same empty negative

    @property
    def seed(self) -> int:
        return self.job.seeds[self.index]


def take_group(queue: collections.deque[Job], limit: Callable[[BatchKey], int]) -> list[WorkItem]:
    """The next call: images of the oldest live job's key, oldest first, at most ``limit(key)``.

    A job larger than the limit is split over several calls (it stays at the head); jobs fully
    handed out and jobs that are gone leave ``queue``. Other keys wait for a later call.

    >>> k = BatchKey(64, 64, 4, 7.0, None)
    >>> q = collections.deque([Job(k, "a", None, [1, 2]), Job(BatchKey(64, 64, 8, 7.0, None), "b", None, [3]),
    ...                        Job(k, "c", None, [4])])
    >>> [(i.prompt, i.seed) for i in take_group(q, lambda key: 4)]
    [('a', 1), ('a', 2), ('c', 4)]
    >>> [(i.prompt, i.seed) for i in take_group(q, lambda key: 4)]
    [('b', 3)]
    """
    while queue and (queue[0].gone or not queue[0].unscheduled):
        queue.popleft()
    if not queue:
        return []
    key = queue[0].key
    room = max(1, int(limit(key)))
    items: list[WorkItem] = []
    for job in queue:
        if job.gone or job.key != key:
            continue
        take = min(job.unscheduled, room - len(items))
        items.extend(WorkItem(job, job.next_index + i) for i in range(take))
        job.next_index += take
        if len(items) >= room:
            break
    for job in [j for j in queue if j.gone or not j.unscheduled]:
        queue.remove(job)
    return items


def ready_images(queue: Sequence[Job], key: BatchKey) -> int:
    """Images of live jobs with ``key`` not yet handed to a call."""
    return sum(j.unscheduled for j in queue if not j.gone and j.key == key)


RunCall = Callable[[BatchKey, list[WorkItem], Callable[[], bool]], list[Any]]


class Batcher:
    """The replica's queue of jobs and its one worker.

    ``run(key, items, should_stop)`` makes one image per item (in order) in one pipeline call and
    runs in a worker thread; ``should_stop()`` turns True when every job of the call is gone.
    ``limit(key)`` is the most images one call may take for that key.
    """

    def __init__(self, run: RunCall, limit: Callable[[BatchKey], int], wait_s: float, max_pending_images: int,
                 retry_after_s: float = 5.0) -> None:
        self.run = run
        self.limit = limit
        self.wait_s = wait_s
        self.max_pending_images = max_pending_images
        self.retry_after_s = retry_after_s
        self._queue: collections.deque[Job] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sd-accel-batch")
        self._lock = threading.Lock()  # stats are read from other threads (Ray's health checks)
        self.calls = 0
        self.aborted_calls = 0
        self.failed_calls = 0
        self.images_made = 0
        self.cancelled_jobs = 0
        self.call_sizes: collections.Counter[int] = collections.Counter()

    # ------------------------------------------------------------------ the caller's side

    def pending_images(self) -> int:
        return sum(j.unscheduled for j in self._queue if not j.gone)

    async def submit(self, job: Job) -> Job:
        """Queue ``job`` and wait for its images; ``QueueFull`` when the queue has no room.

        Cancelling the caller (the client went away, a timeout) takes the job out of the queue
        at once; a call already running finishes for the others, or stops if it was alone.
        """
        loop = asyncio.get_running_loop()
        pending = self.pending_images()
        # An empty queue takes any one job, so a request larger than the bound is not refused forever.
        if pending and pending + len(job.seeds) > self.max_pending_images:
            raise QueueFull(
                f"this replica already holds {pending} queued images "
                f"(at most {self.max_pending_images}); retry in {self.retry_after_s:g} s"
            )
        self._ensure_worker(loop)
        job.future = loop.create_future()
        job.enqueued = loop.time()
        self._queue.append(job)
        job.future.add_done_callback(lambda f, j=job: self._on_done(j, f))
        assert self._wake is not None
        self._wake.set()
        await job.future  # cancelling this await cancels the future: the job is gone
        return job

    def _on_done(self, job: Job, future: asyncio.Future) -> None:
        if future.cancelled():
            with self._lock:
                self.cancelled_jobs += 1
            if job in self._queue:
                self._queue.remove(job)  # its slot is free now, not when a worker reaches it

    def _ensure_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is None or self._task.done():
            if self._task is not None and not self._task.cancelled() and self._task.exception():
                log.error("sd-accel serve: the batch loop had stopped: %r; restarted", self._task.exception())
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._loop())

    @property
    def alive(self) -> bool:
        """False when the batch loop died (the replica is then unhealthy and Ray restarts it)."""
        return self._task is None or not self._task.done()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "calls": self.calls,
                "aborted_calls": self.aborted_calls,
                "failed_calls": self.failed_calls,
                "images_made": self.images_made,
                "cancelled_requests": self.cancelled_jobs,
                "images_per_call": dict(sorted(self.call_sizes.items())),
                "queued_images": self.pending_images(),
            }

    # ------------------------------------------------------------------ the worker's side

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while True:
            while not any(not j.gone for j in self._queue):
                self._wake.clear()
                await self._wake.wait()
            head = next(j for j in self._queue if not j.gone)
            limit = max(1, int(self.limit(head.key)))
            # Wait for company: until the call is full, or the oldest request waited wait_s.
            deadline = head.enqueued + self.wait_s
            while ready_images(self._queue, head.key) < limit and not head.gone:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            items = take_group(self._queue, self.limit)
            if items:
                await self._run(loop, items)

    async def _run(self, loop: asyncio.AbstractEventLoop, items: list[WorkItem]) -> None:
        jobs = list(dict.fromkeys(item.job for item in items))
        n = len(items)

        def should_stop() -> bool:
            return all(j.gone for j in jobs)

        start = time.perf_counter()
        try:
            images = await loop.run_in_executor(self._executor, self.run, items[0].job.key, items, should_stop)
        except Abandoned:
            with self._lock:
                self.aborted_calls += 1
            log.info("sd-accel serve: a call of %d image(s) stopped: all its requests went away", n)
            return
        except Exception as exc:
            with self._lock:
                self.failed_calls += 1
            log.exception("sd-accel serve: a call of %d image(s) failed", n)
            for job in jobs:
                if not job.gone:
                    job.future.set_exception(exc)
            return
        if len(images) != n:
            raise RuntimeError(f"the pipeline returned {len(images)} images for {n} requested")
        with self._lock:
            self.calls += 1
            self.images_made += n
            self.call_sizes[n] += 1
        log.debug("sd-accel serve: call of %d image(s) in %.2f s", n, time.perf_counter() - start)
        for item, image in zip(items, images, strict=True):
            item.job.images[item.index] = image
        for job in jobs:
            job.call_sizes.append(n)
            if not job.gone and all(img is not None for img in job.images):
                job.future.set_result(job)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------- the pipeline call


def engine_batch_limit(pipe, key: BatchKey) -> int | None:
    """The most images per call that every engine-backed component serves at ``key``'s size,
    or None when no component has an engine for it (torch has no batch range).

    The UNet runs cond and uncond together when guidance is on (``cfg > 1``), so its batch
    range is halved for images.
    """
    limits = []
    scale = getattr(pipe, "vae_scale_factor", 8) or 8
    latent = (key.height // scale, key.width // scale)
    for slot in ("text_encoder", "text_encoder_2", "text_encoder_3", "controlnet", "unet", "transformer", "vae"):
        module = getattr(pipe, slot, None)
        engines_by_component = getattr(module, "engines", None)
        if not isinstance(engines_by_component, dict):
            continue
        for component, engines in engines_by_component.items():
            if component == "vae_encoder":
                continue  # txt2img never encodes images
            # the UNet families always double their denoiser's rows under CFG; the transformer
            # families (and their ControlNets) only where the family runs CFG (SD3, not FLUX.1)
            unet_family = getattr(pipe, "unet", None) is not None
            doubled = (component in ("unet", "unet_control", "controlnet") if unet_family
                       else component in ("transformer", "transformer_control", "controlnet") and runs_cfg(pipe))
            per_image = 2 if doubled and key.cfg > 1 else 1
            best = 0
            for handle in getattr(engines, "handles", []):
                if getattr(handle, "broken", None):
                    continue
                shapes = getattr(handle, "shapes", {})
                if not _covers_latent(shapes, latent):
                    continue
                batch_max = [hi[0] for _, _, hi in shapes.values() if len(hi)]
                if batch_max:
                    best = max(best, min(batch_max) // per_image)
            if best:
                limits.append(best)
    return min(limits) if limits else None


def runs_cfg(pipe) -> bool:
    """Whether ``pipe`` runs classifier-free guidance (cond and uncond in one denoiser batch) when
    its guidance scale is above 1: every family but FLUX.1, whose guidance scale is an input of the
    transformer (FLUX.1-dev's guidance embedding; schnell ignores it)."""
    return not type(pipe).__name__.startswith("Flux")


def _covers_latent(shapes: dict, latent: tuple[int, int]) -> bool:
    """Whether every 4-D input spans ``latent`` (height, width): in the UNet and the VAE decoder
    those are the latents (``sample``, ``latent``); the CLIP encoders have none."""
    for lo, _, hi in shapes.values():
        if len(lo) == 4 and not (lo[2] <= latent[0] <= hi[2] and lo[3] <= latent[1] <= hi[3]):
            return False
    return True


def run_pipeline(pipe, key: BatchKey, items: Sequence[WorkItem], should_stop: Callable[[], bool],
                 scheduler=None, extra: dict | None = None) -> list:
    """One pipeline call for ``items`` (one image each, own prompt and seed); PIL images in order.
    ``extra``: more call arguments (a ControlNet pipeline's hint images and scales).

    Raises ``Abandoned`` at a step boundary when ``should_stop()`` turns True.
    """
    import torch

    if scheduler is not None:
        pipe.scheduler = scheduler

    def on_step_end(_pipe, _step, _timestep, callback_kwargs):
        if should_stop():
            raise Abandoned("every request of this call went away")
        return callback_kwargs

    # CPU generators, one per image, as sd_accel.generate uses: the seed means the same image
    # alone or in a batch, on any device.
    import inspect

    generators = [torch.Generator("cpu").manual_seed(item.seed) for item in items]
    negative = {"negative_prompt": [item.negative_prompt for item in items]} if runs_cfg(pipe) else {}
    # img2img pipelines of SD take the size from the init image (resized to it beforehand)
    size = {"width": key.width, "height": key.height} if "width" in inspect.signature(pipe.__call__).parameters else {}
    # SD3's ControlNet pipeline samples its hint's latents from torch's global generator, not the
    # request's: seeded from the call's first seed (in a forked state, the process's own untouched)
    # so that a seed gives the same picture every time, on engines as in PyTorch.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(items[0].seed)
        return pipe(
            prompt=[item.prompt for item in items],
            **negative,
            num_inference_steps=key.steps,
            guidance_scale=key.cfg,
            **size,
            num_images_per_prompt=1,
            generator=generators,
            callback_on_step_end=on_step_end,
            **(extra or {}),
        ).images
