"""The boundary between the rollout server and whatever runs rollouts.

The server calls ``execute(request, rollout)`` once per admitted rollout. ``rollout``
(a ``harbor_exec.authoring.RolloutContext``) carries the rollout id, the
chat-completions URL and the LLM key, and takes the backend's status reports; it is
also the ambient context while ``execute`` runs, for workflow code that asks
``get_rollout_context()``. A backend returns the result; it never talks HTTP.

The server owns every rollout's state. A backend only pushes transitions:

* The server moves a rollout to ``running`` itself just before ``execute``,
  unless the backend sets ``reports_running = True``; then the rollout stays
  ``queued`` until the backend calls ``rollout.update_status(RolloutStatus.RUNNING)``
  when the work really starts (so a cancel while waiting says ``cancelled_queued``).
* Before grading, the backend calls ``rollout.update_status(RolloutStatus.GRADING)``.
* Terminal statuses come from the returned ``ExecutionOutcome``; the backend
  must not set them itself.

Cancelling has one path: the server asks ``cancel(rollout_id)``; a backend that
stops the rollout itself answers True (``execute`` then returns a ``cancelled``
outcome), otherwise the server cancels the ``execute`` task. osmosis-ai's pull hooks
(``rollout_status``, ``cancel_rollouts``) live only in the adapter for its backends
(``harbor_exec.backends.osmosis``).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from harbor_exec.authoring import RolloutContext, get_rollout_context
from harbor_exec.protocol import (
    BackendHealth,
    ExecutionOutcome,
    ExecutionRequest,
    PrewarmSummary,
    QueueInfo,
)

__all__ = [
    "ARTIFACT_ROOT_ENV",
    "OSMOSIS_ARTIFACT_ROOT_ENV",
    "ExecutionBackend",
    "default_artifact_root",
    "local_artifact_root",
    "rollout_of",
]


ARTIFACT_ROOT_ENV = "HARBOR_EXEC_ARTIFACT_ROOT"
# Set by `osmosis eval run` (osmosis-ai[eval]) for the rollout server it starts: it
# waits for <root>/<id>/trajectory.json there, so we honour it when nothing of ours says.
OSMOSIS_ARTIFACT_ROOT_ENV = "_OSMOSIS_ROLLOUT_ARTIFACT_ROOT"


def default_artifact_root() -> Path:
    """``$HARBOR_EXEC_ARTIFACT_ROOT``, else ``$_OSMOSIS_ROLLOUT_ARTIFACT_ROOT``, else
    ``~/.harbor-exec/rollouts``."""
    for name in (ARTIFACT_ROOT_ENV, OSMOSIS_ARTIFACT_ROOT_ENV):
        if configured := os.environ.get(name):
            return Path(configured)
    return Path.home() / ".harbor-exec" / "rollouts"


def local_artifact_root() -> Path:
    """LocalBackend's root, osmosis-ai 0.3.8's: ``$HARBOR_EXEC_ARTIFACT_ROOT``, else
    ``$_OSMOSIS_ROLLOUT_ARTIFACT_ROOT``, else ``~/.osmosis`` (so ``<id>/artifacts`` is
    where the Osmosis guide says LocalBackend puts it)."""
    for name in (ARTIFACT_ROOT_ENV, OSMOSIS_ARTIFACT_ROOT_ENV):
        if configured := os.environ.get(name):
            return Path(configured)
    return Path.home() / ".osmosis"


def rollout_of(request: ExecutionRequest, rollout: RolloutContext | None) -> RolloutContext:
    """The rollout context ``execute`` was given; for a direct caller that gave none,
    the ambient one (osmosis-ai's LocalBackend is driven that way), else a new one for
    ``request.id`` (URL and key from the ``OSMOSIS_*`` environment)."""
    return rollout or get_rollout_context() or RolloutContext(rollout_id=request.id)


class ExecutionBackend(ABC):
    """Runs rollouts for the server. Only ``execute`` is required."""

    reports_running: ClassVar[bool] = False
    """True when the backend itself moves rollouts from ``queued`` to ``running``."""

    reports_agent_start: ClassVar[bool] = False
    """True when the backend records the agent's start itself (``await
    rollout.mark_agent_started(when)`` once its set-up is done); else the server
    records the time ``execute`` begins."""

    @abstractmethod
    async def execute(
        self, request: ExecutionRequest, rollout: RolloutContext | None = None
    ) -> ExecutionOutcome:
        """Run one rollout to its end and return its outcome.

        ``rollout`` holds the chat URL and key and takes status reports; the server
        always passes it (a direct caller may leave it out: see ``rollout_of``). Raising is
        allowed: the server turns the exception into a ``failure`` with a category
        from ``categorize_exception``. Cancellation arrives as
        ``asyncio.CancelledError`` (unless ``cancel`` handles it).
        """

    def start(self) -> None:
        """Do the slow set-up (build bundles, open engines); blocking and idempotent.

        Constructors only read configuration; the server calls this (in a worker
        thread) before it serves, and ``serve`` before it binds, so that set-up
        errors stop start-up with their own message.
        """
        return None

    def has_capacity(self) -> bool:
        """Whether another rollout may be admitted now; False makes the server answer 429."""
        return True

    def reserve(self, rollout_id: str) -> bool:
        """Take a place for ``rollout_id`` at admission, or refuse it (False: 429).

        Called synchronously on the event loop, so a reservation counts before the
        next submission is looked at, however many arrive at once (``execute`` only
        starts later). The default asks ``has_capacity``; a bounded backend counts
        its reservations. ``release`` is called once the rollout's task ended."""
        return self.has_capacity()

    def release(self, rollout_id: str) -> None:
        """The admitted rollout's task ended (or it never started): drop its place."""
        return None

    def cancel(self, rollout_id: str) -> bool:
        """Stop a rollout this backend is running; True when it handles the stop itself
        (``execute`` then returns a ``cancelled`` outcome). False (the default) makes
        the server cancel the ``execute`` task instead."""
        return False

    def health(self) -> BackendHealth:
        """Backend part of ``GET /health``; must not raise."""
        return BackendHealth()

    def recover_interrupted(self, rollout_ids: Sequence[str]) -> None:
        """A restarted server found these rollouts unfinished (they now end as
        ``internal_error``); release what the dead process left for them. Default: nothing."""
        return None

    def unavailable_reason(self) -> str | None:
        """Why rollouts cannot run right now (e.g. the container engine is down), else None.

        While it is not None the server answers ``POST /rollout`` with 503 and this
        reason, and ``/health`` reports ``accepting_rollouts: false``. Must be cheap.
        """
        return None

    def queue_info(self) -> QueueInfo:
        """Backend part of ``GET /queue``; None fields are filled from the server's registry."""
        return QueueInfo()

    async def prewarm(self, task_ids: list[str] | None) -> PrewarmSummary:
        """Make the given tasks (None: all of them) ready to start fast; returns a summary.
        The default has nothing to do."""
        return PrewarmSummary()

    async def shutdown(self) -> None:
        """Release resources; called once, after admissions stopped and in-flight work drained."""
        return None
