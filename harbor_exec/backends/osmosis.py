"""Serve an osmosis-ai 0.3.8 ``ExecutionBackend`` (its LocalBackend, a user's own) with
harbor-exec's server: durable state, leases, metrics and OpenAPI stay ours, the rollouts
run in the osmosis-ai object, through the methods its interface defines.

``OsmosisBackend`` wraps such an object into our ``ExecutionBackend``: ``execute`` runs
inside the SDK's own ambient ``RolloutContext`` (same chat URL, key and id; its status
changes reach the server), requests and outcomes are converted between the SDK's
models and ours, and ``has_capacity``, ``health`` and ``shutdown`` are passed on.
osmosis-ai's servers pull a backend's state (``rollout_status``, ``cancel_rollouts``)
where ours are pushed it: this adapter is the one place that pulls, for the status
route (``live_status``, ``retained_state``) and for ``cancel``, as osmosis-ai's server
does. ``create_rollout_server`` wraps such a backend itself (``as_backend``).
osmosis-ai stays optional: it is looked up in ``sys.modules`` (an object of its
classes has imported it already) and imported only when such a backend runs.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, ClassVar, Final

from harbor_exec.authoring import RolloutContext
from harbor_exec.backends.base import ExecutionBackend, rollout_of
from harbor_exec.compat.osmosis import sdk_rollout_context
from harbor_exec.protocol import (
    CANCEL_DISPOSITIONS,
    TERMINAL_STATUSES,
    BackendHealth,
    CancelDisposition,
    ExecutionOutcome,
    ExecutionRequest,
    RolloutStatus,
    RolloutStatusResponse,
)

__all__ = ["OsmosisBackend", "as_backend", "is_osmosis_backend"]

logger = logging.getLogger(__name__)

# Live statuses in their order, to tell which of two is further on.
_LIVE_ORDER: Final = {RolloutStatus.QUEUED: 0, RolloutStatus.RUNNING: 1, RolloutStatus.GRADING: 2}
_FINISHED: Final = frozenset(status.value for status in TERMINAL_STATUSES)

# Where osmosis-ai 0.3.8 defines its backend interface.
_SDK_BACKEND_MODULE = "osmosis_ai.rollout.backend.base"


def is_osmosis_backend(obj: object) -> bool:
    """True for an instance of osmosis-ai's ``ExecutionBackend`` (when osmosis-ai is
    imported: without it no object can be one)."""
    module = sys.modules.get(_SDK_BACKEND_MODULE)
    base = getattr(module, "ExecutionBackend", None) if module is not None else None
    return isinstance(base, type) and isinstance(obj, base)


def as_backend(obj: object) -> ExecutionBackend:
    """``obj`` as the server's backend: itself when it is ours, an ``OsmosisBackend``
    around it when it is osmosis-ai's; ``TypeError`` for anything else."""
    if isinstance(obj, ExecutionBackend):
        return obj
    if is_osmosis_backend(obj):
        return OsmosisBackend(obj)
    raise TypeError(
        "backend must implement harbor_exec.backends.base.ExecutionBackend or "
        f"osmosis_ai.rollout.backend.ExecutionBackend, got {type(obj).__name__}"
    )


class OsmosisBackend(ExecutionBackend):
    """Our backend interface around an osmosis-ai 0.3.8 ``ExecutionBackend``."""

    # As osmosis-ai's server does, ours moves the rollout to running before execute.
    reports_running: ClassVar[bool] = False

    def __init__(self, backend: Any) -> None:
        if not is_osmosis_backend(backend):
            raise TypeError(
                "OsmosisBackend wraps an osmosis_ai.rollout.backend.ExecutionBackend, "
                f"got {type(backend).__name__}"
            )
        self.backend = backend
        # The SDK's LocalBackend keeps its root here: the server writes trajectories
        # next to its artifacts, as osmosis-ai's server does.
        self.artifact_root = getattr(backend, "artifact_root", None)

    async def execute(
        self, request: ExecutionRequest, rollout: RolloutContext | None = None
    ) -> ExecutionOutcome:
        from osmosis_ai.rollout.types import ExecutionRequest as SdkExecutionRequest

        rollout = rollout_of(request, rollout)
        sdk_request = SdkExecutionRequest.model_validate(request.model_dump())
        with sdk_rollout_context(rollout):
            sdk_outcome = await self.backend.execute(sdk_request)
        return _from_sdk_outcome(sdk_outcome)

    def has_capacity(self) -> bool:
        return bool(self.backend.has_capacity())

    def health(self) -> BackendHealth:
        reported = self.backend.health()
        fields: dict[str, Any] = dict(reported) if reported else {}
        fields.setdefault("status", "ok")
        fields.setdefault("backend", f"osmosis:{type(self.backend).__name__}")
        return BackendHealth.model_validate(fields)

    # ------------------------------------------------------------------ pulled state

    def _state(self, rollout_id: str) -> dict[str, Any] | None:
        """The backend's ``rollout_status``; None when it does not know the rollout,
        does not say, or fails."""
        try:
            state = self.backend.rollout_status(rollout_id)
        except Exception:
            logger.exception("rollout %s: backend.rollout_status failed", rollout_id)
            return None
        return dict(state) if isinstance(state, dict) else None

    def live_status(self, rollout_id: str, server_status: RolloutStatus) -> RolloutStatus:
        """The server's status of a running rollout, or the backend's when it tracks
        one further on (e.g. ``grading`` it never reported through the context).
        Terminal statuses still come only from ``execute``'s outcome."""
        state = self._state(rollout_id)
        try:
            status = RolloutStatus(str(state.get("status"))) if state else None
        except ValueError:
            return server_status
        if status is None or status in TERMINAL_STATUSES:
            return server_status
        if _LIVE_ORDER[status] > _LIVE_ORDER.get(server_status, 0):
            return status
        return server_status

    def retained_state(self, rollout_id: str) -> RolloutStatusResponse | None:
        """A rollout the server does not hold, as the backend reports it (e.g. kept
        longer than the server's retention); None when it does not know it."""
        state = self._state(rollout_id)
        if state is None:
            return None
        fields = ("status", "reward", "err_message", "err_category")
        try:
            return RolloutStatusResponse.model_validate(
                {"rollout_id": rollout_id, **{name: state.get(name) for name in fields}}
            )
        except ValueError:
            logger.warning("rollout %s: backend.rollout_status gave %r", rollout_id, state)
            return None

    def cancel(self, rollout_id: str) -> bool:
        """As osmosis-ai's server: the backend stops the rollout itself when
        ``cancel_rollouts`` gives it a disposition. ``not_found`` only counts when
        ``rollout_status`` says it finished (its result is on its way); for work not
        started yet it means "not mine yet", and the server cancels the task."""
        try:
            disposition = self.backend.cancel_rollouts(ids=[rollout_id]).get(rollout_id)
        except Exception:
            logger.exception("rollout %s: backend.cancel_rollouts failed", rollout_id)
            return False
        if disposition == CancelDisposition.NOT_FOUND:
            state = self._state(rollout_id)
            return state is not None and str(state.get("status")) in _FINISHED
        return disposition in CANCEL_DISPOSITIONS

    async def shutdown(self) -> None:
        await self.backend.shutdown()


def _from_sdk_outcome(outcome: Any) -> ExecutionOutcome:
    """The SDK's ``ExecutionOutcome`` as ours (same fields; statuses by value)."""
    if isinstance(outcome, ExecutionOutcome):
        return outcome
    return ExecutionOutcome.model_validate(outcome.model_dump())
