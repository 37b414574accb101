"""The one builder (:func:`run_jobs`: a list of :class:`EngineJob` in, cache records out) and
``build_engines``, the Python API's face on it: export each component once, build one engine per
profile, validate it, and commit it to the cache; engines already in the cache are reused."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sd_accel import device
from sd_accel.backends.registry import check_precision, get_backend
from sd_accel.cache.key import EngineKey
from sd_accel.core import BuildCancelled, EngineError, InvalidValue, Progress, ValidationFailed
from sd_accel.profiles import Profile, default_preset
from sd_accel.profiles import preset as preset_profile
from sd_accel.units import format_size

log = logging.getLogger("sd_accel")


@dataclass
class BuildEvent:
    """One progress report: which engine (``index`` of ``total``), what stage, how far."""

    index: int
    total: int
    component: str
    profile: str
    stage: str
    fraction: float


@dataclass(frozen=True)
class EngineJob:
    """One engine to build: what every face (CLI, Python API, autobuild, panel, WebUI, serve)
    hands :func:`run_jobs`.

    ``spec``: the component spec (a diffusers one, or the WebUI's LDM one); ``model_id``
    replaces the weight fingerprint in the engine key (the WebUI keys by checkpoint hash);
    ``record_extra(artifact)`` adds fields to the cache record once the ONNX artifact exists.
    """

    spec: Any
    profile: Profile
    precision: str
    model_id: str | None = None
    record_extra: Callable[[Any], dict] | None = None
    # a transformer cut as a first-block step cache needs (sd_accel.components.segments.step_cache_plan)
    step_cache: bool = False


def run_jobs(
    jobs: Sequence[EngineJob],
    cache,
    backend,
    *,
    progress: bool | Callable[[BuildEvent], None] = True,
    cancel: threading.Event | None = None,
    validate: bool = True,
    context: Callable[[EngineJob], AbstractContextManager] | None = None,
) -> list:
    """The one builder: build (or reuse) each job's engine in turn, validated and committed to
    ``cache``; returns their records in job order.

    Every precision is checked against ``backend`` first (:func:`registry.check_precision`: the
    message says what a missing one needs), so nothing is exported for a build that cannot
    run. Progress reports number the jobs (``index`` of ``total``); ``cancel`` stops the build
    at the next tick (:class:`BuildCancelled`). ``context(job)``, when given, is entered around
    each run of consecutive jobs of the same spec (the WebUI undoes its patches of a module once
    for all its profiles).
    """
    for precision in dict.fromkeys(job.precision for job in jobs):
        check_precision(backend, precision)  # says what a missing precision needs (NNCF, a bf16 CPU)
    info = backend.info()
    report = _reporter(progress)
    records: list = []
    numbered = list(enumerate(jobs))
    try:
        for _, group in itertools.groupby(numbered, key=lambda item: id(item[1].spec)):
            group = list(group)
            with context(group[0][1]) if context is not None else contextlib.nullcontext():
                for index, job in group:
                    tick = make_tick(report, cancel, index, len(jobs), job.spec.name, job.profile.tag)
                    records.append(_build_one(cache, backend, info, job, tick, validate))
    finally:
        report(None)
    return records


def _profiles(pipe, preset: str | None, profiles: Iterable | None) -> list[Profile]:
    if profiles is not None:
        if preset is not None:
            raise InvalidValue("give preset= or profiles=, not both")
        out = [Profile.of(p) for p in profiles]
        if not out:
            raise InvalidValue("profiles= is empty")
        return out
    family = getattr(getattr(pipe, "sd_accel_model", None), "family", None) or (
        "sdxl" if hasattr(pipe, "text_encoder_2") else "sd15"
    )
    return [preset_profile(preset or default_preset(family))]


def _components(specs: dict, components: Iterable[str] | None) -> list[str]:
    if components is None:
        return list(specs)
    wanted: list[str] = []
    for c in components:  # "controlnet" names every ControlNet of the pipeline (controlnet, controlnet.1, ...)
        wanted += [k for k in specs if k.split(".")[0] == c] if c == "controlnet" and c in specs else [c]
    unknown = [c for c in wanted if c not in specs]
    if unknown:
        raise InvalidValue(f"components {unknown} are not in this pipeline; it has: {', '.join(specs)}")
    return wanted


def build_engines(
    pipe,
    preset: str | None = None,
    *,
    profiles: Iterable[Profile | dict] | None = None,
    backend: str = "auto",
    precision: str = "auto",
    components: Iterable[str] | None = None,
    engine_dir: str | Path | None = None,
    progress: bool | Callable[[BuildEvent], None] = True,
    cancel: threading.Event | None = None,
    validate: bool = True,
    keep_onnx: bool | str = "graph",
    step_cache: bool = False,
) -> list:
    """Build (or reuse) an engine for every component and profile; returns their cache records.

    ``step_cache``: build an SD3 / FLUX.1 transformer in the segments a first-block step cache
    runs one by one (``AccelConfig(step_cache=...)``: the embeddings and first block; the other
    blocks; the final projection), whatever its size. Such an engine serves every call, cached
    or not; other components are built as always.

    ``keep_onnx`` says what stays of the ONNX exports these engines were built from once the
    last one is built (unless another build is reading them). ``"graph"`` (the default): the
    graph only, a few MB; its weights, most of an export (3.4 GB for SD 1.5's UNet), come from
    the module when another profile is built or an engine is refitted, with no new export.
    ``True``: the whole export. ``False``: nothing; engines run without it, another profile
    exports again and a refit is refused. Whatever is kept is counted in the cache's disk use
    and removed with the last engine built from it.

    ``build_engines(pipe, preset="dynamic-512-768")`` builds the UNet, VAE decoder and text
    encoders for 512-768 px on the machine's default backend. On the tiny model, in seconds:

    >>> from sd_accel import load_pipeline
    >>> records = build_engines(load_pipeline("builtin:tiny-sd15"), profiles=[dict(batch=1, height=64, width=64)],
    ...                         backend="onnxruntime", components=["vae_decoder"], progress=False)
    >>> [(r.key.component, r.key.backend, r.key.precision) for r in records]
    [('vae_decoder', 'onnxruntime', 'fp32')]
    """
    from sd_accel.cache.store import EngineCache
    from sd_accel.components import specs_for
    from sd_accel.components.controlnet import control_specs
    from sd_accel.runtime.swap import torch_modules

    if keep_onnx not in (True, False, "graph"):
        raise InvalidValue(f"keep_onnx={keep_onnx!r}: use 'graph' (the default: the graph without its weights), "
                           "True (the whole export) or False (nothing)")
    cache = EngineCache(engine_dir)
    be = get_backend(backend, cache_root=cache.root, device=str(getattr(pipe, "device", "cpu")))
    precision = be.default_precision() if precision == "auto" else precision
    check_precision(be, precision)  # before the pipeline is read: a refused precision costs nothing
    with torch_modules(pipe):
        specs = {**specs_for(pipe), **control_specs(pipe)}  # a ControlNet pipeline's nets and residual UNet too
        names = _components(specs, components)
        profs = _profiles(pipe, preset, profiles)
        jobs = [EngineJob(specs[n], p, precision, step_cache=step_cache and n == "transformer")
                for n in names for p in profs]
        if be.torch_device == "cpu":  # T5-XXL (9.5 GB) is not held beside a build: read from disk when exported
            from sd_accel.runtime.paged_encoders import page_big_encoders

            page_big_encoders(pipe, cache.root)
        records = run_jobs(jobs, cache, be, progress=progress, cancel=cancel, validate=validate)
        if keep_onnx is False:
            cache.drop_intermediates_of(records)
        elif keep_onnx == "graph":
            keep_graphs_only(cache, records, [specs[n] for n in names])
    return records


def keep_graphs_only(cache, records: Sequence, specs: Iterable) -> list:
    """Keep only the graph of the ONNX exports ``records`` were built from, once the last of a
    build's engines is built (every path calls this: ``build_engines`` by default, the WebUI's and
    ComfyUI's builds): the weights, most of an export (3.4 GB of fp32 for SD 1.5's UNet, 7 GB
    with the residual-taking UNet's), come from the module when another profile is built or an
    engine is refitted (:func:`sd_accel.onnx.export.full_model`, :func:`sd_accel.onnx.weights.write_full`),
    with no new export. ``specs``: the component specs built, whose torch modules say which
    initializers are weights. An export a running build reads is left whole; one whose module's
    tensors do not match stays whole too. Returns the exports slimmed (the cache's
    :class:`~sd_accel.cache.intermediates.Intermediate`)."""
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    built = {r.key.component for r in records}
    for spec in specs:
        # several ControlNets share the component name; the first one's shapes stand for all
        # (their exports stay whole when the shapes differ)
        if spec.name in built and spec.name not in shapes:
            shapes[spec.name] = _tensor_shapes(spec.torch_module())
    if not shapes:
        return []
    return cache.slim_intermediates_of(records, shapes)


def _tensor_shapes(module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in (*module.named_parameters(), *module.named_buffers())}


def make_tick(report: Callable[[BuildEvent], None], cancel: threading.Event | None, index: int, total: int,
              component: str, profile_tag: str) -> Progress:
    """The progress callback of one engine job: reports a BuildEvent, and raises BuildCancelled
    once ``cancel`` is set, except on the job's final tick: by then the engine is committed to the
    cache, and it must be reported as finished, not cancelled (the cancel stops the next job)."""

    def tick(frac: float, msg: str) -> None:
        if cancel is not None and cancel.is_set() and frac < 1.0:
            raise BuildCancelled("build cancelled; no partial engine was kept")
        report(BuildEvent(index, total, component, profile_tag, msg, frac))

    return tick


def engine_components(pipe) -> list[str]:
    """The components of ``pipe`` that engines can be built for (``clip2`` only on SDXL, ...).

    >>> from sd_accel import load_pipeline
    >>> engine_components(load_pipeline("builtin:tiny-sd15"))
    ['clip', 'unet', 'vae_decoder', 'vae_encoder']
    """
    from sd_accel.components import specs_for
    from sd_accel.runtime.swap import torch_modules

    with torch_modules(pipe):
        return list(specs_for(pipe))


def built_from(pipe, record) -> bool:
    """Whether the cached engine ``record`` was built from ``pipe``'s current weights."""
    from sd_accel.components import specs_for
    from sd_accel.onnx.fingerprint import fingerprint
    from sd_accel.runtime.swap import torch_modules

    with torch_modules(pipe):
        spec = specs_for(pipe).get(record.key.component)
        return spec is not None and fingerprint(spec.torch_module()) == record.key.model


def _build_one(cache, be, info, job: EngineJob, tick: Progress, validate_it: bool):
    """Build (or reuse) one job's engine, validated and committed to the cache."""
    from sd_accel.onnx.export import ensure_onnx_artifact
    from sd_accel.onnx.fingerprint import fingerprint

    spec, profile, precision, record_extra = job.spec, job.profile, job.precision, job.record_extra
    model = job.model_id or be.model_id(spec.torch_module()) or fingerprint(spec.torch_module())
    plan = _segment_plan(be, spec, precision, job.step_cache)
    key = EngineKey(model, spec.name, be.name, info.version, info.arch, precision, profile.tag,
                    layout=plan.tag if plan is not None else "")
    existing = cache.get(key)
    if existing is not None and existing.status == "ok":
        tick(1.0, "cached")
        return existing
    if not be.takes_torch_module:
        check_export_fits(spec, plan)  # before the slot: a refused build leaves nothing behind
    with cache.build_slot(key) as slot:
        if slot is None:  # another process built it while we waited for the lock
            tick(1.0, "built by another process")
            return cache.get(key)
        start = time.perf_counter()
        if be.takes_torch_module:  # (the compiled backend): no ONNX export, no weights paged out
            files, result = _build_module_and_check(be, spec, model, profile, precision, slot.dir, tick, validate_it)
            record = slot.commit(files, spec.shape_ranges(profile), time.perf_counter() - start,
                                 result.to_dict() if result else None, record_extra(None) if record_extra else {},
                                 share=be.weights_files)
            tick(1.0, "done")
            return record
        if plan is not None:  # (a transformer too big to export whole: sd_accel.build_segments)
            files, result = _build_chain_and_check(be, spec, plan, profile, precision, slot.dir, tick, validate_it)
            record = slot.commit(files, spec.shape_ranges(profile), time.perf_counter() - start,
                                 result.to_dict() if result else None, record_extra(None) if record_extra else {})
            tick(1.0, "done")
            return record
        tick(0.0, "exporting ONNX")
        artifact = ensure_onnx_artifact(spec, cache.root, progress=lambda f, m: tick(0.4 * f, m))
        shapes = spec.shape_ranges(profile)
        calibration, holdout = None, None
        if precision == "int8":  # static INT8: calibration feeds captured from real prompt runs (cached)
            from sd_accel.calibration import calibration_for, split_holdout

            tick(0.4, "capturing calibration data from prompt runs")
            calibration, holdout = split_holdout(calibration_for(spec, profile, cache.root))
        scopes = int8_scopes(be, precision, validate_it)
        memo: dict = {}  # what the checks of one scope leave for the next (torch's picture)
        for attempt, scope in enumerate(scopes, 1):
            files, result = _build_and_check(be, spec, artifact, profile, shapes, precision, slot.dir, tick,
                                             validate_it, holdout, calibration, scope, memo)
            if result is None or result.ok:
                break
            if attempt == len(scopes):
                tried = ", ".join(s for s in scopes if s)
                way_out = ("try a narrower profile or fp32" if precision != "int8" else
                           f"int8 missed it{f' in every scope tried ({tried})' if tried else ''} on this "
                           f"machine: build {spec.name} in {be.default_precision()} "
                           f"(precision='{be.default_precision()}')")
                raise ValidationFailed(f"engine {key.name} failed validation: {result.why}. It was not kept; {way_out}.")
            log.warning("%s: int8 with the %s scope failed validation (%s); quantizing again with the "
                        "%s scope, which keeps more layers in float", spec.name, scope, result.why, scopes[attempt])
            tick(0.4, f"int8 ({scope} scope) failed its check; quantizing again ({scopes[attempt]} scope)")
        fields = record_extra(artifact) if record_extra else {}
        if scope:
            fields["int8_scope"] = scope
        record = slot.commit(files, shapes, time.perf_counter() - start, result.to_dict() if result else None,
                             fields, share=be.weights_files)
        tick(1.0, "done")
        return record


# What an ONNX export or conversion takes beyond one fp32 copy of the weights, at the least (the
# trace, the graph's protobuf, the backend's own structures).
EXPORT_OVERHEAD = 1 << 30


def export_needs(spec, plan=None) -> int:
    """Bytes the ONNX export (or the backend's conversion of it) of ``spec``'s module needs at the
    least: one fp32 copy of its weights (the graph's initializers) plus :data:`EXPORT_OVERHEAD`;
    for a build in segments (``plan``), of its largest segment's blocks. Measured peaks were
    1.7-4.7x the fp32 weights plus 1-2 GB (SD 1.5 UNet 2.5x, SDXL's 1.7x, FLUX.1's width at 1024 px
    3.7x; a segment ~5x its blocks), so this bound refuses only a build that cannot fit."""
    module = spec.torch_module()
    if plan is None:
        count = sum(t.numel() for t in itertools.chain(module.parameters(), module.buffers()))
    else:
        count = max(sum(p.numel() for name, i in segment.blocks for p in module.get_submodule(name)[i].parameters())
                    for segment in plan.segments)
    return 4 * count + EXPORT_OVERHEAD


def check_export_fits(spec, plan=None) -> None:
    """Raise :class:`~sd_accel.core.EngineError` before an export that cannot fit in the memory and
    swap available now (FLUX.1's transformer needs 45 GB, SD3.5 Large's 31 GB), instead of the
    kernel ending the process halfway. ``SD_ACCEL_NO_PREFLIGHT=1`` skips the check."""
    if os.environ.get("SD_ACCEL_NO_PREFLIGHT") == "1":
        return
    free = device.available_memory()
    if free is None:
        return
    need = export_needs(spec, plan)
    if need <= free:
        return
    raise EngineError(
        f"not enough memory to build the {spec.name} engine: exporting its "
        f"{(need - EXPORT_OVERHEAD) / 4e9:.2f}B parameters needs at least {format_size(need)} (one fp32 copy of "
        f"the weights and the trace), and {format_size(free)} of memory and swap is available. Nothing was "
        "written and the pipeline keeps running in PyTorch. Close other applications (or engines), add swap, "
        "or build on a machine with more memory; SD_ACCEL_NO_PREFLIGHT=1 tries anyway.")


def _build_and_check(be, spec, artifact, profile: Profile, shapes, precision: str, out_dir: Path, tick: Progress,
                     validate_it: bool, holdout, calibration, int8_scope: str | None, memo: dict | None = None):
    """One backend build into ``out_dir`` and, when asked, its check against torch: (files,
    validation or None)."""
    from sd_accel.onnx.export import full_model
    from sd_accel.validate import validate

    # Inside the slot: a crash leaves it where leftovers of this build are removed.
    with full_model(artifact, spec.torch_module(), out_dir / ".onnx-source") as source:
        release_torch_weights(spec)
        files = be.build(source, shapes, precision, out_dir, lambda f, m: tick(0.4 + 0.4 * f, m),
                         calibration=calibration, int8_scope=int8_scope)
    if not validate_it:
        return files, None
    tick(0.85, "validating against torch")
    runner = be.load(out_dir, files, shapes)
    try:
        return files, validate(spec, runner, profile, precision, device=be.torch_device, feeds=holdout or None,
                               memo=memo)
    finally:
        runner.close()


def _segment_plan(be, spec, precision: str, step_cache: bool = False):
    """Where to cut ``spec``'s module for a build in segments (:func:`sd_accel.components.segments.plan_for`),
    or None: built whole. int8 in segments is int8 weights only (the backend's
    ``int8_weights_only``: OpenVINO); a backend without it builds static int8 whole (its
    calibration feeds the whole module's inputs). A backend that builds from the torch module
    builds it whole."""
    from sd_accel.components.segments import plan_for, step_cache_plan

    if be.takes_torch_module:
        if step_cache:
            log.warning("%s: the %s backend builds from the torch module whole; a step cache has no first "
                        "block to run alone on it (its steps run in full)", spec.name, be.name)
        return None
    plan = step_cache_plan(spec) if step_cache else None
    if step_cache and plan is None:
        log.warning("%s cannot be cut for a step cache (not an SD3 / FLUX.1 transformer of 2 blocks or more); "
                    "built as always", spec.name)
    plan = plan or plan_for(spec)
    if plan is not None and precision == "int8" and be.int8_weights_only is None:
        log.warning("%s: static int8 builds the module whole on %s (its calibration is the whole module's); "
                    "it would be built in %d segments otherwise", spec.name, be.name, len(plan.segments))
        return None
    return plan


def _build_chain_and_check(be, spec, plan, profile: Profile, precision: str, out_dir: Path, tick: Progress,
                           validate_it: bool):
    """A build in segments into ``out_dir`` (:mod:`sd_accel.build_segments`) and, when asked, its
    check against torch, whose reference also runs one segment in fp32 at a time; a failed check
    raises, as for any engine."""
    from sd_accel.build_segments import ChainReference, build_chain, chain_runner
    from sd_accel.validate import validate

    shapes = spec.shape_ranges(profile)
    log.info("%s: building in %d segments (%s)", spec.name, len(plan.segments), plan.tag)
    files = build_chain(be, spec, plan, profile, precision, out_dir, lambda f, m: tick(0.8 * f, m),
                        release=release_torch_weights)
    if not validate_it:
        return files, None
    tick(0.85, "validating against torch")
    with chain_runner(be, out_dir, files, shapes) as runner:
        result = validate(ChainReference(spec, plan, be.torch_device), runner, profile, precision,
                          device=be.torch_device)
    if not result.ok:
        raise ValidationFailed(f"{be.name} engine of {spec.name} ({profile.tag}, {precision}, {plan.tag}) failed "
                               f"validation: {result.why}. It was not kept; try precision='fp32'.")
    return files, result


def _build_module_and_check(be, spec, model: str, profile: Profile, precision: str, out_dir: Path, tick: Progress,
                            validate_it: bool):
    """A backend that builds from the torch module (``takes_torch_module``): its build into
    ``out_dir`` and, when asked, its check against torch; a failed check raises, as for any engine."""
    from sd_accel.validate import validate

    shapes = spec.shape_ranges(profile)
    files = be.build_module(spec, model, shapes, precision, out_dir, lambda f, m: tick(0.8 * f, m))
    if not validate_it:
        return files, None
    tick(0.85, "validating against torch")
    runner = be.load(out_dir, files, shapes)
    try:
        result = validate(spec, runner, profile, precision, device=be.torch_device)
    finally:
        runner.close()
    if not result.ok:
        raise ValidationFailed(f"{be.name} engine of {spec.name} ({profile.tag}, {precision}) failed validation: "
                               f"{result.why}. It was not kept; try precision='fp32' or another backend.")
    return files, result


def int8_scopes(be, precision: str, validate_it: bool) -> tuple[str | None, ...]:
    """The int8 scopes to build in turn (the backend's ``int8_scopes``, widest first): all of
    them when validation can turn the wider ones down, else only the safest; ``(None,)`` for
    other precisions and for backends with a single int8 scope."""
    scopes = tuple(be.int8_scopes)
    if precision != "int8" or not scopes:
        return (None,)
    return scopes if validate_it else scopes[-1:]


def release_torch_weights(spec) -> int:
    """Hand back the resident pages of the pipeline's torch weights while a backend builds from
    the export: the export, the calibration runs and :func:`full_model` paged them in, and the
    backend never reads them (SD 1.5 in fp32: 4 GB, beside a build that holds the converted model
    and its compiled copy; an int8 build peaked at 15 GB with them resident). Weights mapped from
    their files (diffusers and transformers load ``.safetensors`` that way) or parked by the
    runtime load again from there on first use (the validation, a torch call); weights in
    anonymous memory are left alone. Returns the bytes handed back."""
    from sd_accel.pages import trim_heap
    from sd_accel.runtime.weights import release

    modules = {id(m): m for m in (spec.torch_module(), *_pipeline_modules(getattr(spec, "pipe", None)))}
    total = sum(release(m) for m in modules.values())
    trim_heap()  # the calibration runs' activations, freed but kept by malloc
    if total:
        log.info("%s: %s of torch weights paged out for the backend build", spec.name, format_size(total))
    return total


def _pipeline_modules(pipe) -> list:
    import torch

    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        return []
    return [m for m in components.values() if isinstance(m, torch.nn.Module)]


def _reporter(progress) -> Callable[[BuildEvent | None], None]:
    if callable(progress):
        return lambda ev: ev is not None and progress(ev)
    if not progress:
        return lambda ev: None
    from tqdm.auto import tqdm

    bars: dict[int, tqdm] = {}

    def show(ev: BuildEvent | None) -> None:
        if ev is None:
            for bar in bars.values():
                bar.close()
            bars.clear()
            return
        bar = bars.get(ev.index)
        if bar is None:
            for old in bars.values():
                old.close()
            bars.clear()
            bar = bars[ev.index] = tqdm(total=100, desc=f"[{ev.index + 1}/{ev.total}] {ev.component} {ev.profile}",
                                        unit="%", leave=True)
        bar.set_postfix_str(ev.stage, refresh=False)
        bar.update(max(0, int(ev.fraction * 100) - bar.n))

    return show
