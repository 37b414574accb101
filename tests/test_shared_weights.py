"""Weights shared across engines (issue 46, disk): an engine's weight file is stored once by content
under ``<cache>/weights/<sha256>.bin`` and hard-linked into every engine folder with the same bytes
(sd_accel.cache.shared). Two profiles of one weight set hold one copy on disk; engines load as before;
deleting one engine keeps the other; delete / prune remove weights no engine links; disk totals count
each inode once; an engine folder from before (a plain file) still loads.

The cache-level tests build fake engines through real build slots; the OpenVINO tests build two
tiny UNet profiles (OpenVINO's engine.bin is byte for byte the same in both)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from sd_accel.cache.key import EngineKey
from sd_accel.cache.shared import WEIGHTS_DIR, unique_bytes
from sd_accel.cache.store import EngineCache

SHAPES = {"sample": ((1, 4, 8, 8), (1, 4, 8, 8), (2, 4, 16, 16))}
WEIGHTS = b"w" * 40_000


def _key(profile: str, component: str = "unet") -> EngineKey:
    return EngineKey("0123456789abcdef0123", component, "openvino", "2026.4.1", "cpu-x86_64-avx512", "bf16", profile)


def _build(cache: EngineCache, profile: str, weights: bytes = WEIGHTS, share=("engine.bin",), component="unet"):
    """A fake engine: a graph of its own (differs per profile) and a weight file."""
    with cache.build_slot(_key(profile, component), timeout=0) as slot:
        assert slot is not None
        (slot.dir / "engine.blob").write_bytes(f"graph of {profile}".encode())
        (slot.dir / "engine.bin").write_bytes(weights)
        return slot.commit(["engine.blob", "engine.bin"], SHAPES, 1.0, {"ok": True}, share=share)


def _inode(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def _verify(cache: EngineCache, record) -> None:
    cache.verify(record, arch=record.key.arch, backend_version=record.key.backend_version)


def test_two_profiles_of_the_same_weights_share_one_inode(tmp_path):
    cache = EngineCache(tmp_path)
    a = _build(cache, "static.b1.h64.w64.t77")
    b = _build(cache, "b1-2.h64-96.w64-96.t77.opt1x64x64")
    pa, pb = cache.engine_dir(a.key) / "engine.bin", cache.engine_dir(b.key) / "engine.bin"
    assert _inode(pa) == _inode(pb)
    stored = cache.stored_weights()
    assert len(stored) == 1 and stored[0].parent == tmp_path / WEIGHTS_DIR and _inode(stored[0]) == _inode(pa)
    assert pa.stat().st_nlink == 3  # the store and two engines
    # Records, sizes and checksums as before: each engine lists its whole file.
    assert a.size_bytes == len(WEIGHTS) + len(b"graph of static.b1.h64.w64.t77")
    for record in (a, b):
        _verify(cache, record)
    # Totals count the shared file once.
    usage = cache.disk_usage()
    graphs = sum((cache.engine_dir(r.key) / "engine.blob").stat().st_size for r in (a, b))
    assert usage.engines_bytes == len(WEIGHTS) + graphs == cache.total_size() == usage.total_bytes
    assert usage.engines_file_bytes == a.size_bytes + b.size_bytes
    assert usage.shared_bytes == len(WEIGHTS) and "not stored twice" in usage.describe()


def test_sd_accel_list_counts_a_shared_file_once(tmp_path, capsys):
    import json

    from sd_accel.cli import main

    cache = EngineCache(tmp_path)
    a = _build(cache, "static.b1.h64.w64.t77")
    b = _build(cache, "b1-2.h64-96.w64-96.t77.opt1x64x64")
    assert main(["list", "--engine-dir", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["engines_bytes"] == listed["total_bytes"] == a.size_bytes + b.size_bytes - len(WEIGHTS)
    assert listed["shared_weights_saved_bytes"] == len(WEIGHTS) and listed["orphan_weights_bytes"] == 0
    assert main(["list", "--engine-dir", str(tmp_path)]) == 0
    assert "not stored twice" in capsys.readouterr().out


def test_different_weights_are_not_shared_and_unnamed_files_stay_plain(tmp_path):
    cache = EngineCache(tmp_path)
    a = _build(cache, "static.b1.h64.w64.t77")
    b = _build(cache, "static.b1.h96.w96.t77", weights=b"v" * 40_000)
    c = _build(cache, "static.b1.h80.w80.t77", share=())  # a backend that names no weight files
    paths = [cache.engine_dir(r.key) / "engine.bin" for r in (a, b, c)]
    assert len({_inode(p) for p in paths}) == 3 and paths[2].stat().st_nlink == 1
    assert len(cache.stored_weights()) == 2
    assert cache.disk_usage().engines_bytes == sum(r.size_bytes for r in (a, b, c))


def test_delete_one_engine_keeps_the_other_and_the_last_delete_frees_the_weights(tmp_path):
    cache = EngineCache(tmp_path)
    a = _build(cache, "static.b1.h64.w64.t77")
    b = _build(cache, "b1-2.h64-96.w64-96.t77.opt1x64x64")
    assert cache.delete(a.name)
    kept = cache.engine_dir(b.key) / "engine.bin"
    assert kept.read_bytes() == WEIGHTS and kept.stat().st_nlink == 2  # the store and b
    _verify(cache, cache.get(b.key))
    assert len(cache.stored_weights()) == 1 and cache.orphan_weights() == []
    assert cache.delete(b.name)
    assert cache.stored_weights() == [] and cache.disk_usage().total_bytes == 0


def test_prune_drops_weights_no_engine_links_and_counts_shared_ones_once(tmp_path):
    cache = EngineCache(tmp_path)
    a = _build(cache, "static.b1.h64.w64.t77")
    b = _build(cache, "b1-2.h64-96.w64-96.t77.opt1x64x64")
    odd = _build(cache, "static.b1.h96.w96.t77", weights=b"v" * 40_000)
    # An engine folder removed by hand (or by a crash): its weights are left to the store alone.
    shutil.rmtree(cache.engine_dir(odd.key))
    assert [p.name for p in cache.orphan_weights()] and cache.disk_usage().orphan_weights_bytes == 40_000
    assert "no engine holds" in cache.disk_usage().describe()
    # A limit the engines meet when the shared file counts once: nothing of theirs goes.
    limit = cache.disk_usage().total_bytes - 40_000
    assert cache.prune(max_bytes=limit) == []
    assert cache.orphan_weights() == [] and len(cache.stored_weights()) == 1
    assert {r.name for r in cache.list()} == {a.name, b.name}
    assert cache.disk_usage().total_bytes == limit
    # Pruning one of the two sharing engines frees only its graph; the last one frees the weights.
    blob = (cache.engine_dir(a.key) / "engine.blob").stat().st_size
    removed = cache.prune(max_bytes=limit - blob)
    assert [r.name for r in removed] == [a.name] and len(cache.stored_weights()) == 1
    assert cache.prune(max_bytes=0) and cache.stored_weights() == []


def test_no_hard_link_keeps_a_copy_and_the_engine_stays_valid(tmp_path, monkeypatch):
    cache = EngineCache(tmp_path)
    a = _build(cache, "static.b1.h64.w64.t77")
    real_link = os.link

    def cross_device(src, dst, *args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(src), None, str(dst))

    monkeypatch.setattr(os, "link", cross_device)
    b = _build(cache, "b1-2.h64-96.w64-96.t77.opt1x64x64")
    monkeypatch.setattr(os, "link", real_link)
    pa, pb = cache.engine_dir(a.key) / "engine.bin", cache.engine_dir(b.key) / "engine.bin"
    assert _inode(pa) != _inode(pb) and pb.stat().st_nlink == 1 and pb.read_bytes() == WEIGHTS
    _verify(cache, b)
    assert cache.disk_usage().engines_bytes == a.size_bytes + b.size_bytes


def test_a_stored_file_changed_in_place_is_never_linked_into_a_new_engine(tmp_path):
    cache = EngineCache(tmp_path)
    a = _build(cache, "static.b1.h64.w64.t77")
    with open(cache.engine_dir(a.key) / "engine.bin", "r+b") as fh:  # someone edits the weights in place
        fh.write(b"X")
    b = _build(cache, "b1-2.h64-96.w64-96.t77.opt1x64x64")
    pb = cache.engine_dir(b.key) / "engine.bin"
    assert pb.read_bytes() == WEIGHTS and _inode(pb) != _inode(cache.engine_dir(a.key) / "engine.bin")
    _verify(cache, b)
    assert [p.read_bytes() == WEIGHTS for p in cache.stored_weights()] == [True]


def test_unshare_gives_a_writer_its_own_copy(tmp_path):
    from sd_accel.cache.shared import unshare

    cache = EngineCache(tmp_path)
    a = _build(cache, "static.b1.h64.w64.t77")
    b = _build(cache, "b1-2.h64-96.w64-96.t77.opt1x64x64")
    pa = cache.engine_dir(a.key) / "engine.bin"
    assert unshare(pa) and pa.stat().st_nlink == 1 and not unshare(pa)
    pa.write_bytes(b"patched")
    assert (cache.engine_dir(b.key) / "engine.bin").read_bytes() == WEIGHTS


def test_prune_shares_the_weights_of_engines_from_before(tmp_path):
    cache = EngineCache(tmp_path)
    old = [_build(cache, p, share=()) for p in ("static.b1.h64.w64.t77", "b1-2.h64-96.w64-96.t77.opt1x64x64")]
    paths = [cache.engine_dir(r.key) / "engine.bin" for r in old]
    assert _inode(paths[0]) != _inode(paths[1]) and cache.stored_weights() == []
    before = cache.disk_usage().total_bytes
    assert cache.prune(max_bytes=before) == []  # the registry names OpenVINO's engine.bin
    assert _inode(paths[0]) == _inode(paths[1]) and len(cache.stored_weights()) == 1
    assert cache.disk_usage().total_bytes == before - len(WEIGHTS)
    for record in old:
        _verify(cache, record)
    assert cache.share_existing() == 0  # once is enough


def test_unique_bytes_counts_each_inode_once(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    os.link(tmp_path / "a", tmp_path / "b")
    (tmp_path / "c").write_bytes(b"y" * 5)
    assert unique_bytes([tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "gone"]) == 15


# --------------------------------------------------------------------------- OpenVINO engines

STATIC = dict(batch=1, height=64, width=64)
DYNAMIC = dict(batch=(1, 1, 2), height=(64, 64, 96), width=(64, 64, 96))


def _generate(engine_dir: Path | None, size: int = 64):
    from sd_accel import AccelConfig, accelerate, load_pipeline, stats

    config = dict(engines=True, engine_dir=str(engine_dir), backend="openvino") if engine_dir else {}
    pipe = accelerate(load_pipeline("builtin:tiny-sd15"), AccelConfig(precision="fp32", sampler="Euler", **config))
    g = torch.Generator("cpu").manual_seed(0)
    img = pipe("a cat", num_inference_steps=2, height=size, width=size, generator=g, output_type="np").images
    return img, stats(pipe).get("unet", {}).get("engine_calls", 0)


@pytest.mark.slow
def test_openvino_profiles_share_their_weights_run_and_outlive_a_delete(tmp_path):
    pytest.importorskip("openvino")
    from sd_accel import build_engines, load_pipeline

    static, dynamic = build_engines(load_pipeline("builtin:tiny-sd15"), profiles=[STATIC, DYNAMIC],
                                    backend="openvino", precision="fp32", components=["unet"], engine_dir=tmp_path,
                                    progress=False)
    cache = EngineCache(tmp_path)
    ps, pd = (cache.engine_dir(r.key) / "engine.bin" for r in (static, dynamic))
    assert _inode(ps) == _inode(pd) and len(cache.stored_weights()) == 1
    assert cache.disk_usage().engines_bytes == static.size_bytes + dynamic.size_bytes - ps.stat().st_size
    # Both engines load and run after sharing: 64 px on the static one, 80 px on the dynamic one.
    for size in (64, 80):
        reference, _ = _generate(None, size)
        got, calls = _generate(tmp_path, size)
        assert calls >= 2 and np.abs(got - reference).max() < 0.05, size
    # Deleting the static engine leaves the dynamic one whole: it loads and runs.
    assert cache.delete(static.name)
    assert pd.stat().st_nlink == 2 and len(cache.stored_weights()) == 1  # the store and the dynamic engine
    _verify(cache, cache.get(dynamic.key))
    got, calls = _generate(tmp_path, 64)
    assert calls >= 2 and np.isfinite(got).all()


@pytest.mark.slow
def test_an_engine_folder_from_before_sharing_still_loads(tmp_path, monkeypatch):
    """An engine built before this layout (a plain engine.bin, no store) is valid as it is; an
    engine of the same weights built now links to the store, and both run."""
    pytest.importorskip("openvino")
    from sd_accel import build_engines, load_pipeline
    from sd_accel.backends.openvino import OpenVinoBackend

    pipe = load_pipeline("builtin:tiny-sd15")
    monkeypatch.setattr(OpenVinoBackend, "weights_files", ())  # the builder as it was
    (old,) = build_engines(pipe, profiles=[STATIC], backend="openvino", precision="fp32", components=["unet"],
                           engine_dir=tmp_path, progress=False)
    monkeypatch.undo()
    cache = EngineCache(tmp_path)
    plain = cache.engine_dir(old.key) / "engine.bin"
    assert plain.stat().st_nlink == 1 and cache.stored_weights() == []
    (new,) = build_engines(pipe, profiles=[DYNAMIC], backend="openvino", precision="fp32", components=["unet"],
                           engine_dir=tmp_path, progress=False)
    assert (cache.engine_dir(new.key) / "engine.bin").stat().st_nlink == 2  # the store and the new engine
    assert plain.stat().st_nlink == 1
    for record in (old, new):
        _verify(cache, cache.get(record.key))
    for size in (64, 80):  # 64: either engine; 80: the dynamic one only
        got, calls = _generate(tmp_path, size)
        assert calls >= 2 and np.isfinite(got).all()
