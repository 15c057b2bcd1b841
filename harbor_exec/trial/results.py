"""What a trial leaves on disk: Harbor's ``result.json`` shape and its reward contract.

``TrialResult`` carries Harbor 0.26's TrialResult fields; ``parse_rewards`` applies
Harbor's reward rules (``reward.json`` wins over ``reward.txt``; finite numbers
only; empty and missing files are their own errors).
"""

from __future__ import annotations

import json
import math
import traceback
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, computed_field, field_serializer

from harbor_exec.agents.base import AgentInfo
from harbor_exec.container.exchange import json_depth
from harbor_exec.container.redaction import redact
from harbor_exec.errors import (
    RewardFileEmptyError,
    RewardFileNotFoundError,
    StepPreparationError,
    VerifierOutputParseError,
    is_exception,
    policy_for,
)

Rewards = dict[str, float | int]


def utcnow() -> datetime:
    return datetime.now(UTC)


def _iso_z(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class TimingInfo(BaseModel):
    """Start and end of one phase, ISO UTC with a ``Z``."""

    started_at: datetime | None = None
    finished_at: datetime | None = None

    @field_serializer("started_at", "finished_at")
    def _z(self, value: datetime | None) -> str | None:
        return _iso_z(value)

    @property
    def seconds(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()


class ErrorPolicyModel(BaseModel):
    should_retry: bool
    should_grade: bool
    has_valid_reward: bool


class ExceptionInfo(BaseModel):
    """The first exception a trial hit, by Harbor's exception name."""

    exception_type: str
    exception_message: str
    exception_traceback: str
    occurred_at: datetime

    @field_serializer("occurred_at")
    def _z(self, value: datetime) -> str | None:
        return _iso_z(value)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def policy(self) -> ErrorPolicyModel:
        policy = policy_for(self.exception_type)
        return ErrorPolicyModel(
            should_retry=policy.should_retry,
            should_grade=policy.should_grade,
            has_valid_reward=policy.has_valid_reward,
        )

    @classmethod
    def from_exception(cls, exc: BaseException) -> ExceptionInfo:
        return cls(
            exception_type=type(exc).__name__,
            exception_message=str(exc),
            exception_traceback="".join(traceback.format_exception(exc)),
            occurred_at=utcnow(),
        )


class AgentResult(BaseModel):
    n_input_tokens: int | None = None
    n_cache_tokens: int | None = None
    n_output_tokens: int | None = None
    cost_usd: float | None = None
    model_usage: dict[str, Any] | None = None
    rollout_details: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None


class VerifierResult(BaseModel):
    rewards: Rewards | None = None


class StepResult(BaseModel):
    """One step of a multi-step trial (Harbor 0.26 ``StepResult``)."""

    step_name: str
    agent_result: AgentResult | None = None
    verifier_result: VerifierResult | None = None
    exception_info: ExceptionInfo | None = None
    agent_execution: TimingInfo | None = None
    verifier: TimingInfo | None = None


class TrialResult(BaseModel):
    """Harbor's TrialResult (``schema_version: 1``), written as ``<trial>/result.json``."""

    schema_version: Literal[1] = 1
    id: uuid.UUID = Field(default_factory=uuid.uuid4)
    task_name: str
    trial_name: str
    trial_uri: str
    task_id: dict[str, str]
    source: str | None = None
    task_checksum: str
    config: dict[str, Any]
    agent_info: AgentInfo
    agent_result: AgentResult | None = None
    verifier_result: VerifierResult | None = None
    verifier_environment_mode: Literal["shared", "separate"] | None = "shared"
    exception_info: ExceptionInfo | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    environment_setup: TimingInfo | None = None
    agent_setup: TimingInfo | None = None
    agent_execution: TimingInfo | None = None
    verifier: TimingInfo | None = None
    step_results: list[StepResult] | None = None

    @field_serializer("started_at", "finished_at")
    def _z(self, value: datetime | None) -> str | None:
        return _iso_z(value)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reward_valid(self) -> bool:
        """True when there are rewards and no recorded exception voids them."""
        if self.verifier_result is None or not self.verifier_result.rewards:
            return False
        recorded = self.recorded_exceptions()
        if self.exception_info is not None and is_exception(
            self.exception_info.exception_type, StepPreparationError
        ):
            # The step that could not be prepared already counts 0 in the rewards.
            recorded = [self.exception_info]
        return all(policy_for(info.exception_type).has_valid_reward for info in recorded)

    def recorded_exceptions(self) -> list[ExceptionInfo]:
        """The trial's exception first, then each step's, in step order (Harbor's)."""
        found = [self.exception_info] if self.exception_info is not None else []
        found += [s.exception_info for s in self.step_results or [] if s.exception_info]
        return found

    @property
    def first_exception(self) -> ExceptionInfo | None:
        """The trial's exception, else the first step's (multi-step trials record
        what a step's agent or verifier raised on the step)."""
        recorded = self.recorded_exceptions()
        return recorded[0] if recorded else None

    @property
    def reward(self) -> float | None:
        """The ``reward`` key (or the only key) when the reward is valid."""
        if not self.reward_valid or self.verifier_result is None:
            return None
        rewards = self.verifier_result.rewards or {}
        if "reward" in rewards:
            return float(rewards["reward"])
        if len(rewards) == 1:
            return float(next(iter(rewards.values())))
        return None

    @property
    def exception_type(self) -> str | None:
        """The first recorded exception's type (the trial's, else a step's)."""
        first = self.first_exception
        return first.exception_type if first else None

    def write(self, trial_dir: Path, *, redacting: Sequence[str] = ()) -> None:
        """``<trial_dir>/result.json``, with every secret in ``redacting`` scrubbed."""
        text = redact(self.model_dump_json(indent=2), redacting)
        (trial_dir / "result.json").write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------- rewards


def _check_number(value: Any, path: Path, key: str) -> float | int:
    # bool is an int in Python and Harbor lets it through, stored as 1.0/0.0.
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float):
        raise VerifierOutputParseError(f"{path}: reward {key!r} is not a number: {value!r:.80}")
    try:
        # A huge int passes the type check but has no float value (OverflowError);
        # everything downstream (means, JSON, the wire) needs a finite float.
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    if not math.isfinite(as_float):
        shown = f"an integer of {len(str(abs(value)))} digits" if isinstance(value, int) else value
        raise VerifierOutputParseError(f"{path}: reward {key!r} is not a finite number ({shown})")
    return value


#: Bounds on a reward file (written in a container, so possibly hostile): larger
#: files are refused before they are parsed.
MAX_REWARD_FILE_BYTES = 1 << 20
MAX_REWARD_KEYS = 1024
_MAX_REWARD_DEPTH = 8


def _check_reward_size(path: Path) -> None:
    size = path.stat().st_size
    if size > MAX_REWARD_FILE_BYTES:
        raise VerifierOutputParseError(
            f"{path} is {size} bytes; a reward file may hold at most {MAX_REWARD_FILE_BYTES}"
        )


def _parse_int(text: str) -> int | float:
    # Past Python's int-conversion digit limit json.loads would raise before we
    # know the key; such a value is far beyond any float anyway, so make it inf
    # and let the per-key check name it.
    return int(text) if len(text) <= 1000 else math.inf


def parse_rewards(verifier_dir: Path) -> Rewards:
    """Harbor's reward rules over a downloaded ``/logs/verifier`` directory."""
    json_path = verifier_dir / "reward.json"
    text_path = verifier_dir / "reward.txt"
    for path in (json_path, text_path):
        if path.is_file():
            _check_reward_size(path)
    if json_path.is_file():
        if json_path.stat().st_size == 0:
            raise RewardFileEmptyError(f"reward file is empty: {json_path}")
        text = json_path.read_text(encoding="utf-8", errors="replace")
        # Bounded before parsing: the file came out of a container (a deep one would
        # make json.loads recurse). A reward file is flat; some slack for the message.
        if json_depth(text, _MAX_REWARD_DEPTH) > _MAX_REWARD_DEPTH:
            raise VerifierOutputParseError(
                f"{json_path} nests deeper than {_MAX_REWARD_DEPTH} levels; it must be a "
                'flat JSON object of numbers, like {"reward": 1.0}'
            )
        try:
            data = json.loads(text, parse_int=_parse_int)
        except (ValueError, RecursionError) as exc:
            # ValueError also covers JSONDecodeError and integers past Python's
            # digit limit for int conversion (4300 digits).
            raise VerifierOutputParseError(f"{json_path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or not data:
            raise VerifierOutputParseError(
                f"{json_path} must be a flat JSON object of numbers, like "
                f'{{"reward": 1.0}}; got {str(data)[:80]!r}'
            )
        if len(data) > MAX_REWARD_KEYS:
            raise VerifierOutputParseError(
                f"{json_path} has {len(data)} keys; a reward file may hold at most "
                f"{MAX_REWARD_KEYS}"
            )
        return {str(key): _check_number(value, json_path, str(key)) for key, value in data.items()}
    if text_path.is_file():
        if text_path.stat().st_size == 0:
            raise RewardFileEmptyError(f"reward file is empty: {text_path}")
        text = text_path.read_text(encoding="utf-8", errors="replace")
        try:
            value = float(text)
        except ValueError:
            raise VerifierOutputParseError(
                f"{text_path} must hold one number; got {text.strip()[:80]!r}"
            ) from None
        return {"reward": _check_number(value, text_path, "reward")}
    raise RewardFileNotFoundError(
        "tests/test.sh wrote no reward: expected /logs/verifier/reward.json or "
        "/logs/verifier/reward.txt (see verifier/test-stdout.txt)"
    )
