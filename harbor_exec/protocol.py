"""Wire models of the osmosis-ai 0.3.8 rollout protocol, and the backend exchange types.

Field names, defaults and validation match the reference exactly, so the real
``osmosis_ai.rollout.client.RolloutClient`` and our server agree on every byte
that matters. ``ExecutionRequest``/``ExecutionResult``/``ExecutionOutcome`` are
what the server hands to and gets back from an ``ExecutionBackend``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any, ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from harbor_exec.authoring import (
    TERMINAL_STATUSES,
    RolloutErrorCategory,
    RolloutSample,
    RolloutStatus,
)
from harbor_exec.errors import PROVIDER_API_ERROR_TYPES, PROVIDER_ERROR_TYPES

__all__ = [
    "CANCEL_DISPOSITIONS",
    "DEFAULT_MAX_TIMEOUT_SEC",
    "FEATURES_HEADER",
    "GROUP_KEYS",
    "GROUP_SIZE_KEY",
    "MAX_GROUP_SIZE",
    "MAX_ROLLOUT_ID_CHARS",
    "POLLING_LEASE_HEADER",
    "ROLLOUT_ID_JSON_SCHEMA",
    "STATUS_WAIT_FEATURE",
    "TERMINAL_STATUSES",
    "BackendHealth",
    "CancelDisposition",
    "CancelRolloutsRequest",
    "CancelRolloutsResponse",
    "ErrorResponse",
    "ExecutionOutcome",
    "ExecutionRequest",
    "ExecutionResult",
    "HealthResponse",
    "MessageDict",
    "NodeSlots",
    "NodeStatus",
    "PrewarmRequest",
    "PrewarmSummary",
    "QueueInfo",
    "RolloutDetail",
    "RolloutErrorCategory",
    "RolloutFile",
    "RolloutInitRequest",
    "RolloutInitResponse",
    "RolloutLifecycle",
    "RolloutList",
    "RolloutPhase",
    "RolloutResultResponse",
    "RolloutSample",
    "RolloutStatus",
    "RolloutStatusResponse",
    "RolloutSummary",
    "ValidationErrorResponse",
    "categorize_exception",
    "check_timeouts",
    "ensure_single_path_segment",
    "group_hint",
    "group_of",
    "is_single_path_segment",
    "rollout_dir_name",
]

POLLING_LEASE_HEADER: Final = "X-Osmosis-Rollout-Lease"
# Our server sends it with every 202, listing what it offers beyond the reference
# protocol (comma-separated); other clients ignore unknown headers.
FEATURES_HEADER: Final = "X-Harbor-Exec-Features"
# The feature of ``GET /rollout/{id}/status?status=<seen>&wait=<sec>`` (a long-poll).
STATUS_WAIT_FEATURE: Final = "status-wait"

MessageDict = dict[str, Any]

# pydantic caches parsed JSON strings process-wide by default; ids and tokens
# are unique per rollout, so caching them only pins memory. Keys still cache.
_WIRE_CONFIG = ConfigDict(cache_strings="keys")


class CancelDisposition:
    """The three values of ``CancelRolloutsResponse.dispositions``."""

    CANCELLED_QUEUED: Final = "cancelled_queued"
    CANCELLED_RUNNING: Final = "cancelled_running"
    NOT_FOUND: Final = "not_found"


CANCEL_DISPOSITIONS: Final = frozenset(
    {
        CancelDisposition.CANCELLED_QUEUED,
        CancelDisposition.CANCELLED_RUNNING,
        CancelDisposition.NOT_FOUND,
    }
)


MAX_ROLLOUT_ID_CHARS: Final = 256
# Longest directory name we derive from an id as-is; ext4 and most file systems
# stop at 255 bytes per name, and "<name>__<suffix>" trial names need room.
_MAX_DIR_NAME_BYTES: Final = 200
DEFAULT_MAX_TIMEOUT_SEC: Final = 24 * 3600.0
# What ``is_single_path_segment`` accepts, as JSON Schema (for /openapi.json): no
# '/', '\', control characters (C0, DEL, C1), not "." or "..".
ROLLOUT_ID_JSON_SCHEMA: Final[dict[str, Any]] = {
    "minLength": 1,
    "maxLength": MAX_ROLLOUT_ID_CHARS,
    "pattern": r"^[^/\\\u0000-\u001f\u007f-\u009f]+$",
    "not": {"enum": [".", ".."]},
}


def is_single_path_segment(name: str) -> bool:
    """True when ``name`` is a valid rollout id: one plain path component (it is
    joined onto host paths), printable, at most ``MAX_ROLLOUT_ID_CHARS``."""
    return (
        bool(name)
        and len(name) <= MAX_ROLLOUT_ID_CHARS
        and name not in (".", "..")
        and name.isprintable()
        and not any(c in name for c in "/\\")
    )


def ensure_single_path_segment(value: str, *, field: str = "rollout_id") -> str:
    """Return ``value`` or raise ``ValueError`` naming ``field`` (a validator body)."""
    if not is_single_path_segment(value):
        raise ValueError(
            f"{field} must be a single path segment of at most {MAX_ROLLOUT_ID_CHARS} "
            "printable characters: not empty, not '.' or '..', and without '/', '\\', "
            "NUL or other control characters"
        )
    return value


def rollout_dir_name(rollout_id: str) -> str:
    """A file-system-safe directory name for ``rollout_id``: the id itself when it is
    short enough, else a prefix of it plus a hash (every 256-character id fits)."""
    encoded = rollout_id.encode("utf-8", "surrogatepass")
    if len(encoded) <= _MAX_DIR_NAME_BYTES:
        return rollout_id
    digest = hashlib.sha256(encoded).hexdigest()[:16]
    prefix = encoded[: _MAX_DIR_NAME_BYTES - 40].decode("utf-8", "ignore")
    return f"{prefix}~{digest}"


def check_timeouts(request: RolloutInitRequest, max_timeout_sec: float) -> list[dict[str, Any]]:
    """Errors (FastAPI's shape) for timeouts that are not positive or are above the
    server's maximum."""
    errors: list[dict[str, Any]] = []
    for name in ("agent_timeout_sec", "grader_timeout_sec"):
        value = getattr(request, name)
        if value is not None and value <= 0:
            errors.append(
                {
                    "type": "greater_than",
                    "loc": ["body", name],
                    "msg": f"{name} must be greater than 0 seconds (null means no deadline)",
                    "input": value,
                    "ctx": {"gt": 0},
                }
            )
        elif value is not None and value > max_timeout_sec:
            errors.append(
                {
                    "type": "less_than_equal",
                    "loc": ["body", name],
                    "msg": f"{name} must be at most {max_timeout_sec:g} seconds "
                    "(the server's maximum; null means no deadline)",
                    "input": value,
                    "ctx": {"le": max_timeout_sec},
                }
            )
    return errors


# ---------------------------------------------------------------------------- HTTP bodies


class RolloutInitRequest(BaseModel):
    """Body of ``POST /rollout``. Unknown fields are ignored, as in the reference."""

    model_config: ClassVar[ConfigDict] = _WIRE_CONFIG

    initial_messages: list[MessageDict]
    label: str | None = None
    metadata: dict[str, Any] | None = None
    # The validators' rules, stated for /openapi.json (they do not validate).
    rollout_id: str = Field(json_schema_extra=ROLLOUT_ID_JSON_SCHEMA)
    chat_completions_url: str
    llm_api_key: str | None = Field(
        default=None,
        json_schema_extra={"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]},
    )
    grade: bool = True
    # NaN would crash the event loop's timer and inf silently disables the
    # deadline; "no deadline" is spelled null.
    agent_timeout_sec: float | None = Field(default=None, allow_inf_nan=False)
    grader_timeout_sec: float | None = Field(default=None, allow_inf_nan=False)
    extra_fields: dict[str, Any] | None = None

    @field_validator("rollout_id")
    @classmethod
    def _check_rollout_id(cls, value: str) -> str:
        return ensure_single_path_segment(value)

    @field_validator("llm_api_key")
    @classmethod
    def _check_llm_api_key(cls, value: str | None) -> str | None:
        if value == "":
            raise ValueError("llm_api_key must be omitted (or null) or a non-empty string")
        return value


class RolloutInitResponse(BaseModel):
    """Body of the 202 answer to ``POST /rollout``."""

    model_config: ClassVar[ConfigDict] = _WIRE_CONFIG

    rollout_id: str
    status: RolloutStatus
    polling_lease_token: str = Field(min_length=1)
    result_wait_timeout_sec: float
    polling_lease_timeout_sec: float

    @model_validator(mode="after")
    def _check_timeouts(self) -> RolloutInitResponse:
        wait = self.result_wait_timeout_sec
        lease = self.polling_lease_timeout_sec
        if not math.isfinite(wait) or wait <= 0:
            raise ValueError("result_wait_timeout_sec must be positive and finite")
        if not math.isfinite(lease) or lease <= wait:
            raise ValueError(
                "polling_lease_timeout_sec must be finite and exceed result_wait_timeout_sec"
            )
        return self


class RolloutResultResponse(BaseModel):
    """Body of ``GET /rollout/{id}/result``: in progress it has only id and status."""

    model_config: ClassVar[ConfigDict] = _WIRE_CONFIG

    rollout_id: str
    status: RolloutStatus
    sample: RolloutSample | None = None
    err_message: str | None = None
    err_category: RolloutErrorCategory | None = None
    #: When the rollout's agent started (UTC); additive to 0.3.8's format (its clients
    #: ignore it), sent only in a finished result whose agent ran.
    agent_started_at: datetime | None = None


class CancelRolloutsRequest(BaseModel):
    """Body of ``POST /rollout/cancel``; exactly one selector must be given."""

    model_config: ClassVar[ConfigDict] = _WIRE_CONFIG

    ids: list[str] | None = None
    prefix: str | None = None
    all: bool = False

    def selector_count(self) -> int:
        """How many selectors are set (the route answers 422 unless it is 1)."""
        return (self.ids is not None) + (self.prefix is not None) + self.all


class CancelRolloutsResponse(BaseModel):
    """Per-id disposition: ``cancelled_queued``, ``cancelled_running`` or ``not_found``."""

    model_config: ClassVar[ConfigDict] = _WIRE_CONFIG

    dispositions: dict[str, str]


class RolloutStatusResponse(BaseModel):
    """Body of ``GET /rollout/{id}/status`` (no lease needed): the reward and error
    are null until the rollout is finished."""

    rollout_id: str
    status: RolloutStatus
    reward: float | None = None
    err_message: str | None = None
    err_category: RolloutErrorCategory | None = None


class PrewarmRequest(BaseModel):
    """Body of ``POST /prewarm``: ``{"task_ids": [...]}`` or ``{"all": true}``."""

    task_ids: list[str] | None = None
    all: bool = False

    def selector_count(self) -> int:
        """How many selectors are set (the route answers 422 unless it is 1)."""
        return (self.task_ids is not None) + self.all


class ErrorResponse(BaseModel):
    """Body of an error answer: ``{"detail": "<what went wrong>"}``."""

    detail: str


class ValidationErrorResponse(BaseModel):
    """Body of a 422: FastAPI's ``{"detail": [{type, loc, msg, input, ctx}]}`` (``loc``
    names the field at fault), or one message when the fields conflict."""

    detail: list[dict[str, Any]] | str


class RolloutLifecycle(BaseModel):
    """Admission state reported in ``/health``."""

    accepting_rollouts: bool
    active_rollouts: int = Field(ge=0)


# ---------------------------------------------------------------------------- rollout listing


class RolloutSummary(BaseModel):
    """One rollout in ``GET /rollouts``. ``reward`` follows the wire rule (null unless
    ``success`` and kept); ``reason`` is the failure's message with every known secret
    scrubbed, at most 500 characters; ``seconds`` runs from admission to the result."""

    rollout_id: str
    status: RolloutStatus
    task: str | None = None
    admitted_at: datetime
    finished_at: datetime | None = None
    seconds: float | None = None
    reward: float | None = None
    err_category: RolloutErrorCategory | None = None
    reason: str | None = None
    node: str | None = None


class RolloutList(BaseModel):
    """Body of ``GET /rollouts``: newest first; ``next_cursor`` (passed back as
    ``?cursor=``) continues after the last one, null on the last page."""

    rollouts: list[RolloutSummary]
    next_cursor: str | None = None


class RolloutPhase(BaseModel):
    """A phase of a rollout and its length: ``server`` phases (``queued``, ``running``)
    from the server's clock, ``backend`` ones as the backend timed them
    (HarborBackend: ``environment_setup``, ``agent_setup``, ``agent``, ``verifier``,
    ``teardown``, ``total``)."""

    name: str
    source: str
    seconds: float | None = None


class RolloutFile(BaseModel):
    """A file of the rollout's on the server's machine (trajectory, trial result,
    verifier output, logs); ``url`` (this server's path) serves a regular file's text."""

    name: str
    path: str
    url: str | None = None


class RolloutDetail(RolloutSummary):
    """Body of ``GET /rollouts/{rollout_id}``: the summary, its phases, where its trial
    ran (``trial``, ``trial_dir``, ``phase``: where a failure happened), the request's
    metadata (values under secret-looking keys redacted), the sample's metrics, and its
    files that exist."""

    running_at: datetime | None = None
    phases: list[RolloutPhase] = Field(default_factory=list)
    trial: str | None = None
    trial_dir: str | None = None
    phase: str | None = None
    metadata: dict[str, Any] | None = None
    metrics: dict[str, float] | None = None
    files: list[RolloutFile] = Field(default_factory=list)


# ---------------------------------------------------------------------------- backend exchange


class ExecutionRequest(BaseModel):
    """One rollout as a backend sees it. The chat URL and LLM key are on the
    ambient ``RolloutContext``, not here, so they never end up in a dump."""

    id: str
    prompt: list[MessageDict]
    label: str | None = None
    metadata: dict[str, Any] | None = None
    agent_timeout_sec: float | None = Field(default=None, allow_inf_nan=False)
    grader_timeout_sec: float | None = Field(default=None, allow_inf_nan=False)
    grade: bool = True

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        return ensure_single_path_segment(value, field="id")


class ExecutionResult(BaseModel):
    """One phase's result. ``extra_fields`` holds backend diagnostics, never sent on the wire."""

    status: RolloutStatus
    sample: RolloutSample | None = None
    err_message: str | None = None
    err_category: RolloutErrorCategory | None = None
    extra_fields: dict[str, Any] | None = None


class ExecutionOutcome(BaseModel):
    """The workflow result and, when grading ran, the grader result."""

    workflow: ExecutionResult
    grader: ExecutionResult | None = None

    @property
    def result(self) -> ExecutionResult:
        """What the rollout reports: a failed workflow wins (borrowing the grader's
        sample if it has none); otherwise the grader result when there is one."""
        if self.workflow.status is not RolloutStatus.SUCCESS:
            if (
                self.workflow.sample is None
                and self.grader is not None
                and self.grader.sample is not None
            ):
                return self.workflow.model_copy(update={"sample": self.grader.sample})
            return self.workflow
        return self.grader or self.workflow

    @property
    def result_to_save(self) -> ExecutionResult:
        """What the trajectory file is written from: the grader's result when it has a
        sample (it carries the real reward), else the workflow's."""
        if self.grader is not None and self.grader.sample is not None:
            return self.grader
        return self.workflow


# ---------------------------------------------------------------------------- backend contract


class NodeSlots(BaseModel):
    """One node of a multi-node executor (Ray), as ``GET /queue`` lists it."""

    node: str  # short id
    address: str = ""
    alive: bool = True
    slots: int = 0
    in_use: int = 0


class NodeStatus(NodeSlots):
    """One node as ``GET /health`` lists it: its slots, and who it is and what it holds."""

    node_id: str = ""
    name: str = ""  # its containers' owner name (the host name by default)
    trials: int = 0  # trials placed on it so far
    images: int = 0  # images of ours it is known to hold
    #: Its warm containers idle, as its last trial reported (None: none reported yet).
    warm_containers: int | None = None

    def slots_only(self) -> NodeSlots:
        """The node as ``GET /queue`` lists it."""
        return NodeSlots(
            node=self.node,
            address=self.address,
            alive=self.alive,
            slots=self.slots,
            in_use=self.in_use,
        )


class QueueInfo(BaseModel):
    """``GET /queue``: None where the backend does not track it (the server fills in).
    ``nodes`` only where trials run on several nodes (absent from the JSON otherwise)."""

    queued: int | None = None
    running: int | None = None
    capacity: int | None = None
    max_queue_depth: int | None = None
    nodes: list[NodeSlots] | None = None


class BackendHealth(BaseModel):
    """A backend's part of ``GET /health``. Backends add their own fields."""

    model_config = ConfigDict(extra="allow")

    status: str = "ok"
    backend: str = "custom"


class HealthResponse(BackendHealth):
    """Body of ``GET /health`` (always 200): the backend's fields (``BackendHealth``,
    ``"status": "error"`` with an ``error`` when ``health()`` raised), then the
    server's identity and admission state."""

    instance_id: str
    process_id: str
    lifecycle: RolloutLifecycle


class PrewarmSummary(BaseModel):
    """What a prewarm did: counts, and the reason per failed task."""

    total: int = 0
    built: int = 0
    cached: int = 0
    failed: int = 0
    failed_tasks: dict[str, str] = Field(default_factory=dict)
    seconds: dict[str, float] = Field(default_factory=dict)  # per task

    @property
    def systemic(self) -> bool:
        """All tasks failed, or more than half of several: the setup, not one task."""
        return bool(self.failed) and (
            self.failed >= self.total or (self.total > 1 and self.failed > self.total / 2)
        )


# ---------------------------------------------------------------------------- error categories

_PROVIDER_HTTP_STATUSES: Final = frozenset({401, 402, 403, 429, 500, 502, 503, 504})


def categorize_exception(exc: BaseException) -> RolloutErrorCategory:
    """Map an exception to the wire error category, as the reference does."""
    if isinstance(exc, TimeoutError):
        return RolloutErrorCategory.TIMEOUT
    if isinstance(exc, ValueError | TypeError | AssertionError):
        return RolloutErrorCategory.VALIDATION_ERROR
    status_code = getattr(exc, "status_code", None)
    for cls in type(exc).__mro__:
        name = cls.__name__
        if name in PROVIDER_ERROR_TYPES or (
            name in PROVIDER_API_ERROR_TYPES
            and isinstance(status_code, int)
            and status_code in _PROVIDER_HTTP_STATUSES
        ):
            return RolloutErrorCategory.HTTP_ERROR
    return RolloutErrorCategory.AGENT_ERROR


# ---------------------------------------------------------------------------- groups

#: Where a request's metadata names its group (the rollouts a GRPO step samples of one
#: prompt): the first of these that is set. No key is standard in the protocol.
GROUP_KEYS: Final = ("group_id", "group")
#: Where it says how many rollouts its group has (a hint: the rest are coming).
GROUP_SIZE_KEY: Final = "group_size"
#: The largest group size taken as a hint (a bigger one is read as this).
MAX_GROUP_SIZE: Final = 1024


def group_of(metadata: Mapping[str, Any] | None) -> str | None:
    """The group a request's metadata names (None when none)."""
    if not metadata:
        return None
    for key in GROUP_KEYS:
        value = metadata.get(key)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return str(value)[:256]
    return None


def group_hint(metadata: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """(the group, ``metadata.group_size``) when the metadata names a group and the size
    is a whole number of at least 2 (capped at ``MAX_GROUP_SIZE``); None otherwise."""
    group = group_of(metadata)
    size = metadata.get(GROUP_SIZE_KEY) if metadata and group is not None else None
    if group is None or isinstance(size, bool) or not isinstance(size, int) or size < 2:
        return None
    return group, min(size, MAX_GROUP_SIZE)
