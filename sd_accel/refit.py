"""``refit_engines(pipe)``: engines that carry the torch weights a pipeline holds now (a LoRA
loaded, scaled or fused, ``load_state_dict``, an edit), without exporting the model again.

For each engine-backed module whose weights changed since its engines were built
(:mod:`sd_accel.runtime.freshness`), and each of its engines:

1. the ONNX graph the engine was built from (the export cached under ``<engines>/onnx``, keyed
   by the base weights; by default its graph only) is written out again with the module's
   current *full* weights in its weight initializers (base + every active LoRA's delta at its
   scale, never a delta on top of an earlier refit: LoRA A, then B, then A again gives A), one
   tensor at a time (:func:`sd_accel.onnx.weights.write_full`);
   Where the backend can take new weights without compiling (OpenVINO float engines: their
   compiled blob reads the MatMul / Conv weights from ``engine.bin`` at load), a copy of the
   engine with those weights written in is made instead (seconds), validated, and used; a change
   it cannot take (a bias, a norm scale: folded into the compiled blob) goes the full way.
   TensorRT engines (built refittable) take every weight by ONNX initializer name through
   ``trt.Refitter`` the same way (checked on the stand-in TensorRT only: no GPU here). The full way:
2. the backend builds from that graph the way it built the engine (ONNX Runtime: its optimized
   session at the engine's shapes; OpenVINO: convert and compile) into a scratch folder under
   ``<engines>/.refit`` that lives as long as the refitted engine (never in the index: the
   base engine stays in the cache as it was); it is named after this process
   (``.refit/p<pid>-...``), listed and counted by ``sd-accel list``, and removed after a crash
   by the next refit or prune (:mod:`sd_accel.cache.refits`);
3. the refitted engine is validated against the torch module like a new one, and replaces the
   engine in memory for this pipeline; the stand-in takes the current weights as its reference.

The graph is never exported again (the slow, memory-hungry step: 35-72 s and 4 GB for SD 1.5's
UNet); ONNX Runtime does optimize the session again (ORT's optimized model bakes weights into
packed and reordered layouts that cannot be replaced one by one). INT8 engines are refused:
their weights were quantized with calibrated scales, so a changed weight needs a rebuild.

Which initializer holds which torch weight: :func:`sd_accel.onnx.weights.initializer_map`.

Memory. A refit holds the engine it makes and the patched weights it writes; so before it
starts, :func:`preflight` sets that estimate against the memory available and refuses with an
:class:`~sd_accel.core.EngineError` that says both (the host goes on with the engines it has, or
PyTorch). Only one refitted weight set per module is kept by default (:data:`KEEP_REFITS`), and
the previous one is released before the next is made, so a strength change never holds two
patched copies. The hosts (the WebUI extension, the ComfyUI pack) refit lazily: a
:class:`PendingRefit` stands in for each engine and refits it at its first call, so a LoRA change
patches only the profiles the jobs really call.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sd_accel.cache.refits import REFIT_DIR, new_copy  # noqa: F401  (REFIT_DIR: where they go)
from sd_accel.core import SPEC_VERSION, EngineError, InvalidValue
from sd_accel.core import peft_layer as _peft_layer
from sd_accel.device import available_memory  # (refit_fits reads it here: tests patch it)
from sd_accel.onnx.weights import effective_weights, write_full
from sd_accel.paths import export_dir
from sd_accel.runtime.selection import REFIT_CLOSED

log = logging.getLogger("sd_accel")

NEEDS_REBUILD = ("int8", "int8-dynamic", "int4")  # weights stored quantized, with their scales


# --------------------------------------------------------------------------- engines


def _artifact(cache_root: Path, record) -> Path:
    from sd_accel.cache.intermediates import serves

    key = record.key
    # The export is keyed by the weights' fingerprint: the key's own, or, for engines keyed by
    # another id (the WebUI's checkpoint hash), the fingerprint their record keeps.
    candidates = [export_dir(cache_root, component, weights, SPEC_VERSION) / "model.onnx"
                  for component, weights in sorted(serves(record), key=lambda pair: pair[1] != key.model[:16])]
    for path in candidates:
        if path.exists():
            return path
    raise EngineError(f"{key.name}: the ONNX graph it was built from ({candidates[0].parent}) is gone (pruned?); "
                      "rebuild the engine from the changed weights (build_engines(pipe)) instead")


def _scratch(cache_root: Path, name: str) -> Path:
    return new_copy(cache_root, name)  # .refit/p<pid>-<name>-...; stale ones go at the first


_WEIGHT_BYTES = {"fp16": 2, "bf16": 2}  # per element; fp32 engines (and any other) 4


def refit_needs(handle, weights: dict[str, torch.Tensor]) -> int:
    """Bytes a refit of ``handle``'s engine to ``weights`` holds at its peak, estimated: the
    patched weights in the engine's precision (written out, then loaded) plus the engine loaded."""
    record = handle.record
    per = _WEIGHT_BYTES.get(record.key.precision, 4)
    patched = sum(t.numel() for t in weights.values() if t.is_floating_point()) * per
    return patched + int(getattr(record, "size_bytes", 0) or 0)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 // 10 else f"{n / 2**20:.1f} MiB"


def preflight(handle, weights: dict[str, torch.Tensor]) -> None:
    """Raise :class:`~sd_accel.core.EngineError` before a refit that would not fit in the memory
    available now (nothing is written or loaded; the host keeps the engines it has)."""
    free = available_memory()
    if free is None:
        return
    need = refit_needs(handle, weights)
    if need > free:
        raise EngineError(f"not enough memory to refit {handle.name}: needs ~{_gib(need)}, "
                          f"{_gib(free)} available; close other engines or applications (or other "
                          "checkpoints' engines), keep fewer LoRA sets refitted, or build an engine with these "
                          "LoRAs applied; this call runs on the engines or PyTorch as before")


def conversion_preflight(handle, copied, what: str) -> None:
    """Raise :class:`~sd_accel.core.EngineError` before a host's refit whose conversion of its weights
    to the engine's layout makes float32 copies of the tensors ``copied`` and, with the refitted
    engine, would not fit in the memory available now. The copy comes before :func:`preflight`, and at
    FLUX.1's real size a full one is 48 GB; the host's call then goes on in PyTorch, the host
    untouched. ``what``: the weights in the message (``patched transformer``)."""
    free = available_memory()
    if free is None:
        return
    need = 4 * sum(t.numel() for t in copied) + int(getattr(handle.record, "size_bytes", 0) or 0)
    if need > free:
        raise EngineError(f"not enough memory to refit {handle.name}: a float32 copy of the {what} "
                          f"and the engine need ~{_gib(need)}, {_gib(free)} available; close other applications "
                          "or models, or build an engine with the LoRA merged")


class RefittedRunner:
    """A runner built from changed weights; its scratch folder goes when it is closed or dropped."""

    def __init__(self, runner, folder: Path, weights_id: str) -> None:
        self.runner = runner
        self.shapes = runner.shapes
        self.folder = folder
        self.weights_id = weights_id
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(folder), True)

    def infer(self, feed):
        return self.runner.infer(feed)

    def close(self) -> None:
        self.runner.close()
        self._cleanup()


def refit_engine(handle, weights: dict[str, torch.Tensor], spec, progress: Callable[[float, str], None],
                 validate_it: bool = True) -> RefittedRunner:
    """A runner for the engine of ``handle`` with ``weights`` (torch names, full values) in place
    of the ones it was built with; validated against ``spec``'s torch module."""
    from sd_accel.profiles import Profile
    from sd_accel.runtime.weights import handed_back_after_use
    from sd_accel.validate import validate

    record = handle.record
    precision = record.key.precision
    if precision in NEEDS_REBUILD:
        raise InvalidValue(f"{record.key.name}: {precision} engines cannot be refitted (their weights were "
                           "quantized with calibrated scales); rebuild them from the changed weights "
                           f"(build_engines(pipe, precision={precision!r})) or use an fp32/bf16 engine")
    cache_root = Path(handle.cache.root)
    source = _artifact(cache_root, record)
    preflight(handle, weights)
    folder = _scratch(cache_root, record.key.name)
    try:
        runner = _patched(handle, weights, spec, source.parent, folder / "patched", progress, validate_it)
        if runner is not None:
            progress(1.0, "refitted")
            with contextlib.suppress(OSError):
                folder.rmdir()  # compiled in memory: no copy on disk to list or clean up
            return RefittedRunner(runner, folder, record.key.model)
        graph = folder / "graph"
        progress(0.0, "writing the current weights into the exported graph")
        _, written = write_full(source.parent, weights, graph, replace=True)
        progress(0.2, f"building with {written} weights replaced")
        engine = folder / "engine"
        engine.mkdir()
        shapes = handle.shapes
        files = handle.backend.build(graph / "model.onnx", shapes, precision, engine,
                                     lambda f, m: progress(0.2 + 0.6 * f, m))
        shutil.rmtree(graph, ignore_errors=True)
        runner = handle.backend.load(engine, files, shapes)
        if validate_it:
            progress(0.85, "validating against torch")
            with handed_back_after_use(spec.torch_module()):
                result = validate(spec, runner, Profile.from_tag(record.key.profile), precision,
                                  device=handle.backend.torch_device)
            if not result.ok:
                runner.close()
                raise EngineError(f"{record.key.name}: the refitted engine failed validation ({result.why}); "
                                  "it is not used")
            log.info("%s: refitted engine validated (max abs error %.2e)", record.key.name, result.max_abs)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    progress(1.0, "refitted")
    return RefittedRunner(runner, folder, record.key.model)


def _patched(handle, weights: dict[str, torch.Tensor], spec, export: Path, out: Path,
             progress: Callable[[float, str], None], validate_it: bool = True):
    """The fast refit, where the backend can write new weights into a copy of the engine without
    compiling (OpenVINO: its compiled engine reads the MatMul / Conv weights from engine.bin at
    load, so a LoRA needs a patched copy of that file): a validated runner, or None when the
    backend cannot (a bias or norm changed, an older engine) or the result disagrees with torch,
    and the full refit runs. Validated unless ``validate_it`` is False (the caller's
    ``validate=False``, as for the full refit): it relies on how the backend loads its engine."""
    from sd_accel.onnx.weights import onnx_values
    from sd_accel.profiles import Profile
    from sd_accel.runtime.weights import handed_back_after_use
    from sd_accel.validate import validate

    if not handle.backend.patches_weights:  # declared in backends/base.py (False by default)
        return None
    record = handle.record
    engine_dir, files = handle.cache.engine_dir(record.key), list(record.files)
    values = onnx_values(export, weights)
    progress(0.0, "compiling the engine with the current weights")
    runner = handle.backend.refit_runner(engine_dir, files, _one_at_a_time(values), handle.shapes)
    if runner is None:
        progress(0.0, "writing the current weights into a copy of the engine")
        files = handle.backend.patch_weights(engine_dir, files, _one_at_a_time(values), out)
        if files is None:
            shutil.rmtree(out, ignore_errors=True)
            return None
        runner = handle.backend.load(out, files, handle.shapes)
    if not validate_it:
        log.warning("%s: engine refitted with its weights replaced, not validated (validate=False)", record.key.name)
        return runner
    progress(0.5, "validating against torch (one batch item, opt shape)")
    # Narrower than a new engine's check, and as sound for what can go wrong here: the graph and
    # the compiled blob are the base engine's (validated when it was built, at every point and
    # batch item); only its weights are new. A wrong weight (misplaced, mis-converted, or one the
    # blob does not read from engine.bin) is wrong for every batch item and every shape, and the
    # UNet, text encoder and VAE compute each batch item on its own, so the first item at the opt
    # shape shows it. The engine still runs its full static batch; torch computes one item (the
    # fp32 reference is most of the cost: ~5 s per item for SD 1.5's UNet at 512 px on 2 cores).
    # That item passes within the tolerance, or as close to torch as the base engine's same item
    # was at its build (its record; one item's precision error can exceed a tolerance set for a
    # batch); otherwise the rest of the batch is computed and judged as at the build.
    with handed_back_after_use(spec.torch_module()):  # the torch weights one layer at a time, not all resident
        result = validate(spec, runner, Profile.from_tag(record.key.profile), record.key.precision,
                          device=handle.backend.torch_device, items=1, points=("opt",), baseline=record.validation)
    if result.ok:
        log.info("%s: engine refitted with its weights replaced (validated, max abs error %.2e)",
                 record.key.name, result.max_abs)
        return runner
    runner.close()
    shutil.rmtree(out, ignore_errors=True)
    log.warning("%s: the engine with its weights written in disagrees with torch (%s); refitting in full",
                record.key.name, result.why)
    return None


def _one_at_a_time(value: Callable[[str], np.ndarray | None]) -> Callable[[str], np.ndarray | None]:
    """``value`` whose previous array's file-backed pages (the torch weights, memory-mapped from
    their file) are handed back when the next is asked for: a refit that compares every weight
    with the engine's reads the module once without leaving it resident (SD 1.5's UNet: 3.4 GB)."""
    from sd_accel.runtime.weights import PageDropper

    dropper = PageDropper()
    last: list[np.ndarray] = []

    def one(name: str) -> np.ndarray | None:
        while last:
            with warnings.catch_warnings():  # a read-only view of the weight: only its address is used
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                dropper(torch.from_numpy(last.pop()))
        array = value(name)
        if array is not None:
            last.append(array)
        return array

    return one


def needs_rebuild(handle) -> str | None:
    """Why the engine of ``handle`` cannot be refitted (its precision), or None when it can."""
    precision = handle.record.key.precision
    if getattr(handle.record.key, "layout", ""):
        return (f"{handle.name} was built in segments (its exports are not kept): changed weights need an engine "
                "built from them")
    if precision in NEEDS_REBUILD:
        return (f"{handle.name} is {precision} (weights quantized with calibrated scales): changed weights "
                "need an engine built from them")
    return None


def _refittable(engines) -> list:
    """The handles of ``engines`` a refit writes (closed ones included); the error when any of
    them must be rebuilt instead (INT8), or none is usable."""
    handles = [h for h in engines.handles if h.broken in (None, REFIT_CLOSED)]
    refused = [why for why in map(needs_rebuild, handles) if why]
    if refused:
        raise InvalidValue("; ".join(refused))
    if not handles:
        raise EngineError(f"{engines.component}: no usable engine to refit")
    return handles


def refit_component(engines, weights: dict[str, torch.Tensor], spec,
                    progress: Callable[[str, float, str], None] | None = None,
                    validate: bool = True):
    """A new :class:`~sd_accel.runtime.ComponentEngines` with every usable engine of ``engines``
    refitted to ``weights`` (torch names, full values: base + every LoRA delta), each validated
    against ``spec``'s torch module (which must compute with those weights). ``engines`` is left
    as it is (its base engines keep serving other weights); the new handles share its records,
    have their own counters, and close their refits (scratch folders) with :meth:`close`.
    ``progress(engine, fraction, message)``. All or nothing: raises
    :class:`~sd_accel.core.InvalidValue` when an engine cannot be refitted (INT8:
    :func:`needs_rebuild`), :class:`~sd_accel.core.EngineError` when a refit fails validation
    or its graph is gone.

    For hosts that hold engines themselves (the WebUI extension); a diffusers pipeline uses
    :func:`refit_engines`."""
    from dataclasses import replace

    from sd_accel.runtime.selection import ComponentEngines

    handles = _refittable(engines)
    report = progress or (lambda name, f, m: None)
    made: list = []
    try:
        for handle in handles:
            runner = refit_engine(handle, weights, spec, lambda f, m, n=handle.name: report(n, f, m), validate)
            made.append(replace(handle, runner=runner, refit=runner, broken=None, failures=0))
    except BaseException:
        for h in made:
            h.runner.close()
        raise
    out = ComponentEngines(engines.component, made, engines.fallback_allowed, engines.prefer_precision)
    out.model = engines.model
    return out


class PendingRefit:
    """Stands in for the runner of a refitted engine until the engine's first call, which refits
    it (``make(handle)``: a :class:`RefittedRunner`, e.g. :func:`refit_engine` on the host's
    current weights) and serves from then on. A LoRA change thus patches only the profiles
    that are called. The base engine's runner (``base``, serving the unpatched weights) is
    closed as the refit starts: the refit holds one copy of the engine, not two; the base is
    loaded again from the cache when a call without the LoRA comes. A refit that fails, or
    would not fit in memory (:func:`preflight`), sets the engine aside for this weight set with
    the reason (the call, and the next, run on another engine or torch); it is not tried again."""

    def __init__(self, handle, make: Callable[[Any], RefittedRunner], base=None) -> None:
        self.handle = handle
        self.shapes = handle.shapes
        self._make = make
        self._base = base  # the base engine's handle: its runner leaves memory as the refit starts
        self.refit: RefittedRunner | None = None
        self.seconds = 0.0  # what the refit took (0 until it ran)
        self.why: str | None = None  # why it failed

    @property
    def done(self) -> bool:
        return self.refit is not None

    def infer(self, feed):
        if self.refit is None:
            if self.why is not None:
                raise EngineError(self.why)
            base = self._base
            if base is not None and base.runner is not None and base.refit is None:
                base.runner.close()  # it serves other weights; loaded again from the cache when they come back
                base.runner = None
            start = time.perf_counter()
            try:
                self.refit = self._make(self.handle)
            except Exception as exc:
                text = str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
                self.why = f"the refit of {self.handle.name} failed: {text}"
                self.handle.broken = self.why  # this weight set's engine only: the cache keeps the base
                log.warning("%s", self.why)
                raise EngineError(self.why) from exc
            self.seconds = time.perf_counter() - start
        return self.refit.infer(feed)

    def close(self) -> None:
        if self.refit is not None:
            self.refit.close()
            self.refit = None


def pending_component(engines, make: Callable[[Any], RefittedRunner]):
    """A new :class:`~sd_accel.runtime.ComponentEngines` whose every usable engine of
    ``engines`` is refitted at its first call (:class:`PendingRefit`), by ``make(handle)``.
    INT8 engines are refused as by :func:`refit_component`; ``engines`` is left as it is."""
    from dataclasses import replace

    from sd_accel.runtime.selection import ComponentEngines

    handles = _refittable(engines)
    made = []
    for handle in handles:
        new = replace(handle, runner=None, refit=None, broken=None, failures=0)
        pending = PendingRefit(new, make, base=handle)
        new.runner = new.refit = pending  # closed: REFIT_CLOSED, never the base engine's weights
        made.append(new)
    out = ComponentEngines(engines.component, made, engines.fallback_allowed, engines.prefer_precision)
    out.model = engines.model
    return out


def _closed(wrapper) -> bool:
    return any(h.broken == REFIT_CLOSED for e in wrapper.engines.values() for h in e.handles)


def _bar(progress: bool | Callable[[Any], None], label: str) -> tuple[Callable[[float, str], None], Callable]:
    if callable(progress):
        return (lambda f, m: progress((label, f, m))), (lambda: None)
    if not progress:
        return (lambda f, m: None), (lambda: None)
    from tqdm.auto import tqdm

    bar = tqdm(total=100, desc=f"refit {label}", leave=False)

    def tick(frac: float, msg: str) -> None:
        bar.n = int(100 * frac)
        bar.set_postfix_str(msg)
        bar.refresh()

    return tick, bar.close


KEEP_REFITS = 1  # refits kept per module for auto=True: each holds patched engines (memory), one set by default


def _state_key(module: torch.nn.Module) -> tuple:
    """The weights a module computes with, as cheap identities: tensors (object, version) and
    the PEFT layers' states. Equal keys: equal weights (a kept refit fits)."""
    from sd_accel.runtime.freshness import adapter_state

    tensors = tuple((id(t), t._version, t.data_ptr()) for t in (*module.parameters(), *module.buffers()))
    return tensors, tuple(adapter_state(m) for m in module.modules() if _peft_layer(m))


def _refit_module(wrapper, specs: dict, progress, validate: bool) -> list[tuple[Any, RefittedRunner]]:
    """Refitted runners for every usable engine of ``wrapper`` (all or none)."""
    weights = effective_weights(wrapper.torch_module)
    new: list[tuple[Any, RefittedRunner]] = []
    for component, engines in wrapper.engines.items():
        for handle in engines.handles:
            if handle.broken not in (None, REFIT_CLOSED):
                continue
            if getattr(handle.backend, "reads_live_weights", False):
                continue  # (the compiled backend) it runs the torch weights as they are: nothing to refit
            tick, close = _bar(progress, handle.name)
            try:
                new.append((handle, refit_engine(handle, weights, specs[component], tick, validate)))
            except BaseException:
                for _, runner in new:
                    runner.close()
                raise
            finally:
                close()
    return new


def _install(wrapper, pairs: list[tuple[Any, RefittedRunner]]) -> None:
    kept = {id(r) for entry in wrapper.__dict__.get("_refits", {}).values() for _, r in entry}
    for handle, runner in pairs:
        if handle.runner is not None and handle.runner is not runner and id(handle.runner) not in kept:
            handle.runner.close()
        handle.runner = runner
        handle.refit = runner
        handle.broken = None
    wrapper.remember_weights()


def _release(wrapper) -> None:
    """Close the runners ``wrapper``'s engines serve now (the base engine's or a refit's that is
    not kept) before a new refit is made: never two patched copies at once. Their engines are
    marked closed until the refit installs its runners, so they never run stale weights."""
    kept = {id(r) for entry in wrapper.__dict__.get("_refits", {}).values() for _, r in entry}
    for engines in wrapper.engines.values():
        for handle in engines.handles:
            if handle.broken is not None or handle.runner is None or getattr(handle.backend, "reads_live_weights",
                                                                             False):
                continue
            if id(handle.runner) not in kept:
                handle.runner.close()
            handle.runner = handle.refit = None
            handle.broken = REFIT_CLOSED


def _make_room(wrapper, refits: dict, keep: int) -> None:
    """Close the oldest kept refits of ``wrapper`` until at most ``keep`` remain (the ones
    serving now among them: their engines step aside until refitted again)."""
    while refits and len(refits) > max(0, keep):
        old = refits.pop(next(iter(refits)))
        for handle, runner in old:
            runner.close()
            if handle.runner is runner:
                handle.runner = handle.refit = None
                handle.broken = REFIT_CLOSED


def _auto_refit(pipe_ref, progress, validate: bool):
    """The stand-ins' hook for ``auto=True``: on a call whose weights changed, install a kept
    refit of these weights, or make one (and keep it, up to :data:`KEEP_REFITS`)."""

    def refit(wrapper) -> bool:
        from sd_accel.components import specs_for
        from sd_accel.components.controlnet import control_specs
        from sd_accel.runtime.swap import torch_modules

        refits = wrapper.__dict__.setdefault("_refits", {})
        key = _state_key(wrapper.torch_module)
        pairs = refits.pop(key, None)
        if pairs is None:
            pipe = pipe_ref()
            if pipe is None:
                return False
            _make_room(wrapper, refits, KEEP_REFITS - 1)  # the oldest go before the new one is made
            _release(wrapper)
            log.warning("%s: weights changed; refitting its engines to them (refit_engines(pipe, auto=True))",
                        next(iter(wrapper.engines), "module"))
            with torch_modules(pipe):
                pairs = _refit_module(wrapper, {**specs_for(pipe), **control_specs(pipe)}, progress, validate)
        refits[key] = pairs  # most recent last
        while len(refits) > KEEP_REFITS:
            old = refits.pop(next(iter(refits)))
            for _, runner in old:
                runner.close()
        _install(wrapper, pairs)
        return True

    return refit


def refit_engines(pipe, *, progress: bool | Callable[[Any], None] = True, validate: bool = True,
                  force: bool = False, auto: bool | None = None) -> dict[str, list[str]]:
    """Update the engines of ``pipe`` to the torch weights it holds now: after
    ``pipe.load_lora_weights(...)``, ``set_adapters``, ``fuse_lora``, ``unload_lora_weights``,
    ``load_state_dict`` or an edit, the engines serve the calls again instead of torch.

    Only modules whose weights changed since their engines were built (or last refitted) are
    refitted, unless ``force``; each refit starts from the engine's own base weights, so LoRA A,
    then B, then A again gives A's engine. The base engines stay in the cache; the refitted ones
    live in this process. ``progress``: True (a bar per engine), False, or a callable taking
    ``(engine, fraction, message)``. ``validate``: check each refitted engine against torch
    (as new engines are) and refuse it if it disagrees. Raises :class:`~sd_accel.core.InvalidValue`
    for INT8 engines (they need a rebuild) and :class:`~sd_accel.core.EngineError` when the graph an
    engine was built from is gone. Returns, per component, the engines refitted.

    ``auto=True``: from now on a call whose weights changed refits first (``set_adapters``, a new
    LoRA), and ``cross_attention_kwargs={"scale": s}`` runs on engines refitted at that scale; the
    last few refits of each module are kept, so switching back costs nothing. ``auto=False``
    turns that off; ``None`` leaves it as it is.

    (Skipped in the test suite: it needs a LoRA folder, which nothing here ships;
    docs/guides/lora.md runs a refit after a weight edit, tests/test_lora.py with LoRAs it makes.)

    >>> pipe = accelerate(load_pipeline("builtin:tiny-sd15"), AccelConfig(engines=True))  # doctest: +SKIP
    >>> pipe.load_lora_weights("loras/my_style")                                         # doctest: +SKIP
    >>> refit_engines(pipe)              # the UNet and text encoder engines now carry the LoRA  # doctest: +SKIP
    {'unet': ['unet.cpu-...fp32.static.b1.h512.w512.t77...'], 'clip': ['clip.cpu-...']}
    """
    from sd_accel.components import specs_for
    from sd_accel.components.controlnet import control_specs
    from sd_accel.runtime.modules import EngineModule
    from sd_accel.runtime.swap import SLOTS, torch_modules

    wrappers = {slot: getattr(pipe, slot, None) for slot in SLOTS}
    wrappers = {slot: w for slot, w in wrappers.items() if isinstance(w, EngineModule)}
    if not wrappers:
        raise EngineError("this pipeline has no engines to refit: accelerate(pipe, AccelConfig(engines=True)) first")
    todo = {slot: w for slot, w in wrappers.items()
            if force or w.__dict__["_weights"].changed(full=True) is not None or _closed(w)}
    for w in todo.values():  # refuse before any work: an int8 engine needs a rebuild
        for engines in w.engines.values():
            for handle in engines.handles:
                if handle.record.key.precision in NEEDS_REBUILD and handle.broken is None:
                    raise InvalidValue(f"{handle.name}: {handle.record.key.precision} engines cannot be refitted "
                                       "(weights quantized with calibrated scales); rebuild them from the changed "
                                       "weights with build_engines(pipe, ...), or delete them to use the others")
    done: dict[str, list[str]] = {}
    start = time.perf_counter()
    with torch_modules(pipe):  # validation runs the torch modules through the specs
        specs = {**specs_for(pipe), **control_specs(pipe)}  # a ControlNet pipeline's residual UNet: the UNet's weights
        for wrapper in todo.values():
            keep = auto or (auto is None and wrapper.auto_refit)  # kept: switching back costs nothing
            refits = wrapper.__dict__.setdefault("_refits", {})
            _make_room(wrapper, refits, KEEP_REFITS - 1 if keep else 0)  # released before the new refit
            _release(wrapper)
            pairs = _refit_module(wrapper, specs, progress, validate)
            if keep:
                refits[_state_key(wrapper.torch_module)] = pairs
            _install(wrapper, pairs)
            for handle, _ in pairs:
                done.setdefault(handle.record.key.component, []).append(handle.name)
    if auto is not None:
        hook = _auto_refit(weakref.ref(pipe), progress, validate) if auto else None
        for wrapper in wrappers.values():
            wrapper.__dict__["_auto_refit"] = hook
    if done:
        log.warning("refitted %d engines to the current weights in %.1f s: %s", sum(map(len, done.values())),
                    time.perf_counter() - start, ", ".join(sorted(done)))
    return done
