"""LocalBackend: runs an AgentWorkflow and Grader in the server's own event loop.

For iterating on a workflow before moving the same classes into containers.
Semantics follow osmosis-ai 0.3.8's LocalBackend, with two improvements: the
rollout stays ``queued`` while it waits for a concurrency slot, and a graded
rollout that cannot be graded (no grader, or neither label nor metadata) fails
with ``validation_error`` and a message saying which, not a bare failure.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel

from harbor_exec.authoring import (
    AgentWorkflow,
    AgentWorkflowConfig,
    Grader,
    GraderConfig,
    RolloutContext,
    RolloutErrorCategory,
    RolloutSample,
    RolloutStatus,
    resolve_import_path,
    run_workflow_once,
)
from harbor_exec.backends.artifacts import LazyArtifactsDir, LazyGraderContext, LazyWorkflowContext
from harbor_exec.backends.base import (
    ARTIFACT_ROOT_ENV,
    ExecutionBackend,
    default_artifact_root,
    local_artifact_root,
    rollout_of,
)
from harbor_exec.compat.osmosis import (
    as_grader_class,
    as_workflow_class,
    is_grader_config,
    is_workflow_config,
)
from harbor_exec.protocol import (
    BackendHealth,
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    QueueInfo,
    categorize_exception,
)

__all__ = [
    "ARTIFACT_ROOT_ENV",
    "DEFAULT_MAX_CONCURRENT",
    "LazyArtifactsDir",
    "LocalBackend",
    "default_artifact_root",
    "local_artifact_root",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_CONCURRENT = 4
# Below this, time spent queued is not worth mentioning in a deadline message.
_QUEUED_NOTE_MIN_SEC = 0.1


def _deadline_message(phase: str, limit: float | None, queued_sec: float) -> str:
    message = f"{phase} exceeded its {limit}s deadline"
    if queued_sec >= _QUEUED_NOTE_MIN_SEC:
        message += f" ({queued_sec:.1f}s of it spent queued)"
    return message


class _Limiter:
    """A semaphore that also counts who waits and who runs (None: no cap)."""

    def __init__(self, max_concurrent: int | None) -> None:
        self.max_concurrent = max_concurrent
        self.queued = 0
        self.running = 0
        self._semaphore = asyncio.Semaphore(max_concurrent) if max_concurrent else None

    async def acquire(self) -> None:
        if self._semaphore is not None:
            self.queued += 1
            try:
                await self._semaphore.acquire()
            finally:
                self.queued -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        if self._semaphore is not None:
            self._semaphore.release()


class LocalHealth(BackendHealth):
    """``LocalBackend``'s part of ``GET /health``."""

    backend: str = "local"
    concurrency: dict[str, int | None] = {}


class LocalBackend(ExecutionBackend):
    """Runs each rollout in-process: a fresh workflow (and grader) instance per rollout.

    ``workflow``/``grader`` are classes or ``"module:attr"`` strings; configs are
    instances or ``"module:attr"``. Classes and configs written against osmosis-ai
    0.3.8 (subclasses of ``osmosis_ai.rollout.AgentWorkflow``/``Grader``, its configs)
    run unchanged, through ``harbor_exec.compat.osmosis``. Concurrency comes from
    ``workflow_config.concurrency.max_concurrent`` (4 without a config, no cap
    when the config says None). Each rollout gets ``<artifact_root>/<id>/artifacts/``,
    created when the workflow or grader first reads ``ctx.artifacts_dir``;
    ``artifact_root`` defaults to osmosis-ai's (``local_artifact_root()``:
    ``$HARBOR_EXEC_ARTIFACT_ROOT``, else ``$_OSMOSIS_ROLLOUT_ARTIFACT_ROOT``, else
    ``~/.osmosis``).
    """

    reports_running: ClassVar[bool] = True

    def __init__(
        self,
        *,
        workflow: type[Any] | str,
        workflow_config: BaseModel | str | None = None,
        grader: type[Any] | str | None = None,
        grader_config: BaseModel | str | None = None,
        artifact_root: Path | str | None = None,
    ) -> None:
        workflow_cls = as_workflow_class(_resolve(workflow, type, "workflow"))
        if workflow_cls is None:
            raise TypeError(
                "workflow must be an AgentWorkflow subclass (harbor_exec.authoring's or "
                f"osmosis_ai.rollout's), got {workflow!r}"
            )
        self.workflow_cls: type[AgentWorkflow[Any]] = workflow_cls
        # osmosis-ai's configs have the same fields; typed as ours for the code below.
        self.workflow_config: AgentWorkflowConfig | None = (
            _resolve_config(workflow_config, is_workflow_config, "workflow_config")
            if workflow_config is not None
            else None
        )
        self.grader_cls: type[Grader] | None = None
        if grader is not None:
            self.grader_cls = as_grader_class(_resolve(grader, type, "grader"))
            if self.grader_cls is None:
                raise TypeError(
                    "grader must be a Grader subclass (harbor_exec.authoring's or "
                    f"osmosis_ai.rollout's), got {grader!r}"
                )
        self.grader_config: GraderConfig | None = (
            _resolve_config(grader_config, is_grader_config, "grader_config")
            if grader_config is not None
            else None
        )
        max_concurrent = (
            self.workflow_config.concurrency.max_concurrent
            if self.workflow_config is not None
            else DEFAULT_MAX_CONCURRENT
        )
        self._limiter = _Limiter(max_concurrent)
        self.artifact_root = (
            Path(artifact_root).expanduser() if artifact_root else local_artifact_root()
        )

    # ------------------------------------------------------------------ reporting

    def health(self) -> LocalHealth:
        return LocalHealth(
            concurrency={
                "max_concurrent": self._limiter.max_concurrent,
                "queued": self._limiter.queued,
                "running": self._limiter.running,
            },
        )

    def queue_info(self) -> QueueInfo:
        return QueueInfo(
            queued=self._limiter.queued,
            running=self._limiter.running,
            capacity=self._limiter.max_concurrent,
        )

    # ------------------------------------------------------------------ execution

    async def execute(
        self, request: ExecutionRequest, rollout: RolloutContext | None = None
    ) -> ExecutionOutcome:
        context = rollout_of(request, rollout)
        # The caller's clock started at submission, so time spent waiting for a
        # slot comes off the workflow's budget.
        enqueued = time.monotonic()
        await self._limiter.acquire()
        try:
            queued_sec = time.monotonic() - enqueued
            await context.set_status(RolloutStatus.RUNNING)
            artifacts = LazyArtifactsDir(self.artifact_root, request.id)
            workflow_result = await self.run_workflow(
                request, context, queued_sec=queued_sec, artifacts=artifacts
            )
            if not request.grade or workflow_result.status is not RolloutStatus.SUCCESS:
                return ExecutionOutcome(workflow=workflow_result)
            missing = self._why_ungradable(request)
            if missing is not None:
                grader_result = ExecutionResult(
                    status=RolloutStatus.FAILURE,
                    sample=workflow_result.sample,
                    err_message=missing,
                    err_category=RolloutErrorCategory.VALIDATION_ERROR,
                )
            else:
                await context.set_status(RolloutStatus.GRADING)
                grader_result = await self.run_grader(request, workflow_result, artifacts=artifacts)
            return ExecutionOutcome(workflow=workflow_result, grader=grader_result)
        finally:
            self._limiter.release()

    def _why_ungradable(self, request: ExecutionRequest) -> str | None:
        if self.grader_cls is None:
            return (
                "grade=true but no grader is configured on this server; "
                "configure a grader or send grade=false"
            )
        if request.label is None and request.metadata is None:
            return (
                "grade=true but the request has neither a label nor metadata "
                "for the grader; send one of them or grade=false"
            )
        return None

    async def run_workflow(
        self,
        request: ExecutionRequest,
        context: RolloutContext,
        *,
        queued_sec: float = 0.0,
        artifacts: LazyArtifactsDir | None = None,
    ) -> ExecutionResult:
        """Run a fresh workflow instance under the agent deadline (less the time queued)."""
        config = copy.deepcopy(self.workflow_config)
        workflow_context = LazyWorkflowContext(
            prompt=request.prompt,
            config=config,
            metadata=request.metadata,
            artifacts=artifacts or LazyArtifactsDir(self.artifact_root, request.id),
        )
        limit = request.agent_timeout_sec

        async def run() -> RolloutSample | None:
            workflow = self.workflow_cls(config)
            return await run_workflow_once(workflow, workflow_context, context, label=request.label)

        outcome = await _within_deadline(
            "workflow",
            request.id,
            run,
            budget=None if limit is None else max(limit - queued_sec, 0.0),
            limit=limit,
            queued_sec=queued_sec,
        )
        if isinstance(outcome, ExecutionResult):
            return outcome
        return ExecutionResult(status=RolloutStatus.SUCCESS, sample=outcome)

    async def run_grader(
        self,
        request: ExecutionRequest,
        workflow_result: ExecutionResult,
        *,
        artifacts: LazyArtifactsDir | None = None,
    ) -> ExecutionResult:
        """Run a fresh grader instance under its own deadline; it must leave a reward."""
        grader_cls = self.grader_cls
        if grader_cls is None:
            return workflow_result
        grader_context = LazyGraderContext(
            label=request.label,
            sample=workflow_result.sample,
            metadata=request.metadata,
            artifacts=artifacts or LazyArtifactsDir(self.artifact_root, request.id),
        )
        budget = request.grader_timeout_sec

        async def grade() -> None:
            grader = grader_cls(self.grader_config)
            await grader.grade(grader_context)
            _require_reward(grader_context.sample)

        failure = await _within_deadline(
            "grader", request.id, grade, budget=budget, limit=budget, sample=workflow_result.sample
        )
        if failure is not None:
            return failure
        return ExecutionResult(status=RolloutStatus.SUCCESS, sample=grader_context.sample)


async def _within_deadline(
    phase: str,
    rollout_id: str,
    work: Callable[[], Awaitable[T]],
    *,
    budget: float | None,
    limit: float | None,
    queued_sec: float = 0.0,
    sample: RolloutSample | None = None,
) -> T | ExecutionResult:
    """What ``work()`` returns within ``budget`` seconds, else the phase's failure
    (carrying ``sample``); a deadline message names ``limit`` and the time queued."""
    started = time.monotonic()
    deadline = asyncio.timeout(budget)
    try:
        async with deadline:
            result = await work()
    except Exception as exc:
        logger.warning("rollout %s: %s failed", rollout_id, phase, exc_info=True)
        message = (
            _deadline_message(phase, limit, queued_sec)
            if deadline.expired()
            else str(exc) or type(exc).__name__
        )
        return ExecutionResult(
            status=RolloutStatus.FAILURE,
            sample=sample,
            err_message=message,
            err_category=categorize_exception(exc),
        )
    if _overran(deadline, started, budget):
        return ExecutionResult(
            status=RolloutStatus.FAILURE,
            sample=sample,
            err_message=_deadline_message(phase, limit, queued_sec),
            err_category=RolloutErrorCategory.TIMEOUT,
        )
    return result


def _overran(deadline: asyncio.Timeout, started: float, budget: float | None) -> bool:
    """The code returned, but after its deadline: it swallowed the cancellation or
    blocked the loop. A success nobody waited for would be a lie, so it is a timeout."""
    if budget is None:
        return False
    return deadline.expired() or time.monotonic() - started > budget


def _require_reward(sample: RolloutSample | None) -> None:
    if sample is None:
        raise ValueError(
            "no sample to grade: the workflow returned no messages and registered no sample source"
        )
    if sample.reward is None and not sample.remove_sample:
        raise ValueError("the grader set no reward (call ctx.set_reward(...))")


def _resolve_config(ref: Any, accepts: Callable[[Any], bool], what: str) -> Any:
    value = resolve_import_path(ref) if isinstance(ref, str) else ref
    if not accepts(value):
        kind = "AgentWorkflowConfig" if what == "workflow_config" else "GraderConfig"
        raise TypeError(
            f"{what} {ref!r} resolved to {value!r}, expected a {kind} "
            "(harbor_exec.authoring's or osmosis_ai.rollout's)"
        )
    return value


def _resolve(ref: Any, kind: type, what: str) -> Any:
    value = resolve_import_path(ref) if isinstance(ref, str) else ref
    if not isinstance(value, kind):
        raise TypeError(f"{what} {ref!r} resolved to {value!r}, expected a {kind.__name__}")
    return value
