"""Export a component to ONNX, and keep exported files in a cache keyed by the weights' fingerprint.

:func:`export_onnx` traces with the legacy exporter (``dynamo=False``: about 2x faster than dynamo
on the SD UNet and happy with opset 17) and attention in the form backends fuse
(:mod:`sd_accel.onnx.attention`), then folds, saves, and checks. It
writes into a temporary sibling folder and renames it into place, so a crash never leaves a half
file where a reader looks.

:func:`onnx_artifact` / :func:`ensure_onnx_artifact` keep one folder per (component, weights,
spec version) under ``<cache_root>/onnx/`` and export only when that folder is missing or broken.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from filelock import FileLock

from sd_accel.components.spec import ComponentSpec
from sd_accel.core import SPEC_VERSION, EngineError, Progress
from sd_accel.onnx.attention import export_attention
from sd_accel.onnx.fingerprint import fingerprint
from sd_accel.onnx.optimize import DATA_SUFFIX, check_model, optimize_file
from sd_accel.onnx.weights import is_slim, write_full
from sd_accel.pages import FileMaps
from sd_accel.paths import export_dir, export_lock, export_temp, export_temp_globs
from sd_accel.units import format_size

log = logging.getLogger("sd_accel")

MODEL_FILE = "model.onnx"
META_FILE = "meta.json"
DEFAULT_OPSET = 17


def _quiet(frac: float, msg: str) -> None:
    return None


# ---- the torch side -------------------------------------------------------------------------


# Kept for callers of the old name: the export-time attention (see ``sd_accel.onnx.attention``).
plain_attention = export_attention


@contextlib.contextmanager
def fp32_on(module: torch.nn.Module, device: str = "cpu") -> Iterator[None]:
    """``module`` in float32 on ``device`` and in eval mode for the duration; dtypes, devices and
    training flag of every tensor restored after (a mixed-precision module stays mixed)."""
    if hasattr(module, "_hf_hook"):
        raise EngineError(
            f"{type(module).__name__} has accelerate offload hooks, which move it during the trace; "
            "export before enabling CPU offload (or call pipe.remove_all_hooks() first)"
        )
    tensors = _named_tensors(module)
    if any(t.device.type == "meta" for t in tensors.values()):
        raise EngineError("the module's weights are on the meta device (sequential offload); export before offloading")
    # By name: module.to() may replace the tensor objects (overwrite_module_params_on_conversion).
    before = {name: (t.dtype, t.device) for name, t in tensors.items()}
    target = torch.device(device)
    moved = any(
        t.device.type != target.type or (t.is_floating_point() and t.dtype != torch.float32) for t in tensors.values()
    )
    # Weights memory-mapped from their file (a bf16 safetensors checkpoint) get their own data back,
    # not a conversion of the fp32 copy: converted, they would move into anonymous memory for good
    # (a transformer built in segments would end up holding all its weights, 22 GB for FLUX.1).
    # Only these: holding the original of a weight in anonymous memory beside its fp32 copy would
    # cost its size for the duration.
    maps = FileMaps() if moved and target.type == "cpu" else None
    kept = {name: t.data for name, t in tensors.items()
            if maps is not None and t.device.type == "cpu" and t.is_floating_point() and t.dtype != torch.float32
            and _mapped(maps, t)}
    training = module.training
    if moved:
        for t in tensors.values():
            move_tensor(t, target, torch.float32 if t.is_floating_point() else t.dtype)
    module.eval()
    try:
        yield
    finally:
        if moved:
            for name, t in _named_tensors(module).items():
                dtype, device = before[name]
                if name in kept:
                    _set_data(t, kept[name])
                elif t.dtype != dtype or t.device != device:
                    move_tensor(t, device, dtype)
        module.train(training)


def _mapped(maps: FileMaps, t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    return bool(storage.nbytes()) and maps.holds(storage.data_ptr(), storage.nbytes())


def _set_data(t: torch.Tensor, data: torch.Tensor) -> None:
    """``t.data = data``, inside inference mode for an inference tensor (see :func:`move_tensor`)."""
    if t.is_inference():
        with torch.inference_mode():
            t.data = data
    else:
        t.data = data


def move_tensor(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> None:
    """``t.data = t.data.to(device, dtype)`` (what ``module.to()`` does), keeping an inference
    tensor one.

    Forge loads its weights under ``torch.inference_mode``. Given new ``.data`` outside inference
    mode, such a tensor stops counting as an inference tensor but still has no version counter,
    so every later ``t._version`` raises "Inference tensors do not track version counter": the
    ONNX tracer's (the export fails) and the fingerprint's (every later build of that module
    fails), for the rest of the WebUI session. Converted inside inference mode it stays a proper
    inference tensor, which traces and runs as before."""
    if t.device == torch.device(device) and t.dtype == dtype:
        return
    if t.is_inference():
        with torch.inference_mode():
            t.data = t.data.to(device=device, dtype=dtype)
    else:
        t.data = t.data.to(device=device, dtype=dtype)


def _named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _trace(spec: ComponentSpec, path: Path, opset: int) -> None:
    """Trace the spec's export module into ``path`` (the legacy exporter may scatter weights
    into many files next to it when they pass 2 GB; :func:`optimize_file` gathers them)."""
    module = spec.torch_module()
    with export_attention(module), fp32_on(module), torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        wrapper = spec.export_module().eval()
        feed = spec.sample_feed(spec.export_dims())
        torch.onnx.export(
            wrapper,
            tuple(feed.values()),
            str(path),
            input_names=[t.name for t in spec.inputs()],
            output_names=[t.name for t in spec.outputs()],
            dynamic_axes=spec.dynamic_axes(),
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    # Tracer warnings are expected (diffusers branches on sizes; the 17x17 example picks the
    # general branch); keep them for debugging, not for the user's console.
    for message in {str(w.message).splitlines()[0] for w in seen}:
        log.debug("export %s: %s", spec.name, message)


# ---- export ---------------------------------------------------------------------------------


def export_onnx(
    spec: ComponentSpec,
    out_dir: Path,
    progress: Progress | None = None,
    opset: int = DEFAULT_OPSET,
    meta: dict | None = None,
) -> Path:
    """Export ``spec``'s module to ``out_dir/model.onnx`` (+ ``model.onnx.data`` past 2 GB).

    ``out_dir`` is replaced as a whole, atomically: the files are written into a temporary
    sibling folder, checked, then renamed. ``progress(fraction, message)`` is called at each
    stage; an exception from it cancels the export (nothing is left behind). ``meta`` adds
    fields to ``meta.json``. Returns the path of ``model.onnx``.
    """
    progress = progress or _quiet
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    need = export_need_bytes(spec)
    _check_space(spec.name, out_dir.parent, need)
    tmp = export_temp(out_dir, "tmp", f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    start = time.perf_counter()
    try:
        raw = tmp / "raw" / MODEL_FILE
        raw.parent.mkdir(parents=True)
        progress(0.0, f"{spec.name}: exporting to ONNX (opset {opset})")
        _trace(spec, raw, opset)
        gc.collect()  # the trace's garbage: see the finally below
        traced_s = time.perf_counter() - start

        def sub(frac: float, msg: str) -> None:
            progress(0.4 + 0.5 * frac, f"{spec.name}: {msg}")

        external = optimize_file(raw, tmp / MODEL_FILE, sub)
        shutil.rmtree(raw.parent)
        progress(0.9, f"{spec.name}: checking the ONNX file")
        check_model(tmp / MODEL_FILE)
        info = _meta(spec, tmp, opset, external, traced_s, time.perf_counter() - start)
        (tmp / META_FILE).write_text(json.dumps({**info, **(meta or {})}, indent=2))
        _replace_dir(tmp, out_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if _looks_disk_full(exc, out_dir.parent, need):
            raise _disk_full_error(spec.name, out_dir.parent, need) from exc
        raise
    finally:
        # The trace and the ONNX passes leave their tensors in reference cycles that only the
        # cyclic collector frees, which a build rarely triggers: a FLUX.1 built in segments kept
        # each segment's 1.3 GB of ONNX weights (peak 0.4 -> 3.6 GiB over three 2-block segments
        # here, 1.3 GiB more per segment at full size) until it was called.
        gc.collect()
    progress(1.0, f"{spec.name}: ONNX ready ({time.perf_counter() - start:.1f} s)")
    log.info("exported %s to %s in %.1f s", spec.name, out_dir, time.perf_counter() - start)
    return out_dir / MODEL_FILE


def export_need_bytes(spec: ComponentSpec) -> int:
    """Disk an export of ``spec`` takes at its peak: the fp32 trace and its optimized copy side by
    side (the trace is removed once the copy is checked), plus a little for the graphs."""
    weights = sum(t.numel() * 4 for t in _named_tensors(spec.torch_module()).values() if t.is_floating_point())
    return 2 * weights + 64 * 2**20


def _check_space(name: str, folder: Path, need: int) -> None:
    if shutil.disk_usage(folder).free < need:
        raise _disk_full_error(name, folder, need)


def _disk_full_error(name: str, folder: Path, need: int) -> EngineError:
    try:
        free = format_size(shutil.disk_usage(folder).free)
    except OSError:
        free = "unknown"
    return EngineError(
        f"Not enough disk space to export {name} to ONNX: it needs about {format_size(need)} "
        f"(the fp32 trace and its optimized copy), {free} free under {folder}. Nothing was kept. "
        "Free some space (`sd-accel prune`), or give the build a folder on a bigger disk "
        "(SD_ACCEL_ENGINE_DIR: engines and the exports beside them), then build again."
    )


def _looks_disk_full(exc: BaseException, folder: Path, need: int) -> bool:
    """ENOSPC anywhere in the chain, or an opaque write failure of the torch exporter ("Could not
    open file or directory", it drops the errno) while the disk has less free than the export
    needs (measured after the partial files were removed)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            return True
        seen = seen.__cause__ or seen.__context__
    if isinstance(exc, (RuntimeError, OSError)) and not isinstance(exc, EngineError):
        try:
            return shutil.disk_usage(folder).free < need
        except OSError:
            return False
    return False


def _meta(spec: ComponentSpec, folder: Path, opset: int, external: bool, traced_s: float, total_s: float) -> dict:
    return {
        "component": spec.name,
        "spec_version": SPEC_VERSION,
        "opset": opset,
        "inputs": [t.name for t in spec.inputs()],
        "outputs": [t.name for t in spec.outputs()],
        "export_dims": spec.export_dims(),
        "external_data": external,
        "files": {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()},
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "trace_seconds": round(traced_s, 2),
        "export_seconds": round(total_s, 2),
    }


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``, dropping an old ``dst``. The rename itself is atomic."""
    if dst.exists():
        old = export_temp(dst, "old", uuid.uuid4().hex[:8])
        dst.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    src.rename(dst)


# ---- the artifact cache ---------------------------------------------------------------------


@dataclass(frozen=True)
class OnnxArtifact:
    """An exported ONNX file in the cache, and how this call obtained it."""

    path: Path  # .../model.onnx
    fingerprint: str
    exported: bool  # False: an existing, valid file was reused
    repaired: bool = False  # an existing file failed the checks and was exported again
    seconds: float = 0.0

    @property
    def folder(self) -> Path:
        return self.path.parent


def artifact_dir(spec: ComponentSpec, cache_root: Path) -> Path:
    """``<cache_root>/onnx/<component>.<fingerprint[:16]>.s<SPEC_VERSION>`` (:func:`sd_accel.paths.export_dir`)."""
    return export_dir(cache_root, spec.name, fingerprint(spec.torch_module()), SPEC_VERSION)


def ensure_onnx_artifact(spec: ComponentSpec, cache_root: Path, progress: Progress | None = None) -> OnnxArtifact:
    """The cached ONNX export of ``spec``: reused when valid, exported (again) otherwise.

    A file lock on the folder keeps two processes from exporting the same artifact at once: the
    second waits, then finds the first one's file and reuses it.
    """
    start = time.perf_counter()
    fp = fingerprint(spec.torch_module())
    folder = artifact_dir(spec, cache_root)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(export_lock(folder)):
        _drop_stale_temps(folder)
        problem = validate_artifact(folder) if folder.exists() else None
        if folder.exists() and problem is None:
            log.debug("reusing ONNX %s", folder)
            (progress or _quiet)(1.0, f"{spec.name}: reusing the exported ONNX")
            return OnnxArtifact(folder / MODEL_FILE, fp, exported=False, seconds=time.perf_counter() - start)
        if problem is not None:
            log.warning("ONNX artifact %s is unusable (%s); exporting it again", folder, problem)
            shutil.rmtree(folder, ignore_errors=True)
        path = export_onnx(spec, folder, progress, meta={"fingerprint": fp})
    return OnnxArtifact(path, fp, exported=True, repaired=problem is not None, seconds=time.perf_counter() - start)


def onnx_artifact(spec: ComponentSpec, cache_root: Path, progress: Progress | None = None) -> Path:
    """Path of the cached ONNX export of ``spec`` (see :func:`ensure_onnx_artifact`)."""
    return ensure_onnx_artifact(spec, cache_root, progress).path


@contextlib.contextmanager
def full_model(artifact: OnnxArtifact, module: torch.nn.Module, scratch: Path) -> Iterator[Path]:
    """The path of a complete model of ``artifact`` for a backend to build from: the export's own
    file, or, when the export kept its graph only (:func:`sd_accel.onnx.weights.slim_export`),
    that graph with ``module``'s weights written into ``scratch`` (removed after). ``module`` is
    the one the export's fingerprint was taken from, so its weights are the export's."""
    if not is_slim(artifact.folder):
        yield artifact.path
        return
    try:
        path, written = write_full(artifact.folder, _named_tensors(module), Path(scratch))
        log.info("wrote %d weights into the graph of %s for this build", written, artifact.folder.name)
        yield path
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def validate_artifact(folder: Path) -> str | None:
    """Why the artifact in ``folder`` cannot be used, or None when it can.

    Cheap checks first (meta.json present, file sizes as written), then ``onnx.checker`` on the
    path, which also catches a truncated or corrupt model.onnx.
    """
    meta_path = folder / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        return f"{META_FILE} unreadable: {exc}"
    for name, size in meta.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
    if not (folder / MODEL_FILE).is_file():
        return f"{MODEL_FILE} is missing"
    try:
        check_model(folder / MODEL_FILE)
    except Exception as exc:  # onnx raises ValidationError, DecodeError, OSError... by cause
        return f"onnx.checker failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _drop_stale_temps(folder: Path) -> None:
    """Remove temporary folders a crashed export of this artifact left (we hold its lock)."""
    for pattern in export_temp_globs(folder):
        for stale in folder.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


__all__ = [
    "DATA_SUFFIX",
    "MODEL_FILE",
    "OnnxArtifact",
    "artifact_dir",
    "ensure_onnx_artifact",
    "export_need_bytes",
    "export_onnx",
    "fp32_on",
    "full_model",
    "onnx_artifact",
    "plain_attention",
    "validate_artifact",
]
