"""Build an OpenVINO engine: ONNX -> OpenVINO model with the profile's shapes -> compiled for
this CPU at the requested inference precision.

Static profiles compile for one fixed shape (worth up to 3.5x over dynamic ones on
CPU); dynamic profiles compile with bounded dimensions. ``bf16`` sets OpenVINO's
``INFERENCE_PRECISION_HINT``: weights and activations run in bf16 on CPUs with AVX512-BF16 or
AMX, with fp32 accumulation. The compiled model is tied to the CPU class and the OpenVINO version,
which are both part of the engine key.

``int8`` quantizes the converted model with NNCF first (``quantize.py`` beside this file: int8
weights and activations from calibration feeds, the layers that cannot take it kept in float),
then compiles it like ``bf16`` (or ``fp32`` on CPUs without bf16): int8 runs on VNNI/AMX.

**What is stored.** The weights once, in the precision the engine computes in, and the compiled
graph without them:

- ``engine.bin``: the weights as OpenVINO IR stores them: fp32 for ``fp32`` engines, fp16 for
  ``bf16`` (OpenVINO has no bf16 IR weights; fp16 holds every bf16 weight's value to within bf16's
  own rounding and the plugin converts at load), int8 for what NNCF quantized plus fp16 for the
  rest in ``int8`` engines;
- ``engine.blob``: the compiled model exported with ``CACHE_MODE=OPTIMIZE_SIZE`` (OpenVINO's
  "weightless" blob: the optimized graph and kernels' choices, no weights); loading imports it
  with ``WEIGHTS_PATH`` pointing at ``engine.bin``, which OpenVINO memory-maps;
- ``engine.weights.json`` (float engines): where each MatMul / Conv weight sits in ``engine.bin``,
  so a refit patches a copy of it instead of compiling (``weight_map.py``);
- ``engine.xml`` (dynamic profiles, float engines): the graph as OpenVINO IR, without weights (2 MB for SD
  1.5's UNet), which ``SD_ACCEL_OV_FIXED_SHAPES=1`` reshapes and compiles for each call's shapes
  (``runner.py``), and a refit compiles in memory with its changed weights (:meth:`refit_runner`).

The engine used to be one exported blob holding the weights as compiled (fp32 for bf16 engines too:
twice the bf16 size; see the report in the project notes for SD 1.5 figures).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from sd_accel.backends.base import Backend, BackendInfo
from sd_accel.backends.openvino.quantize import SCOPES, WEIGHTS_ONLY, compress_weights_openvino
from sd_accel.backends.openvino.weight_map import MAP_FILE, patch, patched_model, write_map
from sd_accel.core import EngineError, Progress, ShapeRanges
from sd_accel.device import cpu_class, cpu_flags
from sd_accel.pages import kept_released, release_file
from sd_accel.units import format_size

if TYPE_CHECKING:
    from sd_accel.core import CalibrationSet

log = logging.getLogger("sd_accel")

ENGINE_FILE = "engine.blob"  # the compiled graph, without weights
WEIGHTS_FILE = "engine.bin"  # the weights, in the engine's storage precision
META_FILE = "engine.json"  # the compile options: import_model must get them again
_GRAPH_FILE = "engine.xml"  # written with the weights, dropped once compiled (the blob replaces it)
_HINT = {"fp32": "f32", "bf16": "bf16"}
INSTALL_HINT = "install it with `pip install openvino` (or `pip install 'sd-accel[openvino]'`)"
# What bf16 and int8 need where this machine lacks it: said once, here (Backend.missing), for the
# registry's precision check, this builder's refusal and the faces' status lines.
BF16_NEEDS = "bf16 needs a CPU with AVX512-BF16 or AMX"
NEEDS = {
    "bf16": f"{BF16_NEEDS} (`sd-accel doctor` shows the CPU class); build fp32, or int8 with NNCF",
    "int8": "OpenVINO int8 needs NNCF, which is not installed: `pip install nncf` (or `pip install 'sd-accel[openvino]'`)",
    "int4": "OpenVINO int4 needs NNCF, which is not installed: `pip install nncf` (or `pip install 'sd-accel[openvino]'`)",
}
BLOB_CARRIES_WEIGHTS = 0.25  # a blob this big beside engine.bin holds weights: keep the IR instead
QUANTIZED = ("int8", "int4")  # weights stored quantized: no weight map, a refit rebuilds


def has_bf16() -> bool:
    """Whether this CPU runs bf16 natively (AVX512-BF16 or AMX); without it bf16 is emulated."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _has_nncf() -> bool:
    return importlib.util.find_spec("nncf") is not None


def _zeros_feed(compiled, shapes: ShapeRanges) -> dict:
    """Zeros at the smallest shapes for each input of ``compiled`` (only the shapes matter)."""
    import numpy as np

    feed = {}
    for port in compiled.inputs:
        name = next((n for n in port.get_names() if n in shapes), None)
        if name is not None:
            kind = port.get_element_type().get_type_name()
            feed[name] = np.zeros(shapes[name][0], np.int64 if "i64" in kind else np.int32 if "i32" in kind else np.float32)
    return feed


def _outputs(compiled, feed: dict) -> list:
    import numpy as np

    results = compiled.create_infer_request().infer(feed)
    return [np.array(results[i], copy=True) for i in range(len(compiled.outputs))]


def _blob_runs(ov, out_dir: Path, precision: str, shapes: ShapeRanges, expected: list) -> bool:
    """Whether the weightless blob just exported, once imported, gives the compiled model's
    ``expected`` outputs for zeros at the smallest shapes."""
    import numpy as np

    config = {**compile_config(precision), "WEIGHTS_PATH": str(out_dir / WEIGHTS_FILE)}
    try:
        compiled = ov.Core().import_model((out_dir / ENGINE_FILE).read_bytes(), "CPU", config)
        got = _outputs(compiled, _zeros_feed(compiled, shapes))
    except RuntimeError as exc:
        log.debug("the imported blob failed: %s", exc)
        return False
    for g, e in zip(got, expected, strict=True):
        if g.shape != e.shape or not np.allclose(g, e, rtol=1e-3, atol=1e-3 * (float(np.abs(e).max()) + 1e-6)):
            log.debug("the imported blob gives %s where the compiled model gives %s", g.shape, e.shape)
            return False
    return True


def core_config(precision: str) -> dict[str, str]:
    """Compile options: one latency-optimised stream, the precision hint, optional thread count
    (``SD_ACCEL_OV_THREADS``)."""
    hint = _HINT.get(precision) or ("bf16" if has_bf16() else "f32")  # int8: the float rest
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": hint}
    threads = int(os.environ.get("SD_ACCEL_OV_THREADS", "0"))
    if threads:
        config["INFERENCE_NUM_THREADS"] = str(threads)
    return config


def compile_config(precision: str) -> dict[str, str]:
    """:func:`core_config` plus ``CACHE_MODE=OPTIMIZE_SIZE``: the exported blob leaves the weights
    out (they are in ``engine.bin``)."""
    return {**core_config(precision), "CACHE_MODE": "OPTIMIZE_SIZE"}


def _dynamic(shapes: ShapeRanges) -> bool:
    return any(lo != hi for lo, _, hi in shapes.values())


def _partial_shapes(shapes: ShapeRanges):
    import openvino as ov

    out = {}
    for name, (lo, _, hi) in shapes.items():
        out[name] = ov.PartialShape([ov.Dimension(a) if a == b else ov.Dimension(a, b) for a, b in zip(lo, hi, strict=True)])
    return out


class OpenVinoBackend(Backend):
    """OpenVINO on the CPU plugin."""

    name = "openvino"
    torch_device = "cpu"
    int8_scopes = SCOPES  # widest first: the build falls back to the next when validation fails
    int8_weights_only = WEIGHTS_ONLY  # (a transformer built in segments: sd_accel.build_segments)
    patches_weights = True  # engine.bin holds the MatMul / Conv weights the compiled blob reads
    weights_files = (WEIGHTS_FILE,)  # the same bytes in every profile of one weight set: stored once

    def info(self) -> BackendInfo:
        try:
            import openvino as ov
        except ImportError as exc:
            return BackendInfo(self.name, "", cpu_class(), False, f"openvino is not installed ({exc}); {INSTALL_HINT}")
        return BackendInfo(self.name, ov.__version__.split("-")[0], cpu_class(), True)

    def missing(self, precision: str) -> str | None:
        if precision == "bf16" and not has_bf16():
            return NEEDS["bf16"]
        if precision in QUANTIZED and not _has_nncf():
            return NEEDS[precision]
        return None

    def summary(self) -> str:
        return "the fastest here: " + ("bf16 on this CPU's AMX / AVX512-BF16" if has_bf16() else f"fp32; {BF16_NEEDS}")

    def install_packages(self) -> tuple[str, ...]:
        return ("openvino",)

    def default_precision(self) -> str:
        """bf16 where the CPU runs it natively, else fp32."""
        return "bf16" if has_bf16() else "fp32"

    def build(
        self,
        onnx_path: Path,
        shapes: ShapeRanges,
        precision: str,
        out_dir: Path,
        progress: Progress,
        calibration: CalibrationSet | None = None,
        int8_scope: str | None = None,
    ) -> list[str]:
        """Convert, reshape, (quantize,) compile and export; returns the engine file names in
        ``out_dir``. ``calibration``: the feeds ``int8`` needs; ``int8_scope``: which convolutions
        int8 keeps in float (``quantize.SCOPES``; None: the safest), or ``"weights"``: int8 weights
        only, no calibration (``quantize.WEIGHTS_ONLY``); both ignored otherwise."""
        if precision not in self.precisions():
            why = self.missing(precision)
            raise EngineError(f"openvino backend builds {self.precisions()} here, not {precision!r}"
                              + (f" ({why})" if why else ""))
        int8_scope = int8_scope or SCOPES[-1]
        try:
            import openvino as ov
        except ImportError as exc:
            raise EngineError(f"openvino is not installed; {INSTALL_HINT}") from exc
        try:
            progress(0.05, "converting ONNX to OpenVINO")
            # The converted model's weights are memory-mapped from the export (convert_model
            # shares them); converting, quantizing (NNCF compiles the model twice to collect
            # statistics, and rewrites weights) and compiling read them once each to copy them,
            # and free big buffers between steps. Handed back as the build goes, neither stays
            # counted in the build's RSS (SD 1.5's UNet in int8: 3.4 GB of mapped weights, GBs of
            # freed heap).
            with kept_released(Path(onnx_path).parent):
                compiled = self._convert_and_compile(ov, onnx_path, shapes, precision, out_dir, progress, calibration,
                                                     int8_scope)
            progress(0.85, "exporting the compiled model (without weights)")
            (out_dir / ENGINE_FILE).write_bytes(compiled.export_model().getbuffer())
            expected = _outputs(compiled, _zeros_feed(compiled, shapes))
            del compiled
            form = "blob"
            blob, weights = (out_dir / ENGINE_FILE).stat().st_size, (out_dir / WEIGHTS_FILE).stat().st_size
            if blob > max(BLOB_CARRIES_WEIGHTS * weights, 8 << 20):
                # int4 weights are repacked by the CPU plugin when it compiles, and the "weightless"
                # blob then carries that copy (SD3.5 Medium's int4 transformer: 1.24 GB of blobs beside
                # 2.14 GB of engine.bin, more than its int8 engine). Keep the IR instead: compiled on load.
                log.info("%s: the compiled blob carries the weights again (%s beside %s of engine.bin); "
                         "the engine keeps its IR", onnx_path.parent.name, format_size(blob), format_size(weights))
                (out_dir / ENGINE_FILE).unlink()
                form = "ir"
            elif not _blob_runs(ov, out_dir, precision, shapes, expected):
                # OpenVINO 2026.4's weightless blob (CACHE_MODE=OPTIMIZE_SIZE) of SD3's and FLUX.1's
                # transformers imports, then fails its first call in shape inference (a Multiply of
                # the AdaLN or rotary branch), or at static shapes gives 15 image tokens for 16; the
                # same graph compiled from its IR runs right. Keep the IR (a few MB beside
                # engine.bin) and compile it when loaded instead.
                log.info("%s: OpenVINO's compiled blob does not run this graph; the engine keeps its IR",
                         onnx_path.parent.name)
                (out_dir / ENGINE_FILE).unlink()
                form = "ir"
            files = [ENGINE_FILE if form == "blob" else _GRAPH_FILE, WEIGHTS_FILE, META_FILE]
            # for fixed-shape compiles (runner.py) and refits compiled in memory (refit_runner)
            keep_graph = form == "blob" and (_dynamic(shapes) or precision not in QUANTIZED)
            if keep_graph:
                files.append(_GRAPH_FILE)
            if precision not in QUANTIZED:  # quantized weights carry their scales: a refit rebuilds
                progress(0.9, "mapping the weights in engine.bin (for refits)")
                write_map(Path(onnx_path), out_dir / _GRAPH_FILE, out_dir / WEIGHTS_FILE, out_dir / MAP_FILE)
                files.append(MAP_FILE)
            if form == "blob" and not keep_graph:
                (out_dir / _GRAPH_FILE).unlink()
            (out_dir / META_FILE).write_text(json.dumps({"precision": precision, "weights": WEIGHTS_FILE, "form": form}))
        except EngineError:  # BuildCancelled is one too
            raise
        except Exception as exc:  # OpenVINO raises RuntimeError subclasses of its own
            raise EngineError(f"OpenVINO could not build {onnx_path.name}: {exc}") from exc
        progress(1.0, "engine saved")
        return files

    def _convert_and_compile(self, ov, onnx_path: Path, shapes: ShapeRanges, precision: str, out_dir: Path,
                             progress: Progress, calibration: CalibrationSet | None, int8_scope: str = "safe"):
        """Convert, reshape, (quantize,) save ``engine.xml`` / ``engine.bin``, compile."""
        model = ov.convert_model(str(onnx_path))
        # An input can carry several names: where ``x`` feeds a Cast (a full-precision WebUI UNet),
        # the converter folds it and the Cast's output name joins ``x``, and get_any_name() may
        # give either. Match on all of them, as the runner does.
        names = {n for p in model.inputs for n in p.get_names()}
        missing = set(shapes) - names
        if missing:
            have = [sorted(p.get_names()) for p in model.inputs]
            raise EngineError(f"{onnx_path.name} has no inputs {sorted(missing)}; its inputs are named {have}")
        model.reshape(_partial_shapes(shapes))
        if precision == "int4":
            model = compress_weights_openvino(model, lambda f, m: progress(0.1 + 0.4 * f, m), bits=4)
        elif precision == "int8" and int8_scope == WEIGHTS_ONLY:
            model = compress_weights_openvino(model, lambda f, m: progress(0.1 + 0.4 * f, m))
        elif precision == "int8":
            from sd_accel.backends.openvino.quantize import quantize_openvino

            model = quantize_openvino(model, calibration, lambda f, m: progress(0.1 + 0.4 * f, m), int8_scope)
        progress(0.5, "saving the weights" + ("" if precision == "fp32" else " (fp16 storage)"))
        # int8: the quantized weights stay int8; compress_to_fp16 stores the float rest as fp16.
        ov.save_model(model, str(out_dir / _GRAPH_FILE), compress_to_fp16=precision != "fp32")
        del model
        progress(0.6, f"compiling for {cpu_class()} ({precision})")
        compiled = ov.Core().compile_model(str(out_dir / _GRAPH_FILE), "CPU", compile_config(precision))
        release_file(out_dir)  # compiling copied the weights into the plugin's own buffers
        return compiled

    def patch_weights(self, engine_dir: Path, files: list[str], value, out_dir: Path) -> list[str] | None:
        """A copy of an engine with new MatMul / Conv weights, without converting or compiling
        (``weight_map.py`` beside this file): its files in ``out_dir``, or None when the change
        needs a build (a bias or norm changed, an engine built before the map existed)."""
        return patch(engine_dir, files, value, out_dir, WEIGHTS_FILE)

    def refit_runner(self, engine_dir: Path, files: list[str], value, shapes: ShapeRanges):
        """A runner compiled from the engine's graph with its changed weights replaced in memory
        (``weight_map.patched_model``): a LoRA costs no copy of ``engine.bin`` on disk (1.7 GB for
        SD 1.5's UNet in bf16, one per profile), and the compile takes seconds. None where the
        engine kept no graph (built before refits compiled in memory), where a weight outside the
        map changed, or where the runner would compile per call shape from the graph on disk
        (``SD_ACCEL_OV_FIXED_SHAPES=1``, dynamic engines): then a patched copy is written."""
        import openvino as ov

        from sd_accel.backends.openvino.runner import OpenVinoRunner, fixed_shapes_wanted

        engine_dir = Path(engine_dir)
        if fixed_shapes_wanted() and _dynamic(shapes):
            return None
        try:
            meta = json.loads((engine_dir / META_FILE).read_text())
            model = patched_model(engine_dir, files, value, _GRAPH_FILE, meta.get("weights") or WEIGHTS_FILE)
            if model is None:
                return None
            with kept_released(engine_dir):  # compiling copies the mapped weights into the plugin's buffers
                compiled = ov.Core().compile_model(model, "CPU", core_config(meta["precision"]))
            del model
        except Exception as exc:  # OpenVINO raises RuntimeError subclasses of its own
            log.info("%s: compiling the refit in memory failed (%s); refitting by a copy", engine_dir.name, exc)
            return None
        release_file(engine_dir)
        return OpenVinoRunner(compiled, shapes)

    def load(self, engine_dir: Path, files: list[str], shapes: ShapeRanges):
        """Import the compiled model (seconds, no recompilation); the weights are memory-mapped
        from ``engine.bin``."""
        import openvino as ov

        from sd_accel.backends.openvino.runner import FIXED_SHAPES_ENV, OpenVinoRunner, fixed_shapes_wanted

        engine_dir = Path(engine_dir)
        graph = None
        if fixed_shapes_wanted() and _dynamic(shapes) and ENGINE_FILE in files:  # (not the IR form's graphs)
            graph = engine_dir / _GRAPH_FILE
            if _GRAPH_FILE not in files or not graph.is_file():
                log.info("%s: built before %s (no engine.xml kept): it runs on its dynamic shapes; build it "
                         "again to compile per shape", engine_dir.name, FIXED_SHAPES_ENV)
                graph = None
        try:
            meta = json.loads((engine_dir / META_FILE).read_text())
            fixed = {"graph": graph, "config": core_config(meta["precision"])}
            if meta.get("form") == "ir":  # (see build: compiled here, the weights mapped from engine.bin)
                compiled = ov.Core().compile_model(str(engine_dir / _GRAPH_FILE), "CPU", core_config(meta["precision"]))
                # compiling copied the weights into the plugin's buffers: the mapped engine.bin pages
                # would stay resident beside them (a chained engine loads every segment before its
                # first call: their sum)
                release_file(engine_dir)
                return OpenVinoRunner(compiled, shapes, mapped=engine_dir, **fixed)
            config = compile_config(meta["precision"])
            if meta.get("weights"):
                config["WEIGHTS_PATH"] = str(engine_dir / meta["weights"])
            compiled = ov.Core().import_model((engine_dir / ENGINE_FILE).read_bytes(), "CPU", config)
        except Exception as exc:
            raise EngineError(
                f"OpenVINO could not load the engine in {engine_dir} ({exc}); delete it and build again"
            ) from exc
        weights = engine_dir / meta["weights"] if meta.get("weights") else None
        return OpenVinoRunner(compiled, shapes, mapped=engine_dir if weights else None,
                              weights_bytes=weights.stat().st_size if weights else 0, **fixed)
