"""The rollout service: admission, execution, leases and long-polls, results,
restart recovery and shutdown. The routes (``app.py``) are thin wrappers of it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Final

import anyio.to_thread
from starlette.responses import Response

from harbor_exec.authoring import RolloutContext
from harbor_exec.backends.base import ExecutionBackend
from harbor_exec.backends.osmosis import OsmosisBackend
from harbor_exec.container.redaction import REDACTED, needles
from harbor_exec.protocol import (
    FEATURES_HEADER,
    STATUS_WAIT_FEATURE,
    TERMINAL_STATUSES,
    CancelDisposition,
    ExecutionRequest,
    ExecutionResult,
    QueueInfo,
    RolloutDetail,
    RolloutErrorCategory,
    RolloutInitRequest,
    RolloutLifecycle,
    RolloutList,
    RolloutStatus,
    RolloutStatusResponse,
    categorize_exception,
)
from harbor_exec.server.console import SEED_ROWS, ConsoleStats
from harbor_exec.server.http import (
    JSON_CONTENT_TYPE,
    error_response,
    header_error,
    model_response,
    validation_error_response,
)
from harbor_exec.server.metrics import ServerMetrics, package_cache_figures
from harbor_exec.server.registry import (
    DuplicateRolloutError,
    FinalResult,
    RolloutEntry,
    RolloutRegistry,
)
from harbor_exec.server.report import ServeReport
from harbor_exec.server.results import (
    AdmissionEncoder,
    cancelled_result,
    failed_result,
    final_result,
    in_progress_body,
    lease_expired_result,
)
from harbor_exec.server.rollouts import (
    detail_of,
    page_of,
    read_file,
    record_of,
    rollout_info,
    select_entries,
    task_of,
)
from harbor_exec.server.store import RESTARTED_MESSAGE, RolloutQuery, RolloutStore
from harbor_exec.server.trajectory import TrajectoryWriter

__all__ = [
    "DEFAULT_POLLING_LEASE_TIMEOUT_SEC",
    "DEFAULT_RESULT_RETENTION_SEC",
    "DEFAULT_RESULT_WAIT_TIMEOUT_SEC",
    "DEFAULT_RETRY_AFTER_SEC",
    "FEATURES",
    "SHUTDOWN_CLEANUP_SEC",
    "SHUTDOWN_DRAIN_SEC",
    "RolloutService",
]

logger = logging.getLogger(__name__)

DEFAULT_RESULT_WAIT_TIMEOUT_SEC: Final = 30.0
DEFAULT_POLLING_LEASE_TIMEOUT_SEC: Final = 120.0
DEFAULT_RESULT_RETENTION_SEC: Final = 900.0
#: What a 429 (and a 503 while the engine is away) asks clients to wait: the Osmosis
#: guide's figure.
DEFAULT_RETRY_AFTER_SEC: Final = 5
SHUTDOWN_DRAIN_SEC: Final = 10.0
SHUTDOWN_CLEANUP_SEC: Final = 120.0

# Sent in FEATURES_HEADER with every 202, so our client knows it may use the status long-poll.
FEATURES: Final = STATUS_WAIT_FEATURE
INSTANCE_ID_ENVS: Final = ("HARBOR_EXEC_INSTANCE_ID", "_OSMOSIS_ROLLOUT_INSTANCE_ID")

# The request's fields a backend gets as they are, under the same name (``ExecutionRequest``).
_PASSED_TO_BACKEND: Final = (
    "label",
    "metadata",
    "agent_timeout_sec",
    "grader_timeout_sec",
    "grade",
)


class RolloutService:
    """Admission, execution, leases and long-polls, results, restart recovery and
    shutdown of the rollouts of one server; the routes are thin wrappers."""

    def __init__(
        self,
        backend: ExecutionBackend,
        *,
        result_wait_timeout_sec: float,
        polling_lease_timeout_sec: float,
        result_retention_sec: float,
        artifact_root: Path,
        server_secrets: Sequence[str] = (),
        retry_after_sec: int = DEFAULT_RETRY_AFTER_SEC,
        shutdown_drain_sec: float = SHUTDOWN_DRAIN_SEC,
        shutdown_cleanup_sec: float = SHUTDOWN_CLEANUP_SEC,
        store: RolloutStore | None = None,
        report: ServeReport | None = None,
    ) -> None:
        self.backend = backend
        self.report = report
        # osmosis-ai's backends are pulled for their status; ours push it.
        self.osmosis = backend if isinstance(backend, OsmosisBackend) else None
        self.store = store
        self.result_retention_sec = result_retention_sec
        self.result_wait_timeout_sec = result_wait_timeout_sec
        self.polling_lease_timeout_sec = polling_lease_timeout_sec
        self.retry_after = str(retry_after_sec)
        self.shutdown_drain_sec = shutdown_drain_sec
        self.shutdown_cleanup_sec = shutdown_cleanup_sec
        self.accepting = True
        self.tasks: set[asyncio.Task[None]] = set()
        self.process_id = str(uuid.uuid4())
        self.instance_id = next(
            (os.environ[name] for name in INSTANCE_ID_ENVS if os.environ.get(name)),
            self.process_id,
        )
        self.metrics = ServerMetrics()
        self.console = ConsoleStats()
        # Admitted and not finished, for the console's running list.
        self.live: dict[str, RolloutEntry] = {}
        self.registry = RolloutRegistry(
            result_wait_timeout_sec=result_wait_timeout_sec,
            polling_lease_timeout_sec=polling_lease_timeout_sec,
            result_retention_sec=result_retention_sec,
            on_lease_expired=self._expire_lease,
            on_removed=store.forget if store is not None else None,
        )
        self.artifact_root = artifact_root
        self.writer = TrajectoryWriter(artifact_root)
        self._server_secrets = tuple(server_secrets)
        self._admission = AdmissionEncoder(
            result_wait_timeout_sec=result_wait_timeout_sec,
            polling_lease_timeout_sec=polling_lease_timeout_sec,
        )

    # ------------------------------------------------------------------ admission

    def admit(self, request: RolloutInitRequest) -> Response:
        """503 while shutting down, 429 without capacity, 409 for a held id, else 202."""
        if not self.accepting:
            self.metrics.reject("shutting_down")
            return error_response(503, "rollout server is shutting down")
        if (reason := self.backend.unavailable_reason()) is not None:
            self.metrics.reject("unavailable")
            return error_response(503, reason, {"Retry-After": self.retry_after})
        try:
            entry, token = self.registry.admit(request.rollout_id)
        except DuplicateRolloutError:
            self.metrics.reject("duplicate")
            return error_response(409, "rollout_id is already registered")
        # Atomic with the check: nothing awaits between the reservation and the task.
        if not self.backend.reserve(request.rollout_id):
            self.registry.discard(entry)
            self.metrics.reject("queue_full")
            return error_response(
                429, "rollout queue is full; retry later", {"Retry-After": self.retry_after}
            )
        try:
            task = asyncio.create_task(self._execute(entry, request))
        except BaseException:
            self.backend.release(request.rollout_id)
            self.registry.discard(entry)
            raise
        entry.task = task
        self.tasks.add(task)
        self.live[request.rollout_id] = entry
        now = entry.wall_admitted = time.time()
        entry.metadata = request.metadata
        entry.task_name = task_of(request.metadata)
        if self.store is not None:
            self.store.admitted(
                request.rollout_id,
                entry.lease_digest,
                self._stored_request(request),
                task=entry.task_name,
                at=now,
            )
        task.add_done_callback(partial(self._task_done, entry))
        self.metrics.admit()
        body = self._admission.encode(request.rollout_id, token)
        return Response(body, 202, {FEATURES_HEADER: FEATURES}, JSON_CONTENT_TYPE)

    # ------------------------------------------------------------------ polling

    async def poll_result(self, rollout_id: str, token: str | None) -> Response:
        """``GET /rollout/{id}/result``: renews the lease, then parks until the status
        changes or the result wait passes; 422 without a token, 404, 403."""
        if not token:
            return validation_error_response([header_error(token)])
        self.metrics.poll()
        registry = self.registry
        entry = registry.get(rollout_id)
        if entry is None:
            return error_response(404, "unknown rollout_id")
        if not registry.token_matches(entry, token):
            return error_response(403, "invalid polling lease")
        if entry.final is None:
            if not registry.renew_lease(entry):
                self._expire_lease(entry)
            else:
                await registry.wait_for_change(entry, entry.status, self.result_wait_timeout_sec)
        final = entry.final
        body = final.body if final is not None else in_progress_body(rollout_id, entry.status)
        return Response(body, 200, None, JSON_CONTENT_TYPE)

    async def poll_status(
        self, rollout_id: str, seen: RolloutStatus | None, wait: float
    ) -> Response:
        """``GET /rollout/{id}/status``: without a lease; with ``seen`` and ``wait`` it
        parks until the status differs from ``seen`` (at most the result wait)."""
        entry = self.registry.get(rollout_id)
        if entry is None:
            # Not (or no longer) held here: an osmosis-ai backend may still know it.
            held = self.osmosis.retained_state(rollout_id) if self.osmosis else None
            if held is None:
                return error_response(404, "unknown rollout_id")
            return model_response(200, held)
        reported = self._reported_status(entry)
        if seen is not None and wait > 0 and seen is reported:
            # Parked on the server's own status, so a backend that reports a status of
            # its own cannot turn the long-poll into a busy loop.
            await self.registry.wait_for_change(
                entry, entry.status, min(wait, self.result_wait_timeout_sec)
            )
            reported = self._reported_status(entry)
        final = entry.final
        state = RolloutStatusResponse(
            rollout_id=rollout_id,
            status=reported,
            reward=final.reward if final else None,
            err_message=final.err_message if final else None,
            err_category=final.err_category if final else None,
        )
        return model_response(200, state)

    def _reported_status(self, entry: RolloutEntry) -> RolloutStatus:
        """The server's status; an osmosis-ai backend's own while it runs, when that
        one is further on (it never pushes, osmosis-ai's servers pull)."""
        if self.osmosis is None or entry.final is not None:
            return entry.status
        return self.osmosis.live_status(entry.rollout_id, entry.status)

    # ------------------------------------------------------------------ execution

    async def _execute(self, entry: RolloutEntry, request: RolloutInitRequest) -> None:
        context = RolloutContext(
            chat_completions_url=request.chat_completions_url,
            api_key=request.llm_api_key,
            rollout_id=request.rollout_id,
            on_status=partial(self._set_status, entry),
        )
        entry.context = context
        if not self.backend.reports_running:
            context.update_status(RolloutStatus.RUNNING)
        # Already validated as RolloutInitRequest: skip a second validation.
        execution = ExecutionRequest.model_construct(
            id=request.rollout_id,
            prompt=request.initial_messages,
            **{name: getattr(request, name) for name in _PASSED_TO_BACKEND},
        )
        if not self.backend.reports_agent_start:
            context.record_agent_start()
        try:
            with context:
                outcome = await self.backend.execute(execution, context)
            result = outcome.result
            to_save = outcome.result_to_save
        except asyncio.CancelledError:
            self._finish(entry, cancelled_result(request.rollout_id, "cancelled"))
            raise
        except Exception as exc:
            logger.error("rollout %s: backend raised", request.rollout_id, exc_info=True)
            result = ExecutionResult(
                status=RolloutStatus.FAILURE,
                err_message=str(exc) or "Internal server error",
                err_category=categorize_exception(exc),
            )
            to_save = None
        if result.status not in TERMINAL_STATUSES:
            result = ExecutionResult(
                status=RolloutStatus.FAILURE,
                sample=result.sample,
                err_message=f"backend returned the non-terminal status {result.status.value!r}",
                err_category=RolloutErrorCategory.INTERNAL_ERROR,
            )
        if to_save is not None and to_save.status is not RolloutStatus.CANCELLED:
            self.writer.save(
                request.rollout_id,
                sample=to_save.sample,
                diagnostics=to_save.extra_fields,
                label=request.label,
                metadata=request.metadata,
                extra_fields=request.extra_fields,
                secrets=(*self._server_secrets, request.llm_api_key or ""),
            )
        if self.registry.lease_expired(entry):
            # Nobody renewed the lease in time: report that, not a late result.
            self._finish(entry, lease_expired_result(request.rollout_id))
        else:
            info = None
            if result.extra_fields or result.err_message:
                info = rollout_info(result, (*self._server_secrets, request.llm_api_key or ""))
            self._finish(
                entry, final_result(request.rollout_id, result, context.agent_started_at), info
            )

    def _stored_request(self, request: RolloutInitRequest) -> str:
        """The request as the store keeps it: without ``llm_api_key``, and with the key
        (and the server's) scrubbed wherever else it appears (a URL, metadata)."""
        text = request.model_dump_json(exclude={"llm_api_key"})
        for secret in needles((request.llm_api_key, *self._server_secrets)):
            for form in (secret, json.dumps(secret, ensure_ascii=False)[1:-1]):
                if form in text:
                    text = text.replace(form, REDACTED)
        return text

    def _set_status(self, entry: RolloutEntry, status: RolloutStatus) -> None:
        before = entry.status
        self.registry.set_status(entry, status)
        if entry.status is not before:
            running_at = None
            if entry.status is RolloutStatus.RUNNING and entry.wall_running is None:
                running_at = entry.wall_running = time.time()
            if self.store is not None:
                self.store.status(entry.rollout_id, entry.status.value, running_at=running_at)

    def _finish(
        self, entry: RolloutEntry, final: FinalResult, info: dict[str, Any] | None = None
    ) -> None:
        if self.registry.finish(entry, final):
            wall = entry.wall_finished = time.time()
            if info is not None:
                entry.info = info
                reported = info.get("task")
                if reported is not None:
                    entry.task_name = reported
            category = final.err_category.value if final.err_category else None
            if self.store is not None:
                self.store.finished(
                    entry.rollout_id,
                    status=final.status.value,
                    body=final.body,
                    reward=final.reward,
                    err_message=final.err_message,
                    err_category=category,
                    task=entry.task_name,
                    detail=json.dumps(info) if info is not None else None,
                    at=wall,
                )
            if self.live.get(entry.rollout_id) is entry:
                del self.live[entry.rollout_id]
            entry.context = None
            now = self.registry.loop.time()
            self.metrics.complete(final.status.value, category, now - entry.admitted_at)
            reason = info.get("reason") if info is not None else None
            if reason is None:
                reason = final.err_message
            self.console.finished(
                entry,
                status=final.status.value,
                reward=final.reward,
                err_category=category,
                reason=reason,
                info=info,
            )
            if self.report is not None:
                self.report.finished(
                    entry.rollout_id,
                    task=entry.task_name,
                    status=final.status.value,
                    reward=final.reward,
                    seconds=now - entry.admitted_at,
                    err_category=category,
                    reason=reason,
                )
            if final.reward is not None:
                self.metrics.observe_reward(final.reward)
            if entry.running_at is not None:
                self.metrics.queued_seconds.observe(entry.running_at - entry.admitted_at)

    def _task_done(self, entry: RolloutEntry, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.backend.release(entry.rollout_id)
        if task.cancelled():
            # Cancelled before it ever ran: no message, as in the reference.
            self._finish(entry, cancelled_result(entry.rollout_id, None))
        elif (exc := task.exception()) is not None:
            logger.error("rollout %s: task crashed", entry.rollout_id, exc_info=exc)
            self._finish(
                entry,
                failed_result(
                    entry.rollout_id, "rollout task crashed", RolloutErrorCategory.INTERNAL_ERROR
                ),
            )
        self.registry.task_done(entry)

    # ------------------------------------------------------------------ cancellation

    def _expire_lease(self, entry: RolloutEntry) -> None:
        self._finish(entry, lease_expired_result(entry.rollout_id))
        self._cancel_execution(entry)

    def cancel(self, *, ids: list[str] | None, prefix: str | None, all: bool) -> dict[str, str]:
        """Cancel the selected live rollouts; finished, unknown or already-cancelled
        ones answer ``not_found`` (so a repeated cancel is ``not_found``)."""
        dispositions: dict[str, str] = {}
        for rollout_id in self.registry.select(ids=ids, prefix=prefix, all=all):
            entry = self.registry.get(rollout_id)
            if entry is None or entry.finished or entry.cancel_requested:
                dispositions[rollout_id] = CancelDisposition.NOT_FOUND
            else:
                dispositions[rollout_id] = self._cancel_execution(entry)
        return dispositions

    def _cancel_execution(self, entry: RolloutEntry) -> str:
        """The one cancel path: the backend stops the rollout itself (``cancel`` says
        True), else its ``execute`` task is cancelled."""
        entry.cancel_requested = True
        disposition: str = (
            CancelDisposition.CANCELLED_QUEUED
            if entry.status is RolloutStatus.QUEUED
            else CancelDisposition.CANCELLED_RUNNING
        )
        try:
            handled = self.backend.cancel(entry.rollout_id)
        except Exception:
            logger.exception("rollout %s: backend cancellation failed", entry.rollout_id)
            handled = False
        task = entry.task
        if (
            not handled
            and task is not None
            and not task.done()
            and task is not asyncio.current_task()
        ):
            task.cancel()
        return disposition

    # ------------------------------------------------------------------ listing

    async def list_rollouts(self, query: RolloutQuery) -> RolloutList:
        """``GET /rollouts``: from the store (history included) or the registry."""
        wider = RolloutQuery(
            status=query.status,
            task=query.task,
            since=query.since,
            until=query.until,
            before=query.before,
            limit=query.limit + 1,
        )
        if self.store is not None:
            records = await anyio.to_thread.run_sync(self.store.page, wider)
        else:
            records = select_entries(self.registry.entries.values(), wider)
        return page_of(records, query.limit)

    async def rollout_detail(self, rollout_id: str) -> RolloutDetail | None:
        """``GET /rollouts/{id}``: its newest rollout, None when unknown."""
        if self.store is not None:
            record = await anyio.to_thread.run_sync(self.store.find, rollout_id)
        else:
            entry = self.registry.get(rollout_id)
            record = record_of(entry) if entry is not None else None
        if record is None:
            return None
        return await anyio.to_thread.run_sync(
            detail_of, record, self.artifact_root, self._server_secrets
        )

    def console_data(self) -> dict[str, Any]:
        """``GET /console/data``: the console's figures (``console.ConsoleStats``)."""
        counts = self.registry.live_counts
        try:
            nodes = self.queue_info().nodes
        except Exception:
            nodes = None
        return self.console.data(
            self.live.values(),
            {status.value: count for status, count in counts.items()},
            nodes=[node.model_dump(mode="json") for node in nodes] if nodes else None,
            package_cache=package_cache_figures(),
        )

    async def rollout_file(self, rollout_id: str, name: str) -> tuple[bytes, str] | None:
        """``GET /rollouts/{id}/files/{name}``: a file of its newest rollout, None when
        there is none."""
        if self.store is not None:
            record = await anyio.to_thread.run_sync(self.store.find, rollout_id)
        else:
            entry = self.registry.get(rollout_id)
            record = record_of(entry) if entry is not None else None
        if record is None:
            return None
        return await anyio.to_thread.run_sync(
            read_file, record, self.artifact_root, name, self._server_secrets
        )

    # ------------------------------------------------------------------ reporting

    def lifecycle(self) -> RolloutLifecycle:
        accepting = self.accepting and self.backend.unavailable_reason() is None
        return RolloutLifecycle(accepting_rollouts=accepting, active_rollouts=len(self.tasks))

    def live_counts(self) -> tuple[int, int]:
        """(queued, running) rollouts now, grading counted as running."""
        counts = self.registry.live_counts
        return (
            counts[RolloutStatus.QUEUED],
            counts[RolloutStatus.RUNNING] + counts[RolloutStatus.GRADING],
        )

    def queue_info(self) -> QueueInfo:
        """The backend's queue, with what it does not track filled in from the registry."""
        info = self.backend.queue_info()
        counts = self.registry.live_counts
        if info.queued is None:
            info.queued = counts[RolloutStatus.QUEUED]
        if info.running is None:
            info.running = counts[RolloutStatus.RUNNING] + counts[RolloutStatus.GRADING]
        return info

    def render_metrics(self) -> str:
        self.metrics.trajectories_dropped = self.writer.dropped
        counts = self.registry.live_counts
        queue = self.queue_info()
        gauges: dict[str, tuple[str, float | int | None]] = {
            "harbor_exec_rollouts_active": ("Admitted rollouts not finished.", len(self.tasks)),
            "harbor_exec_rollouts_queued": (
                "Rollouts waiting to run.",
                counts[RolloutStatus.QUEUED],
            ),
            "harbor_exec_rollouts_running": ("Rollouts running.", counts[RolloutStatus.RUNNING]),
            "harbor_exec_rollouts_grading": ("Rollouts grading.", counts[RolloutStatus.GRADING]),
            "harbor_exec_rollouts_retained": (
                "Rollout ids held (active or retained).",
                len(self.registry.entries),
            ),
            "harbor_exec_backend_queue_depth": (
                "Rollouts queued inside the backend.",
                queue.queued,
            ),
            "harbor_exec_backend_capacity": (
                "Rollouts the backend runs at once.",
                queue.capacity,
            ),
            "harbor_exec_accepting_rollouts": ("1 while admitting.", int(self.accepting)),
        }
        return self.metrics.render(gauges, nodes=queue.nodes or ())

    # ------------------------------------------------------------------ restart

    def restore(self) -> None:
        """Serve again what a previous process admitted (from ``store``): finished
        results within their retention, and a terminal ``internal_error`` for what
        was queued or running when it died."""
        if self.store is None:
            return
        now = time.time()
        restored: list[tuple[float, str, bytes, FinalResult]] = []
        interrupted: list[str] = []
        for row in self.store.load():
            if row.final_body is not None and row.finished_at is not None:
                left = row.finished_at + self.result_retention_sec - now
                if left <= 0:
                    self.store.forget(row.rollout_id)
                    continue
                category = RolloutErrorCategory(row.err_category) if row.err_category else None
                final = FinalResult(
                    status=RolloutStatus(row.status),
                    body=row.final_body,
                    reward=row.reward,
                    err_message=row.err_message,
                    err_category=category,
                )
            else:
                interrupted.append(row.rollout_id)
                final = failed_result(
                    row.rollout_id, RESTARTED_MESSAGE, RolloutErrorCategory.INTERNAL_ERROR
                )
                left = self.result_retention_sec
                self.store.finished(
                    row.rollout_id,
                    status=final.status.value,
                    body=final.body,
                    reward=None,
                    err_message=final.err_message,
                    err_category=RolloutErrorCategory.INTERNAL_ERROR.value,
                )
            restored.append((left, row.rollout_id, row.lease_digest, final))
        for left, rollout_id, digest, final in sorted(restored, key=lambda item: item[0]):
            self.registry.restore(rollout_id, digest, final, left)
        if interrupted:
            logger.warning(
                "%d rollout(s) were running when the previous server stopped; they end as "
                "internal_error",
                len(interrupted),
            )
            try:
                self.backend.recover_interrupted(interrupted)
            except Exception:
                logger.exception("backend.recover_interrupted failed")
        self.store.flush()
        try:
            self.console.seed(self.store.history(SEED_ROWS))
        except Exception:  # the console is a view: it must not stop the server
            logger.exception("reading finished rollouts back into the console failed")

    # ------------------------------------------------------------------ shutdown

    async def shutdown(self) -> None:
        """Stop admitting, drain, cancel what is left, then shut the backend down."""
        self.accepting = False
        pending: set[asyncio.Task[None]] = set(self.tasks)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=self.shutdown_drain_sec)
        if pending:
            self.cancel(ids=None, prefix=None, all=True)
            _, pending = await asyncio.wait(pending, timeout=self.shutdown_cleanup_sec)
        if pending:
            print(
                f"rollout server shutdown: {len(pending)} rollout(s) did not stop after "
                "cancellation; forcing them",
                flush=True,
            )
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=self.shutdown_drain_sec)
        try:
            await self.backend.shutdown()
        except Exception:
            logger.exception("backend shutdown failed")
        self.registry.close()
        await asyncio.to_thread(self.writer.close)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
