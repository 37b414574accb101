"""The sha256 of model files, remembered in the engine folder (hashing 2-7 GB takes seconds).

Engines of the WebUI, ComfyUI and a pipeline loaded from a single file are keyed by the
checkpoint's short sha256 (``ckpt-<10 hex>``, A1111's "short hash"); the memo
(``file-hashes.json``: path, size and mtime -> sha256) lets each face name a file it has seen
before without reading it again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MEMO = "file-hashes.json"


def file_hash(path: str | Path, cache_dir: Path | None = None) -> str:
    """sha256 of a file (hex), remembered in ``cache_dir`` by path, size and mtime.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "model.safetensors").write_bytes(b"abc")      # a checkpoint, say
    >>> file_hash(folder / "model.safetensors", folder)[:10]
    'ba7816bf8f'
    >>> (folder / MEMO).exists()                                    # hashed once, remembered here
    True
    """
    path = Path(path)
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}"
    store = Path(cache_dir) / MEMO if cache_dir is not None else None
    known: dict[str, str] = {}
    if store is not None and store.is_file():
        try:
            known = json.loads(store.read_text())
        except (OSError, ValueError):
            known = {}
    if key in known:
        return known[key]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    value = digest.hexdigest()
    if store is not None:
        known[key] = value
        try:  # a memo only: a read-only or full disk costs the next caller a re-hash, nothing else
            store.parent.mkdir(parents=True, exist_ok=True)
            tmp = store.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1))
            tmp.replace(store)
        except OSError:
            pass
    return value


def checkpoint_id(path: str | Path, cache_dir: Path | None = None) -> str:
    """``ckpt-<first 10 hex of the sha256>``: how every face names a checkpoint file's weights."""
    return f"ckpt-{file_hash(path, cache_dir)[:10]}"


__all__ = ["MEMO", "checkpoint_id", "file_hash"]
