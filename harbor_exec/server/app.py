"""The rollout HTTP server: the osmosis-ai 0.3.8 wire protocol plus our additions.

Reference routes (unchanged semantics): ``GET /health``, ``POST /rollout``,
``GET /rollout/{id}/result`` (lease header, long-poll), ``POST /rollout/cancel``.
Additions: ``GET /rollout/{id}/status`` (no lease; optional long-poll via
``?status=<seen>&wait=<sec>``), ``GET /queue``, ``POST /prewarm``, ``GET /metrics``,
``GET /rollouts`` (filtered, paged, newest first) and ``GET /rollouts/{id}``.

The routes are thin: bodies go through ``server.http.JsonBody`` (413, 422), the
work is ``server.service.RolloutService``'s, and each answer is the protocol
model ``server.openapi`` documents for the route. Nothing is logged per request,
which keeps server CPU per rollout low.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from starlette.responses import PlainTextResponse, Response

from harbor_exec.backends.base import ExecutionBackend, default_artifact_root
from harbor_exec.backends.osmosis import as_backend
from harbor_exec.protocol import (
    DEFAULT_MAX_TIMEOUT_SEC,
    FEATURES_HEADER,
    POLLING_LEASE_HEADER,
    CancelRolloutsRequest,
    CancelRolloutsResponse,
    PrewarmRequest,
    RolloutInitRequest,
    RolloutStatus,
    check_timeouts,
)
from harbor_exec.server.console import (
    CONSOLE_FILES,
    CONSOLE_HEADERS,
    DOCS_HEADERS,
    PUBLIC_FILES,
    REDOC_HEADERS,
    console_asset,
)
from harbor_exec.server.http import (
    DEFAULT_MAX_BODY_BYTES,
    BearerAuthMiddleware,
    JsonBody,
    error_response,
    json_response,
    model_response,
    query_error,
    validation_error_response,
)
from harbor_exec.server.metrics import PROMETHEUS_CONTENT_TYPE
from harbor_exec.server.openapi import route_docs
from harbor_exec.server.report import ServeReport
from harbor_exec.server.rollouts import parse_query
from harbor_exec.server.service import (
    DEFAULT_POLLING_LEASE_TIMEOUT_SEC,
    DEFAULT_RESULT_RETENTION_SEC,
    DEFAULT_RESULT_WAIT_TIMEOUT_SEC,
    DEFAULT_RETRY_AFTER_SEC,
    SHUTDOWN_CLEANUP_SEC,
    SHUTDOWN_DRAIN_SEC,
    RolloutService,
)
from harbor_exec.server.store import RolloutStore

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

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[Any]]


def create_rollout_server(
    *,
    backend: ExecutionBackend | object,
    lifespan: Lifespan | None = None,
    configure_logging: bool = True,
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
    report: ServeReport | None = None,
) -> FastAPI:
    """Build the FastAPI app that serves rollouts from ``backend``: ours
    (``harbor_exec.backends.base.ExecutionBackend``) or an osmosis-ai 0.3.8
    ``ExecutionBackend`` (its LocalBackend, your own), served through
    ``harbor_exec.backends.osmosis.OsmosisBackend``.

    ``lifespan`` (e.g. a backend's prewarm) is entered before serving and exited
    last. ``configure_logging`` (osmosis-ai's keyword) installs an INFO handler on the
    root logger when the process has none, since uvicorn configures only its own;
    ``False`` keeps yours. ``artifact_root`` receives ``<id>/trajectory.json``; by default
    the backend's own ``artifact_root`` when it has one (a LocalBackend's, so
    trajectory and artifacts share ``<root>/<id>/`` as in osmosis-ai), else
    ``$HARBOR_EXEC_ARTIFACT_ROOT``, ``$_OSMOSIS_ROLLOUT_ARTIFACT_ROOT`` or
    ``~/.harbor-exec/rollouts``. Bodies over
    ``max_body_bytes`` get 413. ``report`` (``serve``'s) prints what is served, a line per
    finished rollout and a periodic summary. Raises ``ValueError`` for inconsistent
    timeouts.
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
    served = as_backend(backend)
    if configure_logging and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    service = RolloutService(
        served,
        result_wait_timeout_sec=result_wait_timeout_sec,
        polling_lease_timeout_sec=polling_lease_timeout_sec,
        result_retention_sec=result_retention_sec,
        artifact_root=Path(artifact_root).expanduser()
        if artifact_root
        else _backend_artifact_root(served) or default_artifact_root(),
        server_secrets=(api_key,) if api_key else (),
        retry_after_sec=retry_after_sec,
        shutdown_drain_sec=shutdown_drain_sec,
        shutdown_cleanup_sec=shutdown_cleanup_sec,
        store=RolloutStore(data_dir) if data_dir is not None else None,
        report=report,
    )
    docs = route_docs(max_timeout_sec=max_timeout_sec, auth=api_key is not None)

    @asynccontextmanager
    async def app_lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            await anyio.to_thread.run_sync(served.start)
            service.restore()
            if report is not None:  # before a prewarm, which may take minutes
                report.start(service.live_counts, _server_facts(service))
            if lifespan is not None:
                await stack.enter_async_context(lifespan(app))
            try:
                yield
            finally:
                try:
                    await service.shutdown()
                finally:
                    if report is not None:
                        report.stop()

    # /docs and /redoc are ours: Swagger UI and ReDoc from the package's files, not a CDN
    # (they work offline).
    app = FastAPI(
        title="harbor-exec rollout server", lifespan=app_lifespan, docs_url=None, redoc_url=None
    )
    app.state.rollout_service = service
    if api_key is not None:
        # Without the key, the console's own files are served (the page asks for the key)
        # and GET / answers 401 with the page's shell: nothing of the server's state.
        app.add_middleware(
            BearerAuthMiddleware,
            api_key=api_key,
            public_paths=PUBLIC_FILES,
            challenges={"/": _console_page(401)},
        )

    def timeouts_within_limit(init: RolloutInitRequest) -> list[dict[str, Any]]:
        if init.agent_timeout_sec is None and init.grader_timeout_sec is None:
            return []  # the common case, without a call
        return check_timeouts(init, max_timeout_sec)

    submit_body = JsonBody(
        RolloutInitRequest,
        limit=max_body_bytes,
        check=timeouts_within_limit,
        on_reject=service.metrics.reject,
    )
    cancel_body = JsonBody(CancelRolloutsRequest, limit=max_body_bytes, check=_one_cancel_selector)
    prewarm_body = JsonBody(PrewarmRequest, limit=max_body_bytes, check=_one_prewarm_selector)

    @app.get("/health", **docs["health"])
    async def health() -> Response:
        try:
            payload = served.health().model_dump(mode="json")
        except Exception as exc:
            # /health answers 200 whatever the backend's state: it is how operators
            # and harnesses learn that state.
            logger.warning("backend.health() failed", exc_info=True)
            payload = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:500]}
        # HealthResponse, with the backend's fields first, as clients have always seen it.
        payload["instance_id"] = service.instance_id
        payload["process_id"] = service.process_id
        payload["lifecycle"] = service.lifecycle().model_dump(mode="json")
        return json_response(200, payload)

    @app.post("/rollout", status_code=202, **docs["submit"])
    async def submit_rollout(request: Request) -> Response:
        """Admit a rollout (body: RolloutInitRequest); 202 with a polling lease token."""
        init = await submit_body.parse(request)
        if isinstance(init, Response):
            return init
        return service.admit(init)

    @app.get("/rollout/{rollout_id}/result", **docs["result"])
    async def rollout_result(request: Request) -> Response:
        """Long-poll: parks until the status changes or the wait passes. Needs the lease."""
        return await service.poll_result(
            request.path_params["rollout_id"], request.headers.get(POLLING_LEASE_HEADER)
        )

    @app.get("/rollout/{rollout_id}/status", **docs["status"])
    async def rollout_status(request: Request) -> Response:
        """Current status without a lease. With ``?status=<seen>&wait=<sec>`` it parks
        until the status differs from ``seen`` (at most the server's result wait)."""
        query = request.query_params
        seen_raw = query.get("status")
        wait_raw = query.get("wait")
        seen: RolloutStatus | None = None
        wait = 0.0
        if seen_raw is not None:
            try:
                seen = RolloutStatus(seen_raw)
            except ValueError:
                return validation_error_response(
                    [query_error("status", seen_raw, "a rollout status")]
                )
        if wait_raw is not None:
            try:
                wait = float(wait_raw)
            except ValueError:
                wait = math.nan
            if not math.isfinite(wait) or wait < 0:
                return validation_error_response(
                    [query_error("wait", wait_raw, "a finite number of seconds >= 0")]
                )
        return await service.poll_status(request.path_params["rollout_id"], seen, wait)

    @app.post("/rollout/cancel", **docs["cancel"])
    async def cancel_rollouts(request: Request) -> Response:
        """Cancel by exactly one selector: ``ids``, ``prefix`` or ``all``."""
        selector = await cancel_body.parse(request)
        if isinstance(selector, Response):
            return selector
        dispositions = service.cancel(ids=selector.ids, prefix=selector.prefix, all=selector.all)
        return model_response(200, CancelRolloutsResponse(dispositions=dispositions))

    @app.get("/queue", **docs["queue"])
    async def queue() -> Response:
        """Backend queue depth: ``queued``, ``running``, ``capacity``, ``max_queue_depth``."""
        info = service.queue_info()
        # ``nodes`` appears only where trials run on several nodes.
        return json_response(
            200, info.model_dump(exclude={"nodes"} if info.nodes is None else None)
        )

    @app.post("/prewarm", **docs["prewarm"])
    async def prewarm(request: Request) -> Response:
        """Prepare tasks ahead of rollouts: ``{"task_ids": [...]}`` or ``{"all": true}``."""
        selector = await prewarm_body.parse(request)
        if isinstance(selector, Response):
            return selector
        if not service.accepting:
            return error_response(503, "rollout server is shutting down")
        try:
            summary = await served.prewarm(None if selector.all else selector.task_ids)
        except (ValueError, KeyError, LookupError) as exc:
            return error_response(400, f"prewarm refused: {exc}")
        except Exception as exc:
            logger.exception("prewarm failed")
            return error_response(500, f"prewarm failed: {type(exc).__name__}: {exc}")
        return model_response(200, summary)

    @app.get("/rollouts", **docs["rollouts"])
    async def list_rollouts(request: Request) -> Response:
        """Rollouts, newest first: ``?status=&task=&since=&until=`` (Unix seconds of
        admission), ``limit`` (1-1000, default 50) and ``cursor`` (``next_cursor``)."""
        query = parse_query(request.query_params)
        if isinstance(query, list):
            return validation_error_response(query)
        return model_response(200, await service.list_rollouts(query))

    @app.get("/rollouts/{rollout_id}", **docs["rollout"])
    async def rollout_detail(request: Request) -> Response:
        """One rollout: its phases and their timings, result, reward, error, node and
        files (the newest rollout of that id)."""
        detail = await service.rollout_detail(request.path_params["rollout_id"])
        if detail is None:
            return error_response(404, "unknown rollout_id")
        return model_response(200, detail)

    @app.get("/rollouts/{rollout_id}/files/{name:path}", **docs["rollout_file"])
    async def rollout_file(request: Request) -> Response:
        """A file of a rollout (a ``files`` entry of its detail): its text, the last MiB."""
        params = request.path_params
        found = await service.rollout_file(params["rollout_id"], params["name"])
        if found is None:
            return error_response(404, "no such file")
        return Response(found[0], 200, {"X-Content-Type-Options": "nosniff"}, found[1])

    @app.get("/", include_in_schema=False)
    async def console_page() -> Response:
        """The live console (files shipped in the package; nothing from elsewhere)."""
        return _console_page(200)

    @app.get("/console/data", include_in_schema=False)
    async def console_data() -> Response:
        """What the console shows (``server.console``), refreshed by the page every 2 s."""
        return json_response(200, service.console_data())

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> Response:
        """Swagger UI over ``/openapi.json``, its files served by this server."""
        page = get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - Swagger UI",
            swagger_js_url="/console/swagger-ui/swagger-ui-bundle.js",
            swagger_css_url="/console/swagger-ui/swagger-ui.css",
            swagger_favicon_url="/console/favicon.svg",
            swagger_ui_parameters={"validatorUrl": None},
        )
        page.headers.update(DOCS_HEADERS)
        return page

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> Response:
        """ReDoc over ``/openapi.json``, its script served by this server (no web fonts)."""
        page = get_redoc_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - ReDoc",
            redoc_js_url="/console/redoc/redoc.standalone.js",
            redoc_favicon_url="/console/favicon.svg",
            with_google_fonts=False,
        )
        page.headers.update(REDOC_HEADERS)
        return page

    @app.get("/console/{name:path}", include_in_schema=False)
    async def console_file(request: Request) -> Response:
        name = request.path_params["name"]
        media = CONSOLE_FILES.get(name)
        if media is None:
            return error_response(404, "not found")
        return Response(console_asset(name), 200, CONSOLE_HEADERS, media)

    @app.get("/metrics", response_class=PlainTextResponse, **docs["metrics"])
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(service.render_metrics(), 200, None, PROMETHEUS_CONTENT_TYPE)

    return app


def _console_page(status_code: int) -> Response:
    return Response(console_asset("index.html"), status_code, CONSOLE_HEADERS, "text/html")


def _server_facts(service: RolloutService) -> dict[str, Any]:
    """What the server itself knows to say at start: where it keeps rollouts, what it
    read back, and the nodes trials run on."""
    facts: dict[str, Any] = {"artifacts": str(service.artifact_root)}
    if service.store is not None:
        facts["data_dir"] = str(service.store.data_dir)
        facts["restored"] = len(service.registry.entries)
    try:
        nodes = service.backend.queue_info().nodes
    except Exception:
        nodes = None
    if nodes:
        slots = sum(node.slots for node in nodes)
        facts["ray_nodes"] = [f"{node.node} ({node.slots} slots)" for node in nodes]
        facts["ray_slots"] = slots
    return facts


def _backend_artifact_root(backend: ExecutionBackend) -> Path | None:
    root = getattr(backend, "artifact_root", None)
    return root if isinstance(root, Path) else None


def _one_cancel_selector(selector: CancelRolloutsRequest) -> str | None:
    if selector.selector_count() == 1:
        return None
    return "pass exactly one selector: ids, prefix, or all"


def _one_prewarm_selector(selector: PrewarmRequest) -> str | None:
    if selector.selector_count() == 1:
        return None
    return "pass exactly one of task_ids or all=true"
