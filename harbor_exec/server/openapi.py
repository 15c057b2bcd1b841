"""What ``/openapi.json`` says about each route, from the pydantic models.

The routes read raw bodies and validate them with ``model_validate_json`` (much
cheaper than FastAPI's per-parameter machinery), so FastAPI cannot infer their
request bodies and parameters: they are declared here instead, so that generated
clients, ``/docs`` and schema-driven fuzzers see the real API.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, ConfigDict

from harbor_exec.protocol import (
    MAX_ROLLOUT_ID_CHARS,
    POLLING_LEASE_HEADER,
    CancelRolloutsRequest,
    CancelRolloutsResponse,
    NodeSlots,
    RolloutErrorCategory,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutLifecycle,
    RolloutResultResponse,
    RolloutStatus,
)

__all__ = ["route_docs"]

# No '/', '\', control characters (C0, DEL, C1); at least one character.
_ROLLOUT_ID_PATTERN: Final = r"^[^/\\\u0000-\u001f\u007f-\u009f]+$"


class ErrorDetail(BaseModel):
    """``{"detail": "..."}``: what went wrong, in words."""

    detail: str


class ValidationErrorDetail(BaseModel):
    """422: FastAPI's ``{"detail": [{type, loc, msg, input}]}``, or one message."""

    detail: list[dict[str, Any]] | str


class HealthResponse(BaseModel):
    """The backend's health fields plus the server's identity and lifecycle."""

    model_config = ConfigDict(extra="allow")

    status: str | None = None
    instance_id: str
    process_id: str
    lifecycle: RolloutLifecycle


class StatusResponse(BaseModel):
    """``GET /rollout/{id}/status``."""

    rollout_id: str
    status: RolloutStatus
    reward: float | None = None
    err_message: str | None = None
    err_category: RolloutErrorCategory | None = None


class QueueResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    queued: int | None = None
    running: int | None = None
    capacity: int | None = None
    max_queue_depth: int | None = None
    nodes: list[NodeSlots] | None = None


class PrewarmRequestDoc(BaseModel):
    task_ids: list[str] | None = None
    all: bool = False


class PrewarmSummary(BaseModel):
    model_config = ConfigDict(extra="allow")

    total: int
    built: int
    cached: int
    failed: int
    failed_tasks: dict[str, str]


def _body(model: type[BaseModel], patch: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    for name, extra in (patch or {}).items():
        schema["properties"][name].update(extra)
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    }


def _error(description: str, model: type[BaseModel] = ErrorDetail) -> dict[str, Any]:
    return {"model": model, "description": description}


_ROLLOUT_ID_PARAM: Final = {
    "name": "rollout_id",
    "in": "path",
    "required": True,
    "schema": {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_ROLLOUT_ID_CHARS,
        "pattern": _ROLLOUT_ID_PATTERN,
    },
}


def route_docs(*, max_timeout_sec: float, auth: bool) -> dict[str, dict[str, Any]]:
    """Keyword arguments for each route decorator (``responses``, ``openapi_extra``)."""
    common: dict[int | str, dict[str, Any]] = {}
    if auth:
        common[401] = _error("Missing or wrong `Authorization: Bearer <key>`.")
    invalid = _error("The request does not validate; `loc` names the field.", ValidationErrorDetail)
    too_large = _error("The body exceeds the server's `max_body_bytes`.")
    timeout_limit = {"maximum": max_timeout_sec}
    rollout_id = {
        "maxLength": MAX_ROLLOUT_ID_CHARS,
        "pattern": _ROLLOUT_ID_PATTERN,
        "not": {"enum": [".", ".."]},
    }
    init_schema: dict[str, dict[str, Any]] = {
        "rollout_id": rollout_id,
        "agent_timeout_sec": timeout_limit,
        "grader_timeout_sec": timeout_limit,
        # "" is refused; omit it or send null.
        "llm_api_key": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]},
    }
    return {
        "health": {
            "response_model": None,
            "responses": {
                200: {"model": HealthResponse, "description": "Always 200, also while degraded."},
                **common,
            },
        },
        "submit": {
            "response_model": None,
            "responses": {
                202: {
                    "model": RolloutInitResponse,
                    "description": "Admitted; poll with the lease.",
                },
                409: _error("The rollout_id is active or still retained."),
                413: too_large,
                422: invalid,
                429: _error("The queue is full; retry after `Retry-After` seconds."),
                503: _error("Shutting down, or the container engine is unavailable."),
                **common,
            },
            "openapi_extra": _body(RolloutInitRequest, init_schema),
        },
        "result": {
            "response_model": None,
            "responses": {
                200: {"model": RolloutResultResponse, "description": "Final or in-progress."},
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
            "response_model": None,
            "responses": {
                200: {"model": StatusResponse, "description": "Current status."},
                404: _error("Unknown rollout_id."),
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
            "response_model": None,
            "responses": {
                200: {"model": CancelRolloutsResponse, "description": "Disposition per id."},
                413: too_large,
                422: invalid,
                **common,
            },
            "openapi_extra": _body(CancelRolloutsRequest),
        },
        "queue": {
            "response_model": None,
            "responses": {200: {"model": QueueResponse, "description": "Queue depth."}, **common},
        },
        "prewarm": {
            "response_model": None,
            "responses": {
                200: {"model": PrewarmSummary, "description": "What was built."},
                400: _error("The backend refused the task ids."),
                413: too_large,
                422: invalid,
                500: _error("Prewarm failed on the backend."),
                503: _error("Shutting down."),
                **common,
            },
            "openapi_extra": _body(PrewarmRequestDoc),
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
