"""The rollout HTTP server: the osmosis-ai 0.3.8 wire protocol plus our additions.

Reference routes (unchanged semantics): ``GET /health``, ``POST /rollout``,
``GET /rollout/{id}/result`` (lease header, long-poll), ``POST /rollout/cancel``.
Additions: ``GET /rollout/{id}/status`` (no lease; optional long-poll via
``?status=<seen>&wait=<sec>``), ``GET /queue``, ``POST /prewarm``, ``GET /metrics``.

Routes read raw bodies and return pre-serialized bytes: validation is pydantic's
``model_validate_json`` (errors in FastAPI's ``{"detail": [...]}`` shape, 422),
and nothing is logged per request. That keeps server CPU per rollout low.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from harbor_exec.authoring import RolloutContext
from harbor_exec.backends.base import ExecutionBackend, default_artifact_root
from harbor_exec.protocol import (
    DEFAULT_MAX_TIMEOUT_SEC,
    FEATURES_HEADER,
    POLLING_LEASE_HEADER,
    STATUS_WAIT_FEATURE,
    TERMINAL_STATUSES,
    CancelDisposition,
    CancelRolloutsRequest,
    ExecutionRequest,
    ExecutionResult,
    RolloutErrorCategory,
    RolloutInitRequest,
    RolloutResultResponse,
    RolloutSample,
    RolloutStatus,
    categorize_exception,
    check_timeouts,
)
from harbor_exec.server.metrics import PROMETHEUS_CONTENT_TYPE, ServerMetrics
from harbor_exec.server.openapi import route_docs
from harbor_exec.server.registry import (
    DuplicateRolloutError,
    FinalResult,
    RolloutEntry,
    RolloutRegistry,
)
from harbor_exec.server.store import RESTARTED_MESSAGE, RolloutStore
from harbor_exec.server.trajectory import TrajectoryWriter

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_POLLING_LEASE_TIMEOUT_SEC",
    "DEFAULT_RESULT_RETENTION_SEC",
    "DEFAULT_RESULT_WAIT_TIMEOUT_SEC",
    "FEATURES_HEADER",
    "PrewarmRequest",
    "RolloutService",
    "create_rollout_server",
]

logger = logging.getLogger(__name__)

DEFAULT_RESULT_WAIT_TIMEOUT_SEC: Final = 30.0
DEFAULT_POLLING_LEASE_TIMEOUT_SEC: Final = 120.0
DEFAULT_RESULT_RETENTION_SEC: Final = 900.0
DEFAULT_MAX_BODY_BYTES: Final = 8 * 1024 * 1024
DEFAULT_RETRY_AFTER_SEC: Final = 1
SHUTDOWN_DRAIN_SEC: Final = 10.0
SHUTDOWN_CLEANUP_SEC: Final = 120.0

# Sent in FEATURES_HEADER with every 202, so our client knows it may use the status long-poll.
FEATURES: Final = STATUS_WAIT_FEATURE
INSTANCE_ID_ENVS: Final = ("HARBOR_EXEC_INSTANCE_ID", "_OSMOSIS_ROLLOUT_INSTANCE_ID")

_JSON: Final = "application/json"
# The request's fields a backend gets as they are, under the same name (``ExecutionRequest``).
_PASSED_TO_BACKEND: Final = (
    "label",
    "metadata",
    "agent_timeout_sec",
    "grader_timeout_sec",
    "grade",
)
_MAX_ECHOED_INPUT_CHARS: Final = 1024

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[Any]]


class PrewarmRequest(BaseModel):
    """Body of ``POST /prewarm``: ``{"task_ids": [...]}`` or ``{"all": true}``."""

    task_ids: list[str] | None = None
    all: bool = False


# ---------------------------------------------------------------------------- responses


def _json(status_code: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(payload).encode(), status_code, headers, _JSON)


def _detail(status_code: int, detail: Any, headers: dict[str, str] | None = None) -> Response:
    return _json(status_code, {"detail": detail}, headers)


def _echo_input(value: Any) -> Any:
    """An error's ``input`` as JSON-safe and short (never the whole 8 MiB body)."""
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)[:_MAX_ECHOED_INPUT_CHARS]
    if len(encoded) > _MAX_ECHOED_INPUT_CHARS:
        return f"<{len(encoded)} characters omitted>"
    return value


def _validation_errors(exc: ValidationError, where: str) -> list[dict[str, Any]]:
    """pydantic errors in FastAPI's shape, ``loc`` starting with ``where`` (e.g. "body")."""
    errors: list[dict[str, Any]] = []
    for error in exc.errors(include_url=False):
        item: dict[str, Any] = {
            "type": error["type"],
            "loc": [where, *error["loc"]],
            "msg": error["msg"],
            "input": _echo_input(error.get("input")),
        }
        context = error.get("ctx")
        if context:
            item["ctx"] = {key: _echo_input(value) for key, value in context.items()}
        errors.append(item)
    return errors


class _BodyTooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (``_BodyTooLarge``) more than ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        with contextlib.suppress(ValueError):
            if int(declared) > limit:
                raise _BodyTooLarge
        body = await request.body()
        if len(body) > limit:
            raise _BodyTooLarge
        return body
    # Chunked upload: count as it streams instead of buffering without bound.
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> Response:
    return _detail(413, f"request body exceeds the {limit}-byte limit")


def _sanitize_text(text: str | None) -> str | None:
    # Lone surrogates (from undecodable bytes) cannot be encoded as UTF-8 JSON.
    return None if text is None else text.encode("utf-8", "replace").decode("utf-8")


# ---------------------------------------------------------------------------- auth


class BearerAuthMiddleware:
    """Requires ``Authorization: Bearer <api_key>`` on every HTTP request (pure ASGI)."""

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            supplied = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    supplied = value
                    break
            if not hmac.compare_digest(supplied, self._expected):
                await _detail(401, "unauthorized")(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------- service


class RolloutService:
    """Admission, execution, results and shutdown; the routes are thin wrappers."""

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
    ) -> None:
        self.backend = backend
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
        self.registry = RolloutRegistry(
            result_wait_timeout_sec=result_wait_timeout_sec,
            polling_lease_timeout_sec=polling_lease_timeout_sec,
            result_retention_sec=result_retention_sec,
            on_lease_expired=self._expire_lease,
            on_removed=store.forget if store is not None else None,
        )
        self.writer = TrajectoryWriter(artifact_root)
        self._server_secrets = tuple(server_secrets)
        # Constant tail of every 202 body.
        self._admission_tail = (
            f',"result_wait_timeout_sec":{result_wait_timeout_sec!r}'
            f',"polling_lease_timeout_sec":{polling_lease_timeout_sec!r}}}'
        ).encode()

    # ------------------------------------------------------------------ admission

    def admit(self, request: RolloutInitRequest) -> Response:
        """503 while shutting down, 429 without capacity, 409 for a held id, else 202."""
        if not self.accepting:
            self.metrics.reject("shutting_down")
            return _detail(503, "rollout server is shutting down")
        if (reason := self.backend.unavailable_reason()) is not None:
            self.metrics.reject("unavailable")
            return _detail(503, reason, {"Retry-After": self.retry_after})
        if not self.backend.has_capacity():
            self.metrics.reject("queue_full")
            return _detail(
                429, "rollout queue is full; retry later", {"Retry-After": self.retry_after}
            )
        try:
            entry, token = self.registry.admit(request.rollout_id)
        except DuplicateRolloutError:
            self.metrics.reject("duplicate")
            return _detail(409, "rollout_id is already registered")
        try:
            task = asyncio.create_task(self._execute(entry, request))
        except BaseException:
            self.registry.discard(entry)
            raise
        entry.task = task
        self.tasks.add(task)
        if self.store is not None:
            self.store.admitted(
                request.rollout_id,
                entry.lease_digest,
                request.model_dump_json(exclude={"llm_api_key"}),
            )
        task.add_done_callback(partial(self._task_done, entry))
        self.metrics.admit()
        body = b"".join(
            (
                b'{"rollout_id":',
                json.dumps(request.rollout_id).encode(),
                b',"status":"queued","polling_lease_token":"',
                token.encode(),
                b'"',
                self._admission_tail,
            )
        )
        return Response(body, 202, {FEATURES_HEADER: FEATURES}, _JSON)

    # ------------------------------------------------------------------ execution

    async def _execute(self, entry: RolloutEntry, request: RolloutInitRequest) -> None:
        context = RolloutContext(
            chat_completions_url=request.chat_completions_url,
            api_key=request.llm_api_key,
            rollout_id=request.rollout_id,
            on_status=partial(self._set_status, entry),
        )
        if not self.backend.reports_running:
            context.update_status(RolloutStatus.RUNNING)
        # Already validated as RolloutInitRequest: skip a second validation.
        execution = ExecutionRequest.model_construct(
            id=request.rollout_id,
            prompt=request.initial_messages,
            **{name: getattr(request, name) for name in _PASSED_TO_BACKEND},
        )
        try:
            with context:
                outcome = await self.backend.execute(execution)
            result = outcome.result
            to_save = outcome.result_to_save
        except asyncio.CancelledError:
            self._finish(entry, _cancelled(request.rollout_id, "cancelled"))
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
            self._finish(entry, _lease_failure(request.rollout_id))
        else:
            self._finish(entry, _final_result(request.rollout_id, result))

    def _set_status(self, entry: RolloutEntry, status: RolloutStatus) -> None:
        before = entry.status
        self.registry.set_status(entry, status)
        if self.store is not None and entry.status is not before:
            self.store.status(entry.rollout_id, entry.status.value)

    def _finish(self, entry: RolloutEntry, final: FinalResult) -> None:
        if self.registry.finish(entry, final):
            if self.store is not None:
                self.store.finished(
                    entry.rollout_id,
                    status=final.status.value,
                    body=final.body,
                    reward=final.reward,
                    err_message=final.err_message,
                    err_category=final.err_category.value if final.err_category else None,
                )
            now = self.registry.loop.time()
            category = final.err_category.value if final.err_category else None
            self.metrics.complete(final.status.value, category, now - entry.admitted_at)
            if entry.running_at is not None:
                self.metrics.queued_seconds.observe(entry.running_at - entry.admitted_at)

    def _task_done(self, entry: RolloutEntry, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task.cancelled():
            # Cancelled before it ever ran: no message, as in the reference.
            self._finish(entry, _cancelled(entry.rollout_id, None))
        elif (exc := task.exception()) is not None:
            logger.error("rollout %s: task crashed", entry.rollout_id, exc_info=exc)
            self._finish(
                entry,
                _failure(
                    entry.rollout_id, "rollout task crashed", RolloutErrorCategory.INTERNAL_ERROR
                ),
            )
        self.registry.task_done(entry)

    # ------------------------------------------------------------------ cancellation

    def _expire_lease(self, entry: RolloutEntry) -> None:
        self._finish(entry, _lease_failure(entry.rollout_id))
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
        live = task is not None and not task.done() and task is not asyncio.current_task()
        if not handled and live and task is not None:
            task.cancel()
        return disposition

    # ------------------------------------------------------------------ reporting

    def lifecycle(self) -> dict[str, Any]:
        accepting = self.accepting and self.backend.unavailable_reason() is None
        return {"accepting_rollouts": accepting, "active_rollouts": len(self.tasks)}

    def queue_info(self) -> dict[str, Any]:
        info = self.backend.queue_info()
        counts = self.registry.live_counts
        if info.queued is None:
            info.queued = counts[RolloutStatus.QUEUED]
        if info.running is None:
            info.running = counts[RolloutStatus.RUNNING] + counts[RolloutStatus.GRADING]
        return info.model_dump(exclude={"nodes"} if info.nodes is None else None)

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
                _number_or_none(queue.get("queued")),
            ),
            "harbor_exec_backend_capacity": (
                "Rollouts the backend runs at once.",
                _number_or_none(queue.get("capacity")),
            ),
            "harbor_exec_accepting_rollouts": ("1 while admitting.", int(self.accepting)),
        }
        return self.metrics.render(gauges, nodes=self.backend.queue_info().nodes or ())

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
                final = _failure(
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


def _number_or_none(value: Any) -> float | int | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


# ---------------------------------------------------------------------------- final results


def _encode_result(response: RolloutResultResponse) -> bytes:
    return response.model_dump_json(exclude={"sample": {"trajectory_messages"}}).encode()


def _final_result(rollout_id: str, result: ExecutionResult) -> FinalResult:
    """The wire result: reward nulled unless success and kept; no trajectory_messages."""
    sample = result.sample
    reward = None
    if sample is not None:
        sample = sample.json_safe_copy()
        if result.status is RolloutStatus.SUCCESS and not sample.remove_sample:
            reward = sample.reward
        elif sample.reward is not None:
            sample = sample.model_copy(update={"reward": None})
    response = RolloutResultResponse(
        rollout_id=rollout_id,
        status=result.status,
        sample=sample,
        err_message=_sanitize_text(result.err_message),
        err_category=result.err_category,
    )
    try:
        body = _encode_result(response)
    except ValueError:
        # Free-form messages hold something JSON cannot carry: the reward must
        # still be deliverable.
        logger.warning("rollout %s: sample not serializable; sending its reward only", rollout_id)
        assert sample is not None  # only sample content can fail to encode
        response.sample = RolloutSample(
            reward=sample.reward,
            label=_sanitize_text(sample.label),
            remove_sample=sample.remove_sample,
            trajectory_messages=None,
        )
        body = _encode_result(response)
    return FinalResult(
        status=result.status,
        body=body,
        reward=reward,
        err_message=response.err_message,
        err_category=result.err_category,
    )


def _failure(rollout_id: str, message: str, category: RolloutErrorCategory) -> FinalResult:
    return _final_result(
        rollout_id,
        ExecutionResult(status=RolloutStatus.FAILURE, err_message=message, err_category=category),
    )


def _lease_failure(rollout_id: str) -> FinalResult:
    return _failure(rollout_id, "polling lease expired", RolloutErrorCategory.LEASE_EXPIRED)


def _cancelled(rollout_id: str, message: str | None) -> FinalResult:
    return _final_result(
        rollout_id, ExecutionResult(status=RolloutStatus.CANCELLED, err_message=message)
    )


def _in_progress(rollout_id: str, status: RolloutStatus) -> bytes:
    return (
        f'{{"rollout_id":{json.dumps(rollout_id)},"status":"{status.value}",'
        '"sample":null,"err_message":null,"err_category":null}'
    ).encode()


# ---------------------------------------------------------------------------- the app


def create_rollout_server(
    *,
    backend: ExecutionBackend,
    lifespan: Lifespan | None = None,
    result_wait_timeout_sec: float = DEFAULT_RESULT_WAIT_TIMEOUT_SEC,
    polling_lease_timeout_sec: float = DEFAULT_POLLING_LEASE_TIMEOUT_SEC,
    result_retention_sec: float = DEFAULT_RESULT_RETENTION_SEC,
    api_key: str | None = None,
    artifact_root: Path | str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    retry_after_sec: int = DEFAULT_RETRY_AFTER_SEC,
    shutdown_drain_sec: float = SHUTDOWN_DRAIN_SEC,
    shutdown_cleanup_sec: float = SHUTDOWN_CLEANUP_SEC,
    max_timeout_sec: float = DEFAULT_MAX_TIMEOUT_SEC,
    data_dir: Path | str | None = None,
) -> FastAPI:
    """Build the FastAPI app that serves rollouts from ``backend``.

    ``lifespan`` (e.g. a backend's prewarm) is entered before serving and exited
    last. ``artifact_root`` (default ``$HARBOR_EXEC_ARTIFACT_ROOT`` or
    ``~/.harbor-exec/rollouts``) receives ``<id>/trajectory.json``. Bodies over
    ``max_body_bytes`` get 413. Raises ``ValueError`` for inconsistent timeouts.
    """
    if not math.isfinite(result_wait_timeout_sec) or result_wait_timeout_sec <= 0:
        raise ValueError("result_wait_timeout_sec must be finite and greater than zero")
    if not math.isfinite(result_retention_sec) or result_retention_sec < 0:
        raise ValueError("result_retention_sec must be finite and non-negative")
    if not math.isfinite(polling_lease_timeout_sec) or (
        polling_lease_timeout_sec <= result_wait_timeout_sec
    ):
        raise ValueError(
            "polling_lease_timeout_sec must be finite and exceed result_wait_timeout_sec"
        )
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key must be non-empty when given")
    if not math.isfinite(max_timeout_sec) or max_timeout_sec <= 0:
        raise ValueError("max_timeout_sec must be finite and greater than zero")
    if max_body_bytes < 1:
        raise ValueError("max_body_bytes must be at least 1")

    service = RolloutService(
        backend,
        result_wait_timeout_sec=result_wait_timeout_sec,
        polling_lease_timeout_sec=polling_lease_timeout_sec,
        result_retention_sec=result_retention_sec,
        artifact_root=Path(artifact_root).expanduser()
        if artifact_root
        else default_artifact_root(),
        server_secrets=(api_key,) if api_key else (),
        retry_after_sec=retry_after_sec,
        shutdown_drain_sec=shutdown_drain_sec,
        shutdown_cleanup_sec=shutdown_cleanup_sec,
        store=RolloutStore(data_dir) if data_dir is not None else None,
    )
    registry = service.registry
    wait_sec = result_wait_timeout_sec
    docs = route_docs(max_timeout_sec=max_timeout_sec, auth=api_key is not None)

    @asynccontextmanager
    async def app_lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            await anyio.to_thread.run_sync(backend.start)
            service.restore()
            if lifespan is not None:
                await stack.enter_async_context(lifespan(app))
            try:
                yield
            finally:
                await service.shutdown()

    app = FastAPI(title="harbor-exec rollout server", lifespan=app_lifespan)
    app.state.rollout_service = service
    if api_key is not None:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key)

    @app.get("/health", **docs["health"])
    async def health() -> Response:
        try:
            payload = backend.health().model_dump(mode="json")
        except Exception as exc:
            # /health answers 200 whatever the backend's state: it is how operators
            # and harnesses learn that state.
            logger.warning("backend.health() failed", exc_info=True)
            payload = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:500]}
        payload["instance_id"] = service.instance_id
        payload["process_id"] = service.process_id
        payload["lifecycle"] = service.lifecycle()
        return _json(200, payload)

    @app.post("/rollout", status_code=202, **docs["submit"])
    async def submit_rollout(request: Request) -> Response:
        """Admit a rollout (body: RolloutInitRequest); 202 with a polling lease token."""
        try:
            body = await _read_body(request, max_body_bytes)
        except _BodyTooLarge:
            service.metrics.reject("too_large")
            return _too_large(max_body_bytes)
        try:
            init = RolloutInitRequest.model_validate_json(body)
        except ValidationError as exc:
            service.metrics.reject("invalid")
            return _detail(422, _validation_errors(exc, "body"))
        if (init.agent_timeout_sec is not None or init.grader_timeout_sec is not None) and (
            errors := check_timeouts(init, max_timeout_sec)
        ):
            service.metrics.reject("invalid")
            return _detail(422, errors)
        return service.admit(init)

    @app.get("/rollout/{rollout_id}/result", **docs["result"])
    async def rollout_result(request: Request) -> Response:
        """Long-poll: parks until the status changes or the wait passes. Needs the lease."""
        token = request.headers.get(POLLING_LEASE_HEADER)
        if not token:
            return _detail(422, [_header_error(token)])
        service.metrics.poll()
        rollout_id: str = request.path_params["rollout_id"]
        entry = registry.get(rollout_id)
        if entry is None:
            return _detail(404, "unknown rollout_id")
        if not registry.token_matches(entry, token):
            return _detail(403, "invalid polling lease")
        if entry.final is None:
            if not registry.renew_lease(entry):
                service._expire_lease(entry)
            else:
                await registry.wait_for_change(entry, entry.status, wait_sec)
        final = entry.final
        body = final.body if final is not None else _in_progress(rollout_id, entry.status)
        return Response(body, 200, None, _JSON)

    @app.get("/rollout/{rollout_id}/status", **docs["status"])
    async def rollout_status(request: Request) -> Response:
        """Current status without a lease. With ``?status=<seen>&wait=<sec>`` it parks
        until the status differs from ``seen`` (at most the server's result wait)."""
        rollout_id: str = request.path_params["rollout_id"]
        query = request.query_params
        seen_raw = query.get("status")
        wait_raw = query.get("wait")
        seen: RolloutStatus | None = None
        wait = 0.0
        if seen_raw is not None:
            try:
                seen = RolloutStatus(seen_raw)
            except ValueError:
                return _detail(422, [_query_error("status", seen_raw, "a rollout status")])
        if wait_raw is not None:
            try:
                wait = float(wait_raw)
            except ValueError:
                wait = math.nan
            if not math.isfinite(wait) or wait < 0:
                return _detail(
                    422, [_query_error("wait", wait_raw, "a finite number of seconds >= 0")]
                )
        entry = registry.get(rollout_id)
        if entry is None:
            return _detail(404, "unknown rollout_id")
        if seen is not None and wait > 0:
            await registry.wait_for_change(entry, seen, min(wait, wait_sec))
        final = entry.final
        return _json(
            200,
            {
                "rollout_id": rollout_id,
                "status": entry.status.value,
                "reward": final.reward if final else None,
                "err_message": final.err_message if final else None,
                "err_category": final.err_category if final else None,
            },
        )

    @app.post("/rollout/cancel", **docs["cancel"])
    async def cancel_rollouts(request: Request) -> Response:
        """Cancel by exactly one selector: ``ids``, ``prefix`` or ``all``."""
        try:
            body = await _read_body(request, max_body_bytes)
        except _BodyTooLarge:
            return _too_large(max_body_bytes)
        try:
            selector = CancelRolloutsRequest.model_validate_json(body)
        except ValidationError as exc:
            return _detail(422, _validation_errors(exc, "body"))
        if selector.selector_count() != 1:
            return _detail(422, "pass exactly one selector: ids, prefix, or all")
        dispositions = service.cancel(ids=selector.ids, prefix=selector.prefix, all=selector.all)
        return _json(200, {"dispositions": dispositions})

    @app.get("/queue", **docs["queue"])
    async def queue() -> Response:
        """Backend queue depth: ``queued``, ``running``, ``capacity``, ``max_queue_depth``."""
        return _json(200, service.queue_info())

    @app.post("/prewarm", **docs["prewarm"])
    async def prewarm(request: Request) -> Response:
        """Prepare tasks ahead of rollouts: ``{"task_ids": [...]}`` or ``{"all": true}``."""
        try:
            body = await _read_body(request, max_body_bytes)
        except _BodyTooLarge:
            return _too_large(max_body_bytes)
        try:
            selector = PrewarmRequest.model_validate_json(body)
        except ValidationError as exc:
            return _detail(422, _validation_errors(exc, "body"))
        if (selector.task_ids is not None) + selector.all != 1:
            return _detail(422, "pass exactly one of task_ids or all=true")
        if not service.accepting:
            return _detail(503, "rollout server is shutting down")
        try:
            summary = await backend.prewarm(None if selector.all else selector.task_ids)
        except (ValueError, KeyError, LookupError) as exc:
            return _detail(400, f"prewarm refused: {exc}")
        except Exception as exc:
            logger.exception("prewarm failed")
            return _detail(500, f"prewarm failed: {type(exc).__name__}: {exc}")
        return _json(200, summary.model_dump())

    @app.get("/metrics", response_class=PlainTextResponse, **docs["metrics"])
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(service.render_metrics(), 200, None, PROMETHEUS_CONTENT_TYPE)

    return app


def _header_error(value: str | None) -> dict[str, Any]:
    if value is None:
        return {
            "type": "missing",
            "loc": ["header", POLLING_LEASE_HEADER],
            "msg": "Field required",
            "input": None,
        }
    return {
        "type": "string_too_short",
        "loc": ["header", POLLING_LEASE_HEADER],
        "msg": "String should have at least 1 character",
        "input": value,
        "ctx": {"min_length": 1},
    }


def _query_error(name: str, value: str, expected: str) -> dict[str, Any]:
    return {
        "type": "value_error",
        "loc": ["query", name],
        "msg": f"{name} must be {expected}",
        "input": value,
    }
