"""Wire models, backend exchange types and error categories."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from harbor_exec import protocol
from harbor_exec.protocol import (
    CancelRolloutsRequest,
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    RolloutErrorCategory,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutLifecycle,
    RolloutResultResponse,
    RolloutSample,
    RolloutStatus,
    categorize_exception,
)

BASE: dict[str, Any] = {
    "initial_messages": [{"role": "user", "content": "2+2?"}],
    "rollout_id": "r-1",
    "chat_completions_url": "http://127.0.0.1:9/v1/chat/completions",
}


def _errors(exc: ValidationError) -> list[tuple[Any, ...]]:
    return [error["loc"] for error in exc.errors()]


@pytest.mark.parametrize("rollout_id", ["", ".", "..", "a/b", "a\\b", "a\x00b", "/"])
def test_rollout_id_must_be_one_path_segment(rollout_id: str) -> None:
    with pytest.raises(ValidationError) as caught:
        RolloutInitRequest.model_validate({**BASE, "rollout_id": rollout_id})
    assert _errors(caught.value) == [("rollout_id",)]
    with pytest.raises(ValidationError, match="single path segment"):
        ExecutionRequest(id=rollout_id, prompt=[])


@pytest.mark.parametrize("rollout_id", ["abc", "a.b", "a::b", "...", "x y", "ü"])
def test_plain_ids_are_accepted(rollout_id: str) -> None:
    assert RolloutInitRequest.model_validate({**BASE, "rollout_id": rollout_id}).rollout_id == (
        rollout_id
    )


@pytest.mark.parametrize("field", ["agent_timeout_sec", "grader_timeout_sec"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_timeouts_must_be_finite(field: str, literal: str) -> None:
    body = json.dumps(BASE)[:-1] + f', "{field}": {literal}}}'
    with pytest.raises(ValidationError) as caught:
        RolloutInitRequest.model_validate_json(body)
    assert _errors(caught.value) == [(field,)]
    with pytest.raises(ValidationError):
        RolloutInitRequest.model_validate({**BASE, field: math.nan})


def test_zero_and_negative_timeouts_mean_already_expired_and_are_valid() -> None:
    request = RolloutInitRequest.model_validate(
        {**BASE, "agent_timeout_sec": 0, "grader_timeout_sec": -1}
    )
    assert (request.agent_timeout_sec, request.grader_timeout_sec) == (0.0, -1.0)


def test_llm_api_key_empty_string_is_rejected_but_null_is_fine() -> None:
    with pytest.raises(ValidationError) as caught:
        RolloutInitRequest.model_validate({**BASE, "llm_api_key": ""})
    assert _errors(caught.value) == [("llm_api_key",)]
    assert RolloutInitRequest.model_validate({**BASE, "llm_api_key": None}).llm_api_key is None
    assert RolloutInitRequest.model_validate({**BASE, "llm_api_key": "k"}).llm_api_key == "k"


def test_required_fields_and_defaults_and_ignored_extras() -> None:
    with pytest.raises(ValidationError) as caught:
        RolloutInitRequest.model_validate({})
    assert sorted(_errors(caught.value)) == [
        ("chat_completions_url",),
        ("initial_messages",),
        ("rollout_id",),
    ]
    request = RolloutInitRequest.model_validate({**BASE, "completion_callback_url": "legacy"})
    assert request.grade is True
    assert request.label is None and request.metadata is None and request.extra_fields is None
    assert "completion_callback_url" not in request.model_dump()


def test_init_response_checks_its_timeouts() -> None:
    good = {
        "rollout_id": "r",
        "status": "queued",
        "polling_lease_token": "t",
        "result_wait_timeout_sec": 30,
        "polling_lease_timeout_sec": 120,
    }
    assert RolloutInitResponse.model_validate(good).status is RolloutStatus.QUEUED
    for change in (
        {"result_wait_timeout_sec": 0},
        {"result_wait_timeout_sec": math.inf},
        {"polling_lease_timeout_sec": 30},
        {"polling_lease_token": ""},
    ):
        with pytest.raises(ValidationError):
            RolloutInitResponse.model_validate({**good, **change})


def test_cancel_request_counts_selectors() -> None:
    assert CancelRolloutsRequest().selector_count() == 0
    assert CancelRolloutsRequest(ids=[]).selector_count() == 1
    assert CancelRolloutsRequest(prefix="p", all=True).selector_count() == 2
    assert RolloutLifecycle(accepting_rollouts=True, active_rollouts=0).active_rollouts == 0
    with pytest.raises(ValidationError):
        RolloutLifecycle(accepting_rollouts=True, active_rollouts=-1)


def test_result_response_fills_trajectory_from_messages_on_receipt() -> None:
    wire = {
        "rollout_id": "r",
        "status": "success",
        "sample": {"messages": [{"role": "user", "content": "x"}], "reward": 1.0},
    }
    result = RolloutResultResponse.model_validate(wire)
    assert result.sample is not None
    assert result.sample.trajectory_messages == [{"role": "user", "content": "x"}]


# ---------------------------------------------------------------------------- outcomes

SAMPLE = RolloutSample(messages=[{"role": "assistant", "content": "4"}], reward=1.0)
OK = ExecutionResult(status=RolloutStatus.SUCCESS, sample=SAMPLE)
FAILED = ExecutionResult(status=RolloutStatus.FAILURE, err_message="boom")


def test_outcome_result_and_result_to_save() -> None:
    assert ExecutionOutcome(workflow=OK).result is OK
    graded = ExecutionResult(status=RolloutStatus.SUCCESS, sample=SAMPLE.model_copy())
    assert ExecutionOutcome(workflow=OK, grader=graded).result is graded
    # A failed workflow wins and borrows the grader's sample.
    borrowed = ExecutionOutcome(workflow=FAILED, grader=graded).result
    assert borrowed.status is RolloutStatus.FAILURE and borrowed.sample is graded.sample
    assert ExecutionOutcome(workflow=FAILED).result is FAILED
    # Saved: the grader's result when it has a sample, else the workflow's.
    assert ExecutionOutcome(workflow=OK, grader=graded).result_to_save is graded
    no_sample = ExecutionResult(status=RolloutStatus.FAILURE)
    assert ExecutionOutcome(workflow=OK, grader=no_sample).result_to_save is OK


# ---------------------------------------------------------------------------- error categories


class SandboxApiException(Exception):
    def __init__(self, status_code: int) -> None:
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code


class SandboxConnectionException(Exception):
    pass


class ProviderDown(SandboxConnectionException):
    pass


def test_categorize_exception() -> None:
    class Model(BaseModel):
        x: int

    try:
        Model.model_validate({"x": "no"})
    except ValidationError as exc:
        pydantic_error: Exception = exc
    cases: list[tuple[BaseException, RolloutErrorCategory]] = [
        (TimeoutError(), RolloutErrorCategory.TIMEOUT),
        (ValueError(), RolloutErrorCategory.VALIDATION_ERROR),
        (TypeError(), RolloutErrorCategory.VALIDATION_ERROR),
        (AssertionError(), RolloutErrorCategory.VALIDATION_ERROR),
        (pydantic_error, RolloutErrorCategory.VALIDATION_ERROR),
        (ProviderDown(), RolloutErrorCategory.HTTP_ERROR),
        (SandboxApiException(503), RolloutErrorCategory.HTTP_ERROR),
        (SandboxApiException(404), RolloutErrorCategory.AGENT_ERROR),
        (RuntimeError("boom"), RolloutErrorCategory.AGENT_ERROR),
    ]
    for error, expected in cases:
        assert categorize_exception(error) is expected, error


# ---------------------------------------------------------------------------- reference parity


#: Fields we add to 0.3.8's models (optional, last, ignored by its clients).
ADDITIVE_FIELDS = {"RolloutResultResponse": ("agent_started_at",)}


def test_wire_models_match_osmosis_field_for_field() -> None:
    """Same field names, required-ness and defaults as osmosis-ai 0.3.8's models."""
    osmosis_python = sys.version_info >= (3, 12)  # a bool: mypy (as 3.11) reads on
    if not osmosis_python:  # osmosis-ai 0.3.8 needs Python 3.12
        pytest.skip("osmosis-ai 0.3.8 is installed on Python >= 3.12 only")
    from osmosis_ai.rollout import types as reference

    for name in (
        "RolloutInitRequest",
        "RolloutInitResponse",
        "RolloutResultResponse",
        "CancelRolloutsRequest",
        "CancelRolloutsResponse",
        "RolloutLifecycle",
        "RolloutSample",
        "ExecutionRequest",
        "ExecutionResult",
        "ExecutionOutcome",
    ):
        ours = {
            field: info
            for field, info in getattr(protocol, name).model_fields.items()
            if field not in ADDITIVE_FIELDS.get(name, ())
        }
        theirs = getattr(reference, name).model_fields
        assert list(ours) == list(theirs), name
        for field, info in ours.items():
            other = theirs[field]
            assert info.is_required() == other.is_required(), (name, field)
            if not info.is_required():
                assert info.get_default(call_default_factory=True) == other.get_default(
                    call_default_factory=True
                ), (name, field)
    assert protocol.POLLING_LEASE_HEADER == reference.POLLING_LEASE_HEADER
    assert {s.value for s in RolloutStatus} == {s.value for s in reference.RolloutStatus}
