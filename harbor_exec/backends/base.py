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

from harbor_exec.protocol import ExecutionOutcome, ExecutionRequest

__all__ = [
    "ARTIFACT_ROOT_ENV",
    "OSMOSIS_ARTIFACT_ROOT_ENV",
    "ExecutionBackend",
    "default_artifact_root",
    "empty_prewarm_summary",
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


def empty_prewarm_summary() -> dict[str, Any]:
    """The summary of a prewarm with nothing to do."""
    return {"total": 0, "built": 0, "cached": 0, "failed": 0, "failed_tasks": {}}


class ExecutionBackend(ABC):
    """Runs rollouts for the server. Only ``execute`` is required."""

    reports_running: ClassVar[bool] = False
    """True when the backend itself moves rollouts from ``queued`` to ``running``."""

    @abstractmethod
    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        """Run one rollout to its end and return its outcome.

        Read the chat URL and key from ``get_rollout_context()``. Raising is
        allowed: the server turns the exception into a ``failure`` with a
        category from ``categorize_exception``. Cancellation arrives as
        ``asyncio.CancelledError`` (unless ``cancel_rollouts`` handles it).
        """

    def has_capacity(self) -> bool:
        """Whether another rollout may be admitted now; False makes the server answer 429."""
        return True

    def rollout_status(self, rollout_id: str) -> dict[str, Any] | None:
        """Live or retained state of one rollout (``{"status": ...}``), None when unknown.

        The server reads it while cancelling, to tell finished work (keep
        delivering its result) from work the backend has not seen yet.
        """
        return None

    def cancel_rollouts(
        self,
        ids: Sequence[str] | None = None,
        prefix: str | None = None,
        all: bool = False,
    ) -> dict[str, str]:
        """Cancel matching in-flight rollouts; returns a disposition per id.

        The default ``{}`` means "unsupported": the server then cancels the
        ``execute`` task itself. A backend answering ``not_found`` for finished
        work must keep its terminal ``rollout_status`` until ``execute`` returns.
        """
        return {}

    def health(self) -> dict[str, Any]:
        """Backend part of ``GET /health``."""
        return {"status": "ok"}

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

    def queue_info(self) -> dict[str, Any]:
        """Backend part of ``GET /queue``: queued, running, capacity, max_queue_depth.

        None means "not tracked here"; the server then fills ``queued`` and
        ``running`` from its own registry.
        """
        return {"queued": None, "running": None, "capacity": None, "max_queue_depth": None}

    async def prewarm(self, task_ids: list[str] | None) -> dict[str, Any]:
        """Make the given tasks (None: all of them) ready to start fast; returns a summary.

        Summary keys: ``total``, ``built``, ``cached``, ``failed`` and
        ``failed_tasks`` (task id -> reason). The default has nothing to do.
        """
        return empty_prewarm_summary()

    async def shutdown(self) -> None:
        """Release resources; called once, after admissions stopped and in-flight work drained."""
        return None
