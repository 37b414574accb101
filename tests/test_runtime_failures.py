"""Run-time failures of an engine: only the engine's own faults mark it bad in the cache; out of
memory, a refused call or an interrupt cost that one call, and the engine serves the next."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from sd_accel.backends.base import BackendInfo
from sd_accel.cache.key import EngineKey
from sd_accel.cache.store import EngineCache
from sd_accel.core import EngineError, EngineFault
from sd_accel.runtime import engines_for
from sd_accel.runtime.selection import SUSPEND_AFTER, classify, out_of_memory

ARCH, VERSION = "cpu-test", "1.0"
SHAPES = {"x": ((1, 3), (2, 3), (4, 3))}
FEED = {"x": torch.ones(2, 3)}
# What ONNX Runtime raises when its arena cannot grow (onnxruntime's RuntimeException text).
ORT_OOM = RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running "
                       "Conv node. Name:'/conv_in/Conv' Status Message: Failed to allocate memory for requested "
                       "buffer of size 2147483648")


class Runner:
    """Doubles its input; ``plan`` lists what each call raises (None: runs)."""

    def __init__(self, shapes, plan: list) -> None:
        self.shapes, self.plan = shapes, plan

    def infer(self, feed):
        if self.plan:
            exc = self.plan.pop(0)
            if exc is not None:
                raise exc
        return {"y": feed["x"] * 2}

    def close(self) -> None:
        pass


class Backend:
    name = "stand-in"

    def __init__(self, plan=(), load_error: BaseException | None = None) -> None:
        self.plan = list(plan)
        self.load_error = load_error
        self.loads = 0

    def info(self) -> BackendInfo:
        return BackendInfo(self.name, VERSION, ARCH, True)

    def load(self, engine_dir: Path, files: list[str], shapes):
        self.loads += 1
        if self.load_error is not None:
            raise self.load_error
        return Runner(shapes, self.plan)


@pytest.fixture
def cache(tmp_path) -> EngineCache:
    return EngineCache(tmp_path / "engines")


def store(cache: EngineCache, profile: str = "p0") -> EngineKey:
    key = EngineKey("weights-a", "unet", Backend.name, VERSION, ARCH, "fp32", profile)
    with cache.build_slot(key, timeout=0) as slot:
        (slot.dir / "engine.bin").write_bytes(key.name.encode())
        slot.commit(["engine.bin"], SHAPES, 0.1)
    return key


@pytest.mark.parametrize("oom", [MemoryError("engine arena"), ORT_OOM,
                                 RuntimeError("std::bad_alloc"), EngineError("CUDA out of memory")])
def test_out_of_memory_skips_that_call_only(cache, caplog, oom):
    key = store(cache)
    engines = engines_for(cache, Backend(plan=[oom]), "weights-a", "unet")
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        assert engines.run(FEED) is None  # this call runs torch
        out = engines.run(FEED)  # the next one runs on the engine again
    torch.testing.assert_close(out["y"], FEED["x"] * 2)
    assert cache.get(key).status == "ok"  # the cache is as it was
    s = engines.stats.to_dict()
    assert (s["engine_calls"], s["torch_calls"]) == (1, 1)
    (skip,) = s["engine_skips"]
    assert key.name in skip and "out of memory" in skip
    assert "out of memory" in next(iter(s["fallbacks"]))
    assert sum("skipped for this call" in r.getMessage() for r in caplog.records) == 1  # once, with the reason
    assert not any("marked bad" in r.getMessage() for r in caplog.records)


def test_out_of_memory_while_loading_is_retried_on_the_next_call(cache):
    key = store(cache)
    backend = Backend(load_error=EngineError("ONNX Runtime could not load the engine (bad allocation: bad_alloc)"))
    engines = engines_for(cache, backend, "weights-a", "unet")
    assert engines.run(FEED) is None
    backend.load_error = None
    assert engines.run(FEED) is not None
    assert backend.loads == 2 and cache.get(key).status == "ok"


def test_an_oom_hands_the_call_to_another_engine_that_covers_it(cache):
    store(cache, "p0")
    store(cache, "p1")
    backend = Backend(plan=[MemoryError()])
    engines = engines_for(cache, backend, "weights-a", "unet")
    out = engines.run(FEED)
    assert out is not None and engines.stats.engine_calls == 1 and engines.stats.torch_calls == 0
    assert sum(engines.stats.engine_skips.values()) == 1
    assert all(r.status == "ok" for r in cache.list())


def test_interrupt_propagates_and_leaves_the_engine_in_use(cache):
    key = store(cache)
    engines = engines_for(cache, Backend(plan=[KeyboardInterrupt()]), "weights-a", "unet")
    with pytest.raises(KeyboardInterrupt):
        engines.run(FEED)
    assert engines.run(FEED) is not None
    assert cache.get(key).status == "ok" and engines.stats.engine_calls == 1


def test_refused_call_skips_and_repeated_failures_set_the_engine_aside_in_this_process_only(cache, caplog):
    key = store(cache)
    refused = EngineError("engine does not cover shapes {'x': (2, 3)}")
    plan = [refused, None] + [ValueError("odd feed")] * SUSPEND_AFTER
    engines = engines_for(cache, Backend(plan=plan), "weights-a", "unet")
    assert engines.run(FEED) is None
    assert engines.run(FEED) is not None  # a good call resets the count
    with caplog.at_level(logging.ERROR, logger="sd_accel"):
        for _ in range(SUSPEND_AFTER):
            assert engines.run(FEED) is None
    (handle,) = engines.handles
    assert handle.broken is not None and "odd feed" in handle.broken
    assert cache.get(key).status == "ok"  # a new process (or engines_for again) tries it again
    assert any("set aside until this process ends" in r.getMessage() for r in caplog.records)
    assert engines_for(cache, Backend(), "weights-a", "unet").run(FEED) is not None


@pytest.mark.parametrize("stage", ["load", "infer"])
def test_the_engines_own_faults_mark_it_bad(cache, stage):
    key = store(cache)
    fault = EngineFault("the engine's inputs ['sample'] are not its record's ['x']")
    backend = Backend(load_error=fault) if stage == "load" else Backend(plan=[fault])
    engines = engines_for(cache, backend, "weights-a", "unet")
    assert engines.run(FEED) is None
    record = cache.get(key)
    assert record.status == "bad" and "inputs" in record.bad_reason
    assert engines.run(FEED) is None and backend.loads == 1  # never loaded again


def test_missing_outputs_are_a_fault(cache):
    key = store(cache)
    engines = engines_for(cache, Backend(), "weights-a", "unet")
    assert engines.run(FEED, need=("latent",)) is None
    assert cache.get(key).status == "bad" and "without ['latent']" in cache.get(key).bad_reason


def test_corrupt_engine_file_is_still_marked_bad(cache):
    key = store(cache)
    (cache.engine_dir(key) / "engine.bin").write_bytes(b"X" * len(key.name))  # same size, other bytes
    engines = engines_for(cache, Backend(), "weights-a", "unet")
    assert engines.run(FEED) is None
    assert cache.get(key).status == "bad" and "checksum" in cache.get(key).bad_reason


def test_fallback_off_still_raises_after_a_skip(cache):
    store(cache)
    engines = engines_for(cache, Backend(plan=[MemoryError()]), "weights-a", "unet", fallback=False)
    with pytest.raises(EngineError, match="out of memory.*fallback is off"):
        engines.run(FEED)
    assert engines.run(FEED) is not None


def test_classify_and_out_of_memory_read_causes():
    try:
        try:
            raise MemoryError()
        except MemoryError as inner:
            raise EngineError("OpenVINO could not load the engine") from inner
    except EngineError as exc:
        wrapped = exc
    assert out_of_memory(wrapped) and classify(wrapped, "load")[0] == "oom"
    assert not out_of_memory(RuntimeError("shape mismatch"))
    assert classify(RuntimeError("shape mismatch"), "load")[0] == "fault"


def test_an_output_the_caller_rejects_counts_as_one_torch_call_only(cache):
    """A decode that gave NaN runs torch: counted once as torch, never as an engine call."""
    key = store(cache)
    engines = engines_for(cache, Backend(), "weights-a", "unet")
    assert engines.run(FEED, need=("y",), check=lambda out: "engine decode produced NaN/inf") is None
    assert (engines.stats.engine_calls, engines.stats.torch_calls) == (0, 1)
    assert not engines.stats.engines_used and engines.stats.fallbacks == {"engine decode produced NaN/inf": 1}
    assert engines.run(FEED, need=("y",), check=lambda out: None) is not None
    assert (engines.stats.engine_calls, engines.stats.engines_used[key.name]) == (1, 1)
