"""``rollout_outcome`` as a pure function of a ``TrialRun``: no trial directory on disk.

The trial reads its exchange files into ``TrialRun.output`` as its logs come back;
these tests build that value directly, from a trial directory that does not exist.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harbor_exec.agents.base import AgentInfo
from harbor_exec.backends.harbor.outcomes import OutcomeSpec, rollout_outcome
from harbor_exec.container.exchange import ErrorDetail, SampleFile
from harbor_exec.errors import (
    AgentEndedContainerError,
    AgentOutputLimitError,
    AgentSetupError,
    AgentTimeoutError,
    CancelledError,
    DiskBudgetExceededError,
    RewardFileNotFoundError,
    StepPreparationError,
    TrialError,
)
from harbor_exec.executors.base import TrialRun
from harbor_exec.network.usage import ModelUsage
from harbor_exec.protocol import ExecutionRequest, RolloutErrorCategory, RolloutStatus
from harbor_exec.trial.outputs import AgentOutput, GraderOutput, TrialOutput, parse_agent_sample
from harbor_exec.trial.results import (
    ExceptionInfo,
    TimingInfo,
    TrialResult,
    VerifierResult,
    utcnow,
)

NOWHERE = Path("/nonexistent/harbor-exec/trial")


class NonZeroAgentExitCodeError(TrialError):
    """Harbor's name for an agent that exited non-zero (recorded by name only)."""


REQUEST = ExecutionRequest(id="r-1", prompt=[], label="42")
WORKFLOW = OutcomeSpec("t", is_oracle=False, verify=True, agent_timeout_sec=5.0)
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "42"}]


def run_of(
    *,
    error: TrialError | None = None,
    rewards: dict[str, float | int] | None = None,
    agent: AgentOutput | None = None,
    grader: GraderOutput | None = None,
    usage: ModelUsage | None = None,
) -> TrialRun:
    now = utcnow()
    result = TrialResult(
        task_name="t",
        trial_name="r-1__abcdefg",
        trial_uri=NOWHERE.as_uri(),
        task_id={"path": str(NOWHERE)},
        task_checksum="0" * 64,
        config={},
        agent_info=AgentInfo(name="workflow", version="1"),
        environment_setup=TimingInfo(started_at=now, finished_at=now),
        agent_execution=TimingInfo(started_at=now, finished_at=now),
        verifier=TimingInfo(started_at=now, finished_at=now) if rewards is not None else None,
        verifier_result=VerifierResult(rewards=rewards) if rewards is not None else None,
        exception_info=ExceptionInfo.from_exception(error) if error is not None else None,
    )
    output = TrialOutput(
        agent=agent or AgentOutput(sample=SampleFile(messages=MESSAGES)),
        grader=grader or GraderOutput(),
    )
    return TrialRun(result, NOWHERE, usage=usage, output=output)


def test_success_carries_the_sample_the_reward_and_the_usage() -> None:
    usage = ModelUsage(requests=2, prompt_tokens=10, completion_tokens=5, total_tokens=15)
    outcome = rollout_outcome(REQUEST, run_of(rewards={"reward": 1.0}, usage=usage), WORKFLOW)
    assert outcome.workflow.status is RolloutStatus.SUCCESS
    assert outcome.grader is not None and outcome.grader.sample is not None
    sample = outcome.grader.sample
    assert sample.reward == 1.0 and sample.label == "42"
    assert list(sample.messages) == MESSAGES
    assert sample.metrics["llm_requests"] == 2 and sample.metrics["llm_total_tokens"] == 15
    assert outcome.workflow.extra_fields is not None
    assert outcome.workflow.extra_fields["phase"] == "verifier"
    assert not NOWHERE.exists()


def test_usage_metrics_are_the_relays_and_the_agents_counts_are_cross_checked() -> None:
    usage = ModelUsage(
        requests=2, prompt_tokens=10, completion_tokens=5, total_tokens=15, cached_tokens=4
    )
    agent_usage = {"input_tokens": 10, "cached_tokens": 4, "output_tokens": 5, "cost_usd": None}
    sample_file = SampleFile(messages=MESSAGES, extra_fields={"agent_usage": agent_usage})
    run = run_of(rewards={"reward": 1.0}, usage=usage, agent=AgentOutput(sample=sample_file))
    sample = rollout_outcome(REQUEST, run, WORKFLOW).workflow.sample
    assert sample is not None
    metrics = {k: sample.metrics[k] for k in ("input_tokens", "cached_tokens", "output_tokens")}
    assert metrics == {"input_tokens": 10, "cached_tokens": 4, "output_tokens": 5}
    assert "cost_usd" not in sample.metrics  # the upstream reported none: dropped
    assert "usage_mismatch" not in sample.extra_fields
    # An agent that counts otherwise (it may rewrite its own files) is flagged, not believed.
    lying = SampleFile(
        messages=MESSAGES, extra_fields={"agent_usage": {**agent_usage, "output_tokens": 1}}
    )
    run = run_of(rewards={"reward": 1.0}, usage=usage, agent=AgentOutput(sample=lying))
    sample = rollout_outcome(REQUEST, run, WORKFLOW).workflow.sample
    assert sample is not None and sample.metrics["output_tokens"] == 5
    assert sample.extra_fields["usage_mismatch"] == {"output_tokens": {"relay": 5, "agent": 1}}


def test_several_reward_keys_become_metrics() -> None:
    outcome = rollout_outcome(REQUEST, run_of(rewards={"reward": 0.5, "style": 1}), WORKFLOW)
    assert outcome.grader is not None and outcome.grader.sample is not None
    assert outcome.grader.sample.reward == 0.5
    assert outcome.grader.sample.metrics["reward/style"] == 1.0


def test_agent_timeout_without_a_reward_fails_the_workflow_with_its_deadline() -> None:
    run = run_of(error=AgentTimeoutError("ran past"))
    outcome = rollout_outcome(REQUEST, run, WORKFLOW)
    assert outcome.grader is None
    assert outcome.workflow.status is RolloutStatus.FAILURE
    assert outcome.workflow.err_category is RolloutErrorCategory.TIMEOUT
    assert outcome.workflow.err_message == "workflow exceeded its 5s deadline"
    assert outcome.workflow.extra_fields is not None
    assert outcome.workflow.extra_fields["phase"] == "agent"  # the agent's fault


@pytest.mark.parametrize(
    ("error", "category"),
    [
        (AgentTimeoutError("ran past"), "timeout"),
        (NonZeroAgentExitCodeError("exit 3"), "agent_error"),
        (AgentOutputLimitError("flooded"), "agent_error"),
        (AgentEndedContainerError("kill 1"), "agent_error"),
        (DiskBudgetExceededError("disk"), "agent_error"),
        (StepPreparationError("step 'two' could not be prepared"), "agent_error"),
    ],
)
def test_an_agent_side_error_never_drops_the_verifiers_valid_reward(
    error: TrialError, category: str
) -> None:
    """A policy that knows it answered wrongly cannot erase its zero by failing its own
    side (a trainer drops failed rollouts): the verifier's reward, which the error table
    calls valid, stands in a success that names the agent's error."""
    for agent in (None, AgentOutput(runner_tail="(no output)")):  # with a sample, and none
        outcome = rollout_outcome(
            REQUEST, run_of(error=error, rewards={"reward": 0.0}, agent=agent), WORKFLOW
        )
        assert outcome.workflow.status is RolloutStatus.SUCCESS
        assert outcome.grader is not None and outcome.grader.status is RolloutStatus.SUCCESS
        sample = outcome.grader.sample
        assert sample is not None and sample.reward == 0.0
        assert sample.extra_fields["agent_error"]["category"] == category
        assert sample.extra_fields["agent_error"]["exception_type"] == type(error).__name__
        assert list(sample.messages) == (MESSAGES if agent is None else [])
        assert outcome.grader.extra_fields is not None
        assert outcome.grader.extra_fields["agent_error"] == sample.extra_fields["agent_error"]


def test_an_error_whose_reward_is_not_valid_still_fails() -> None:
    """Harbor's table: a failed agent set-up is not graded, its reward is not valid."""
    run = run_of(error=AgentSetupError("no install"), rewards={"reward": 1.0})
    outcome = rollout_outcome(REQUEST, run, WORKFLOW)
    assert outcome.workflow.status is RolloutStatus.FAILURE and outcome.grader is None


def test_grader_error_is_reported_with_its_category() -> None:
    grader = GraderOutput(error=ErrorDetail(message="boom", category="validation_error"))
    run = run_of(error=RewardFileNotFoundError("no reward"), grader=grader)
    outcome = rollout_outcome(REQUEST, run, WORKFLOW)
    assert outcome.workflow.status is RolloutStatus.SUCCESS  # a verifier-side error
    assert outcome.grader is not None
    assert outcome.grader.status is RolloutStatus.FAILURE
    assert outcome.grader.err_message == "grader failed: boom"
    assert outcome.grader.err_category is RolloutErrorCategory.VALIDATION_ERROR
    assert outcome.grader.sample is not None and list(outcome.grader.sample.messages) == MESSAGES


def test_verifier_error_without_a_grader_error_uses_the_error_table() -> None:
    run = run_of(error=RewardFileNotFoundError("tests/test.sh wrote no reward"))
    outcome = rollout_outcome(REQUEST, run, WORKFLOW)
    assert outcome.grader is not None
    assert outcome.grader.err_category is RolloutErrorCategory.VALIDATION_ERROR
    assert outcome.grader.err_message == "tests/test.sh wrote no reward"


@pytest.mark.parametrize(
    ("agent", "message"),
    [
        (AgentOutput(runner_tail="Traceback: nope"), "wrote no sample"),
        (AgentOutput(invalid="Input should be a valid list"), "is not a sample"),
        (AgentOutput(error=ErrorDetail(message="workflow raised")), "workflow raised"),
    ],
)
def test_missing_or_failed_sample_fails_the_workflow(agent: AgentOutput, message: str) -> None:
    ungraded = OutcomeSpec("t", is_oracle=False, verify=False)
    outcome = rollout_outcome(REQUEST, run_of(agent=agent), ungraded)
    assert outcome.grader is None
    assert outcome.workflow.status is RolloutStatus.FAILURE
    assert outcome.workflow.err_category is RolloutErrorCategory.AGENT_ERROR
    assert message in (outcome.workflow.err_message or "")
    if agent.runner_tail != "(no output)":
        assert agent.runner_tail in (outcome.workflow.err_message or "")
    # Graded, the verifier's reward stands: the failure is named, not dropped.
    graded = rollout_outcome(REQUEST, run_of(rewards={"reward": 1.0}, agent=agent), WORKFLOW)
    assert graded.grader is not None and graded.grader.sample is not None
    assert graded.grader.sample.reward == 1.0
    assert message in graded.grader.sample.extra_fields["agent_error"]["message"]


def test_no_sample_at_all_is_a_success_without_one() -> None:
    agent = AgentOutput(sample=SampleFile(messages=None))
    outcome = rollout_outcome(REQUEST, run_of(agent=agent), OutcomeSpec("t", False, verify=False))
    assert outcome.workflow.status is RolloutStatus.SUCCESS
    assert outcome.workflow.sample is None and outcome.grader is None


def test_the_grader_changed_sample_wins() -> None:
    changed = SampleFile(
        messages=[{"role": "assistant", "content": "graded"}],
        remove_sample=True,
        metrics={"judge": 0.25},
    )
    run = run_of(rewards={"reward": 0.0}, grader=GraderOutput(sample=changed))
    outcome = rollout_outcome(REQUEST, run, WORKFLOW)
    assert outcome.grader is not None and outcome.grader.sample is not None
    sample = outcome.grader.sample
    assert sample.remove_sample is True
    assert sample.metrics == {"judge": 0.25}
    assert list(sample.messages) == [{"role": "assistant", "content": "graded"}]
    assert sample.reward == 0.0 and sample.label == "42"


def test_a_grader_that_changed_the_sample_keeps_the_agents_error_named() -> None:
    """The agent flooded its outputs and the grader (which records a metric, so hands
    its sample back) gave 0: the graded sample still names the agent's error."""
    changed = SampleFile(messages=MESSAGES, metrics={"honest_grader": 1.0})
    run = run_of(
        error=AgentOutputLimitError("flooded"),
        rewards={"reward": 0.0},
        grader=GraderOutput(sample=changed),
    )
    outcome = rollout_outcome(REQUEST, run, WORKFLOW)
    assert outcome.workflow.status is RolloutStatus.SUCCESS
    assert outcome.grader is not None and outcome.grader.sample is not None
    sample = outcome.grader.sample
    assert sample.reward == 0.0 and sample.metrics == {"honest_grader": 1.0}
    assert sample.extra_fields["agent_error"]["exception_type"] == "AgentOutputLimitError"


def test_cancelled_trial_is_cancelled() -> None:
    outcome = rollout_outcome(REQUEST, run_of(error=CancelledError("cancelled")), WORKFLOW)
    assert outcome.workflow.status is RolloutStatus.CANCELLED
    assert outcome.grader is None


def test_oracle_needs_no_sample() -> None:
    run = run_of(rewards={"reward": 1.0}, agent=AgentOutput())
    outcome = rollout_outcome(REQUEST, run, OutcomeSpec("t", is_oracle=True, verify=True))
    assert outcome.grader is not None and outcome.grader.sample is not None
    assert outcome.grader.sample.reward == 1.0


def test_the_agents_reward_and_remove_sample_never_reach_the_outcome() -> None:
    claimed = SampleFile(messages=MESSAGES, reward=1.0, remove_sample=True)
    run = run_of(rewards={"reward": 0.0}, agent=AgentOutput(sample=claimed))
    outcome = rollout_outcome(REQUEST, run, WORKFLOW)
    assert outcome.workflow.sample is not None
    assert outcome.workflow.sample.reward is None
    assert outcome.workflow.sample.remove_sample is False
    assert outcome.grader is not None and outcome.grader.sample is not None
    assert outcome.grader.sample.reward == 0.0
    assert outcome.grader.sample.remove_sample is False


def test_a_deep_sample_is_a_clear_agent_side_failure() -> None:
    agent = parse_agent_sample("[" * 200_000 + "]" * 200_000)
    ungraded = OutcomeSpec("t", is_oracle=False, verify=False)
    outcome = rollout_outcome(REQUEST, run_of(agent=agent), ungraded)
    assert outcome.workflow.status is RolloutStatus.FAILURE
    assert outcome.workflow.err_category is RolloutErrorCategory.AGENT_ERROR
    assert "nests deeper than" in (outcome.workflow.err_message or "")
    assert outcome.grader is None
    # Graded, it is named beside the verifier's reward, never in place of it.
    graded = rollout_outcome(REQUEST, run_of(rewards={"reward": 0.0}, agent=agent), WORKFLOW)
    assert graded.grader is not None and graded.grader.sample is not None
    assert graded.grader.sample.reward == 0.0 and graded.grader.sample.messages == []
    assert "nests deeper than" in graded.grader.sample.extra_fields["agent_error"]["message"]
