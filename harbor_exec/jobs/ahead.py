"""``validate`` and ``run`` know their whole schedule: while ``slots`` trials run, the
next ones start their environment ahead (image, container, files, healthcheck) and
wait, started and idle, for a slot before their agent (``RunSlots``).

A trial started ahead is exactly the trial that would have started later, with its own
container, sockets and files; it only begins earlier. How many may wait so is the
operator's warm-container bound (``SandboxPolicy.warm_containers``, their memory limits
within ``warm_memory_mb``), as for the served path's warm pool
(``harbor_exec.trial.warm``). A trial ready ahead takes the next free slot before any
trial that has not started (its container is the one waiting); GPU tasks never start
ahead (a container holding GPUs it does not use would take them from a running one).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from harbor_exec.trial.policy import SandboxPolicy

#: A waiting thread looks at its trial's cancellation at least this often (a cancel
#: also wakes it at once through ``RunSlots.stop``).
_WAKE_SEC = 1.0


@dataclass(eq=False)
class Turn:
    """One trial's place: a slot's (``runner``) or one ahead of the slots (``ahead``)."""

    gate: RunSlots
    kind: Literal["runner", "ahead", "running", "done"]
    memory_mb: int = 0
    ready: threading.Event = field(default_factory=threading.Event)

    def wait(self, cancelled: threading.Event) -> None:
        """The trial's environment is up: take a slot (at once for a runner; the next
        free one for a trial started ahead). Returns early, holding nothing more, when
        ``cancelled`` is set or the job stops (the trial then sees its cancellation)."""
        self.gate._take_slot(self, cancelled)

    def done(self) -> None:
        """The trial's reward is read (its containers' removal is clean-up), or it ended
        or never started: give back what it holds. Once; a second call does nothing."""
        self.gate._release(self)


class RunSlots:
    """``slots`` trials run their agents at once; up to ``ahead`` more (their memory
    limits within ``ahead_memory_mb``) start their environment ahead of a slot."""

    def __init__(self, slots: int, ahead: int, ahead_memory_mb: int) -> None:
        self.slots = max(1, slots)
        self.ahead = max(0, ahead)
        self.ahead_memory_mb = ahead_memory_mb
        self._cond = threading.Condition()
        self._running = 0  # trials holding a slot
        self._runners = 0  # trials admitted to a slot, setting up
        self._ahead: deque[Turn] = deque()  # admitted ahead, in order; ready ones first win
        self._ahead_mb = 0
        self._stopped = False

    @classmethod
    def for_policy(cls, slots: int, policy: SandboxPolicy) -> RunSlots:
        """The operator's warm-container bounds: ``--warm-containers`` trials ahead
        (0: none), their memory limits within ``--warm-memory-mb``."""
        return cls(slots, policy.warm_containers, policy.warm_memory_mb)

    @property
    def workers(self) -> int:
        """Threads the job needs: one per slot, one per trial ahead, and one per slot
        for a trial whose containers are being removed (it gave its slot back)."""
        return 2 * self.slots + self.ahead

    def admit(self, memory_mb: int, *, may_go_ahead: bool = True) -> Turn | None:
        """A place for the next trial of the schedule: a slot if one is free (no trial
        ahead waiting for it), else a place ahead if the bounds allow; waits for either.
        None once the job stops."""
        with self._cond:
            while not self._stopped:
                if self._running + self._runners + len(self._ahead) < self.slots:
                    self._runners += 1
                    return Turn(self, "runner")
                if (
                    may_go_ahead
                    and len(self._ahead) < self.ahead
                    and self._ahead_mb + memory_mb <= self.ahead_memory_mb
                ):
                    turn = Turn(self, "ahead", memory_mb)
                    self._ahead.append(turn)
                    self._ahead_mb += memory_mb
                    return turn
                self._cond.wait(_WAKE_SEC)
            return None

    def stop(self) -> None:
        """The job stops: nothing more is admitted and every waiting trial wakes."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _take_slot(self, turn: Turn, cancelled: threading.Event) -> None:
        with self._cond:
            if turn.kind == "runner":
                self._runners -= 1
            elif turn.kind == "ahead":
                turn.ready.set()
                while not (self._stopped or cancelled.is_set() or self._next_ready() is turn):
                    self._cond.wait(_WAKE_SEC)
                if self._next_ready() is not turn:
                    return  # stopped or cancelled: it stays ahead until done()
                self._leave_ahead(turn)
            else:
                return
            turn.kind = "running"
            self._running += 1
            self._cond.notify_all()

    def _next_ready(self) -> Turn | None:
        """The trial ahead that takes the next free slot: the first one ready (its
        environment up), while a slot is free."""
        if self._running + self._runners >= self.slots:
            return None
        return next((t for t in self._ahead if t.ready.is_set()), None)

    def _leave_ahead(self, turn: Turn) -> None:
        self._ahead.remove(turn)
        self._ahead_mb -= turn.memory_mb

    def _release(self, turn: Turn) -> None:
        with self._cond:
            if turn.kind == "runner":
                self._runners -= 1
            elif turn.kind == "ahead":
                self._leave_ahead(turn)
            elif turn.kind == "running":
                self._running -= 1
            turn.kind = "done"
            self._cond.notify_all()


__all__ = ["RunSlots", "Turn"]
