"""What ``/openapi.json`` says about each route, from the protocol models the routes
really accept and return (``harbor_exec.protocol``); no model is declared here.

Each route's success body is its ``response_model`` and each error status names
``ErrorResponse`` or ``ValidationErrorResponse`` (what ``server.http`` answers with),
so FastAPI documents them from those classes. The routes read raw bodies and
validate them with ``model_validate_json`` (much cheaper than FastAPI's
per-parameter machinery), so FastAPI cannot infer request bodies and parameters:
request bodies are the JSON schema of the body's model, plus what only the server
knows (its maximum timeout); parameters are declared below.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel

from harbor_exec.protocol import (
    POLLING_LEASE_HEADER,
    ROLLOUT_ID_JSON_SCHEMA,
    CancelRolloutsRequest,
    CancelRolloutsResponse,
    ErrorResponse,
    HealthResponse,
    PrewarmRequest,
    PrewarmSummary,
    QueueInfo,
    RolloutDetail,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutList,
    RolloutResultResponse,
    RolloutStatus,
    RolloutStatusResponse,
    ValidationErrorResponse,
)

__all__ = ["request_body_schema", "route_docs"]

_ROLLOUT_ID_PARAM: Final = {
    "name": "rollout_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", **ROLLOUT_ID_JSON_SCHEMA},
}


def request_body_schema(
    model: type[BaseModel], limits: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``model``'s JSON schema as a request body, each property in ``limits``
    extended with the server's own bounds (e.g. ``{"maximum": 600}``)."""
    schema = model.model_json_schema()
    if "$defs" in schema:
        # Their schemas would need components of their own; no body model has any.
        raise TypeError(f"{model.__name__}: nested models in a request body are not documented")
    for name, extra in (limits or {}).items():
        schema["properties"][name].update(extra)
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    }


def _query(name: str, schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    parameter = {"name": name, "in": "query", "required": False, "schema": schema}
    if description:
        parameter["description"] = description
    return parameter


def _error(description: str, model: type[BaseModel] = ErrorResponse) -> dict[str, Any]:
    return {"model": model, "description": description}


def route_docs(*, max_timeout_sec: float, auth: bool) -> dict[str, dict[str, Any]]:
    """Keyword arguments for each route decorator (``response_model``, ``responses``,
    ``openapi_extra``)."""
    common: dict[int | str, dict[str, Any]] = {}
    if auth:
        common[401] = _error("Missing or wrong `Authorization: Bearer <key>`.")
    invalid = _error(
        "The request does not validate; `loc` names the field.", ValidationErrorResponse
    )
    too_large = _error("The body exceeds the server's `max_body_bytes`.")
    timeout_limit = {"maximum": max_timeout_sec}
    return {
        "health": {
            "response_model": HealthResponse,
            "response_description": "Always 200, also while degraded.",
            "responses": common,
        },
        "submit": {
            "response_model": RolloutInitResponse,
            "response_description": "Admitted; poll with the lease.",
            "responses": {
                409: _error("The rollout_id is active or still retained."),
                413: too_large,
                422: invalid,
                429: _error("The queue is full; retry after `Retry-After` seconds."),
                503: _error("Shutting down, or the container engine is unavailable."),
                **common,
            },
            "openapi_extra": request_body_schema(
                RolloutInitRequest,
                {"agent_timeout_sec": timeout_limit, "grader_timeout_sec": timeout_limit},
            ),
        },
        "result": {
            "response_model": RolloutResultResponse,
            "response_description": "Final or in-progress.",
            "responses": {
                403: _error("Wrong polling lease token."),
                404: _error("Unknown rollout_id (never admitted, or retention ended)."),
                422: invalid,
                **common,
            },
            "openapi_extra": {
                "parameters": [
                    _ROLLOUT_ID_PARAM,
                    {
                        "name": POLLING_LEASE_HEADER,
                        "in": "header",
                        "required": True,
                        "schema": {"type": "string", "minLength": 1},
                    },
                ]
            },
        },
        "status": {
            "response_model": RolloutStatusResponse,
            "response_description": "Current status (the backend's, when its "
            "rollout_status knows a rollout the server does not hold).",
            "responses": {
                404: _error("Unknown rollout_id (to the server and to the backend)."),
                422: invalid,
                **common,
            },
            "openapi_extra": {
                "parameters": [
                    _ROLLOUT_ID_PARAM,
                    {
                        "name": "status",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": [s.value for s in RolloutStatus]},
                    },
                    {
                        "name": "wait",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "number", "minimum": 0},
                    },
                ]
            },
        },
        "cancel": {
            "response_model": CancelRolloutsResponse,
            "response_description": "Disposition per id.",
            "responses": {413: too_large, 422: invalid, **common},
            "openapi_extra": request_body_schema(CancelRolloutsRequest),
        },
        "queue": {
            "response_model": QueueInfo,
            "response_description": "Queue depth.",
            "responses": common,
        },
        "prewarm": {
            "response_model": PrewarmSummary,
            "response_description": "What was built.",
            "responses": {
                400: _error("The backend refused the task ids."),
                413: too_large,
                422: invalid,
                500: _error("Prewarm failed on the backend."),
                503: _error("Shutting down."),
                **common,
            },
            "openapi_extra": request_body_schema(PrewarmRequest),
        },
        "rollouts": {
            "response_model": RolloutList,
            "response_description": "A page of rollouts, newest first.",
            "responses": {422: invalid, **common},
            "openapi_extra": {
                "parameters": [
                    _query("status", {"type": "string", "enum": [s.value for s in RolloutStatus]}),
                    _query("task", {"type": "string", "minLength": 1}),
                    _query("since", {"type": "number"}, "Admitted at or after (Unix seconds)."),
                    _query("until", {"type": "number"}, "Admitted before (Unix seconds)."),
                    _query(
                        "cursor",
                        {"type": "string", "pattern": "^[0-9]{1,18}$"},
                        "The previous page's next_cursor.",
                    ),
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000}),
                ]
            },
        },
        "rollout": {
            "response_model": RolloutDetail,
            "response_description": "One rollout (the newest of that id).",
            "responses": {
                404: _error("Unknown rollout_id (never admitted here, or its history is gone)."),
                **common,
            },
            "openapi_extra": {"parameters": [_ROLLOUT_ID_PARAM]},
        },
        "rollout_file": {
            "response_model": None,
            "responses": {
                200: {
                    "description": "The file's text (its last MiB), scrubbed of the server's key.",
                    "content": {
                        "text/plain": {"schema": {"type": "string"}},
                        "application/json": {"schema": {}},
                    },
                },
                404: _error("No such rollout, or no such file of it."),
                **common,
            },
            "openapi_extra": {
                "parameters": [
                    _ROLLOUT_ID_PARAM,
                    {
                        "name": "name",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                        "description": "A `files[].name` of the rollout's detail.",
                    },
                ]
            },
        },
        "metrics": {
            "response_model": None,
            "responses": {
                200: {
                    "description": "Prometheus text exposition.",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                },
                **common,
            },
        },
    }
