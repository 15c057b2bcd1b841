"""A finished trial as a rollout's outcome: ``TrialResult`` -> ``ExecutionOutcome``.

No side effects: it reads the trial directory (the agent's ``sample.json``, the
grader's ``reward.json`` / ``sample.json`` / ``grader_error.json``) and maps
exception types through the one error table (``harbor_exec.errors.POLICIES``).

* The workflow result fails on any agent-side error (a timeout says so), on a
  missing or failed sample, and succeeds otherwise (the oracle's sample is empty).
* The grader result, when the rollout is graded, carries the reward: the
  ``reward`` key, or the only key; other keys become ``reward/<key>`` metrics.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from harbor_exec.authoring import RolloutErrorCategory, RolloutSample, RolloutStatus
from harbor_exec.container.exchange import (
    AGENT_SAMPLE,
    GRADER_ERROR,
    RUNNER_OUTPUT,
    VERIFIER_SAMPLE,
    ErrorFile,
    SampleFile,
)
from harbor_exec.errors import policy_for
from harbor_exec.executors.local import ModelUsage, TrialRun
from harbor_exec.protocol import ExecutionOutcome, ExecutionRequest, ExecutionResult
from harbor_exec.trial.results import TrialResult


@dataclass(frozen=True)
class OutcomeSpec:
    """What the mapping needs to know about the rollout beyond its trial."""

    task_id: str
    is_oracle: bool
    verify: bool
    agent_timeout_sec: float | None = None


def category_of(exception_type: str | None) -> RolloutErrorCategory:
    """The rollout category for a trial exception type (from the one error table)."""
    return RolloutErrorCategory(policy_for(exception_type or "").category)


def failure(
    message: str,
    category: RolloutErrorCategory,
    diagnostics: dict[str, Any] | None = None,
    sample: RolloutSample | None = None,
) -> ExecutionResult:
    return ExecutionResult(
        status=RolloutStatus.FAILURE,
        sample=sample,
        err_message=message or "rollout failed",
        err_category=category,
        extra_fields=diagnostics,
    )


def cancelled(diagnostics: dict[str, Any] | None = None) -> ExecutionResult:
    return ExecutionResult(
        status=RolloutStatus.CANCELLED, err_message="cancelled", extra_fields=diagnostics
    )


def rollout_outcome(
    request: ExecutionRequest, run: TrialRun, spec: OutcomeSpec
) -> ExecutionOutcome:
    """The workflow result and, when graded, the grader result of one finished trial."""
    result = run.result
    exc_type = result.exception_type
    diagnostics = diagnostics_of(run, spec)
    if exc_type == "CancelledError":
        return ExecutionOutcome(workflow=cancelled(diagnostics))
    message = result.exception_info.exception_message if result.exception_info else ""
    workflow, sample = _workflow_result(request, run, spec, message, diagnostics)
    if workflow.status is not RolloutStatus.SUCCESS or not spec.verify:
        return ExecutionOutcome(workflow=workflow)
    grader = _grader_result(run, sample, message, diagnostics)
    return ExecutionOutcome(workflow=workflow, grader=grader)


def _workflow_result(
    request: ExecutionRequest,
    run: TrialRun,
    spec: OutcomeSpec,
    message: str,
    diagnostics: dict[str, Any],
) -> tuple[ExecutionResult, RolloutSample | None]:
    exc_type = run.result.exception_type
    if exc_type == "AgentTimeoutError":
        limit = spec.agent_timeout_sec
        text = f"workflow exceeded its {limit:g}s deadline" if limit is not None else message
        return failure(text, RolloutErrorCategory.TIMEOUT, diagnostics), None
    verifier_side = policy_for(exc_type or "").phase == "verifier"
    if exc_type is not None and (not verifier_side or not spec.verify):
        return failure(message, category_of(exc_type), diagnostics), None
    if spec.is_oracle:
        sample = RolloutSample(messages=[], label=request.label)
        return _success(sample, diagnostics), sample
    path = run.trial_dir / AGENT_SAMPLE
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError):
        tail = _tail(run.trial_dir / RUNNER_OUTPUT)
        text = f"the workflow wrote no sample (agent/sample.json); runner output:\n{tail}"
        return failure(text, RolloutErrorCategory.AGENT_ERROR, diagnostics), None
    if isinstance(payload, dict) and "error" in payload:
        error = _error_of(payload)
        return failure(error.message, _category(error.category), diagnostics), None
    try:
        parsed = SampleFile.model_validate(payload)
    except ValidationError as exc:
        text = f"the workflow's agent/sample.json is not a sample: {exc.errors()[0]['msg']}"
        return failure(text, RolloutErrorCategory.AGENT_ERROR, diagnostics), None
    if parsed.messages is None:  # the workflow produced no sample: a success without one
        return _success(None, diagnostics), None
    sample = RolloutSample.model_validate(
        {**parsed.model_dump(), "label": request.label, "reward": None}
    )
    if run.usage is not None:
        sample.metrics = {**sample.metrics, **usage_metrics(run.usage)}
    return _success(sample, diagnostics), sample


def _grader_result(
    run: TrialRun,
    sample: RolloutSample | None,
    message: str,
    diagnostics: dict[str, Any],
) -> ExecutionResult:
    result = run.result
    exc_type = result.exception_type
    if exc_type is not None and exc_type != "AgentTimeoutError":
        error_file = run.trial_dir / GRADER_ERROR
        if error_file.is_file():
            with contextlib.suppress(ValueError, OSError):
                error = _error_of(json.loads(error_file.read_text()))
                text = f"grader failed: {error.message}"
                return failure(text, _category(error.category), diagnostics, sample)
        return failure(message, category_of(exc_type), diagnostics, sample)
    rewards = (result.verifier_result.rewards if result.verifier_result else None) or {}
    if "reward" in rewards:
        reward = float(rewards["reward"])
    elif len(rewards) == 1:
        reward = float(next(iter(rewards.values())))
    else:
        text = f"reward.json has no 'reward' key for the sample (keys: {sorted(rewards)})"
        return failure(text, RolloutErrorCategory.VALIDATION_ERROR, diagnostics, sample)
    graded = run.trial_dir / VERIFIER_SAMPLE
    if graded.is_file():  # the grader changed the sample: keep everything it decided
        with contextlib.suppress(ValueError, OSError, ValidationError):
            payload = SampleFile.model_validate_json(graded.read_text()).model_dump()
            sample = RolloutSample.model_validate(
                {**payload, "label": sample.label if sample else None}
            )
    sample = (sample or RolloutSample(messages=[])).model_copy(deep=True)
    sample.reward = reward
    if len(rewards) > 1:
        sample.metrics = {
            **sample.metrics,
            **{f"reward/{k}": float(v) for k, v in rewards.items()},
        }
    return _success(sample, diagnostics)


def usage_metrics(usage: ModelUsage) -> dict[str, int]:
    """The relay's counts as sample metrics."""
    return {
        "llm_requests": usage.requests,
        "llm_prompt_tokens": usage.prompt_tokens,
        "llm_completion_tokens": usage.completion_tokens,
        "llm_total_tokens": usage.total_tokens,
    }


def diagnostics_of(run: TrialRun, spec: OutcomeSpec) -> dict[str, Any]:
    """Per-phase timings and the trial's identity, kept beside the rollout's artifacts."""
    result: TrialResult = run.result
    timings = {
        "environment_setup": result.environment_setup.seconds if result.environment_setup else None,
        "agent_setup": result.agent_setup.seconds if result.agent_setup else None,
        "agent": result.agent_execution.seconds if result.agent_execution else None,
        "verifier": result.verifier.seconds if result.verifier else None,
    }
    if result.started_at and result.finished_at:
        timings["total"] = (result.finished_at - result.started_at).total_seconds()
    phase = (
        "verifier"
        if result.verifier
        else "agent"
        if result.agent_execution
        else "environment_setup"
    )
    exc_type = result.exception_type
    if exc_type and phase == "verifier" and policy_for(exc_type).phase in ("agent", "environment"):
        phase = "agent"
    return {
        "backend": "harbor",
        "task": spec.task_id,
        "trial": result.trial_name,
        "trial_dir": str(run.trial_dir),
        "node": run.node,
        "phase": phase,
        "harbor_exception_type": exc_type,
        "category": category_of(exc_type).value if exc_type else None,
        "rewards": result.verifier_result.rewards if result.verifier_result else None,
        "timings_sec": timings,
    }


def _success(sample: RolloutSample | None, diagnostics: dict[str, Any]) -> ExecutionResult:
    return ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample, extra_fields=diagnostics)


def _error_of(payload: Any) -> Any:
    try:
        return ErrorFile.model_validate(payload).error
    except ValidationError:
        return ErrorFile.model_validate({"error": {"message": "the runner failed"}}).error


def _category(value: str) -> RolloutErrorCategory:
    try:
        return RolloutErrorCategory(value)
    except ValueError:
        return RolloutErrorCategory.AGENT_ERROR


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


__all__ = [
    "OutcomeSpec",
    "cancelled",
    "category_of",
    "diagnostics_of",
    "failure",
    "rollout_outcome",
    "usage_metrics",
]
