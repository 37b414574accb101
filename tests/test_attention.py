"""Attention that scales: the export-time processor, its graph, and what each backend makes of it.

- The exported graph has no shape-sized zero bias (diffusers' ``baddbmm(empty, ...)``), so fixed
  shapes fold nothing into gigabytes, and every attention block is the 4-D
  ``MatMul(Q * scale, K^T) -> Softmax -> MatMul(., V)`` pattern.
- ONNX Runtime engines run it as ``com.microsoft.MultiHeadAttention`` (flash attention on CPU),
  OpenVINO's CPU plugin fuses it (no Softmax or MatMul layer left in the compiled model), and the
  fp16 ONNX TensorRT builds from keeps the pattern its fused MHA matches.
- Static engines at 512 px hold the weights, not shape-sized constants.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

from sd_accel.backends.onnxruntime import OnnxRuntimeBackend
from sd_accel.backends.onnxruntime.attention import count_unfused, fuse_attention
from sd_accel.components import specs_for
from sd_accel.models.builtin import build_tiny_pipeline
from sd_accel.onnx.attention import ExportAttnProcessor, export_attention, sdpa_attention
from sd_accel.onnx.export import export_onnx
from sd_accel.profiles import Profile
from sd_accel.validate import Validation, _points, reference, validate

STATIC_512 = Profile(batch=1, height=512, width=512)


def _quiet(frac: float, msg: str) -> None:
    return None


def weight_bytes(path: Path) -> tuple[int, int]:
    """(total, largest) bytes of the initializers of an ONNX file, external ones included."""
    model = onnx.load(str(path), load_external_data=False)
    sizes = [math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
             for t in model.graph.initializer]
    return sum(sizes), max(sizes)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


@pytest.fixture(scope="module")
def pipe():
    return build_tiny_pipeline("sd15")


@pytest.fixture(scope="module")
def exported(pipe, tmp_path_factory):
    """``exported(component)`` -> (spec, model.onnx), each exported once."""
    root = tmp_path_factory.mktemp("attn-onnx")
    done: dict = {}

    def get(component: str):
        if component not in done:
            spec = specs_for(pipe)[component]
            done[component] = (spec, export_onnx(spec, root / component))
        return done[component]

    return get


# ---- the processor ---------------------------------------------------------------------------


@pytest.mark.parametrize("cross", [False, True])
def test_processor_matches_diffusers_attention(cross):
    torch.manual_seed(0)
    attn = Attention(query_dim=32, cross_attention_dim=16 if cross else None, heads=4, dim_head=8).eval()
    x = torch.randn(2, 37, 32)
    context = torch.randn(2, 11, 16) if cross else None
    with torch.no_grad():
        attn.set_processor(AttnProcessor())
        want = attn(x, context)
        for processor in (ExportAttnProcessor(), ExportAttnProcessor(sdpa=True)):
            attn.set_processor(processor)
            torch.testing.assert_close(attn(x, context), want, rtol=1e-5, atol=1e-5)


def test_processor_applies_masks_group_norm_and_residual_like_diffusers():
    """The VAE's attention (group norm, residual, 4-D input) and a padding mask."""
    torch.manual_seed(0)
    vae_attn = Attention(query_dim=32, heads=1, dim_head=32, norm_num_groups=8, residual_connection=True,
                         rescale_output_factor=2.0, bias=True, upcast_softmax=True).eval()
    x = torch.randn(1, 32, 5, 7)
    masked = Attention(query_dim=32, cross_attention_dim=16, heads=4, dim_head=8).eval()
    y, context = torch.randn(2, 9, 32), torch.randn(2, 6, 16)
    mask = torch.zeros(2, 1, 6)
    mask[1, :, 4:] = -10000.0  # the second prompt is padded after 4 tokens
    with torch.no_grad():
        for attn, args in ((vae_attn, (x,)), (masked, (y, context, mask))):
            attn.set_processor(AttnProcessor2_0())
            want = attn(*args)
            for processor in (ExportAttnProcessor(), ExportAttnProcessor(sdpa=True)):
                attn.set_processor(processor)
                torch.testing.assert_close(attn(*args), want, rtol=1e-5, atol=1e-5)


def test_processors_are_set_for_the_block_and_restored(pipe):
    pipe.unet.set_attn_processor(AttnProcessor2_0())
    before = pipe.unet.attn_processors
    with export_attention(pipe.unet):
        assert {type(p) for p in pipe.unet.attn_processors.values()} == {ExportAttnProcessor}
    with sdpa_attention(pipe.vae):
        assert all(p.sdpa for p in pipe.vae.attn_processors.values())
    after = pipe.unet.attn_processors
    assert all(after[k] is before[k] for k in before)


# ---- the exported graph ------------------------------------------------------------------------


@pytest.mark.parametrize("component", ["unet", "vae_decoder"])
def test_exported_attention_has_no_score_sized_zero_bias(exported, component):
    _, path = exported(component)
    nodes = onnx.load(str(path)).graph.node
    producer = {o: n for n in nodes for o in n.output}
    softmaxes = [n for n in nodes if n.op_type == "Softmax"]
    assert softmaxes
    for node in softmaxes:  # Softmax reads the score MatMul directly: no Add of an empty * 0 tensor
        assert producer[node.input[0]].op_type == "MatMul", node.name
    assert not [n for n in nodes if n.op_type == "ConstantOfShape" and "attn" in n.name]


@pytest.mark.parametrize("component", ["unet", "vae_decoder"])
def test_every_attention_block_fuses_into_multihead_attention(exported, component):
    _, path = exported(component)
    model = onnx.load(str(path), load_external_data=False)
    softmaxes = count_unfused(model)
    assert fuse_attention(model, path.parent) == softmaxes > 0
    assert count_unfused(model) == 0
    ops = {n.op_type for n in model.graph.node}
    assert "MultiHeadAttention" in ops and "Softmax" not in ops
    onnx.checker.check_model(model)


def test_fusion_leaves_other_patterns_alone():
    """A softmax that is not the exported block (here: no scale on Q) is not touched."""

    class Plain(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)), -1), v)

    import io

    buf = io.BytesIO()
    q = torch.randn(1, 2, 5, 4)
    torch.onnx.export(Plain(), (q, q, q), buf, dynamo=False, opset_version=17)
    model = onnx.load_from_string(buf.getvalue())
    assert fuse_attention(model) == 0 and count_unfused(model) == 1


# ---- what each backend makes of it --------------------------------------------------------------


def test_onnxruntime_engine_runs_multihead_attention_and_matches_torch(exported, tmp_path):
    spec, path = exported("unet")
    profile = Profile(batch=1, height=128, width=128)
    shapes = spec.shape_ranges(profile)
    be = OnnxRuntimeBackend()
    files = be.build(path, shapes, "fp32", tmp_path, _quiet)
    engine = onnx.load(str(tmp_path / files[0]), load_external_data=False)
    ops = [n.op_type for n in engine.graph.node]
    assert ops.count("MultiHeadAttention") == count_unfused(onnx.load(str(path), load_external_data=False))
    assert "Softmax" not in ops
    runner = be.load(tmp_path, files, shapes)
    result = validate(spec, runner, profile, "fp32")
    assert result.ok and result.rel_l2 < 1e-4, result


def test_onnxruntime_without_fused_attention_builds_plain_and_says_so(exported, tmp_path, monkeypatch, caplog):
    """An ONNX Runtime that cannot take the rewritten graph (no in-memory external data, no
    MultiHeadAttention kernel) still gets an engine, with plain attention, and a warning."""
    import onnxruntime as ort

    real = ort.InferenceSession

    def no_bytes(model, *args, **kwargs):
        if isinstance(model, bytes):
            raise RuntimeError("this ONNX Runtime takes no graphs from memory")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", no_bytes)
    spec, path = exported("unet")
    files = OnnxRuntimeBackend().build(path, spec.shape_ranges(Profile(batch=1, height=64, width=64)), "fp32",
                                       tmp_path, _quiet)
    ops = {n.op_type for n in onnx.load(str(tmp_path / files[0]), load_external_data=False).graph.node}
    assert "Softmax" in ops and "MultiHeadAttention" not in ops
    assert "plain attention" in caplog.text


def test_onnxruntime_int8_keeps_attention_float_and_fused(exported, tmp_path):
    from sd_accel.core import CalibrationSet

    spec, path = exported("unet")
    profile = Profile(batch=1, height=64, width=64)
    shapes = spec.shape_ranges(profile)
    dims = {k: r[1] for k, r in spec.dim_ranges(profile).items()}
    feeds = [{k: v.numpy() for k, v in spec.sample_feed(dims, seed=i).items()} for i in range(2)]
    files = OnnxRuntimeBackend().build(path, shapes, "int8", tmp_path, _quiet, calibration=CalibrationSet("unet", feeds))
    ops = [n.op_type for n in onnx.load(str(tmp_path / files[0]), load_external_data=False).graph.node]
    assert "MultiHeadAttention" in ops and "Softmax" not in ops
    assert "QLinearMatMul" in ops or "MatMulInteger" in ops  # the linear layers are int8


def test_openvino_compiles_attention_into_fused_kernels(exported, tmp_path):
    pytest.importorskip("openvino")
    from sd_accel.backends.openvino import OpenVinoBackend

    spec, path = exported("unet")
    shapes = spec.shape_ranges(STATIC_512)
    be = OpenVinoBackend()
    runner = be.load(tmp_path, be.build(path, shapes, "fp32", tmp_path, _quiet), shapes)
    layers = [op.get_rt_info()["layerType"].astype(str) for op in runner.compiled.get_runtime_model().get_ops()]
    # Unfused, each block would show two MatMul layers and a Softmax layer (SNIPPETS_MODE=DISABLE does).
    assert "Softmax" not in layers and "MatMul" not in layers
    assert layers.count("Subgraph") + layers.count("ScaledDotProductAttention") >= 8


def test_tensorrt_fp16_onnx_keeps_the_fusable_pattern(exported):
    """TensorRT's MHA fusion wants Q, K, V as [B, H, S, d], the scale on Q before the first
    MatMul, and Softmax between the two MatMuls (NVIDIA, "Fused Attention"). No TensorRT here:
    the check is on the fp16 ONNX the TensorRT 11 build parses."""
    from sd_accel.onnx.fp16 import fp16_onnx

    _, path = exported("unet")
    half = onnx.load(str(fp16_onnx(path)), load_external_data=False)
    graph = half.graph
    producer = {o: n for n in graph.node for o in n.output}
    for node in (n for n in graph.node if n.op_type == "Softmax"):
        scores = producer[node.input[0]]
        assert scores.op_type == "MatMul"
        assert producer[scores.input[0]].op_type == "Mul"  # Q * scale
        assert producer[producer[scores.input[0]].input[0]].op_type == "Transpose"
        assert producer[scores.input[1]].op_type == "Transpose"  # K^T
        consumer = [n for n in graph.node if node.output[0] in n.input]
        assert [n.op_type for n in consumer] == ["MatMul"]
    total, largest = weight_bytes(path.with_name("model.fp16.onnx"))
    fp32_total, fp32_largest = weight_bytes(path)
    assert total <= 0.55 * fp32_total and largest <= fp32_largest  # fp16 weights, nothing folded


# ---- engines at 512 px hold weights, not shape-sized constants -----------------------------------


@pytest.mark.parametrize("component", ["unet", "vae_decoder", "vae_encoder", "clip"])
def test_static_512_onnxruntime_engine_is_the_size_of_its_weights(exported, component, tmp_path):
    """ONNX Runtime folds every constant a fixed shape allows (what TensorRT folds too): what is
    left is the weights."""
    spec, path = exported(component)
    files = OnnxRuntimeBackend().build(path, spec.shape_ranges(STATIC_512), "fp32", tmp_path, _quiet)
    weights, largest = weight_bytes(path)
    _, engine_largest = weight_bytes(tmp_path / files[0])
    assert engine_largest <= largest  # no [batch * heads, N, N] constant
    assert folder_bytes(tmp_path) <= 1.1 * weights + 2**20


def test_static_512_openvino_engine_is_the_size_of_its_weights(exported, tmp_path):
    pytest.importorskip("openvino")
    from sd_accel.backends.openvino import OpenVinoBackend

    spec, path = exported("unet")
    OpenVinoBackend().build(path, spec.shape_ranges(STATIC_512), "fp32", tmp_path, _quiet)
    weights, _ = weight_bytes(path)
    assert folder_bytes(tmp_path) <= 1.1 * weights + 2**20


@pytest.mark.parametrize(("precision", "factor"), [("fp32", 1.02), ("bf16", 0.52)])
def test_openvino_stores_weights_once_in_the_engine_precision(exported, tmp_path, precision, factor):
    """``engine.bin`` holds the weights (fp16 storage for bf16 engines); the compiled blob holds
    none of them (weightless export); the engine loads and matches torch."""
    pytest.importorskip("openvino")
    from sd_accel.backends.openvino import OpenVinoBackend
    from sd_accel.backends.openvino.builder import ENGINE_FILE, WEIGHTS_FILE

    be = OpenVinoBackend()
    if precision not in be.precisions():
        pytest.skip(f"this CPU has no native {precision} (AVX512-BF16 or AMX)")
    spec, path = exported("unet")
    profile = Profile(batch=1, height=128, width=128)
    shapes = spec.shape_ranges(profile)
    files = be.build(path, shapes, precision, tmp_path, _quiet)
    weights, _ = weight_bytes(path)
    assert (tmp_path / WEIGHTS_FILE).stat().st_size <= factor * weights
    assert (tmp_path / ENGINE_FILE).stat().st_size <= 0.3 * weights
    assert sorted(files) == sorted(p.name for p in tmp_path.iterdir())  # nothing left beside them
    result = validate(spec, be.load(tmp_path, files, shapes), profile, precision)
    assert result.ok, result


# ---- validation -----------------------------------------------------------------------------------


def test_reference_one_item_at_a_time_equals_the_batch(pipe):
    spec = specs_for(pipe)["unet"]
    feed = spec.sample_feed({"B2": 3, "H8": 8, "W8": 8, "T": 77})
    with torch.no_grad(), sdpa_attention(pipe.unet):
        whole = spec.export_module()(*feed.values())
        parts = reference(spec.export_module(), feed)
    torch.testing.assert_close(parts[0], whole[0], rtol=1e-5, atol=1e-5)


class _TorchRunner:
    """Stands in for an engine: the torch module itself."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.calls: list[tuple] = []

    def infer(self, feed):
        self.calls.append(tuple(next(iter(feed.values())).shape))
        with torch.no_grad():
            out = self.spec.export_module()(*feed.values())
        return dict(zip([t.name for t in self.spec.outputs()], out, strict=True))


def test_max_point_is_checked_when_it_fits(pipe):
    spec = specs_for(pipe)["unet"]
    profile = Profile(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96))
    runner = _TorchRunner(spec)
    result = validate(spec, runner, profile, "fp32")
    assert result.ok and result.points == ["opt", "max"] and not result.skipped
    assert [c[0] for c in runner.calls] == [2, 4]  # the engine runs the whole max batch


def test_max_point_is_skipped_and_recorded_when_it_would_not_fit(pipe, monkeypatch):
    import sd_accel.validate as validation

    monkeypatch.setattr(validation, "available_memory", lambda: 1)
    monkeypatch.setattr(validation._PeakSampler, "growth", property(lambda self: 2**20))
    spec = specs_for(pipe)["unet"]
    profile = Profile(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96))
    result = validate(spec, _TorchRunner(spec), profile, "fp32")
    assert result.ok and result.points == ["opt"]
    assert "max" in result.skipped and "GiB available" in result.skipped["max"]
    assert Validation(**result.to_dict()) == result  # what the index stores round-trips


def test_max_point_estimate_scales_only_what_grows_with_the_shape():
    from sd_accel.validate import HEADROOM, max_point_need

    gib = 2**30
    # SD 1.5's dynamic-512-768 UNet in OpenVINO bf16 (measured, issue 46): the opt point grew 2.27
    # GiB and kept 2.14 GiB, of which 1.60 GiB the weights its first call copied (engine.bin); the
    # max shape is x8.2 the opt's size. Only the 0.67 GiB of activations scales.
    need = max_point_need(int(2.27 * gib), int(2.14 * gib), int(1.60 * gib), 8.2)
    assert need == pytest.approx(0.67 * gib * 8.2 * HEADROOM, rel=1e-3)
    assert 3.27 * gib < need < 10 * gib  # above what the max took (3.27 GiB), under 10.9 GiB free
    assert 2.27 * gib * 8.2 * HEADROOM > 27 * gib  # scaling the weights too: the max never fits
    # kept past the weights' size is counted as growing (a runtime's pooled activations)
    assert max_point_need(3 * gib, 3 * gib, 1 * gib, 2.0) == int(2 * gib * 2.0 * HEADROOM)
    # nothing kept (the weights were loaded before the point), or not measured: all of it scales
    assert max_point_need(3 * gib, 0, 2 * gib, 2.0) == max_point_need(3 * gib, None, 2 * gib, 2.0) \
        == int(3 * gib * 2.0 * HEADROOM)
    # a runner that loads the weights again for a new shape (OpenVINO's fixed shapes): added once
    assert max_point_need(3 * gib, 2 * gib, 2 * gib, 2.0, per_shape=2 * gib) == int(gib * 2.0 * HEADROOM) + 2 * gib


def _squeeze_memory(monkeypatch, spec, profile, fits):
    """Makes the max point's estimate fit only the dims ``fits`` (a dims dict): 1 GiB of growth at
    opt, none of it kept, and just enough memory available for ``fits``."""
    import sd_accel.validate as validation

    gib = 2**30
    pts = validation._points(spec, profile)
    ratio = validation._elements(spec, fits) / validation._elements(spec, pts["opt"])
    free = validation.max_point_need(gib, 0, 0, ratio) + 1
    monkeypatch.setattr(validation, "available_memory", lambda: free)
    monkeypatch.setattr(validation._PeakSampler, "growth", property(lambda self: gib))
    monkeypatch.setattr(validation._PeakSampler, "kept", property(lambda self: 0))


def test_max_point_that_does_not_fit_is_checked_at_a_smaller_batch_and_recorded(pipe, monkeypatch):
    spec = specs_for(pipe)["unet"]
    profile = Profile(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96))
    full = {"B2": 4, "H8": 12, "W8": 12, "T": 77}
    assert _points(spec, profile)["max"] == full
    _squeeze_memory(monkeypatch, spec, profile, {**full, "B2": 1})  # batch 2 at max does not fit, 1 does
    runner = _TorchRunner(spec)
    result = validate(spec, runner, profile, "fp32")
    assert result.ok and result.points == ["opt", "max"] and not result.skipped
    assert result.reduced["max"]["dims"] == {**full, "B2": 1}
    assert "GiB available" in result.reduced["max"]["why"]
    assert runner.calls == [(2, 4, 8, 8), (1, 4, 12, 12)]  # the max image size, one batch row
    assert Validation(**result.to_dict()) == result  # what the index stores round-trips


def test_max_point_checked_at_a_smaller_image_when_even_batch_1_does_not_fit(pipe, monkeypatch):
    spec = specs_for(pipe)["unet"]
    profile = Profile(batch=(1, 1, 2), height=(64, 64, 128), width=(64, 64, 128))
    half = {"B2": 1, "H8": 12, "W8": 12, "T": 77}  # 96 px: half way from opt (64) to max (128)
    _squeeze_memory(monkeypatch, spec, profile, half)
    runner = _TorchRunner(spec)
    result = validate(spec, runner, profile, "fp32")
    assert result.ok and result.points == ["opt", "max"] and not result.skipped
    assert result.reduced["max"]["dims"] == half
    assert runner.calls[-1] == (1, 4, 12, 12)


def test_reference_runs_sdpa_whatever_the_pipeline_set(pipe, monkeypatch):
    from diffusers.models.attention_processor import SlicedAttnProcessor

    spec = specs_for(pipe)["unet"]
    pipe.unet.set_attn_processor(SlicedAttnProcessor(1))
    seen = set()
    real = ExportAttnProcessor.__call__

    def spy(self, *args, **kwargs):
        seen.add(self.sdpa)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ExportAttnProcessor, "__call__", spy)
    try:
        validate(spec, _TorchRunner(spec), Profile(batch=1, height=64, width=64), "fp32")
    finally:
        pipe.unet.set_attn_processor(AttnProcessor2_0())
    assert seen == {True}


def test_rss_sampler_sees_an_allocation():
    from sd_accel.validate import _PeakSampler, _rss_bytes

    if _rss_bytes() is None:
        pytest.skip("no /proc/self/statm on this system: the max-point estimate is off here")
    with _PeakSampler(interval=0.001) as sampler:
        block = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
        block += 1
        import time

        time.sleep(0.05)
    del block
    assert sampler.growth is not None and sampler.growth >= 32 * 2**20


_RSS_SAMPLER_CHILD = """
import json, time
import numpy as np
from sd_accel.validate import _PeakSampler, _rss_bytes
if _rss_bytes() is None:
    print("RESULT null")
    raise SystemExit
size = 64 * 2**20
with _PeakSampler(interval=0.001) as held:
    kept = np.ones(size // 8)
with _PeakSampler(interval=0.001) as freed:
    scratch = np.ones(size // 8)  # (numpy's big buffers are mmapped: freed means handed back)
    scratch += 1
    time.sleep(0.05)
    del scratch
print("RESULT " + json.dumps({"size": size, "held_kept": held.kept, "sum": float(kept.sum()),
                              "freed_growth": freed.growth, "freed_kept": freed.kept}))
"""


def test_rss_sampler_tells_what_the_block_kept_from_what_it_freed():
    """The max estimate's split: what stays held after the opt point (weights a first call loaded)
    is not scaled; what was freed (activations) is. In a fresh process: a test worker's other
    threads (thread pools of earlier tests) hand memory back while the block runs (CI saw 0 kept)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _RSS_SAMPLER_CHILD], capture_output=True, text=True, env=env,
                          timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.split("RESULT", 1)[1])
    if r is None:
        pytest.skip("no /proc/self/statm on this system: the max-point estimate is off here")
    size = r["size"]
    assert r["held_kept"] >= size // 2 and r["sum"] == size // 8
    assert r["freed_growth"] >= size // 2 and r["freed_kept"] < size // 4
