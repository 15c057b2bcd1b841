"""The authoring API: what workflow and grader code imports.

This module runs inside task containers on Python 3.11 with only the standard
library and pydantic installed, so it must import nothing else. Names and
semantics match the osmosis-ai 0.3.8 SDK, so moving a workflow over is a change
of imports only.
"""

from __future__ import annotations

import copy
import importlib
import logging
import math
import numbers
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "TERMINAL_STATUSES",
    "AgentWorkflow",
    "AgentWorkflowConfig",
    "AgentWorkflowContext",
    "AgentWorkflowOutput",
    "BaseConfig",
    "ConcurrencyConfig",
    "Grader",
    "GraderConfig",
    "GraderContext",
    "Messages",
    "RolloutContext",
    "RolloutErrorCategory",
    "RolloutSample",
    "RolloutStatus",
    "SampleSource",
    "StatusCallback",
    "coerce_workflow_output",
    "get_rollout_context",
    "get_sample",
    "resolve_import_path",
    "run_workflow_once",
    "set_sample_source",
    "set_status",
]

logger = logging.getLogger(__name__)

Messages = list[dict[str, Any]]

# Environment fallbacks for a RolloutContext built without values (container
# runners); the names are the SDK's so existing bundles keep working.
CHAT_COMPLETIONS_URL_ENV = "OSMOSIS_CHAT_COMPLETIONS_URL"
API_KEY_ENV = "OSMOSIS_API_KEY"
ROLLOUT_ID_ENV = "OSMOSIS_ROLLOUT_ID"


# --------------------------------------------------------------------------- enums


class RolloutStatus(StrEnum):
    """Status of a rollout: lifecycle states in flight, terminal states at the end."""

    QUEUED = "queued"
    RUNNING = "running"
    GRADING = "grading"
    SUCCESS = "success"
    FAILURE = "failure"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"


class RolloutErrorCategory(StrEnum):
    """Why a rollout failed, in the wire vocabulary."""

    TIMEOUT = "timeout"
    LEASE_EXPIRED = "lease_expired"
    VALIDATION_ERROR = "validation_error"
    HTTP_ERROR = "http_error"
    AGENT_ERROR = "agent_error"
    INTERNAL_ERROR = "internal_error"


TERMINAL_STATUSES: frozenset[RolloutStatus] = frozenset(
    {RolloutStatus.SUCCESS, RolloutStatus.FAILURE, RolloutStatus.CANCELLED}
)


# --------------------------------------------------------------------------- sample

# Marker for values that JSON cannot represent at all.
_DROP = object()


def _is_json_ready(value: Any) -> bool:
    """True when ``json.dumps`` encodes ``value`` as-is (exact builtin types only)."""
    if value is None or isinstance(value, bool | str):
        return True
    if type(value) is int:
        return True
    if type(value) is float:
        return math.isfinite(value)
    if type(value) is dict:
        return all(isinstance(k, str) and _is_json_ready(v) for k, v in value.items())
    if type(value) is list or type(value) is tuple:
        return all(_is_json_ready(v) for v in value)
    return False


def _fit_json(value: Any, dropped: list[str]) -> Any:
    """Return ``value`` in a JSON-encodable form, or ``_DROP``.

    numpy-style scalars register with the ``numbers`` ABCs, so they become
    builtin numbers without this module importing numpy.
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        as_float = float(value)
        if math.isfinite(as_float):
            return as_float
        dropped.append(f"non-finite {type(value).__name__}")
        return _DROP
    if isinstance(value, Mapping):
        fitted: dict[str, Any] = {}
        for key, item in value.items():
            if isinstance(key, str):
                name = key
            elif isinstance(key, numbers.Real) and not isinstance(key, bool):
                number = _fit_json(key, dropped)
                if number is _DROP:
                    continue
                name = str(number)
            else:
                dropped.append(f"unencodable key {type(key).__name__}")
                continue
            fitted_item = _fit_json(item, dropped)
            if fitted_item is not _DROP:
                fitted[name] = fitted_item
        return fitted
    if isinstance(value, list | tuple):
        return [f for item in value if (f := _fit_json(item, dropped)) is not _DROP]
    dropped.append(type(value).__name__)
    return _DROP


class RolloutSample(BaseModel):
    """The one sample a rollout produces: its messages, reward and measurements.

    ``reward`` rejects NaN and infinity, also on assignment, because graders set
    it through ``GraderContext.set_reward`` (a plain attribute assignment).
    ``trajectory_messages`` defaults to a deep copy of ``messages``; pass
    ``None`` explicitly to turn trajectory persistence off.
    """

    model_config: ClassVar[ConfigDict] = ConfigDict(
        allow_inf_nan=False,
        validate_assignment=True,
    )

    messages: Sequence[Mapping[str, Any]] = Field(default_factory=list)
    trajectory_messages: Sequence[Mapping[str, Any]] | None = None
    label: str | None = None
    reward: float | None = None
    remove_sample: bool = False
    metrics: dict[str, Any] = Field(default_factory=dict)
    extra_fields: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _default_trajectory_messages(self) -> RolloutSample:
        if "trajectory_messages" not in self.model_fields_set:
            # Written directly (not by assignment) so that validation does not
            # re-enter; marking it set keeps later assignments from redoing it.
            try:
                snapshot: list[Mapping[str, Any]] | None = copy.deepcopy(list(self.messages))
            except Exception:
                logger.warning("could not snapshot messages for the trajectory", exc_info=True)
                snapshot = None
            self.__dict__["trajectory_messages"] = snapshot
            self.model_fields_set.add("trajectory_messages")
        return self

    def json_safe_copy(self) -> RolloutSample:
        """Return a copy whose ``metrics`` and ``extra_fields`` survive JSON encoding.

        Those two maps are free-form and mutated in place, where no validator
        sees them; numpy scalars become builtin numbers, non-finite numbers and
        unencodable objects are dropped (telemetry must not cost the reward).
        """
        if _is_json_ready(self.metrics) and _is_json_ready(self.extra_fields):
            return self
        dropped: list[str] = []
        fitted = self.model_copy(
            update={
                "metrics": _fit_json(self.metrics, dropped),
                "extra_fields": _fit_json(self.extra_fields, dropped),
            }
        )
        if dropped:
            logger.warning(
                "dropped values with no JSON form from sample metrics/extra_fields: %s",
                ", ".join(sorted(set(dropped))),
            )
        return fitted


# --------------------------------------------------------------------------- configs


class ConcurrencyConfig(BaseModel):
    """How many rollouts of a workflow may run at once; None means no cap."""

    max_concurrent: int | None = Field(default=None, ge=1)


class BaseConfig(BaseModel):
    """Base for workflow and grader configs; extra fields are kept."""

    model_config: ClassVar[ConfigDict] = ConfigDict(
        extra="allow",
        validate_assignment=True,
        arbitrary_types_allowed=True,
    )

    name: str
    description: str | None = None


class AgentWorkflowConfig(BaseConfig):
    """Config handed to each new ``AgentWorkflow`` instance (deep-copied per rollout)."""

    concurrency: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig)


class GraderConfig(BaseConfig):
    """Config handed to each new ``Grader`` instance."""

    concurrency: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig)


class AgentWorkflowOutput(BaseModel):
    """What ``AgentWorkflow.run`` returns: one message history plus measurements.

    ``info`` is reserved for workflow metadata and is not passed to graders.
    """

    model_config: ClassVar[ConfigDict] = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        revalidate_instances="always",
    )

    messages: Messages | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)


def coerce_workflow_output(value: Any) -> AgentWorkflowOutput | None:
    """Normalize a ``run()`` return value; None means "use the sample source"."""
    if value is None:
        return None
    if isinstance(value, AgentWorkflowOutput):
        return AgentWorkflowOutput.model_validate(value)
    if isinstance(value, list):
        return AgentWorkflowOutput(messages=value)
    raise TypeError(
        "AgentWorkflow.run() must return AgentWorkflowOutput, a message list, or None; "
        f"got {type(value).__name__}"
    )


# --------------------------------------------------------------------------- ambient context


class SampleSource(ABC):
    """Produces the rollout's sample when the workflow returns None.

    Integrations (an agent or session wrapper) register one per rollout with
    ``set_sample_source``; the backend pulls the sample before grading.
    """

    @abstractmethod
    async def get_sample(self) -> RolloutSample:
        """Return the rollout's current sample."""

    async def get_preview(self, max_messages: int) -> RolloutSample | None:
        """Return a snapshot of at most ``max_messages`` recent messages, if supported."""
        return None


StatusCallback = Callable[["RolloutStatus"], None]
"""Called synchronously with each accepted status change of a rollout."""

_current_context: ContextVar[RolloutContext | None] = ContextVar(
    "harbor_exec_rollout_context", default=None
)


@dataclass
class RolloutContext:
    """Ambient state of one rollout, visible to workflow code via ``get_rollout_context()``.

    Use it as a context manager around the workflow. ``on_status`` lets a
    backend or server observe status changes (e.g. to wake long-polls); once
    the status is terminal, later changes are ignored. Empty URL, key and id
    fall back to the ``OSMOSIS_*`` environment variables (container runners).
    """

    chat_completions_url: str = ""
    api_key: str | None = None
    rollout_id: str = ""
    sample_source: SampleSource | None = None
    status: RolloutStatus = RolloutStatus.QUEUED
    on_status: StatusCallback | None = field(default=None, repr=False)
    #: When the rollout's agent started (``agent_started_at`` in the result): the
    #: server's clock at ``execute`` unless the backend ``reports_agent_start``.
    agent_started_at: datetime | None = None
    #: When its trial began to tear down (its last phase ended): harbor-exec's own, set
    #: by HarborBackend, for the console's live phase.
    teardown_started_at: datetime | None = None
    _tokens: list[Token[RolloutContext | None]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not self.chat_completions_url:
            self.chat_completions_url = os.environ.get(CHAT_COMPLETIONS_URL_ENV, "")
        if not self.api_key:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if not self.rollout_id:
            self.rollout_id = os.environ.get(ROLLOUT_ID_ENV, "")

    def __enter__(self) -> RolloutContext:
        # A token stack (not "set None on exit") so nesting restores the outer context.
        self._tokens.append(_current_context.set(self))
        return self

    def __exit__(self, *_: object) -> None:
        _current_context.reset(self._tokens.pop())

    def set_sample_source(self, source: SampleSource) -> None:
        """Register the rollout's single sample source; a second one raises ``ValueError``."""
        if self.sample_source is not None:
            raise ValueError(
                "this rollout already has a sample source; a rollout produces one "
                "sample, so build a single agent/session per rollout"
            )
        self.sample_source = source

    async def get_sample(self) -> RolloutSample | None:
        """Return the registered source's sample, or None when none is registered."""
        if self.sample_source is None:
            return None
        return await self.sample_source.get_sample()

    async def set_status(self, status: RolloutStatus) -> bool:
        """Move the rollout to ``status``; returns False when ignored.

        A repeated status, or any change after a terminal status, is ignored.
        Async for SDK compatibility; observers are called synchronously.
        """
        return self.update_status(status)

    async def mark_agent_started(self, when: datetime | None = None) -> None:
        """Record when the agent started (a UTC datetime; default: now). Only the first
        call counts. For backends that set ``reports_agent_start``."""
        self.record_agent_start(when)

    def record_agent_start(self, when: datetime | None = None) -> None:
        """Synchronous form of ``mark_agent_started``."""
        if self.agent_started_at is None:
            self.agent_started_at = when or datetime.now(UTC)

    def update_status(self, status: RolloutStatus) -> bool:
        """Synchronous form of ``set_status`` for code outside a coroutine."""
        if status is self.status or self.status in TERMINAL_STATUSES:
            return False
        self.status = status
        if self.on_status is not None:
            try:
                self.on_status(status)
            except Exception:
                # An observer bug must not fail the rollout itself.
                logger.warning("rollout status observer failed", exc_info=True)
        return True


def get_rollout_context() -> RolloutContext | None:
    """The active rollout's context, or None outside a rollout."""
    return _current_context.get()


def set_sample_source(source: SampleSource) -> None:
    """Register ``source`` on the active rollout; raises ``RuntimeError`` outside one."""
    context = _current_context.get()
    if context is None:
        raise RuntimeError("set_sample_source() called outside a rollout")
    context.set_sample_source(source)


async def get_sample() -> RolloutSample | None:
    """The active rollout's sample from its source, or None."""
    context = _current_context.get()
    return None if context is None else await context.get_sample()


async def set_status(status: RolloutStatus) -> bool:
    """Move the active rollout to ``status``; a no-op (False) outside a rollout."""
    context = _current_context.get()
    return False if context is None else await context.set_status(status)


# --------------------------------------------------------------------------- workflow, grader

TConfig = TypeVar("TConfig", bound=AgentWorkflowConfig)


@dataclass
class AgentWorkflowContext(Generic[TConfig]):
    """What ``AgentWorkflow.run`` receives. ``artifacts_dir`` is None when unusable."""

    prompt: Messages
    config: TConfig | None = None
    metadata: dict[str, Any] | None = None
    artifacts_dir: Path | None = None


@dataclass
class GraderContext:
    """What ``Grader.grade`` receives; the grader calls ``set_reward``."""

    label: str | None = None
    sample: RolloutSample | None = None
    project_path: str | None = None
    metadata: dict[str, Any] | None = None
    artifacts_dir: Path | None = None

    def set_reward(self, reward: float) -> None:
        """Set the sample's reward; NaN/inf raise ``ValidationError``."""
        if self.sample is None:
            raise ValueError("GraderContext has no sample to reward")
        self.sample.reward = reward


class AgentWorkflow(ABC, Generic[TConfig]):
    """An agent run: one prompt in, one message history out.

    A fresh instance is made per rollout with a deep copy of the config.
    """

    def __init__(self, config: TConfig | None = None) -> None:
        self.config = config

    @abstractmethod
    async def run(
        self, ctx: AgentWorkflowContext[TConfig]
    ) -> AgentWorkflowOutput | Messages | None:
        """Run the workflow.

        Return an ``AgentWorkflowOutput`` or a bare message list; return None
        to use the sample of the source registered with ``set_sample_source``.
        """


class Grader(ABC):
    """Scores a rollout's sample by calling ``ctx.set_reward`` (the return value is ignored)."""

    def __init__(self, config: GraderConfig | None = None) -> None:
        self.config = config

    @abstractmethod
    async def grade(self, ctx: GraderContext) -> Any:
        """Grade ``ctx.sample``; set ``ctx.sample.remove_sample`` to drop it from training."""


# --------------------------------------------------------------------------- import paths


def resolve_import_path(ref: str) -> Any:
    """Import ``"package.module:attr"`` (``attr`` may be dotted) and return the object.

    Raises ``ValueError`` for a malformed path and ``ImportError`` naming the
    missing module or attribute.
    """
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"invalid import path {ref!r}: expected 'module:attr'")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{module_name!r} has no attribute {attr_path!r}") from None
    return obj


async def run_workflow_once(
    workflow: AgentWorkflow[Any],
    context: AgentWorkflowContext[Any],
    rollout: RolloutContext,
    *,
    label: str | None = None,
) -> RolloutSample | None:
    """Run one workflow instance inside ``rollout`` and return its one sample.

    The sample is the returned messages (a list, or an ``AgentWorkflowOutput``
    with its metrics), or, when ``run`` returns None, the registered sample
    source's (no source is a ``ValueError``: a bug in the workflow). An output
    with ``messages=None`` means "no sample", as in the reference: the rollout
    succeeds without one, and grading it fails with "no sample to grade".
    ``LocalBackend`` and the container runner both run workflows through this.
    """
    with rollout:
        output = coerce_workflow_output(await workflow.run(context))
        if output is None:
            sample = await rollout.get_sample()
            if sample is None:
                raise ValueError(
                    "the workflow returned None but registered no sample source; return "
                    "the messages (or an AgentWorkflowOutput), or call set_sample_source()"
                )
            return sample
        if output.messages is None:
            return None
        return RolloutSample(messages=output.messages, label=label, metrics=dict(output.metrics))
