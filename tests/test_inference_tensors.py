"""Weights made under ``torch.inference_mode`` (as Forge loads them) through export and validation.

Forge 2 keeps its CLIP text encoder in fp16 on the CPU (``text_encoder_dtype``), so the export
and the validation move it to fp32 and back. Done with ``module.to()`` / ``t.data = ...`` outside
inference mode, that left tensors without a version counter that no longer counted as inference
tensors: the tracer failed ("Inference tensors do not track version counter", a real Forge's
``POST /sd-accel/build`` of the text encoder) and so did every later fingerprint of the module.
"""

from __future__ import annotations

import warnings

import torch

from sd_accel.onnx.export import fp32_on
from sd_accel.onnx.fingerprint import fingerprint


def _forge_like() -> torch.nn.Module:
    with torch.inference_mode():
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).half()


def test_fp16_inference_weights_export_and_stay_as_they_were(tmp_path):
    module = _forge_like()
    before = fingerprint(module)
    with fp32_on(module), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert all(p.dtype == torch.float32 and p.is_inference() for p in module.parameters())
        torch.onnx.export(module, (torch.randn(1, 8),), str(tmp_path / "m.onnx"), dynamo=False)
    assert all(p.dtype == torch.float16 and p.is_inference() for p in module.parameters())
    assert fingerprint(module) == before
    with torch.inference_mode():  # and Forge still runs it
        assert module(torch.randn(1, 8, dtype=torch.float16)).dtype == torch.float16


def test_fingerprint_reads_tensors_without_a_version_counter():
    """An inference tensor given ``.data`` outside inference mode (by any other code) has no counter
    and no longer says it is an inference tensor: the fingerprint still works."""
    module = _forge_like()
    module.to(torch.float32)  # what made such tensors
    weight = module[0].weight
    assert not weight.is_inference()
    first = fingerprint(module)
    assert fingerprint(module) == first


def test_forge2_clip_with_a_text_projection_attribute_exports_pooler_output(tmp_path):
    """Forge 2's loader builds ``IntegratedCLIP(CLIPTextModel, config, add_text_projection=True)``,
    which sets ``transformer.text_projection``; the model still returns ``pooler_output``, and its
    weights are fp16 inference tensors on the CPU. The ldm_clip export must work on exactly that."""
    from transformers import CLIPTextConfig, CLIPTextModel

    from sd_accel.components.ldm_clip import LdmClipSpec
    from sd_accel.onnx.export import _trace

    config = CLIPTextConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=77, projection_dim=16)
    with torch.inference_mode():
        model = CLIPTextModel(config).half()
        model.text_projection = torch.nn.Linear(32, 32, bias=False).half()
    spec = LdmClipSpec(model)
    assert not spec.projected
    assert [t.name for t in spec.outputs()][:2] == ["last_hidden_state", "pooler_output"]
    _trace(spec, tmp_path / "model.onnx", 17)
    assert (tmp_path / "model.onnx").exists()
    assert all(p.dtype == torch.float16 and p.is_inference() for p in model.parameters())
