"""harbor-exec's one cache directory, and what lives in it.

``$HARBOR_EXEC_CACHE_DIR``, else ``~/.cache/harbor-exec``. Everything harbor-exec
caches on the host is below it, one subdirectory a kind::

    bundles/      workflow bundles, their dependency wheelhouses and harbor-exec's
                  container-side wheel (harbor_exec.bundler; layout in docs/bundles.md)
    snapshots/    checked copies of task directories, named by content hash
    git-tasks/    git tasks checked out at their commit (harbor_exec.sources.git)
    build-logs/   the whole log of each image build, ``<tag>.log``

Every entry is rebuilt on demand, so the directory can be removed whenever no
harbor-exec process is running.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["BUILD_LOGS", "BUNDLES", "CACHE_ENV", "SNAPSHOTS", "cache_root"]

CACHE_ENV = "HARBOR_EXEC_CACHE_DIR"
BUNDLES = "bundles"
SNAPSHOTS = "snapshots"
BUILD_LOGS = "build-logs"


def cache_root() -> Path:
    """``$HARBOR_EXEC_CACHE_DIR`` (``~`` expanded), else ``~/.cache/harbor-exec``."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "harbor-exec"
