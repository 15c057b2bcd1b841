"""A finished trial as a rollout's outcome: ``TrialRun`` -> ``ExecutionOutcome``.

A pure function of the run: Harbor's record (``TrialResult``: the exception and
the rewards) and what the exchange files said (``TrialOutput``: the agent's
sample, the grader's error or changed sample), read by the trial as its logs came
back. Exception types map through the one error table (``harbor_exec.errors``).

* The workflow result fails on any agent-side error (a timeout says so), on a
  missing or failed sample, and succeeds otherwise (the oracle's sample is empty).
* The grader result, when the rollout is graded, carries the reward: the
  ``reward`` key, or the only key; other keys become ``reward/<key>`` metrics.
  ``reward`` and ``remove_sample`` come from the grader (its changed sample) or
  the task's tests only; the agent's sample never sets them.
* A reward the agent cannot drop: when the verifier gave a reward the error table
  calls valid (a timeout, an exit code, a flood of outputs, a container the agent
  ended, or no sample at all), an agent-side failure does not fail the rollout (a
  trainer drops failed rollouts, so failing would erase the agent's zero): the
  rollout is a success carrying that reward, its sample (empty when the agent left
  none) names the agent's error in ``extra_fields["agent_error"]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harbor_exec.authoring import RolloutErrorCategory, RolloutSample, RolloutStatus
from harbor_exec.errors import (
    AgentTimeoutError,
    CancelledError,
    TrialPhase,
    is_exception,
    policy_for,
)
from harbor_exec.executors.base import TrialRun
from harbor_exec.protocol import ExecutionOutcome, ExecutionRequest, ExecutionResult
from harbor_exec.trial.results import TrialResult

#: Diagnostics name the phase a trial reached by its ``timings_sec`` key.
_TIMING_KEY = {
    TrialPhase.ENVIRONMENT: "environment_setup",
    TrialPhase.AGENT: "agent",
    TrialPhase.VERIFIER: "verifier",
}


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
    if is_exception(exc_type, CancelledError):
        return ExecutionOutcome(workflow=cancelled(diagnostics))
    first = result.first_exception
    message = first.exception_message if first else ""
    workflow, sample = _workflow_result(request, run, spec, message, diagnostics)
    # ``reward_valid``: the error table's one rule (Harbor's) over what the trial recorded.
    if workflow.status is not RolloutStatus.SUCCESS and spec.verify and result.reward_valid:
        return _graded_despite_the_agent(request, run, workflow, sample, message, diagnostics)
    if workflow.status is not RolloutStatus.SUCCESS or not spec.verify:
        return ExecutionOutcome(workflow=workflow)
    grader = _grader_result(run, sample, message, diagnostics)
    return ExecutionOutcome(workflow=workflow, grader=grader)


def _graded_despite_the_agent(
    request: ExecutionRequest,
    run: TrialRun,
    workflow: ExecutionResult,
    sample: RolloutSample | None,
    message: str,
    diagnostics: dict[str, Any],
) -> ExecutionOutcome:
    """The agent failed its side but the verifier's reward stands: a success carrying
    it, with the agent's error named in the sample and the diagnostics."""
    category = workflow.err_category or RolloutErrorCategory.AGENT_ERROR
    agent_error = {
        "category": category.value,
        "message": workflow.err_message,
        "exception_type": run.result.exception_type,
    }
    sample = (sample or RolloutSample(messages=[], label=request.label)).model_copy(deep=True)
    sample.extra_fields = {**sample.extra_fields, "agent_error": agent_error}
    diagnostics = {**diagnostics, "agent_error": agent_error}
    grader = _grader_result(run, sample, message, diagnostics)
    if grader.sample is not None and "agent_error" not in grader.sample.extra_fields:
        # A grader that changed the sample handed back its own extra fields: the
        # agent's error is named on the graded sample too.
        graded = grader.sample.model_copy(deep=True)
        graded.extra_fields = {**graded.extra_fields, "agent_error": agent_error}
        grader = grader.model_copy(update={"sample": graded})
    return ExecutionOutcome(workflow=_success(sample, diagnostics), grader=grader)


def _workflow_result(
    request: ExecutionRequest,
    run: TrialRun,
    spec: OutcomeSpec,
    message: str,
    diagnostics: dict[str, Any],
) -> tuple[ExecutionResult, RolloutSample | None]:
    exc_type = run.result.exception_type
    if is_exception(exc_type, AgentTimeoutError):
        limit = spec.agent_timeout_sec
        text = f"workflow exceeded its {limit:g}s deadline" if limit is not None else message
        return failure(text, RolloutErrorCategory.TIMEOUT, diagnostics), _agent_sample(request, run)
    verifier_side = policy_for(exc_type or "").phase is TrialPhase.VERIFIER
    if exc_type is not None and (not verifier_side or not spec.verify):
        return failure(message, category_of(exc_type), diagnostics), _agent_sample(request, run)
    if spec.is_oracle:
        sample = RolloutSample(messages=[], label=request.label)
        return _success(sample, diagnostics), sample
    output = run.output.agent
    if output.error is not None:
        error = output.error
        return failure(error.message, _category(error.category), diagnostics), None
    if output.invalid is not None:
        text = f"the workflow's agent/sample.json is not a sample: {output.invalid}"
        return failure(text, RolloutErrorCategory.AGENT_ERROR, diagnostics), None
    if output.sample is None:
        text = (
            "the workflow wrote no sample (agent/sample.json); runner output:\n"
            f"{output.runner_tail}"
        )
        return failure(text, RolloutErrorCategory.AGENT_ERROR, diagnostics), None
    if output.sample.messages is None:  # the workflow produced no sample: a success without one
        return _success(None, diagnostics), None
    kept = _agent_sample(request, run)
    return _success(kept, diagnostics), kept


def _agent_sample(request: ExecutionRequest, run: TrialRun) -> RolloutSample | None:
    """The workflow's sample as the rollout carries it (None when it left none that
    reads as one, or the oracle ran): the request's label, the relay's usage."""
    output = run.output.agent
    if output.error is not None or output.sample is None or output.sample.messages is None:
        return None
    # The reward and whether the sample is dropped are the grader's to say (or the
    # task's tests'), never the agent's: what it wrote there is ignored.
    sample = RolloutSample.model_validate(
        {
            **output.sample.model_dump(),
            "label": request.label,
            "reward": None,
            "remove_sample": False,
        }
    )
    if run.usage is not None:
        # The relay's counts are the sample's; the agent's own (a native agent's
        # ``agent_usage``) are only checked against them, and a difference flagged.
        sample.metrics = {**sample.metrics, **run.usage.sample_metrics()}
        mismatch = run.usage.disagreement(sample.extra_fields.get("agent_usage"))
        if mismatch is not None:
            sample.extra_fields = {**sample.extra_fields, "usage_mismatch": mismatch}
    return sample


def _grader_result(
    run: TrialRun,
    sample: RolloutSample | None,
    message: str,
    diagnostics: dict[str, Any],
) -> ExecutionResult:
    result, grader = run.result, run.output.grader
    exc_type = result.exception_type
    rewards = (result.verifier_result.rewards if result.verifier_result else None) or {}
    if exc_type is not None and not (policy_for(exc_type).has_valid_reward and rewards):
        if grader.error is not None:
            text = f"grader failed: {grader.error.message}"
            return failure(text, _category(grader.error.category), diagnostics, sample)
        return failure(message, category_of(exc_type), diagnostics, sample)
    if "reward" in rewards:
        reward = float(rewards["reward"])
    elif len(rewards) == 1:
        reward = float(next(iter(rewards.values())))
    else:
        text = f"reward.json has no 'reward' key for the sample (keys: {sorted(rewards)})"
        return failure(text, RolloutErrorCategory.VALIDATION_ERROR, diagnostics, sample)
    if grader.sample is not None:  # the grader changed the sample: keep everything it decided
        sample = RolloutSample.model_validate(
            {**grader.sample.model_dump(), "label": sample.label if sample else None}
        )
    sample = (sample or RolloutSample(messages=[])).model_copy(deep=True)
    sample.reward = reward
    if len(rewards) > 1:
        sample.metrics = {
            **sample.metrics,
            **{f"reward/{k}": float(v) for k, v in rewards.items()},
        }
    return _success(sample, diagnostics)


def diagnostics_of(run: TrialRun, spec: OutcomeSpec) -> dict[str, Any]:
    """Per-phase timings and the trial's identity, kept beside the rollout's artifacts."""
    result: TrialResult = run.result
    timings = {
        "environment_setup": result.environment_setup.seconds if result.environment_setup else None,
        "agent_setup": result.agent_setup.seconds if result.agent_setup else None,
        "agent": result.agent_execution.seconds if result.agent_execution else None,
        "verifier": result.verifier.seconds if result.verifier else None,
    }
    # Teardown (logs and artifacts copied back, containers and networks removed): from
    # the end of the trial's last phase to its end.
    timed = [
        result.environment_setup,
        result.agent_setup,
        result.agent_execution,
        result.verifier,
    ]
    for step in result.step_results or ():  # a multi-step trial's phases are its steps'
        timed += [step.agent_execution, step.verifier]
    ends = [t.finished_at for t in timed if t is not None and t.finished_at is not None]
    if result.finished_at and ends:
        timings["teardown"] = max(0.0, (result.finished_at - max(ends)).total_seconds())
    if result.started_at and result.finished_at:
        timings["total"] = (result.finished_at - result.started_at).total_seconds()
    last_step = result.step_results[-1] if result.step_results else None
    phase = (
        TrialPhase.VERIFIER
        if result.verifier or (last_step and last_step.verifier)
        else TrialPhase.AGENT
        if result.agent_execution or (last_step and last_step.agent_execution)
        else TrialPhase.ENVIRONMENT
    )
    exc_type = result.exception_type
    # An agent-side or environment error that let the verifier run still belongs to the agent.
    blamed = policy_for(exc_type).phase if exc_type else None
    if phase is TrialPhase.VERIFIER and blamed in (TrialPhase.AGENT, TrialPhase.ENVIRONMENT):
        phase = TrialPhase.AGENT
    return {
        "backend": "harbor",
        "task": spec.task_id,
        "trial": result.trial_name,
        "trial_dir": str(run.trial_dir),
        "node": run.node,
        "phase": _TIMING_KEY[phase],
        "harbor_exception_type": exc_type,
        "category": category_of(exc_type).value if exc_type else None,
        "rewards": result.verifier_result.rewards if result.verifier_result else None,
        "timings_sec": timings,
    }


def _success(sample: RolloutSample | None, diagnostics: dict[str, Any]) -> ExecutionResult:
    return ExecutionResult(status=RolloutStatus.SUCCESS, sample=sample, extra_fields=diagnostics)


def _category(value: str) -> RolloutErrorCategory:
    try:
        return RolloutErrorCategory(value)
    except ValueError:
        return RolloutErrorCategory.AGENT_ERROR


__all__ = [
    "OutcomeSpec",
    "cancelled",
    "category_of",
    "diagnostics_of",
    "failure",
    "rollout_outcome",
]
