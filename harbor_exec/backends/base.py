"""The boundary between the rollout server and whatever runs rollouts.

The server calls ``execute`` once per admitted rollout, inside an ambient
``RolloutContext`` (see ``harbor_exec.authoring``) that carries the rollout id,
the chat-completions URL and the LLM key. A backend reports progress through
that context and returns the result; it never talks HTTP.

Status contract:

* The server moves a rollout to ``running`` itself just before ``execute``,
  unless the backend sets ``reports_running = True``; then the rollout stays
  ``queued`` until the backend calls ``set_status(RolloutStatus.RUNNING)`` when
  the work really starts (so a cancel while waiting says ``cancelled_queued``).
* Before grading, the backend calls
  ``await harbor_exec.authoring.set_status(RolloutStatus.GRADING)``.
* Terminal statuses come from the returned ``ExecutionOutcome``; the backend
  must not set them itself.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

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


class ExecutionBackend(ABC):
    """Runs rollouts for the server. Only ``execute`` is required."""

    reports_running: ClassVar[bool] = False
    """True when the backend itself moves rollouts from ``queued`` to ``running``."""

    reports_agent_start: ClassVar[bool] = False
    """True when the backend records the agent's start itself (``await
    get_rollout_context().mark_agent_started(when)`` once its set-up is done); else the
    server records the time ``execute`` begins."""

    @abstractmethod
    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        """Run one rollout to its end and return its outcome.

        Read the chat URL and key from ``get_rollout_context()``. Raising is
        allowed: the server turns the exception into a ``failure`` with a
        category from ``categorize_exception``. Cancellation arrives as
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
        the server cancel the ``execute`` task instead. The server owns every
        rollout's state: a backend only reports transitions through the rollout
        context (``update_status``)."""
        return False

    def rollout_status(self, rollout_id: str) -> dict[str, Any] | None:
        """osmosis-ai 0.3.8's hook: the backend's own state of one rollout (``{"status":
        ..., "reward": ..., "err_message": ...}``), None when it does not know it (the
        default). The server asks it on ``GET /rollout/{id}/status`` (a live status the
        backend tracks further than the server, or a rollout the server no longer
        holds) and while cancelling (to tell finished work from unknown work)."""
        return None

    def cancel_rollouts(
        self,
        ids: Sequence[str] | None = None,
        prefix: str | None = None,
        all: bool = False,
    ) -> dict[str, str]:
        """osmosis-ai 0.3.8's hook: cancel matching rollouts, ``{id: "cancelled_queued" |
        "cancelled_running" | "not_found"}``; ``{}`` (the default) means unsupported.
        ``POST /rollout/cancel`` calls it with one id at a time; a disposition it returns
        means the backend stops the rollout itself (``not_found`` only counts when
        ``rollout_status`` reports a terminal state), otherwise the server goes on
        with ``cancel`` and, failing that, cancels the ``execute`` task."""
        return {}

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
