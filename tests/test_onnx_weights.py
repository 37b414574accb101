"""Slim exports: once engines are built only the graph of an export is kept, and a complete
model is written again from the graph and the module's weights, equal to the export, for the
next build (no new export) and for a refit."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from sd_accel import build_engines
from sd_accel.cache.store import EngineCache
from sd_accel.components import specs_for
from sd_accel.core import EngineError, InvalidValue
from sd_accel.onnx import export as export_mod
from sd_accel.onnx import validate_artifact
from sd_accel.onnx.export import artifact_dir, export_onnx
from sd_accel.onnx.weights import WEIGHTS_FILE, is_slim, slim_export, slim_weights, write_full


def _shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in (*module.named_parameters(), *module.named_buffers())}


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _initializers(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


@pytest.fixture(scope="module")
def unet_export(tmp_path_factory, tiny_sd15):
    """The tiny SD 1.5 UNet exported with external data (as every SD-size UNet is)."""
    spec = specs_for(tiny_sd15)["unet"]
    folder = tmp_path_factory.mktemp("weights") / "unet"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sd_accel.onnx.optimize.EXTERNAL_DATA_THRESHOLD", 1)
        export_onnx(spec, folder)
    assert (folder / "model.onnx.data").is_file()
    return spec, folder


def test_slim_keeps_a_valid_graph_and_write_full_gives_the_export_back(unet_export, tmp_path):
    spec, full = unet_export
    slim = tmp_path / "slim"
    shutil.copytree(full, slim)
    freed = slim_export(slim, _shapes(spec.torch_module()))
    assert is_slim(slim) and not (slim / "model.onnx.data").exists()
    listed = slim_weights(slim)
    weights_bytes = sum(int(np.prod(w.shape)) * 4 for w in listed)
    assert freed >= 0.95 * weights_bytes and _folder_bytes(slim) < 0.1 * _folder_bytes(full)
    # every Linear of the UNet is a MatMul on a transposed, anonymous initializer: mapped by the node
    assert sum(w.transpose for w in listed) >= 10 and all(w.torch_name in _shapes(spec.torch_module()) for w in listed)
    assert validate_artifact(slim) is None  # the checker passes: the weights are graph inputs
    assert {w.onnx_name for w in listed} <= {i.name for i in onnx.load(str(slim / "model.onnx")).graph.input}

    path, written = write_full(slim, _tensors(spec.torch_module()), tmp_path / "again")
    assert written == len(listed)
    want, got = _initializers(full / "model.onnx"), _initializers(path)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    inputs = [i.name for i in onnx.load(str(path)).graph.input]
    assert inputs == [i.name for i in onnx.load(str(full / "model.onnx")).graph.input]
    feed = {k: v.numpy() for k, v in spec.sample_feed(spec.export_dims()).items()}
    a = ort.InferenceSession(str(full / "model.onnx")).run(None, feed)[0]
    b = ort.InferenceSession(str(path)).run(None, feed)[0]
    np.testing.assert_array_equal(a, b)


def test_write_full_refuses_a_module_without_the_graphs_weights(unet_export, tmp_path):
    spec, full = unet_export
    slim = tmp_path / "slim"
    shutil.copytree(full, slim)
    slim_export(slim, _shapes(spec.torch_module()))
    weights = _tensors(spec.torch_module())
    weights.pop(slim_weights(slim)[0].torch_name)
    with pytest.raises(EngineError, match="needs weights the module does not have"):
        write_full(slim, weights, tmp_path / "out")


def test_a_half_slimmed_folder_is_not_valid(unet_export, tmp_path, monkeypatch):
    """A crash after meta.json says "slim" but before the small graph replaced model.onnx: the
    sizes disagree, so the export is made again, never used half."""
    spec, full = unet_export
    folder = tmp_path / "half"
    shutil.copytree(full, folder)

    def crash(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr("sd_accel.onnx.weights.os.replace", crash)
    with pytest.raises(KeyboardInterrupt):
        slim_export(folder, _shapes(spec.torch_module()))
    assert validate_artifact(folder) is not None


def test_build_keeps_the_graph_only_and_the_next_profile_needs_no_export(tmp_path, tiny_factory, monkeypatch):
    pipe = tiny_factory("sd15")
    spec = specs_for(pipe)["unet"]
    (first,) = build_engines(pipe, profiles=[dict(batch=1, height=64, width=64)], backend="onnxruntime",
                             components=["unet"], engine_dir=tmp_path, progress=False)
    folder = artifact_dir(spec, tmp_path)
    assert is_slim(folder) and (folder / WEIGHTS_FILE).is_file()
    (item,) = EngineCache(tmp_path).intermediates()
    assert item.size_bytes == _folder_bytes(folder) and item.size_bytes < 0.2 * first.size_bytes

    def no_export(*a, **kw):
        raise AssertionError("exported again")

    monkeypatch.setattr(export_mod, "_trace", no_export)
    (second,) = build_engines(pipe, profiles=[dict(batch=1, height=96, width=64)], backend="onnxruntime",
                              components=["unet"], engine_dir=tmp_path, progress=False)
    assert second.status == "ok" and second.validation and second.validation["ok"]
    assert is_slim(folder) and not list(tmp_path.glob(".tmp-*"))  # the written model went with the build


def test_keep_onnx_true_keeps_the_whole_export_and_bad_values_are_refused(tmp_path, tiny_factory):
    pipe = tiny_factory("sd15")
    build_engines(pipe, profiles=[dict(batch=1, height=64, width=64)], backend="onnxruntime",
                  components=["vae_decoder"], engine_dir=tmp_path, progress=False, keep_onnx=True)
    folder = artifact_dir(specs_for(pipe)["vae_decoder"], tmp_path)
    assert not is_slim(folder) and validate_artifact(folder) is None
    with pytest.raises(InvalidValue, match="keep_onnx='yes'"):
        build_engines(pipe, components=["vae_decoder"], engine_dir=tmp_path, progress=False, keep_onnx="yes")


def test_constant_nodes_kept_outside_the_graph_survive_slimming(tmp_path):
    """A wide model's Constant nodes (FLUX.1's norm constants at width 3072) hold their values in
    the data file too: slimming keeps them inline, so write_full (a refit, another profile's
    build) gives a complete model."""
    from onnx import TensorProto, helper

    folder = tmp_path / "m"
    folder.mkdir()
    c = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(8, 8), "c")
    w = numpy_helper.from_array(np.ones((8, 8), np.float32), "lin.weight")
    graph = helper.make_graph([helper.make_node("Constant", [], ["cv"], value=c),
                               helper.make_node("Add", ["x", "cv"], ["y0"]),
                               helper.make_node("Mul", ["y0", "lin.weight"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 8])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
                    size_threshold=0, convert_attribute=True)
    attr = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node[0].attribute[0].t
    assert attr.data_location == onnx.TensorProto.EXTERNAL  # (as the exporter leaves them)

    slim_export(folder, {"lin.weight": (8, 8)})
    assert is_slim(folder) and not (folder / "model.onnx.data").exists()
    path, written = write_full(folder, {"lin.weight": torch.full((8, 8), 2.0)}, tmp_path / "again")
    assert written == 1
    x = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    got = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, (x + numpy_helper.to_array(c)) * 2, rtol=1e-6)
