"""Request and response helpers of the rollout routes: JSON answers, the one
read-body / 413 / validate / 422 path, FastAPI-shaped errors and bearer auth.

Bodies are read raw and validated with pydantic's ``model_validate_json`` (much
cheaper than FastAPI's per-parameter machinery); errors keep FastAPI's
``{"detail": [...]}`` shape. Answers are ``json.dumps`` of the protocol models'
``model_dump`` (the bytes clients have always received).
"""

from __future__ import annotations

import contextlib
import hmac
import json
from collections.abc import Callable, Mapping
from typing import Any, Final, Generic, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from harbor_exec.protocol import POLLING_LEASE_HEADER, ErrorResponse, ValidationErrorResponse

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "JSON_CONTENT_TYPE",
    "BearerAuthMiddleware",
    "BodyRejection",
    "JsonBody",
    "error_response",
    "header_error",
    "json_response",
    "model_response",
    "query_error",
    "validation_error_response",
]

DEFAULT_MAX_BODY_BYTES: Final = 8 * 1024 * 1024
JSON_CONTENT_TYPE: Final = "application/json"
_MAX_ECHOED_INPUT_CHARS: Final = 1024

BodyRejection = Literal["too_large", "invalid"]
ModelT = TypeVar("ModelT", bound=BaseModel)
# A body check beyond the model: None (or []) when fine, else the 422 detail.
BodyCheck = Callable[[ModelT], list[dict[str, Any]] | str | None]


# ---------------------------------------------------------------------------- responses


def json_response(
    status_code: int, payload: Any, headers: dict[str, str] | None = None
) -> Response:
    return Response(json.dumps(payload).encode(), status_code, headers, JSON_CONTENT_TYPE)


def model_response(
    status_code: int, model: BaseModel, headers: dict[str, str] | None = None
) -> Response:
    """``model`` as the body (JSON-mode dump, ``json.dumps`` spacing)."""
    return json_response(status_code, model.model_dump(mode="json"), headers)


def error_response(
    status_code: int, message: str, headers: dict[str, str] | None = None
) -> Response:
    """``ErrorResponse``: ``{"detail": message}``."""
    return model_response(status_code, ErrorResponse(detail=message), headers)


def validation_error_response(detail: list[dict[str, Any]] | str) -> Response:
    """422 with ``ValidationErrorResponse``: FastAPI-shaped errors, or one message."""
    return model_response(422, ValidationErrorResponse(detail=detail))


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


def header_error(value: str | None) -> dict[str, Any]:
    """The 422 item for a missing or empty lease header, as FastAPI words it."""
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


def query_error(name: str, value: str, expected: str) -> dict[str, Any]:
    """The 422 item for query parameter ``name``: it must be ``expected``."""
    return {
        "type": "value_error",
        "loc": ["query", name],
        "msg": f"{name} must be {expected}",
        "input": value,
    }


# ---------------------------------------------------------------------------- request bodies


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


class JsonBody(Generic[ModelT]):
    """One route's JSON body: read at most ``limit`` bytes (else 413), validated as
    ``model`` and then by ``check`` (else 422). ``on_reject`` hears why a body was
    refused (e.g. to count it)."""

    def __init__(
        self,
        model: type[ModelT],
        *,
        limit: int,
        check: BodyCheck[ModelT] | None = None,
        on_reject: Callable[[BodyRejection], None] | None = None,
    ) -> None:
        self.model = model
        self.limit = limit
        self._check = check
        self._on_reject = on_reject

    async def parse(self, request: Request) -> ModelT | Response:
        """The validated body, or the 413/422 response to answer instead."""
        try:
            body = await _read_body(request, self.limit)
        except _BodyTooLarge:
            return self._reject(
                "too_large",
                error_response(413, f"request body exceeds the {self.limit}-byte limit"),
            )
        try:
            parsed = self.model.model_validate_json(body)
        except ValidationError as exc:
            return self._reject(
                "invalid", validation_error_response(_validation_errors(exc, "body"))
            )
        if self._check is not None and (detail := self._check(parsed)):
            return self._reject("invalid", validation_error_response(detail))
        return parsed

    def _reject(self, reason: BodyRejection, response: Response) -> Response:
        if self._on_reject is not None:
            self._on_reject(reason)
        return response


# ---------------------------------------------------------------------------- auth


class BearerAuthMiddleware:
    """Requires ``Authorization: Bearer <api_key>`` on every HTTP request (pure ASGI)
    but a GET or HEAD of ``public_paths``; a GET of a path in ``challenges`` without the
    key is answered with that path's response (a 401 that says how to sign in) instead
    of the bare 401."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str,
        public_paths: frozenset[str] = frozenset(),
        challenges: Mapping[str, Response] | None = None,
    ) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._public = public_paths
        self._challenges = dict(challenges or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            supplied = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    supplied = value
                    break
            if not hmac.compare_digest(supplied, self._expected):
                path, method = scope["path"], scope["method"]
                if method in ("GET", "HEAD") and path in self._public:
                    await self.app(scope, receive, send)
                    return
                challenge = self._challenges.get(path) if method == "GET" else None
                if challenge is not None:
                    await challenge(scope, receive, send)
                    return
                await error_response(401, "unauthorized")(scope, receive, send)
                return
        await self.app(scope, receive, send)
