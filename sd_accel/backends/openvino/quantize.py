"""OpenVINO INT8: post-training quantization of a converted component with NNCF.

Weights and activations of the convolutions and linear layers become int8 (per-channel weights;
activation ranges from calibration feeds captured on real prompt runs; SmoothQuant on the linear
layers), and the CPU plugin runs them with VNNI/AMX int8 dot products. What is left in float
runs at the engine's float precision (bf16 where the CPU has it).

Two places of a diffusion UNet do not survive int8 activations (measured on the SD 1.5 UNet at
256x256, error per call against torch fp32, bf16 elsewhere): the convolution that reads the raw
latent (its range moves with the noise level) and the convolutions of the last, full-resolution
decoder level, which write straight into the predicted noise. Quantizing everything gave 4.4-8.9%;
keeping those in float gave 2.8-5.0% (bf16 alone: 2.5-3.6%) at 1.46x the speed of bf16
(scripts/BENCHMARKS.md). They are found from the graph, not by layer names, so diffusers, WebUI
(LDM) and SDXL UNets are all covered: convolutions fed by a model input, and every convolution
after the last upsampling.

That is the ``"safe"`` scope. The ``"wide"`` scope keeps only the input convolutions and the last
one (conv_out) in float: on an AMX CPU its UNet is about 1.12x faster than the safe one (SD 1.5 at
256 px, 569 against 636 ms per call alternated) at 7.3% error per call against 4.5%. The build
tries the wide scope first and takes it only when the engine passes its accuracy gate; when it
fails, the build quantizes again with the safe scope (``sd_accel.build``).
"""

from __future__ import annotations

import logging

from sd_accel.core import CalibrationSet, EngineError, Progress
from sd_accel.device import has_int8_dot

log = logging.getLogger("sd_accel")

# NNCF walks the calibration set about this many times (SmoothQuant statistics, range statistics,
# bias correction): used only to scale the progress bar.
_PASSES = 3


SCOPES = ("wide", "safe")  # tried in this order when the build validates its engines
# Weights only: every MatMul's weights int8 (asymmetric, per output channel), activations left in
# float, no calibration. What a transformer built in segments takes for int8 (each segment's
# calibration would need the states the segments before it make), and what halves the memory a
# bf16 engine holds (FLUX.1: 22 GB in bf16, 12 GB in int8).
WEIGHTS_ONLY = "weights"


# int4 (``precision="int4"``): every MatMul's weights 4-bit symmetric in groups of INT4_GROUP input
# channels, each group with its own scale; NNCF keeps the embeddings and the last layer in int8
# (its default backup). Weights only, like the int8 above: no calibration, so a transformer built
# in segments takes it too. A quarter of bf16's bytes (FLUX.1's 22 GB of bf16: about 6.5 GB),
# computed in the CPU's float precision. Its error per call is larger than int8's: the build's
# check judges it by the picture where a pipeline makes one (``sd_accel.validate``).
INT4_GROUP = 64


def compress_weights_openvino(model, progress: Progress, bits: int = 8):
    """The weight-only int8 (:data:`WEIGHTS_ONLY`) or grouped int4 (:data:`INT4_GROUP`) version of
    an ``openvino.Model``."""
    try:
        import nncf
    except ImportError as exc:
        raise EngineError(f"OpenVINO int{bits} needs NNCF: pip install nncf (or `pip install 'sd-accel[openvino]'`)") from exc
    logging.getLogger("nncf").setLevel(logging.WARNING)
    if bits == 4:
        progress(0.0, f"compressing the weights to int4 (groups of {INT4_GROUP}) with NNCF")
        # a layer whose input width the group does not divide takes the largest power of two that
        # does (FLUX.1's 64-channel x_embedder has whole-row groups), or int8 below 16
        adjust = nncf.AdvancedCompressionParameters(group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST)
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=INT4_GROUP, ratio=1.0,
                                     advanced_parameters=adjust)
    progress(0.0, "compressing the weights to int8 with NNCF (weights only)")
    return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)


def float_convolutions(model, scope: str = "safe") -> list[str]:
    """Names of the convolutions that stay in float in ``scope`` (see the module docstring)."""
    if scope not in SCOPES:
        raise EngineError(f"unknown int8 scope {scope!r}; use one of {SCOPES}")
    ops = model.get_ordered_ops()
    params = {p.get_friendly_name() for p in model.get_parameters()}
    convs = [i for i, op in enumerate(ops) if op.get_type_name() == "Convolution"]
    last_up = max((i for i, op in enumerate(ops) if op.get_type_name() == "Interpolate"), default=len(ops))
    keep = []
    for i in convs:
        op = ops[i]
        source = op.input_value(0).get_node()
        # a Convert or Reshape may sit between the parameter and the convolution
        while source.get_type_name() in ("Convert", "Reshape") and source.get_input_size():
            source = source.input_value(0).get_node()
        late = i == convs[-1] if scope == "wide" else i > last_up
        if source.get_friendly_name() in params or late:
            keep.append(op.get_friendly_name())
    return keep


def _dataset(calibration: CalibrationSet, input_names: set[str], progress: Progress):
    import nncf

    total = max(1, len(calibration) * _PASSES)
    seen = [0]

    def feed(sample: dict) -> dict:
        # Called per sample by NNCF: the progress callback is also where a cancelled build stops.
        seen[0] += 1
        progress(min(0.95, seen[0] / total), f"quantizing with NNCF (calibration sample {seen[0]})")
        return {k: v for k, v in sample.items() if k in input_names}

    return nncf.Dataset(calibration.feeds, feed)


def quantize_openvino(model, calibration: CalibrationSet | None, progress: Progress, scope: str = "safe"):
    """The INT8 version of an ``openvino.Model`` (reshaped to the engine's profile), calibrated on
    ``calibration`` (feeds at the profile's opt shape), with the convolutions of ``scope`` kept in
    float (:func:`float_convolutions`).

    (Skipped in the test suite: it needs an OpenVINO model and captured calibration feeds, and
    NNCF takes minutes; tests/test_int8_engines.py runs it through ``build_engines``.)

    >>> int8_model = quantize_openvino(ov_model, calibration, lambda f, m: None)  # doctest: +SKIP
    """
    if calibration is None or not len(calibration):
        raise EngineError("static int8 needs calibration data (build_engines captures it from prompt runs)")
    try:
        import nncf
    except ImportError as exc:
        raise EngineError("OpenVINO int8 needs NNCF: pip install nncf (or `pip install 'sd-accel[openvino]'`)") from exc
    names = {n for p in model.inputs for n in p.get_names()}
    fed = set(calibration.feeds[0])
    # An input is fed when any of its names is (a folded Cast adds its output name to ``x``).
    missing = [sorted(p.get_names()) for p in model.inputs if not p.get_names() & fed]
    if missing:
        raise EngineError(f"the calibration data has no inputs {missing}; it has {sorted(fed)}")
    floats = float_convolutions(model, scope)
    log.info("int8 (%s scope): %d convolutions stay in float: %s", scope, len(floats), ", ".join(floats))
    progress(0.0, f"quantizing with NNCF ({len(calibration)} calibration samples)")
    # NNCF logs every layer it skips at INFO; keep the build's own log readable.
    logging.getLogger("nncf").setLevel(logging.WARNING)
    return nncf.quantize(
        model,
        _dataset(calibration, names, progress),
        model_type=nncf.ModelType.TRANSFORMER,
        subset_size=len(calibration),
        ignored_scope=nncf.IgnoredScope(names=floats, validate=False),
        advanced_parameters=_advanced_parameters(),
    )


def _advanced_parameters():
    """NNCF's overflow fix for every layer on CPUs without VNNI/AMX (AVX2-only x86): their int8
    kernels saturate int16 sums of full 8-bit weights. Measured on a 2-core AMD EPYC (Zen 3, AVX2)
    with the tiny SD 1.5 UNet: the safe scope's engine failed the 10% gate (10.2% per call) with
    the default (first layer only). Engines are keyed by CPU class, so such an engine is never
    used on a VNNI CPU, where the default keeps the full 8 bits."""
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

    fix = OverflowFix.FIRST_LAYER if has_int8_dot() else OverflowFix.ENABLE
    return AdvancedQuantizationParameters(overflow_fix=fix)
