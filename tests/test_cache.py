"""The engine cache on real files: index rebuilds, locks across processes, checksums, pruning."""

from __future__ import annotations

import errno
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sd_accel.cache import store
from sd_accel.cache.key import EngineKey
from sd_accel.cache.record import META_FILE, EngineRecord
from sd_accel.cache.store import INDEX_FILE, INDEX_SCHEMA, EngineCache
from sd_accel.core import SPEC_VERSION, EngineError
from sd_accel.paths import default_engine_dir
from sd_accel.units import format_size

SHAPES = {"sample": ((1, 4, 8, 8), (2, 4, 8, 8), (2, 4, 16, 16)), "t": ((1,), (1,), (1,))}
VALIDATION = {"max_abs": 1e-4, "rel_l2": 2e-5, "ok": True}


def make_key(**changes: object) -> EngineKey:
    fields = {
        "model": "0123456789abcdef0123",
        "component": "unet",
        "backend": "onnxruntime",
        "backend_version": "1.20.0",
        "arch": "sm86",
        "precision": "fp16",
        "profile": "static.b2.h64.w64.t77",
    }
    fields.update(changes)
    return EngineKey(**fields)  # type: ignore[arg-type]


def build(
    cache: EngineCache, key: EngineKey, payload: bytes = b"engine-bytes", **commit: object
) -> EngineRecord:
    """Build a fake engine of two files through a real build slot."""
    with cache.build_slot(key, timeout=0) as slot:
        assert slot is not None
        (slot.dir / "model.onnx").write_bytes(payload)
        (slot.dir / "data").mkdir()
        (slot.dir / "data" / "weights.bin").write_bytes(payload * 3)
        args = {"validation": VALIDATION, "extra": {"opset": 17}, **commit}
        return slot.commit(["model.onnx", slot.dir / "data" / "weights.bin"], SHAPES, 1.5, **args)


def leftovers(cache: EngineCache) -> list[str]:
    return sorted(p.name for p in cache.root.iterdir() if p.name.startswith((".tmp-", ".trash-")))


def lock_is_free(cache: EngineCache, key: EngineKey) -> bool:
    """Whether another build of ``key`` can start at once (a fresh lock, no waiting)."""
    try:
        with cache.build_slot(key, timeout=0, force=True):
            return True
    except EngineError:
        return False


def run_python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture()
def cache(tmp_path: Path) -> EngineCache:
    return EngineCache(tmp_path / "engines")


# --------------------------------------------------------------------------- commit, read


def test_commit_writes_folder_meta_and_index(cache: EngineCache) -> None:
    key = make_key()
    record = build(cache, key)

    folder = cache.root / key.name
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "data/weights.bin",
        META_FILE,
        "model.onnx",
    ]
    assert record.files == ["data/weights.bin", "model.onnx"]
    assert record.size_bytes == len(b"engine-bytes") * 4
    assert record.checksum.startswith("sha256:") and len(record.checksum) == 7 + 64
    assert record.shapes == SHAPES and record.validation == VALIDATION and record.extra == {"opset": 17}
    assert record.status == "ok" and record.bad_reason is None and record.build_seconds == 1.5
    assert record.created == record.last_used <= time.time()

    meta = json.loads((folder / META_FILE).read_text())
    assert EngineRecord.from_dict(meta) == record
    index = json.loads((cache.root / INDEX_FILE).read_text())
    assert index["schema"] == INDEX_SCHEMA and list(index["engines"]) == [key.name]
    assert leftovers(cache) == []
    cache.verify(record, arch="sm86", backend_version="1.20.0")


def test_list_get_find(cache: EngineCache) -> None:
    unet = build(cache, make_key())
    vae = build(cache, make_key(component="vae_decoder"))
    trt = build(cache, make_key(backend="tensorrt", backend_version="10.5.0", arch="sm89"))
    other_model = build(cache, make_key(model="fedcba9876543210"))

    assert cache.list() == sorted([unet, vae, trt, other_model], key=lambda r: r.name)
    assert cache.get(make_key(component="vae_decoder")) == vae
    assert cache.get(make_key(precision="fp32")) is None
    assert cache.find(component="unet", backend="onnxruntime") == sorted(
        [unet, other_model], key=lambda r: r.name
    )
    assert cache.find(arch="sm89") == [trt]
    assert cache.find(model="fedcba9876543210") == [other_model]
    assert cache.find(component="clip") == []
    assert cache.total_size() == sum(r.size_bytes for r in (unet, vae, trt, other_model))


def test_commit_without_file_list_takes_every_file(cache: EngineCache) -> None:
    with cache.build_slot(make_key()) as slot:
        assert slot is not None
        (slot.dir / "a.plan").write_bytes(b"a")
        (slot.dir / "b.cache").write_bytes(b"bb")
        record = slot.commit(None, SHAPES, 0.1)
    assert record.files == ["a.plan", "b.cache"] and record.size_bytes == 3


def test_commit_refuses_files_it_did_not_get(cache: EngineCache, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"x")
    for files in ([outside], ["missing.plan"], []):
        with pytest.raises(EngineError), cache.build_slot(make_key()) as slot:
            assert slot is not None
            slot.commit(files, SHAPES, 0.1)
    assert cache.list() == [] and leftovers(cache) == []


def test_existing_engine_yields_none_and_bad_one_is_rebuilt(cache: EngineCache) -> None:
    key = make_key()
    build(cache, key, validation={"max_abs": float("nan"), "ok": False})
    bad = cache.get(key)
    assert bad is not None and bad.status == "bad" and "validation" in (bad.bad_reason or "")

    rebuilt = build(cache, key, payload=b"better")  # a bad engine gets a slot again
    assert cache.list() == [rebuilt] and rebuilt.status == "ok"
    with cache.build_slot(key) as slot:
        assert slot is None
    with cache.build_slot(key, force=True) as slot:
        assert slot is not None
    assert cache.list() == [rebuilt]  # a forced slot left without commit changes nothing


def test_reading_an_empty_or_missing_root_creates_nothing(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "nowhere")
    assert cache.list() == [] and cache.broken() == [] and cache.total_size() == 0
    assert cache.get(make_key()) is None and cache.prune(max_bytes=0) == []
    assert not cache.root.exists()


# --------------------------------------------------------------------------- the index


def test_deleted_index_is_rebuilt_with_the_same_records(
    cache: EngineCache, caplog: pytest.LogCaptureFixture
) -> None:
    records = [build(cache, make_key(component=c)) for c in ("unet", "clip", "vae_decoder")]
    before = cache.list()
    (cache.root / INDEX_FILE).unlink()

    with caplog.at_level(logging.WARNING, logger=store.__name__):
        after = cache.list()

    assert after == before == sorted(records, key=lambda r: r.name)
    assert "rebuilt" in caplog.text and INDEX_FILE in caplog.text
    index = json.loads((cache.root / INDEX_FILE).read_text())
    assert index["schema"] == INDEX_SCHEMA and sorted(index["engines"]) == [r.name for r in before]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "",
        "[1, 2]",
        json.dumps({"schema": INDEX_SCHEMA + 1, "engines": {}}),
        json.dumps({"engines": {}}),
        json.dumps({"schema": INDEX_SCHEMA, "engines": {"unet.x.s1": {"key": 5}}}),
    ],
    ids=["garbage", "empty", "list", "newer-schema", "no-schema", "bad-entry"],
)
def test_unusable_index_is_rebuilt(
    cache: EngineCache, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    record = build(cache, make_key())
    (cache.root / INDEX_FILE).write_text(content)

    with caplog.at_level(logging.WARNING, logger=store.__name__):
        assert cache.list() == [record]
    assert "rebuilt" in caplog.text
    index = json.loads((cache.root / INDEX_FILE).read_text())
    assert index["schema"] == INDEX_SCHEMA and list(index["engines"]) == [record.name]


def test_entry_whose_folder_was_deleted_by_hand_is_dropped(
    cache: EngineCache, caplog: pytest.LogCaptureFixture
) -> None:
    gone = build(cache, make_key())
    kept = build(cache, make_key(component="clip"))
    shutil.rmtree(cache.root / gone.name)

    with caplog.at_level(logging.WARNING, logger=store.__name__):
        assert cache.list() == [kept]
    assert gone.name in caplog.text and "dropped" in caplog.text
    assert cache.get(gone.key) is None
    assert list(json.loads((cache.root / INDEX_FILE).read_text())["engines"]) == [kept.name]


def test_folder_without_index_entry_is_picked_up(cache: EngineCache, tmp_path: Path) -> None:
    here = build(cache, make_key())
    elsewhere = EngineCache(tmp_path / "other")
    copied = build(elsewhere, make_key(component="clip"), payload=b"copied")
    shutil.copytree(elsewhere.root / copied.name, cache.root / copied.name)

    assert cache.list() == sorted([here, copied], key=lambda r: r.name)
    cache.verify(cache.get(copied.key), arch="sm86", backend_version="1.20.0")  # type: ignore[arg-type]
    assert sorted(json.loads((cache.root / INDEX_FILE).read_text())["engines"]) == sorted(
        [here.name, copied.name]
    )


def test_folder_with_missing_or_corrupt_meta_is_reported_not_listed_not_deleted(
    cache: EngineCache, caplog: pytest.LogCaptureFixture
) -> None:
    good = build(cache, make_key())
    corrupt = build(cache, make_key(component="clip"))
    no_meta = build(cache, make_key(component="vae_decoder"))
    (cache.root / corrupt.name / META_FILE).write_text('{"key": ')
    (cache.root / no_meta.name / META_FILE).unlink()
    (cache.root / INDEX_FILE).unlink()

    with caplog.at_level(logging.WARNING, logger=store.__name__):
        assert cache.list() == [good]
    broken = {b.name: b.reason for b in cache.broken()}
    assert sorted(broken) == sorted([corrupt.name, no_meta.name])
    assert "unreadable" in broken[corrupt.name] and "no meta.json" in broken[no_meta.name]
    assert corrupt.name in caplog.text and no_meta.name in caplog.text

    assert [r.name for r in cache.prune(max_bytes=0)] == [good.name]
    assert (cache.root / corrupt.name / "model.onnx").exists()
    assert (cache.root / no_meta.name / "model.onnx").exists()

    rebuilt = build(cache, corrupt.key)  # building that key replaces the broken folder
    assert cache.list() == [rebuilt] and [b.name for b in cache.broken()] == [no_meta.name]
    assert cache.delete(no_meta.name) is True
    assert cache.broken() == [] and not (cache.root / no_meta.name).exists()


def test_other_modules_folders_are_never_touched(cache: EngineCache) -> None:
    record = build(cache, make_key())
    (cache.root / "notes").mkdir()
    (cache.root / "notes" / "a.txt").write_text("mine")
    (cache.root / "README.txt").write_text("mine")

    assert cache.list() == [record] and cache.broken() == [] and cache.intermediates() == []
    assert cache.total_size() == record.size_bytes == cache.disk_usage().total_bytes
    assert cache.prune(max_bytes=0, older_than_s=0) == [record]
    assert (cache.root / "notes" / "a.txt").read_text() == "mine"
    assert (cache.root / "README.txt").read_text() == "mine"
    for reserved in ("onnx", "calibration"):
        with pytest.raises(ValueError, match="not an engine"):
            cache.delete(reserved)


# --------------------------------------------------------------------------- intermediates

WEIGHTS = make_key().model[:16]  # what an engine of make_key() was built from


def export(cache: EngineCache, component: str = "unet", weights: str = WEIGHTS, spec: int = SPEC_VERSION,
           size: int = 1000) -> Path:
    """An ONNX export folder as sd_accel.onnx.export lays it out."""
    folder = cache.root / "onnx" / f"{component}.{weights}.s{spec}"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"g" * size)
    (folder / "meta.json").write_text("{}")
    return folder


def calibration(cache: EngineCache, component: str = "unet", weights: str = WEIGHTS, size: int = 300) -> Path:
    path = cache.root / "calibration" / f"{weights}-{component}-{'ab' * 8}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"c" * size)
    return path


def by_name(cache: EngineCache) -> dict:
    return {i.name: i for i in cache.intermediates()}


def test_intermediates_are_counted_kept_for_their_engines_and_go_with_the_last(cache: EngineCache) -> None:
    unet = build(cache, make_key())
    unet_int8 = build(cache, make_key(precision="int8"))
    unet_onnx = export(cache)
    unet_calib = calibration(cache)
    clip_calib = calibration(cache, "clip", "f" * 16)  # captured beside the UNet's; no clip engine
    old_spec = export(cache, spec=SPEC_VERSION - 1, size=10)  # another export spec version: no engine uses it
    (cache.root / "onnx" / f"{unet_onnx.name}.lock").write_text("")  # the export's lock file: not data

    items = by_name(cache)
    assert set(items) == {f"onnx/unet.0123456789abcdef.s{SPEC_VERSION}", f"onnx/unet.0123456789abcdef.s{SPEC_VERSION - 1}",
                          f"calibration/{unet_calib.name}", f"calibration/{clip_calib.name}"}
    kept = items[f"onnx/unet.0123456789abcdef.s{SPEC_VERSION}"]
    assert kept.engines == tuple(sorted([unet.name, unet_int8.name])) and kept.status == "kept for 2 engines"
    assert kept.size_bytes == 1002 and kept.label == "ONNX export"
    assert items[f"calibration/{clip_calib.name}"].unused and items[f"onnx/unet.0123456789abcdef.s{SPEC_VERSION - 1}"].unused
    usage = cache.disk_usage()
    assert usage.engines == 2 and usage.engines_bytes == unet.size_bytes + unet_int8.size_bytes
    assert usage.intermediates_bytes == 1002 + 12 + 300 + 300
    assert usage.total_bytes == usage.engines_bytes + usage.intermediates_bytes
    assert "intermediates" in usage.describe() and "unused" in usage.describe()

    # deleting one engine removes what no engine needs; the export stays for the other engine
    assert cache.delete(unet.name)
    assert set(by_name(cache)) == {f"onnx/unet.0123456789abcdef.s{SPEC_VERSION}", f"calibration/{unet_calib.name}"}
    assert not clip_calib.exists() and not old_spec.exists()
    # deleting every engine leaves no intermediates behind
    assert cache.delete(unet_int8.name)
    assert cache.intermediates() == [] and cache.disk_usage().total_bytes == 0
    assert not unet_onnx.exists() and not unet_calib.exists()
    data = [p for p in cache.root.rglob("*") if p.is_file() and p.stat().st_size and p.name != INDEX_FILE]
    assert data == []


def test_webui_engines_keep_the_export_of_their_weights_fingerprint(cache: EngineCache) -> None:
    weights = "9" * 64
    record = build(cache, make_key(model="ckpt-1234abcd"), extra={"webui": {"weights_fingerprint": weights}})
    folder = export(cache, weights=weights[:16])
    assert by_name(cache)[f"onnx/{folder.name}"].engines == (record.name,)
    assert cache.drop_unused_intermediates() == [] and folder.exists()


def test_keep_onnx_false_drops_the_export_but_keeps_engines_and_calibration(cache: EngineCache) -> None:
    record = build(cache, make_key())
    other = build(cache, make_key(component="clip", model="e" * 20))
    folder, calib, other_export = export(cache), calibration(cache), export(cache, "clip", "e" * 16)
    dropped = cache.drop_intermediates_of([record])
    assert [i.name for i in dropped] == [f"onnx/{folder.name}"]
    assert not folder.exists() and calib.exists() and other_export.exists()
    assert cache.list() == sorted([record, other], key=lambda r: r.name)
    with pytest.raises(ValueError, match="not an intermediate"):
        cache.delete_intermediate("../index.json")
    assert cache.delete_intermediate(f"calibration/{calib.name}") is True and not calib.exists()
    assert cache.delete_intermediate(f"calibration/{calib.name}") is False


def test_a_running_build_keeps_what_it_may_read(cache: EngineCache) -> None:
    folder = export(cache)  # no engine yet: unused, but a build of unet is running
    calib = calibration(cache, "clip", "f" * 16)  # a capture writes every component's feeds
    other = export(cache, "vae_decoder", "d" * 16)
    with cache.build_slot(make_key(), timeout=0) as slot:
        assert slot is not None
        items = by_name(cache)
        assert items[f"onnx/{folder.name}"].building and items[f"calibration/{calib.name}"].building
        assert not items[f"onnx/{other.name}"].building
        assert [i.name for i in cache.drop_unused_intermediates()] == [f"onnx/{other.name}"]
        with pytest.raises(EngineError, match="in use by a running build"):
            cache.delete_intermediate(f"onnx/{folder.name}")
        assert folder.exists() and calib.exists()
    # the build ended without an engine: now nothing needs them
    assert {i.name for i in cache.drop_unused_intermediates()} == {f"onnx/{folder.name}", f"calibration/{calib.name}"}


def test_an_export_being_written_is_never_removed(cache: EngineCache) -> None:
    from filelock import FileLock

    folder = export(cache)
    temp = cache.root / "onnx" / f".{folder.name}.tmp-123-abcd"  # ensure_onnx_artifact's temp folder
    temp.mkdir()
    (temp / "model.onnx").write_bytes(b"t" * 50)
    assert by_name(cache)[f"onnx/{folder.name}"].size_bytes == 1002 + 50
    # ensure_onnx_artifact holds this lock while it exports (here: another process, as far as flock goes)
    with FileLock(str(folder) + ".lock"):
        assert cache.drop_unused_intermediates() == []
        assert folder.exists() and temp.exists()
    assert len(cache.drop_unused_intermediates()) == 1
    assert not folder.exists() and not temp.exists()


def test_a_shared_onnx_folder_is_counted_but_never_emptied(cache: EngineCache, tmp_path: Path) -> None:
    shared = tmp_path / "shared-onnx"  # the benchmark links one export folder into each row's cache
    (shared / f"unet.{WEIGHTS}.s{SPEC_VERSION}").mkdir(parents=True)
    (shared / f"unet.{WEIGHTS}.s{SPEC_VERSION}" / "model.onnx").write_bytes(b"g" * 10)
    cache.root.mkdir(parents=True)
    (cache.root / "onnx").symlink_to(shared, target_is_directory=True)
    assert [i.size_bytes for i in cache.intermediates()] == [10]
    assert cache.drop_unused_intermediates() == [] and (shared / f"unet.{WEIGHTS}.s{SPEC_VERSION}").is_dir()


def test_prune_by_size_counts_intermediates_and_drops_them_before_engines(cache: EngineCache) -> None:
    record = build(cache, make_key())
    folder = export(cache, size=5000)
    assert cache.prune(max_bytes=cache.disk_usage().total_bytes) == [] and folder.exists()
    assert cache.prune(max_bytes=record.size_bytes) == []  # the export goes, the engine stays
    assert not folder.exists() and cache.list() == [record]
    export(cache, size=5000)
    assert cache.prune(max_bytes=0) == [record]
    assert cache.disk_usage().total_bytes == 0


# --------------------------------------------------------------------------- verify


def test_flipped_bytes_fail_the_checksum(cache: EngineCache) -> None:
    record = build(cache, make_key())
    path = cache.root / record.name / "data" / "weights.bin"
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="checksum") as info:
        cache.verify(record, arch="sm86", backend_version="1.20.0")
    assert "corrupt" in str(info.value) and "Delete" in str(info.value)


def test_truncated_and_missing_files_fail_verify(cache: EngineCache) -> None:
    record = build(cache, make_key())
    folder = cache.root / record.name
    with open(folder / "model.onnx", "r+b") as fh:
        fh.truncate(3)
    with pytest.raises(EngineError, match="truncated"):
        cache.verify(record, arch="sm86", backend_version="1.20.0")
    (folder / "model.onnx").unlink()
    with pytest.raises(EngineError, match="model.onnx missing"):
        cache.verify(record, arch="sm86", backend_version="1.20.0")


def test_foreign_arch_and_backend_version_fail_verify_naming_both(cache: EngineCache) -> None:
    record = build(cache, make_key(arch="sm86", backend_version="10.5.0"))
    with pytest.raises(EngineError) as info:
        cache.verify(record, arch="sm89", backend_version="10.5.0")
    assert "built for sm86" in str(info.value) and "this device is sm89" in str(info.value)
    assert "rebuild it" in str(info.value)
    with pytest.raises(EngineError) as info:
        cache.verify(record, arch="sm86", backend_version="11.0.1")
    assert "10.5.0" in str(info.value) and "11.0.1" in str(info.value)
    with pytest.raises(EngineError) as info:
        cache.verify(record, arch="sm89", backend_version="11.0.1")
    assert all(s in str(info.value) for s in ("sm86", "sm89", "10.5.0", "11.0.1"))
    cache.verify(record, arch="sm86", backend_version="10.5.0")


def test_mark_bad_persists_and_fails_verify(cache: EngineCache) -> None:
    key = make_key()
    build(cache, key)
    marked = cache.mark_bad(key, "NaN in output at 1024x1024")
    assert marked is not None and marked.status == "bad"
    (cache.root / INDEX_FILE).unlink()  # the status lives in meta.json, not only in the index
    record = cache.get(key)
    assert record is not None and record.status == "bad" and record.bad_reason == "NaN in output at 1024x1024"
    with pytest.raises(EngineError, match="marked bad: NaN in output"):
        cache.verify(record, arch="sm86", backend_version="1.20.0")
    assert cache.mark_bad(make_key(component="clip"), "absent") is None


def test_touch_updates_last_used_in_meta_and_index(cache: EngineCache) -> None:
    key = make_key()
    record = build(cache, key)
    time.sleep(0.02)
    cache.touch(key)
    touched = cache.get(key)
    assert touched is not None and touched.last_used > record.last_used
    assert json.loads((cache.root / key.name / META_FILE).read_text())["last_used"] == touched.last_used
    cache.touch(make_key(component="clip"))  # absent: nothing happens
    assert cache.list() == [touched]


# --------------------------------------------------------------------------- locks, failures

BUILDER = r"""
import json, sys, time
from pathlib import Path
from sd_accel.cache.key import EngineKey
from sd_accel.cache.store import EngineCache

root, me, key = Path(sys.argv[1]), sys.argv[2], EngineKey.from_dict(json.loads(sys.argv[3]))
cache = EngineCache(root)
(root.parent / f"ready-{me}").touch()
while len(list(root.parent.glob("ready-*"))) < 2:  # start both builds at the same moment
    time.sleep(0.005)
out = {"me": me, "t_call": time.time()}
with cache.build_slot(key, timeout=60) as slot:
    out["t_got"] = time.time()
    out["built"] = slot is not None
    if slot is not None:
        (slot.dir / "engine.bin").write_bytes(me.encode() * 1000)
        time.sleep(1.0)
        slot.commit(["engine.bin"], {"x": ((1,), (1,), (2,))}, build_seconds=1.0)
        out["t_commit"] = time.time()
print(json.dumps(out))
"""


def test_two_processes_building_one_key_build_it_once(cache: EngineCache) -> None:
    key = make_key()
    cache.root.mkdir(parents=True)
    procs = [run_python(BUILDER, str(cache.root), me, json.dumps(key.to_dict())) for me in ("a", "b")]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=90)
        assert proc.returncode == 0, stderr
        results.append(json.loads(stdout.strip().splitlines()[-1]))

    builders = [r for r in results if r["built"]]
    waiters = [r for r in results if not r["built"]]
    assert len(builders) == 1 and len(waiters) == 1
    builder, waiter = builders[0], waiters[0]
    assert waiter["t_call"] < builder["t_commit"] <= waiter["t_got"]  # it waited for the build

    records = cache.list()
    assert [r.key for r in records] == [key]
    assert (cache.root / key.name / "engine.bin").read_bytes() == builder["me"].encode() * 1000
    cache.verify(records[0], arch="sm86", backend_version="1.20.0")
    assert leftovers(cache) == [] and lock_is_free(cache, key)


@pytest.mark.parametrize("error", [RuntimeError("builder crashed"), KeyboardInterrupt()])
def test_interrupted_build_leaves_no_temp_and_no_lock(cache: EngineCache, error: BaseException) -> None:
    key = make_key()
    with pytest.raises(type(error)), cache.build_slot(key) as slot:
        assert slot is not None
        (slot.dir / "model.onnx").write_bytes(b"half an engine")
        raise error
    assert leftovers(cache) == [] and cache.list() == [] and not (cache.root / key.name).exists()
    assert lock_is_free(cache, key)
    build(cache, key)  # timeout=0: the next build proceeds at once
    assert [r.key for r in cache.list()] == [key]


def test_build_ended_without_commit_stores_nothing(cache: EngineCache) -> None:
    key = make_key()
    with cache.build_slot(key) as slot:
        assert slot is not None
        (slot.dir / "model.onnx").write_bytes(b"cancelled")
    assert leftovers(cache) == [] and cache.list() == [] and lock_is_free(cache, key)
    with pytest.raises(EngineError, match="closed"):
        slot.commit(["model.onnx"], SHAPES, 0.1)


def test_second_builder_in_one_process_times_out_with_a_clear_error(cache: EngineCache) -> None:
    key = make_key()
    with cache.build_slot(key) as slot:
        assert slot is not None
        started = time.monotonic()
        with pytest.raises(EngineError, match="another process"), cache.build_slot(key, timeout=0.3):
            pass
        assert 0.25 < time.monotonic() - started < 5
        with pytest.raises(EngineError, match="being built or deleted"):
            cache.delete(key, timeout=0)
        (slot.dir / "model.onnx").write_bytes(b"x")
        slot.commit(None, SHAPES, 0.1)
    assert [r.key for r in cache.list()] == [key]


KILLED = r"""
import json, os, sys
from sd_accel.cache.key import EngineKey
from sd_accel.cache.store import EngineCache

cache = EngineCache(sys.argv[1])
with cache.build_slot(EngineKey.from_dict(json.loads(sys.argv[2]))) as slot:
    (slot.dir / "model.onnx").write_bytes(b"half")
    print(slot.dir.name, flush=True)
    os._exit(9)  # killed: no clean-up runs
"""


def test_temp_folder_of_a_killed_build_is_cleaned_by_the_next_build(cache: EngineCache) -> None:
    key = make_key()
    proc = run_python(KILLED, str(cache.root), json.dumps(key.to_dict()))
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 9, stderr
    stale = stdout.strip()
    assert stale.startswith(f".tmp-{key.name}-") and leftovers(cache) == [stale]
    assert cache.list() == [] and cache.broken() == []

    record = build(cache, key)  # timeout=0: the dead process's lock is gone too
    assert leftovers(cache) == [] and cache.list() == [record]


def test_prune_removes_dead_temp_folders_of_other_keys_but_not_live_ones(cache: EngineCache) -> None:
    dead, live = make_key(component="clip"), make_key()
    cache.root.mkdir(parents=True)
    (cache.root / f".tmp-{dead.name}-999999").mkdir()
    (cache.root / f".tmp-{dead.name}-999999" / "x").write_bytes(b"x")
    with cache.build_slot(live) as slot:
        assert slot is not None
        cache.prune()
        assert leftovers(cache) == [slot.dir.name]
    assert leftovers(cache) == []


def test_disk_full_while_writing_raises_clearly_and_keeps_the_cache(cache: EngineCache) -> None:
    key = make_key()
    old = build(cache, key)
    with pytest.raises(EngineError, match="disk is full") as info, cache.build_slot(key, force=True) as slot:
        assert slot is not None
        (slot.dir / "model.onnx").write_bytes(b"x" * 5000)
        raise OSError(errno.ENOSPC, "No space left on device")
    message = str(info.value)
    assert "5.0 KB" in message and "Nothing was stored" in message and "SD_ACCEL_ENGINE_DIR" in message
    assert isinstance(info.value.__cause__, OSError)
    assert cache.list() == [old] and leftovers(cache) == [] and lock_is_free(cache, key)
    cache.verify(old, arch="sm86", backend_version="1.20.0")


def test_disk_full_writing_meta_keeps_the_old_engine(
    cache: EngineCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = make_key()
    old = build(cache, key)
    from sd_accel.cache import slots  # BuildSlot.commit writes meta.json

    real_write = slots.write_json_atomic

    def full_disk_for_meta(path: Path, data: object) -> None:
        if path.name == META_FILE:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(slots, "write_json_atomic", full_disk_for_meta)
    with pytest.raises(EngineError, match="disk is full"), cache.build_slot(key, force=True) as slot:
        assert slot is not None
        (slot.dir / "model.onnx").write_bytes(b"new engine")
        slot.commit(None, SHAPES, 0.1)
    monkeypatch.undo()
    assert cache.list() == [old] and leftovers(cache) == [] and lock_is_free(cache, key)
    cache.verify(old, arch="sm86", backend_version="1.20.0")
    assert (cache.root / key.name / "model.onnx").read_bytes() == b"engine-bytes"


def test_known_need_is_checked_against_free_space_before_building(cache: EngineCache) -> None:
    cache.root.mkdir(parents=True)
    need = shutil.disk_usage(cache.root).free * 10
    with (
        pytest.raises(EngineError, match="Not enough disk space") as info,
        cache.build_slot(make_key(), need_bytes=need),
    ):
        pass
    assert format_size(need) in str(info.value)
    assert leftovers(cache) == [] and lock_is_free(cache, make_key())


# --------------------------------------------------------------------------- prune, delete


def test_prune_by_size_removes_least_recently_used_first(cache: EngineCache) -> None:
    keys = [make_key(component=c) for c in ("unet", "clip", "vae_decoder")]
    sizes = {
        k: build(cache, k, payload=b"x" * n).size_bytes for k, n in zip(keys, (100, 200, 300), strict=True)
    }
    for key in (keys[1], keys[0], keys[2]):  # least recently used: clip, then unet, then vae
        time.sleep(0.02)
        cache.touch(key)

    assert cache.prune(max_bytes=cache.total_size()) == []
    removed = cache.prune(max_bytes=sizes[keys[0]] + sizes[keys[2]])
    assert [r.key for r in removed] == [keys[1]]
    assert [r.key for r in cache.list()] == sorted([keys[0], keys[2]], key=lambda k: k.name)
    removed = cache.prune(max_bytes=sizes[keys[2]] + 1)
    assert [r.key for r in removed] == [keys[0]]
    assert cache.total_size() == sizes[keys[2]] and not (cache.root / keys[0].name).exists()
    assert cache.prune(max_bytes=0)[0].key == keys[2] and cache.list() == []
    with pytest.raises(ValueError):
        cache.prune(max_bytes=-1)


def test_prune_by_age(cache: EngineCache) -> None:
    old = build(cache, make_key(component="clip"))
    time.sleep(0.05)
    new = build(cache, make_key())
    gap = new.last_used - old.last_used
    now = new.last_used + 100

    assert cache.prune(older_than_s=100 + gap + 1, now=now) == []
    assert cache.prune(older_than_s=100 + gap / 2, now=now) == [old]
    assert cache.list() == [new]


def test_delete_by_name_and_by_key(cache: EngineCache) -> None:
    by_name = build(cache, make_key())
    by_key = build(cache, make_key(component="clip"))
    kept = build(cache, make_key(component="vae_decoder"))

    assert cache.delete(by_name.name) is True
    assert cache.delete(by_key.key) is True
    assert cache.delete(by_key.key) is False
    assert cache.list() == [kept] and leftovers(cache) == []
    assert list(json.loads((cache.root / INDEX_FILE).read_text())["engines"]) == [kept.name]
    assert not (cache.root / by_name.name).exists() and not (cache.root / by_key.name).exists()
    for bad_name in ("../etc", "onnx", ".locks", ""):
        with pytest.raises(ValueError):
            cache.delete(bad_name)


# --------------------------------------------------------------------------- helpers


def test_default_engine_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SD_ACCEL_ENGINE_DIR", str(tmp_path / "from-env"))
    assert default_engine_dir() == tmp_path / "from-env"
    assert EngineCache().root == tmp_path / "from-env"
    monkeypatch.delenv("SD_ACCEL_ENGINE_DIR")
    monkeypatch.chdir(tmp_path)
    assert default_engine_dir() == tmp_path / "engines"
    assert EngineCache().root == tmp_path / "engines"
    assert EngineCache("rel").root == tmp_path / "rel"


def test_record_round_trips_through_json() -> None:
    record = EngineRecord(
        make_key(), ["a.plan"], SHAPES, "sha256:00", 10, 1.0, 2.0, 3.0, VALIDATION, "ok", None, {"k": [1]}
    )
    assert EngineRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    for bad in ({}, {**record.to_dict(), "status": "maybe"}, {**record.to_dict(), "files": ["../x"]}):
        with pytest.raises(ValueError, match="not an engine record"):
            EngineRecord.from_dict(bad)


# --------------------------------------------------------------------------- intermediates of real builds


@pytest.mark.slow
def test_a_real_int8_build_then_deleting_every_engine_leaves_no_hidden_data(tmp_path: Path, tiny_sd15) -> None:
    from sd_accel import build_engines

    (record,) = build_engines(tiny_sd15, profiles=[dict(batch=1, height=64, width=64)], backend="onnxruntime",
                              precision="int8", components=["unet"], engine_dir=tmp_path, progress=False)
    cache = EngineCache(tmp_path)
    items = {f"{i.kind}:{i.component}": i for i in cache.intermediates()}
    assert items["onnx:unet"].engines == (record.name,) and items["onnx:unet"].size_bytes > 0
    assert items["calibration:unet"].engines == (record.name,)
    # one capture records every component's feeds: those with no engine are unused
    assert items["calibration:clip"].unused and items["calibration:vae_decoder"].unused
    usage = cache.disk_usage()
    assert usage.intermediates_bytes == sum(i.size_bytes for i in items.values()) > 0
    assert usage.total_bytes == record.size_bytes + usage.intermediates_bytes

    assert cache.delete(record.name)
    assert cache.intermediates() == [] and cache.disk_usage().total_bytes == 0
    kept = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size and p.name != INDEX_FILE]
    assert kept == [], kept  # no ONNX, no calibration data, no engine: only empty lock files


@pytest.mark.slow
def test_keep_onnx_false_keeps_no_export_and_the_engine_still_runs(tmp_path: Path, tiny_sd15) -> None:
    import torch

    from sd_accel import AccelConfig, accelerate, build_engines, stats

    (record,) = build_engines(tiny_sd15, profiles=[dict(batch=1, height=64, width=64)], backend="onnxruntime",
                              components=["vae_decoder"], engine_dir=tmp_path, progress=False, keep_onnx=False)
    cache = EngineCache(tmp_path)
    assert cache.list() == [record] and cache.intermediates() == []
    pipe = accelerate(tiny_sd15, AccelConfig(engines=True, backend="onnxruntime", engine_dir=str(tmp_path)))
    try:
        pipe("a cat", num_inference_steps=1, height=64, width=64, generator=torch.Generator().manual_seed(0))
        assert stats(pipe)["vae_decoder"]["engine_calls"] == 1
    finally:
        accelerate(pipe, AccelConfig())  # give the session-scoped pipeline its torch modules back
