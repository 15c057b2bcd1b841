"""How much a container has written to the host's disk, measured from the host, cheaply.

Docker's overlay2 on ext4 cannot bound a container's writable layer
(``--storage-opt size`` needs xfs with project quotas), so a trial's disk budget is
kept by watching: the writable layer is one host directory (the overlay's upper
dir; ``/logs`` lives in it too), and ``WritableLayer.usage`` counts it.

Counting is a walk of that directory, which the agent shaped: it may hold a
million empty files or a path deeper than ``PATH_MAX``. So a walk is bounded (it
stops once past the budget, or past ``max_entries`` entries, and reports the
layer as over budget when it cannot finish), and walks are rare: between them a
``statvfs`` of the host filesystem (one syscall) bounds how much anything wrote
since the last walk, and a new walk runs only when that could have crossed the
budget, or when the last walk is old. Standard library only.

Residual: an agent may write about one watch interval's worth past its budget
before it is stopped (``harbor_exec.trial.diskwatch``); a layer of a million empty
files is stopped as over budget rather than walked further.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from harbor_exec.sandbox.runtime import DiskUsage

#: Entries one walk visits at most (also a bound on the host inodes a trial may use).
MAX_ENTRIES = 500_000  # about a second to walk
#: A walk is repeated this often however quiet the filesystem looks (another trial
#: freeing space would hide this one's growth from statvfs) ...
_REWALK_SEC = 10.0
#: ... or, for a big layer, every this many times the walk's own cost, so that a
#: quiet container's watch costs at most a few percent of a core.
_COST_FACTOR = 20.0


@dataclass
class WritableLayer:
    """A container's writable layer (a host directory), measured by bounded walks."""

    directory: Path
    max_entries: int = MAX_ENTRIES
    _last: DiskUsage | None = field(default=None, init=False)
    _free_at_walk: int = field(default=0, init=False)
    _walked_at: float = field(default=0.0, init=False)
    _walk_cost: float = field(default=0.0, init=False)

    def usage(self, budget_bytes: int) -> DiskUsage:
        """The layer's use, exact up to ``budget_bytes`` (beyond it: at least that much).

        Between walks the answer is an upper bound: the last walk plus whatever the
        whole filesystem lost since."""
        free = _free_bytes(self.directory)
        now = time.monotonic()
        last = self._last
        if last is not None and not last.incomplete:
            estimate = last.bytes_used + max(0, self._free_at_walk - free)
            since = now - self._walked_at
            # Only a walk may say "over" (the estimate counts other containers' writes
            # too); it resets the estimate, so walks stay rare however busy the disk.
            if estimate <= budget_bytes and since < max(
                _REWALK_SEC, _COST_FACTOR * self._walk_cost
            ):
                return DiskUsage(estimate, last.entries)
        walked = walk(self.directory, stop_above=budget_bytes, max_entries=self.max_entries)
        self._walk_cost = time.monotonic() - now
        self._last, self._free_at_walk, self._walked_at = walked, free, now
        return walked


def _free_bytes(directory: Path) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def walk(root: Path, *, stop_above: int, max_entries: int = MAX_ENTRIES) -> DiskUsage:
    """Allocated bytes under ``root`` (not following links, hard links counted once),
    stopping once past ``stop_above`` bytes or ``max_entries`` entries."""
    total = entries = 0
    seen: set[int] = set()  # inodes with several links
    stack = [os.fspath(root)]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as listing:
                for entry in listing:
                    entries += 1
                    if entries > max_entries:
                        return DiskUsage(total, entries, f"more than {max_entries:,} files")
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed while we looked
                    if info.st_nlink > 1 and not entry.is_dir(follow_symlinks=False):
                        if info.st_ino in seen:
                            continue
                        seen.add(info.st_ino)
                    total += info.st_blocks * 512
                    if total > stop_above:
                        return DiskUsage(total, entries, "past the budget")
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if directory == os.fspath(root):
                raise  # the layer itself: this host cannot measure it at all
            # Below it the agent chose the shape: what cannot be counted is over budget,
            # or an agent could hide its writes from the count.
            if exc.errno == errno.ENAMETOOLONG:
                return DiskUsage(total, entries, "paths too deep to measure")
            return DiskUsage(total, entries, f"cannot be measured: {exc.strerror}")
    return DiskUsage(total, entries)


__all__ = ["MAX_ENTRIES", "WritableLayer", "walk"]
