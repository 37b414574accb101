"""The runtime's public entry (``sd_accel.runtime.engines_for``) on a real engine cache, with a
stand-in backend: which engines load, what is refused and said, fallback switching, reloading."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sd_accel.backends.base import BackendInfo
from sd_accel.cache.key import EngineKey
from sd_accel.cache.store import EngineCache
from sd_accel.core import EngineError
from sd_accel.runtime import engines_for, refusal, set_fallback
from sd_accel.runtime.modules import EngineUNet

ARCH, VERSION = "cpu-test", "1.0"
SHAPES = {"x": ((1, 3), (2, 3), (4, 3))}  # batch 1..4 of 3 values
OTHER = {"x": ((1, 5), (1, 5), (1, 5))}


class Runner:
    """Doubles its input; counts how often it was loaded and closed."""

    def __init__(self, shapes, log: list) -> None:
        self.shapes, self.log = shapes, log
        log.append("load")

    def infer(self, feed):
        return {"y": feed["x"] * 2, "latent": feed["x"] * 2}

    def close(self) -> None:
        self.log.append("close")


class Backend:
    name = "stand-in"

    def __init__(self) -> None:
        self.log: list[str] = []

    def info(self) -> BackendInfo:
        return BackendInfo(self.name, VERSION, ARCH, True)

    def load(self, engine_dir: Path, files: list[str], shapes):
        return Runner(shapes, self.log)


def store(cache: EngineCache, shapes=SHAPES, **changes) -> EngineKey:
    fields = {"model": "weights-a", "component": "unet", "backend": Backend.name, "backend_version": VERSION,
              "arch": ARCH, "precision": "fp32", "profile": f"p{len(cache.list())}"}
    fields.update(changes)
    key = EngineKey(**fields)
    with cache.build_slot(key, timeout=0) as slot:
        (slot.dir / "engine.bin").write_bytes(key.name.encode())
        slot.commit(["engine.bin"], shapes, 0.1)
    return key


@pytest.fixture
def cache(tmp_path) -> EngineCache:
    return EngineCache(tmp_path / "engines")


def test_engines_for_loads_only_usable_engines_of_that_id_and_component(cache, caplog):
    good = store(cache)
    store(cache, model="weights-b")
    store(cache, component="vae_decoder")
    store(cache, backend="other-backend")
    foreign = store(cache, arch="sm86")
    old = store(cache, backend_version="0.9")
    bad = store(cache, precision="fp16")
    cache.mark_bad(bad, "NaN in output")

    told: list[str] = []
    engines = engines_for(cache, Backend(), "weights-a", "unet", on_refused=told.append)
    assert [h.name for h in engines.handles] == [good.name]
    # the refused ones of this id and component are said, each with what to do
    assert len(told) == 3
    assert any(foreign.name in t and "sm86" in t and "rebuild" in t for t in told)
    assert any(old.name in t and "0.9" in t for t in told)
    assert any(bad.name in t and "NaN in output" in t and "delete" in t for t in told)
    # without a listener, refusals are logged warnings
    with caplog.at_level(logging.WARNING, logger="sd_accel"):
        engines_for(cache, Backend(), "weights-a", "unet")
    assert sum("not loading engine" in r.getMessage() for r in caplog.records) == 3
    # nothing for an id without engines: an empty set that falls back
    assert engines_for(cache, Backend(), "weights-c", "unet").handles == []


def test_refusal_names_backend_arch_version_and_status(cache):
    info = Backend().info()
    ok = cache.get(store(cache))
    assert refusal(ok, info) is None
    other = cache.get(store(cache, backend="other-backend"))
    assert "other-backend engine" in refusal(other, info)
    assert "this machine is cpu-test / 1.0" in refusal(cache.get(store(cache, arch="sm89")), info)


def test_fallback_switch_and_reload(cache):
    store(cache)
    backend = Backend()
    engines = engines_for(cache, backend, "weights-a", "unet", fallback=False)
    covered, outside = {"x": torch.ones(2, 3)}, {"x": torch.ones(5, 3)}
    torch.testing.assert_close(engines.run(covered)["y"], torch.full((2, 3), 2.0))
    with pytest.raises(EngineError, match="fallback is off"):
        engines.run(outside)
    engines.set_fallback(True)
    assert engines.run(outside) is None  # the caller runs torch
    assert (engines.stats.engine_calls, engines.stats.torch_calls) == (1, 1)
    assert "no engine covers x=(5, 3)" in next(iter(engines.stats.fallbacks))
    old = engines.reset_stats()
    assert old.engine_calls == 1 and engines.stats.engine_calls == 0

    # close drops the loaded runner; the next call loads it again
    assert backend.log == ["load"]
    engines.close()
    assert backend.log == ["load", "close"] and all(h.runner is None for h in engines.handles)
    engines.run(covered)
    assert backend.log == ["load", "close", "load"]

    # an engine built since: a new engines_for picks it up
    store(cache, shapes=OTHER)
    again = engines_for(cache, backend, "weights-a", "unet")
    assert len(again.handles) == 2
    torch.testing.assert_close(again.run({"x": torch.ones(1, 5)})["y"], torch.full((1, 5), 2.0))


def test_subset_shares_counters_and_fallback_setting(cache):
    store(cache)
    store(cache, shapes=OTHER)
    engines = engines_for(cache, Backend(), "weights-a", "unet", fallback=False)
    small = engines.subset(lambda h: h.shapes["x"][2][1] == 3)
    assert len(small.handles) == 1 and not small.fallback_allowed
    small.run({"x": torch.ones(1, 3)})
    assert engines.stats.engine_calls == 1  # one set of counters for both


def test_set_fallback_reaches_every_swapped_module(cache):
    store(cache)
    engines = engines_for(cache, Backend(), "weights-a", "unet", fallback=True)
    pipe = SimpleNamespace(unet=EngineUNet(torch.nn.Linear(1, 1), {"unet": engines}), vae=None)
    set_fallback(pipe, False)
    assert engines.fallback_allowed is False
    set_fallback(pipe, True)
    assert engines.fallback_allowed is True


def test_webui_engines_cut_batches_and_switch_fallback_on_both_sets(cache):
    from sd_accel.webui.runner import LdmEngines

    shapes = {"x": ((1, 4, 8, 8), (2, 4, 8, 8), (4, 4, 8, 8)), "timesteps": ((1,), (2,), (4,)),
              "context": ((1, 77, 8), (2, 77, 8), (4, 77, 8))}
    store(cache, shapes=shapes, component="ldm_unet")
    engines = LdmEngines("weights-a", engines_for(cache, Backend(), "weights-a", "ldm_unet"))
    x, t, ctx = torch.randn(6, 4, 8, 8), torch.tensor([3.0]), torch.randn(6, 77, 8)

    def torch_part(part: slice) -> torch.Tensor:
        raise AssertionError(f"no torch call expected, got {part}")

    torch.testing.assert_close(engines(x, t, ctx, None, torch_part), x * 2)
    assert engines.stats.engine_calls == 2  # 6 rows: 4 + 2, each covered
    engines.set_fallback(False)
    with pytest.raises(EngineError, match="fallback is off"):
        engines(torch.randn(1, 4, 16, 16), t, torch.randn(1, 77, 8), None, torch_part)
    engines.set_fallback(True)
    out = engines(torch.randn(1, 4, 16, 16), t, torch.randn(1, 77, 8), None, lambda part: torch.zeros(1))
    assert out.shape == (1,) and engines.stats.torch_calls == 1
