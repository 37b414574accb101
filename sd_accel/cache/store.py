"""The engine cache: engine folders on disk, an index rebuilt from them, and the locks.

What one engine's record holds, and its checksum, is :mod:`sd_accel.cache.record`; where the
root is by default, :func:`sd_accel.paths.default_engine_dir`.

Layout under the root::

    <root>/index.json                  {"schema": 1, "engines": {name: meta}}: a cache of the metas
    <root>/<key.name>/meta.json        the truth for one engine (an EngineRecord)
    <root>/<key.name>/<engine files>   whatever names the backend wrote
    <root>/.locks/<key.name>.lock      held while that engine is built or deleted
    <root>/.locks/index.lock           held for each index / meta.json update (milliseconds)
    <root>/.tmp-<key.name>-<pid>/      a build in progress; renamed into place on commit
    <root>/weights/<sha256>.bin        large weight files by content (an OpenVINO engine's engine.bin),
                                       hard-linked into every engine folder that holds them: one
                                       copy on disk across profiles (:mod:`sd_accel.cache.shared`)
    <root>/onnx/, <root>/calibration/  intermediates other modules write (ONNX exports, int8
                                       calibration data): counted, and removed when no engine
                                       needs them (:mod:`sd_accel.cache.intermediates`)
    anything else                      never listed, never pruned

``meta.json`` is what counts: the index is only a fast path, and it is rebuilt from the
folders whenever it is missing, unreadable, of another schema or out of step with them.

A build, as a backend makes one (here the engine file is written by hand):

>>> import tempfile
>>> from sd_accel.cache.key import EngineKey
>>> cache = EngineCache(tempfile.mkdtemp())                           # e.g. EngineCache("engines")
>>> key = EngineKey("0123456789abcdef", "unet", "onnxruntime", "1.32.0", "cpu-x86_64-avx512", "fp32",
...                 "static.b1.h64.w64.t77")
>>> shapes = {"sample": ((2, 4, 8, 8),) * 3}
>>> with cache.build_slot(key) as slot:
...     if slot is not None:                  # None: another process built it while we waited
...         _ = (slot.dir / "model.onnx").write_bytes(b"engine")   # files = backend.build(..., slot.dir, ...)
...         _ = slot.commit(["model.onnx"], shapes, build_seconds=12.5, validation={"ok": True})
>>> record = cache.get(key)
>>> cache.verify(record, arch="cpu-x86_64-avx512", backend_version="1.32.0")   # raises unless it can load here
>>> [r.key.component for r in cache.find(component="unet", backend="onnxruntime")]
['unet']
>>> cache.disk_usage().describe()
'1 engine, 6 B = 6 B'
>>> cache.delete(record.name), cache.list()
(True, [])
"""

from __future__ import annotations

from .folder import (
    DEFAULT_BUILD_WAIT_S,
    DEFAULT_DELETE_WAIT_S,
    INDEX_FILE,
    INDEX_SCHEMA,
    LOCK_DIR,
    RESERVED,
    CacheFolder,
)
from .index import EngineIndex
from .kept import DiskUsage, KeptIntermediates
from .record import BrokenEngine, EngineRecord
from .removal import Removal
from .shared import SharedWeights
from .slots import BuildSlot, BuildSlots


class EngineCache(KeptIntermediates, Removal, BuildSlots, SharedWeights, EngineIndex, CacheFolder):
    """Engine files on disk under ``root`` (default :func:`sd_accel.paths.default_engine_dir`).

    Every method reads the disk afresh (no state is shared between instances or processes),
    so several processes may use one cache at once.

    >>> import tempfile
    >>> cache = EngineCache(tempfile.mkdtemp())                       # e.g. EngineCache("engines")
    >>> [r.name for r in cache.find(component="unet", arch="sm89")]   # none yet; once built, e.g.
    []

    ``['unet.sm89.fp16.static.b2.h512.w512.t77.tensorrt-10.5.0.0123456789ab.s1']``.

    The facade over the cache's parts, one module each: the root and its locks
    (:mod:`~sd_accel.cache.folder`), the index (:mod:`~sd_accel.cache.index`), build slots and
    install (:mod:`~sd_accel.cache.slots`), delete and prune (:mod:`~sd_accel.cache.removal`), the
    weights shared across engines (:mod:`~sd_accel.cache.shared`), and the intermediates
    (:mod:`~sd_accel.cache.kept`).
    """


__all__ = [
    "DEFAULT_BUILD_WAIT_S",
    "DEFAULT_DELETE_WAIT_S",
    "INDEX_FILE",
    "INDEX_SCHEMA",
    "LOCK_DIR",
    "RESERVED",
    "BrokenEngine",
    "BuildSlot",
    "DiskUsage",
    "EngineCache",
    "EngineRecord",
]
