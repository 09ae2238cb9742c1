"""Model files on disk: the cache root, the cross-process lock for building a cache entry, and
the error for a model file that cannot be found.

Cache entries (an assembled GGUF file, a GGUF converted to a HF directory) are published by one
atomic rename of a complete temporary beside them, so a reader sees either no entry or a whole
one. Building an entry holds ``entry_lock`` (an ``flock`` on a lock file beside it), so two
processes on one node (two replicas, two TP ranks) build it once, and nobody removes an entry
another process may be reading. Lock files are never deleted: deleting one lets a third process
lock a fresh file while the second still holds the old one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_root() -> Path:
    root = os.environ.get("ASPIRE_RAY_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "aspire_ray"


@contextlib.contextmanager
def entry_lock(entry: Path) -> Iterator[None]:
    """Hold the exclusive lock for building ``entry`` (blocks while another process holds it)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(entry.parent / f".{entry.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def fsync_path(path: Path) -> None:
    """fsync a file or directory (a directory: so that a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_prefix(entry: Path) -> str:
    """Name prefix of the temporaries that build ``entry`` (beside it, hidden)."""
    return f".{entry.name}.tmp-"
