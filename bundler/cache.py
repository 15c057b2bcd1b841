"""The content-addressed cache: where bundles live and how they are published.

The bundler's cache directory is ``<harbor-exec cache>/bundles`` unless a caller
names another (``build_bundle(cache_dir=...)``, ``harbor-exec bundle --cache-dir``);
see ``harbor_exec.cache``. Layout under it::

    bundles/<inputs digest[:32]>/   one bundle (manifest.json, wheel/, wheelhouse/)
    wheels/<tree digest[:32]>/      the project's wheel, built once per source tree
    deps/<key[:32]>/                one dependency wheelhouse, keyed by the requirement set
    runtime/<key[:32]>/             harbor-exec's container-side wheel, keyed by its source
    build-envs/<key[:32]>/          a build environment per [build-system] requires
    tmp/                            work directories; entries are renamed into place
    locks/                          one lock file per entry being made

Entries are immutable once published. Publication is one ``os.rename`` of a
finished directory within the same filesystem, so a reader sees a whole entry
or none, and of two concurrent builders of one entry the loser simply uses the
winner's. Builders of one entry in several processes (two servers, parallel
test workers) take its lock first, so the later ones wait and reuse the entry
instead of making it again.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harbor_exec.cache import BUNDLES, cache_root

__all__ = ["default_cache_dir", "entry_lock", "publish", "work_dir"]

_STALE_WORK_SEC = 24 * 3600.0


def default_cache_dir() -> Path:
    """``<harbor-exec cache>/bundles``: ``$HARBOR_EXEC_CACHE_DIR/bundles``, else
    ``~/.cache/harbor-exec/bundles``."""
    return cache_root() / BUNDLES


def work_dir(cache_dir: Path, prefix: str) -> Path:
    """A fresh directory under ``cache_dir/tmp`` (same filesystem as the entries)."""
    tmp = cache_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    _sweep_stale(tmp)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=tmp))


def _sweep_stale(tmp: Path) -> None:
    # Work dirs of builders that were killed; old enough that nobody uses them.
    cutoff = time.time() - _STALE_WORK_SEC
    for entry in tmp.iterdir():
        try:
            if entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue


def publish(src: Path, dst: Path) -> bool:
    """Move the finished directory ``src`` to ``dst`` atomically.

    Returns False when ``dst`` already existed (another builder won the race);
    ``src`` is then left for the caller to discard.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(src, dst)
    except OSError:
        if dst.is_dir():
            return False
        raise
    return True


@contextmanager
def entry_lock(cache_dir: Path, kind: str, key: str) -> Iterator[None]:
    """Hold the lock of one cache entry (an exclusive ``flock``: released by the
    kernel when the holder dies, so a killed builder never blocks the next)."""
    locks = cache_dir / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{kind}-{key[:32]}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
