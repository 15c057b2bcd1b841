"""Server-side bookkeeping of admitted rollouts: leases, long-poll waits, retention.

Everything here runs on the event loop thread and is synchronous except the
long-poll wait, so admission needs no lock. Timers are shared: one timer
handle for all lease deadlines (a heap) and one for retention (a FIFO, since
retention is constant and rollouts finish in time order). A lease renewal only
moves a float; nothing is rescheduled per poll and no task exists per rollout
besides the execution task itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import hmac
import itertools
import secrets
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Final

from harbor_exec.errors import HarborExecError
from harbor_exec.protocol import TERMINAL_STATUSES, RolloutErrorCategory, RolloutStatus

__all__ = ["DuplicateRolloutError", "FinalResult", "RolloutEntry", "RolloutRegistry"]

# Rebuild the lease heap once this many of its items belong to finished rollouts
# (and they are the majority), so finished rollouts are not pinned until their
# old lease deadline.
_HEAP_COMPACT_MIN_DEAD: Final = 1024


class DuplicateRolloutError(HarborExecError, KeyError):
    """The rollout id is active or still retained."""


class FinalResult:
    """A finished rollout: the serialized wire body plus what ``/status`` reports."""

    __slots__ = ("body", "err_category", "err_message", "reward", "status")

    def __init__(
        self,
        *,
        status: RolloutStatus,
        body: bytes,
        reward: float | None = None,
        err_message: str | None = None,
        err_category: RolloutErrorCategory | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.reward = reward
        self.err_message = err_message
        self.err_category = err_category


class RolloutEntry:
    """One admitted rollout, from admission until its retention ends."""

    __slots__ = (
        "admitted_at",
        "cancel_requested",
        "context",
        "final",
        "info",
        "lease_deadline",
        "lease_digest",
        "metadata",
        "retention_over",
        "rollout_id",
        "running_at",
        "seq",
        "status",
        "task",
        "task_name",
        "waiters",
        "wall_admitted",
        "wall_finished",
        "wall_running",
    )

    def __init__(
        self, rollout_id: str, lease_digest: bytes, now: float, lease_sec: float, seq: int = 0
    ) -> None:
        self.rollout_id = rollout_id
        # For listing without a store (``GET /rollouts``): admission order, the task,
        # wall-clock times (admitted, running, finished), the request's metadata and
        # what the server kept of the backend's report (scrubbed).
        self.seq = seq
        self.task_name: str | None = None
        self.wall_admitted = 0.0
        self.wall_running: float | None = None
        self.wall_finished: float | None = None
        self.metadata: dict[str, Any] | None = None
        self.info: dict[str, Any] | None = None
        # The rollout's RolloutContext while it executes (when its agent started).
        self.context: Any = None
        self.lease_digest = lease_digest
        self.lease_deadline = now + lease_sec
        self.admitted_at = now
        self.running_at: float | None = None
        self.status = RolloutStatus.QUEUED
        self.final: FinalResult | None = None
        self.task: asyncio.Task[None] | None = None
        self.waiters: list[asyncio.Future[None]] | None = None
        self.cancel_requested = False
        self.retention_over = False

    @property
    def finished(self) -> bool:
        return self.final is not None


def _digest(token: str) -> bytes:
    # Tokens carry 256 random bits, so one plain SHA-256 is enough (and cheap);
    # only the digest is stored, so a memory dump does not reveal live tokens.
    return hashlib.sha256(token.encode()).digest()


class RolloutRegistry:
    """Admitted rollouts by id, with polling leases and result retention.

    ``on_lease_expired(entry)`` is called (synchronously, from a timer) when a
    live rollout's lease runs out; the server fails and cancels it there.
    """

    def __init__(
        self,
        *,
        result_wait_timeout_sec: float,
        polling_lease_timeout_sec: float,
        result_retention_sec: float,
        on_lease_expired: Callable[[RolloutEntry], None],
        on_removed: Callable[[str], None] | None = None,
    ) -> None:
        self.result_wait_timeout_sec = result_wait_timeout_sec
        self.polling_lease_timeout_sec = polling_lease_timeout_sec
        self.result_retention_sec = result_retention_sec
        self._on_lease_expired = on_lease_expired
        self._on_removed = on_removed
        self.entries: dict[str, RolloutEntry] = {}
        # Live (unfinished) rollouts per status, for /queue and /metrics.
        self.live_counts: dict[RolloutStatus, int] = {
            RolloutStatus.QUEUED: 0,
            RolloutStatus.RUNNING: 0,
            RolloutStatus.GRADING: 0,
        }
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lease_heap: list[tuple[float, int, RolloutEntry]] = []
        self._lease_seq = itertools.count()
        self._admission_seq = itertools.count(1)
        self._lease_timer: asyncio.TimerHandle | None = None
        self._lease_timer_at = 0.0
        self._dead_in_heap = 0
        self._retained: deque[tuple[float, RolloutEntry]] = deque()
        self._retention_timer: asyncio.TimerHandle | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    # ------------------------------------------------------------------ admission

    def admit(self, rollout_id: str) -> tuple[RolloutEntry, str]:
        """Register a rollout and return it with its lease token (stored only as a hash)."""
        if rollout_id in self.entries:
            raise DuplicateRolloutError(rollout_id)
        token = secrets.token_urlsafe(32)
        entry = RolloutEntry(
            rollout_id,
            _digest(token),
            self.loop.time(),
            self.polling_lease_timeout_sec,
            next(self._admission_seq),
        )
        self.entries[rollout_id] = entry
        self.live_counts[RolloutStatus.QUEUED] += 1
        self._push_lease(entry)
        return entry, token

    def restore(
        self, rollout_id: str, lease_digest: bytes, final: FinalResult, retention_sec: float
    ) -> None:
        """Re-register a finished rollout read back after a restart (before serving;
        call in order of increasing ``retention_sec``)."""
        now = self.loop.time()
        entry = RolloutEntry(rollout_id, lease_digest, now, 0.0, next(self._admission_seq))
        entry.final = final
        entry.status = final.status
        self.entries[rollout_id] = entry
        self._retained.append((now + max(retention_sec, 0.0), entry))
        if self._retention_timer is None:
            self._arm_retention_timer()

    def discard(self, entry: RolloutEntry) -> None:
        """Forget an entry whose admission did not complete."""
        if self.entries.get(entry.rollout_id) is entry:
            del self.entries[entry.rollout_id]
            if not entry.finished:
                self.live_counts[entry.status] -= 1
                entry.final = FinalResult(status=RolloutStatus.CANCELLED, body=b"")
                self._dead_in_heap += 1

    def get(self, rollout_id: str) -> RolloutEntry | None:
        return self.entries.get(rollout_id)

    # ------------------------------------------------------------------ leases

    @staticmethod
    def token_matches(entry: RolloutEntry, token: str) -> bool:
        return hmac.compare_digest(entry.lease_digest, _digest(token))

    def renew_lease(self, entry: RolloutEntry) -> bool:
        """Extend a live rollout's lease; False when it had already expired."""
        now = self.loop.time()
        if now >= entry.lease_deadline:
            return False
        entry.lease_deadline = now + self.polling_lease_timeout_sec
        return True

    def lease_expired(self, entry: RolloutEntry) -> bool:
        return self.loop.time() >= entry.lease_deadline

    def _push_lease(self, entry: RolloutEntry) -> None:
        deadline = entry.lease_deadline
        heapq.heappush(self._lease_heap, (deadline, next(self._lease_seq), entry))
        if self._lease_timer is None or deadline < self._lease_timer_at:
            self._arm_lease_timer(deadline)

    def _arm_lease_timer(self, when: float) -> None:
        if self._lease_timer is not None:
            self._lease_timer.cancel()
        self._lease_timer_at = when
        self._lease_timer = self.loop.call_at(when, self._on_lease_timer)

    def _on_lease_timer(self) -> None:
        self._lease_timer = None
        now = self.loop.time()
        heap = self._lease_heap
        expired: list[RolloutEntry] = []
        while heap and heap[0][0] <= now:
            _, _, entry = heapq.heappop(heap)
            if entry.finished:
                self._dead_in_heap -= 1
            elif entry.lease_deadline <= now:
                expired.append(entry)
            else:
                # Renewed since it was pushed: come back at the new deadline.
                heapq.heappush(heap, (entry.lease_deadline, next(self._lease_seq), entry))
        if heap:
            self._arm_lease_timer(heap[0][0])
        for entry in expired:
            if not entry.finished:
                self._on_lease_expired(entry)

    def _compact_lease_heap(self) -> None:
        self._lease_heap = [item for item in self._lease_heap if not item[2].finished]
        heapq.heapify(self._lease_heap)
        self._dead_in_heap = 0

    # ------------------------------------------------------------------ status and results

    def set_status(self, entry: RolloutEntry, status: RolloutStatus) -> None:
        """Record a non-terminal status change and wake the long-polls parked on it."""
        if entry.finished or status is entry.status or status in TERMINAL_STATUSES:
            return
        counts = self.live_counts
        counts[entry.status] -= 1
        counts[status] = counts.get(status, 0) + 1
        entry.status = status
        if status is RolloutStatus.RUNNING and entry.running_at is None:
            entry.running_at = self.loop.time()
        self._wake(entry)

    def finish(self, entry: RolloutEntry, final: FinalResult) -> bool:
        """Publish the final result once; later calls are ignored (returns False)."""
        if entry.finished:
            return False
        self.live_counts[entry.status] -= 1
        entry.final = final
        entry.status = final.status
        self._dead_in_heap += 1
        if self._dead_in_heap >= _HEAP_COMPACT_MIN_DEAD and self._dead_in_heap * 2 > len(
            self._lease_heap
        ):
            self._compact_lease_heap()
        self._wake(entry)
        self._retained.append((self.loop.time() + self.result_retention_sec, entry))
        if self._retention_timer is None:
            self._arm_retention_timer()
        return True

    def task_done(self, entry: RolloutEntry) -> None:
        """The execution task ended: drop the entry if its retention already passed."""
        if entry.retention_over:
            self._remove(entry)

    def _arm_retention_timer(self) -> None:
        when = self._retained[0][0]
        self._retention_timer = self.loop.call_at(when, self._on_retention_timer)

    def _on_retention_timer(self) -> None:
        self._retention_timer = None
        now = self.loop.time()
        retained = self._retained
        while retained and retained[0][0] <= now:
            _, entry = retained.popleft()
            task = entry.task
            if task is None or task.done():
                self._remove(entry)
            else:
                # The id stays reserved until the work has really stopped, so a
                # late completion cannot touch a new rollout with the same id.
                entry.retention_over = True
        if retained:
            self._arm_retention_timer()

    def _remove(self, entry: RolloutEntry) -> None:
        if self.entries.get(entry.rollout_id) is entry:
            del self.entries[entry.rollout_id]
            if self._on_removed is not None:
                self._on_removed(entry.rollout_id)
        entry.task = None

    # ------------------------------------------------------------------ long-poll

    async def wait_for_change(
        self, entry: RolloutEntry, seen: RolloutStatus, wait_sec: float
    ) -> None:
        """Return once the status differs from ``seen``, it finished, or ``wait_sec`` passed."""
        if entry.finished or entry.status is not seen or wait_sec <= 0:
            return
        future: asyncio.Future[None] = self.loop.create_future()
        if entry.waiters is None:
            entry.waiters = []
        entry.waiters.append(future)
        # A timer handle, not asyncio.wait_for: no extra task per parked poll.
        timer = self.loop.call_later(wait_sec, _release, future)
        try:
            await future
        finally:
            timer.cancel()
            waiters = entry.waiters
            if waiters is not None and not future.done():
                waiters.remove(future)

    @staticmethod
    def _wake(entry: RolloutEntry) -> None:
        waiters = entry.waiters
        if waiters:
            entry.waiters = None
            for future in waiters:
                if not future.done():
                    future.set_result(None)

    # ------------------------------------------------------------------ selection and close

    def select(self, *, ids: Iterable[str] | None, prefix: str | None, all: bool) -> list[str]:
        """Ids chosen by a cancel selector: ``ids`` literally, or by prefix, or all."""
        if all:
            return list(self.entries)
        if prefix is not None:
            return [rollout_id for rollout_id in self.entries if rollout_id.startswith(prefix)]
        return list(dict.fromkeys(ids or ()))

    def close(self) -> None:
        """Stop the shared timers and release every parked poll."""
        for timer in (self._lease_timer, self._retention_timer):
            if timer is not None:
                timer.cancel()
        self._lease_timer = self._retention_timer = None
        for entry in self.entries.values():
            self._wake(entry)


def _release(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
