"""Build an ONNX Runtime engine: an optimized model saved for one profile.

Static profiles pin every symbolic dimension (``add_free_dimension_override_by_name``), so ORT
plans for fixed shapes, which on CPU is worth a lot (up to 3.5x, the OpenVINO figure). The
optimized model bakes in CPU-specific layouts, so engines are keyed by CPU class.

INT8 (``int8``: static, calibrated; ``int8-dynamic``: no calibration) quantizes the ONNX file
first (``quantize.py`` beside this file), then optimizes the quantized model the same way as fp32.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from sd_accel.backends.base import Backend, BackendInfo
from sd_accel.core import EngineError, Progress, ShapeRanges
from sd_accel.device import arch_for
from sd_accel.onnx.symbols import symbol_values

if TYPE_CHECKING:
    from sd_accel.core import CalibrationSet

log = logging.getLogger("sd_accel")

ENGINE_FILE = "engine.onnx"
DATA_FILE = "engine.onnx.data"


def _providers(device: str) -> list[str]:
    import onnxruntime as ort

    if device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def session_options(threads: int | None = None, optimize: bool = True):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    # ORT warns that an optimized model is hardware specific; engines are keyed by CPU class.
    opts.log_severity_level = 3
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    threads = threads or int(os.environ.get("SD_ACCEL_ORT_THREADS", "0"))
    if threads:
        opts.intra_op_num_threads = threads
    return opts


class OnnxRuntimeBackend(Backend):
    """ONNX Runtime on the CPU provider (the CUDA provider when present and asked for)."""

    name = "onnxruntime"
    torch_device = "cpu"  # the runner takes and returns CPU tensors, whatever the provider
    weights_files = (DATA_FILE,)  # stored once where two engines' optimized tensors are the same bytes

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def info(self) -> BackendInfo:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            return BackendInfo(self.name, "", arch_for("cpu"), False, f"onnxruntime is not installed ({exc})")
        dev = "cuda" if _providers(self.device)[0] == "CUDAExecutionProvider" else "cpu"
        return BackendInfo(self.name, ort.__version__, arch_for(dev), True)

    def install_packages(self) -> tuple[str, ...]:
        return ("onnxruntime",)

    def default_precision(self) -> str:
        return "fp32"

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
        """Optimize ``onnx_path`` for ``shapes`` into ``out_dir``; INT8 precisions quantize first
        (``calibration``: the feeds static ``int8`` needs; ignored otherwise). One int8 scope:
        ``int8_scope`` is ignored."""
        if precision not in self.precisions():
            raise EngineError(f"onnxruntime backend builds {self.precisions()}, not {precision!r}")
        if precision == "fp32":
            return self._optimize(onnx_path, shapes, out_dir, progress)
        from sd_accel.backends.onnxruntime.quantize import quantize_onnx, remove_quantized

        quant = out_dir / "quantized.onnx"
        try:
            quantize_onnx(onnx_path, quant, precision, shapes, calibration, lambda f, m: progress(0.7 * f, m))
            return self._optimize(quant, shapes, out_dir, lambda f, m: progress(0.7 + 0.3 * f, m))
        finally:
            remove_quantized(quant)

    def _optimize(self, onnx_path: Path, shapes: ShapeRanges, out_dir: Path, progress: Progress) -> list[str]:
        """ORT's optimized model of ``onnx_path`` at ``shapes``, attention fused, saved as the engine.

        The engine's tensors always go to one external data file: the optimized model's size is
        only known once ORT writes it (a protobuf cannot pass 2 GB), and a data file next to a
        small graph is what ORT loads fastest at any size.
        """
        import onnx
        import onnxruntime as ort

        from sd_accel.backends.onnxruntime.attention import count_unfused, fuse_attention

        progress(0.05, "fusing attention")
        model = onnx.load(str(onnx_path), load_external_data=False)  # the graph; weights stay on disk
        fused = fuse_attention(model, onnx_path.parent)
        if fused:
            log.info("%s: %d attention blocks run as MultiHeadAttention (%d softmax left)",
                     onnx_path.name, fused, count_unfused(model))
        progress(0.1, "optimizing with ONNX Runtime")

        def options(external_folder: Path | None):
            opts = session_options()
            for symbol, value in symbol_values(onnx_path, shapes).items():
                opts.add_free_dimension_override_by_name(symbol, value)
            opts.optimized_model_filepath = str(out_dir / ENGINE_FILE)
            opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", DATA_FILE)
            opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
            if external_folder is not None:  # a graph handed over in memory reads its weights from there
                opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                              str(external_folder))
            return opts

        providers = _providers(self.device)
        try:
            if fused:
                try:
                    ort.InferenceSession(model.SerializeToString(), options(onnx_path.parent), providers=providers)
                except Exception as exc:  # an ORT without in-memory external data, or without the op
                    log.warning("ONNX Runtime %s could not build the fused attention (%s); building with plain "
                                "attention, whose memory grows with the square of the tokens", ort.__version__,
                                str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                    fused = 0
            if not fused:
                ort.InferenceSession(str(onnx_path), options(None), providers=providers)
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph types
            raise EngineError(f"ONNX Runtime could not build {onnx_path.name}: {exc}") from exc
        del model
        progress(1.0, "optimized model saved")
        return [ENGINE_FILE] + ([DATA_FILE] if (out_dir / DATA_FILE).exists() else [])

    def load(self, engine_dir: Path, files: list[str], shapes: ShapeRanges):
        import onnxruntime as ort

        from sd_accel.backends.onnxruntime.runner import OnnxRuntimeRunner

        # The file is already optimized: skipping the optimizers again makes loading fast.
        opts = session_options(optimize=False)
        # The CPU arena keeps its high-water mark (grown in powers of two) for the session's life:
        # at 1024 px that held more than torch's whole peak. Plain allocations hand it back.
        opts.enable_cpu_mem_arena = False
        try:
            session = ort.InferenceSession(str(engine_dir / ENGINE_FILE), opts, providers=_providers(self.device))
        except Exception as exc:
            raise EngineError(
                f"ONNX Runtime could not load the engine in {engine_dir} ({exc}); delete it and build again"
            ) from exc
        return OnnxRuntimeRunner(session, shapes)
