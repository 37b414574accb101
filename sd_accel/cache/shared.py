"""Weights shared across engines: one copy on disk of each distinct weight file, however many
engines hold it.

Engines of the same component and weights differ in their compiled graph (a static and a
dynamic profile, the residual-taking UNet beside the plain one), not in their weights: an
OpenVINO engine's ``engine.bin`` (1.7 GB for SD 1.5's UNet in bf16) is byte for byte the same in
each. So once a build is committed, the large weight files its backend names
(``Backend.weights_files``) are stored by content::

    <root>/weights/<sha256>.bin        one file per distinct content
    <root>/<engine>/engine.bin         a hard link to it: the same inode, no second copy

An engine reads its files as before (a hard link *is* the file: an engine folder with a plain
file, from before this layout or where links cannot be made, is as valid); its record, size and
checksum are unchanged. Deleting an engine removes its link; the stored file stays while another
engine links it. A stored file whose link count is 1 is held by the store alone (its last engine
is gone): ``delete`` and ``prune`` remove it (:meth:`SharedWeights.drop_orphan_weights`). Disk
use counts each inode once (:func:`unique_bytes`).

**Never write an engine file in place**: with its weights shared, the bytes are every linking
engine's. A writer (a refit patching weights) writes a copy, or first calls :func:`unshare`.

Where a hard link cannot be made (another filesystem: an engine folder that is a link elsewhere,
a filesystem without hard links), the engine keeps its own copy and nothing is stored.

>>> import tempfile
>>> from sd_accel.cache.store import EngineCache
>>> cache = EngineCache(tempfile.mkdtemp())
>>> a, b = cache.root / "a", cache.root / "b"
>>> for folder in (a, b):
...     folder.mkdir()
...     _ = (folder / "engine.bin").write_bytes(b"the same weights")
>>> cache.share_weights(a, ["engine.bin"]), cache.share_weights(b, ["engine.bin"])
(1, 1)
>>> (a / "engine.bin").stat().st_ino == (b / "engine.bin").stat().st_ino, unique_bytes([a / "engine.bin", b / "engine.bin"])
(True, 16)
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import filecmp
import hashlib
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from ..core import EngineError
from ..units import format_size
from .folder import INDEX_LOCK_WAIT_S, LOCK_DIR, CacheFolder, logger

WEIGHTS_DIR = "weights"  # under the cache root: <sha256>.bin, each linked into the engines that hold it
SUFFIX = ".bin"
_CHUNK = 8 << 20
# errors that say "no hard link here" (another filesystem, no link support, a link count at its limit)
_NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES})


def sha256_of(path: Path) -> str:
    """The file's sha256 (hex), streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def unique_bytes(paths: Iterable[Path]) -> int:
    """Bytes of ``paths`` with each inode counted once (hard links to one file count once);
    files that are gone count 0."""
    seen: dict[tuple[int, int], int] = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def _is_stored_name(name: str) -> bool:
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else ""
    return len(stem) == 64 and all(c in "0123456789abcdef" for c in stem)


class SharedWeights(CacheFolder):
    """The content-addressed weight store under ``<root>/weights`` (see the module's docstring)."""

    # A part of EngineCache (the facade in store.py): its methods call the other parts'
    # through ``self``.

    @property
    def weights_dir(self) -> Path:
        """``<root>/weights``: one ``<sha256>.bin`` per distinct weight file the engines hold."""
        return self.root / WEIGHTS_DIR

    def share_weights(self, folder: Path, names: Iterable[str]) -> int:
        """Store each of ``names`` (files in ``folder``, an engine's or a build's) by content and
        make it a hard link to the stored file: the one already stored with the same bytes, or
        this file, which becomes the stored one. A name that is not a file there is skipped; where
        no link can be made the file stays as it is. Returns how many files are now links to the
        store. Never raises for what only costs the saving (it is logged)."""
        shared = 0
        for name in names:
            path = Path(folder) / name
            if not path.is_file() or path.is_symlink():
                continue
            try:
                if self._share_one(path):
                    shared += 1
            except (OSError, EngineError) as exc:  # (a store lock held too long: EngineError)
                logger.warning("could not share %s through %s (%s): the engine keeps its own copy",
                               path, self.weights_dir, exc)
        return shared

    def _share_one(self, path: Path) -> bool:
        digest = sha256_of(path)
        stored = self.weights_dir / f"{digest}{SUFFIX}"
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        with self._weights_lock(INDEX_LOCK_WAIT_S):
            if stored.is_file():
                st, mine = stored.stat(), path.stat()
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    return True
                # Bytes compared, not only the name: a stored file changed in place (by hand) must
                # never become a new engine's weights.
                if st.st_size == mine.st_size and filecmp.cmp(stored, path, shallow=False):
                    return self._link_in(stored, path)
                logger.warning("%s does not hold what its name says (changed in place?); storing %s in its place",
                               stored, path)
                stored.unlink()
            try:
                os.link(path, stored)  # this file becomes the stored one (no copy)
            except OSError as exc:
                if exc.errno in _NO_LINK:
                    logger.info("%s: no hard link possible to %s (%s); the engine keeps its own copy",
                                path, self.weights_dir, exc.strerror)
                    return False
                raise
            logger.debug("stored %s as %s", path, stored.name)
            return True

    def _link_in(self, stored: Path, path: Path) -> bool:
        """Replace ``path`` with a link to ``stored`` (same bytes), atomically."""
        tmp = path.with_name(f".{path.name}.link-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        try:
            os.link(stored, tmp)
        except OSError as exc:
            if exc.errno in _NO_LINK:
                logger.info("%s: no hard link possible from %s (%s); the engine keeps its own copy",
                            path, stored, exc.strerror)
                return False
            raise
        try:
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        logger.info("%s shares its weights with other engines (%s, one copy on disk)", path.parent.name,
                    format_size(stored.stat().st_size))
        return True

    def share_existing(self, weights_files: Callable[[str], Iterable[str]] | None = None) -> int:
        """Share the weight files of engines already in the cache (built before this layout, or
        where a link failed then): each engine's files that its backend names
        (``weights_files(backend)``, default the registry's :func:`~sd_accel.backends.registry.weights_files`)
        and that no other engine links yet, under the engine's lock (an engine being built or
        deleted is skipped). The bytes stay the same, so each record stays valid. :meth:`prune`
        calls this. Returns how many files became links to the store."""
        if weights_files is None:
            from ..backends.registry import weights_files as registry_files

            weights_files = registry_files
        names_of: dict[str, set[str]] = {}
        shared = 0
        for record in self.list():
            backend = record.key.backend
            if backend not in names_of:
                names_of[backend] = set(weights_files(backend))
            folder = self.engine_dir(record.name)
            todo = []
            for name in record.files:
                with contextlib.suppress(OSError):
                    if name in names_of[backend] and (folder / name).stat().st_nlink == 1:
                        todo.append(name)
            if not todo:
                continue
            try:
                lock = self._acquire(record.name, 0, "share the weights of")
            except EngineError:
                continue
            try:
                shared += self.share_weights(folder, todo)
            finally:
                lock.release()
        return shared

    def stored_weights(self) -> builtins.list[Path]:
        """Every ``<sha256>.bin`` in the store."""
        folder = self.weights_dir
        if not folder.is_dir():
            return []
        return sorted(p for p in folder.iterdir() if p.is_file() and _is_stored_name(p.name))

    def orphan_weights(self) -> builtins.list[Path]:
        """Stored files no engine links any more (link count 1: the store's own)."""
        out = []
        for path in self.stored_weights():
            with contextlib.suppress(OSError):
                if path.stat().st_nlink <= 1:
                    out.append(path)
        return out

    def drop_orphan_weights(self) -> builtins.list[tuple[Path, int]]:
        """Remove the stored files no engine links (:meth:`orphan_weights`), and what a crash left
        in the store; returns (path, bytes) of each removed. :meth:`delete` and :meth:`prune` call
        this."""
        if not self.weights_dir.is_dir():
            return []
        removed = []
        try:
            with self._weights_lock(0):
                for path in self.orphan_weights():
                    try:
                        size = path.stat().st_size
                        if path.stat().st_nlink > 1:
                            continue
                        path.unlink()
                    except OSError:
                        continue
                    logger.info("removed %s (weights no engine holds any more, %s)", path.name, format_size(size))
                    removed.append((path, size))
        except EngineError:  # a build is sharing right now: the next delete or prune removes them
            logger.info("the weight store %s is busy; orphaned weights are left for the next prune", self.weights_dir)
        return removed

    def orphan_weights_bytes(self) -> int:
        return unique_bytes(self.orphan_weights())

    @contextlib.contextmanager
    def _weights_lock(self, timeout: float) -> Iterator[None]:
        (self.root / LOCK_DIR).mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.root / LOCK_DIR / "weights.lock")
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise EngineError(f"The weight store lock {lock.lock_file} stayed busy for {timeout} s.") from None
        try:
            yield
        finally:
            lock.release()


def unshare(path: Path) -> bool:
    """Make ``path`` a file of its own (a copy, swapped in atomically) when it is linked elsewhere
    (a weight file shared with other engines), so that it can be written in place without changing
    theirs. Returns whether it copied."""
    path = Path(path)
    if os.stat(path).st_nlink <= 1:
        return False
    tmp = path.with_name(f".{path.name}.own-{os.getpid()}")
    try:
        shutil.copyfile(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True
