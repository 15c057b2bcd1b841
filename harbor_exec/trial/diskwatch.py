"""The agent phase's disk budget: a watch that stops the agent once it wrote too much.

Docker's overlay2 on ext4 cannot cap a container's writable layer, so the budget is
kept from outside: while the agent runs, a thread asks the runtime what the
container wrote (``ContainerRuntime.disk_usage``: cheap between bounded walks) every
``interval_sec``; past the budget it kills every process of the agent phase
(``stop_processes``), which ends the agent's command, and the trial records
``DiskBudgetExceededError``. The host's disk use is then bounded by the budget
plus what the agent wrote in one interval (and one walk), until the container is
removed at teardown.
"""

from __future__ import annotations

import contextlib
import threading
from types import TracebackType

from harbor_exec.errors import HarborExecError
from harbor_exec.sandbox.runtime import ContainerRuntime, DiskUsage

#: How often the watch asks; each ask is one ``statvfs`` unless a walk is due.
DISK_WATCH_INTERVAL_SEC = 0.1


class DiskWatch:
    """Watches one container during the agent phase (a context manager)."""

    def __init__(
        self,
        runtime: ContainerRuntime,
        container_id: str,
        budget_bytes: int,
        *,
        interval_sec: float = DISK_WATCH_INTERVAL_SEC,
    ) -> None:
        self.runtime = runtime
        self.container_id = container_id
        self.budget_bytes = budget_bytes
        self.interval_sec = interval_sec
        #: The count that crossed the budget (None: it was kept).
        self.exceeded: DiskUsage | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hx-disk-watch", daemon=True)

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        # The first ask waits one interval: a short agent never pays for a walk.
        while not self._stop.wait(self.interval_sec):
            try:
                usage = self.runtime.disk_usage(self.container_id, budget_bytes=self.budget_bytes)
            except (HarborExecError, OSError):
                return  # the engine's trouble shows in the agent's own command
            if usage is None:
                return  # this engine cannot tell: no budget is kept
            if usage.bytes_used > self.budget_bytes or usage.incomplete:
                self.exceeded = self.exceeded or usage
                # A failure here shows again in the trial's own stop after the phase.
                # Not the last ask: an agent that runs several commands is stopped
                # again each interval until its phase ends.
                with contextlib.suppress(HarborExecError, OSError):
                    self.runtime.stop_processes(self.container_id)


__all__ = ["DISK_WATCH_INTERVAL_SEC", "DiskWatch"]
