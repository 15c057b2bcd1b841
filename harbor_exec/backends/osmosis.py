"""Serve an osmosis-ai 0.3.8 ``ExecutionBackend`` (its LocalBackend, a user's own) with
harbor-exec's server: durable state, leases, metrics and OpenAPI stay ours, the rollouts
run in the osmosis-ai object, through the methods its interface defines.

``OsmosisBackend`` wraps such an object into our ``ExecutionBackend``: ``execute`` runs
inside the SDK's own ambient ``RolloutContext`` (same chat URL, key and id; its status
changes reach the server), requests and outcomes are converted between the SDK's
models and ours, and ``has_capacity``, ``health``, ``rollout_status``,
``cancel_rollouts`` and ``shutdown`` are passed on. ``create_rollout_server`` wraps
such a backend itself (``as_backend``). osmosis-ai stays optional: it is looked up in
``sys.modules`` (an object of its classes has imported it already) and imported only
when such a backend runs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, ClassVar

from harbor_exec.authoring import RolloutContext, get_rollout_context
from harbor_exec.backends.base import ExecutionBackend
from harbor_exec.compat.osmosis import sdk_rollout_context
from harbor_exec.protocol import BackendHealth, ExecutionOutcome, ExecutionRequest

__all__ = ["OsmosisBackend", "as_backend", "is_osmosis_backend"]

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

    async def execute(self, request: ExecutionRequest) -> ExecutionOutcome:
        from osmosis_ai.rollout.types import ExecutionRequest as SdkExecutionRequest

        rollout = get_rollout_context() or RolloutContext(rollout_id=request.id)
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

    def rollout_status(self, rollout_id: str) -> dict[str, Any] | None:
        state = self.backend.rollout_status(rollout_id)
        return dict(state) if state is not None else None

    def cancel_rollouts(
        self,
        ids: Sequence[str] | None = None,
        prefix: str | None = None,
        all: bool = False,
    ) -> dict[str, str]:
        dispositions = self.backend.cancel_rollouts(ids=ids, prefix=prefix, all=all)
        return {str(key): str(value) for key, value in (dispositions or {}).items()}

    async def shutdown(self) -> None:
        await self.backend.shutdown()


def _from_sdk_outcome(outcome: Any) -> ExecutionOutcome:
    """The SDK's ``ExecutionOutcome`` as ours (same fields; statuses by value)."""
    if isinstance(outcome, ExecutionOutcome):
        return outcome
    return ExecutionOutcome.model_validate(outcome.model_dump())
