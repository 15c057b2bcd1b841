"""Wire bodies of rollout results: each finished rollout is encoded once, as
``RolloutResultResponse``, and its bytes are what every later poll answers.

Two bodies are on every rollout's path and are assembled by hand, byte for byte
``json.dumps(model.model_dump(mode="json"), separators=(",", ":"))`` of their model
(tests/test_openapi.py checks it), at a tenth of the cost: the 202
``RolloutInitResponse`` (``AdmissionEncoder``) and the in-progress
``RolloutResultResponse`` (``in_progress_body``).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any

from harbor_exec.protocol import (
    ExecutionResult,
    RolloutErrorCategory,
    RolloutResultResponse,
    RolloutSample,
    RolloutStatus,
)
from harbor_exec.server.registry import FinalResult

__all__ = [
    "AdmissionEncoder",
    "cancelled_result",
    "failed_result",
    "final_result",
    "in_progress_body",
    "lease_expired_result",
]

logger = logging.getLogger(__name__)


def _sanitize_text(text: str | None) -> str | None:
    # Lone surrogates (from undecodable bytes) cannot be encoded as UTF-8 JSON.
    return None if text is None else text.encode("utf-8", "replace").decode("utf-8")


def _encode_result(response: RolloutResultResponse) -> bytes:
    exclude: dict[str, Any] = {"sample": {"trajectory_messages"}}
    if response.agent_started_at is None:
        exclude["agent_started_at"] = True  # 0.3.8's exact bytes when no agent ran
    return response.model_dump_json(exclude=exclude).encode()


def final_result(
    rollout_id: str, result: ExecutionResult, agent_started_at: datetime | None = None
) -> FinalResult:
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
        agent_started_at=agent_started_at,
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


def failed_result(rollout_id: str, message: str, category: RolloutErrorCategory) -> FinalResult:
    return final_result(
        rollout_id,
        ExecutionResult(status=RolloutStatus.FAILURE, err_message=message, err_category=category),
    )


def lease_expired_result(rollout_id: str) -> FinalResult:
    return failed_result(rollout_id, "polling lease expired", RolloutErrorCategory.LEASE_EXPIRED)


def cancelled_result(rollout_id: str, message: str | None) -> FinalResult:
    return final_result(
        rollout_id, ExecutionResult(status=RolloutStatus.CANCELLED, err_message=message)
    )


def in_progress_body(rollout_id: str, status: RolloutStatus) -> bytes:
    """``RolloutResultResponse(rollout_id=, status=)`` (no sample, no error) as bytes."""
    return (
        f'{{"rollout_id":{json.dumps(rollout_id)},"status":"{status.value}",'
        '"sample":null,"err_message":null,"err_category":null}'
    ).encode()


class AdmissionEncoder:
    """The 202 body, ``RolloutInitResponse`` with status ``queued``, as bytes; the
    server's waits are the same in every one, so that tail is encoded once."""

    def __init__(self, *, result_wait_timeout_sec: float, polling_lease_timeout_sec: float) -> None:
        self._tail = (
            f',"result_wait_timeout_sec":{result_wait_timeout_sec!r}'
            f',"polling_lease_timeout_sec":{polling_lease_timeout_sec!r}}}'
        ).encode()

    def encode(self, rollout_id: str, polling_lease_token: str) -> bytes:
        return b"".join(
            (
                b'{"rollout_id":',
                json.dumps(rollout_id).encode(),
                b',"status":"queued","polling_lease_token":"',
                # URL-safe base64 (the registry's): nothing to escape.
                polling_lease_token.encode(),
                b'"',
                self._tail,
            )
        )
