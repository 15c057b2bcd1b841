"""The authoring API: samples, contexts, configs, the ambient rollout context."""

from __future__ import annotations

import asyncio
import fractions
import math
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from harbor_exec import authoring
from harbor_exec.authoring import (
    AgentWorkflowConfig,
    AgentWorkflowOutput,
    BaseConfig,
    ConcurrencyConfig,
    GraderConfig,
    GraderContext,
    RolloutContext,
    RolloutSample,
    RolloutStatus,
    SampleSource,
    coerce_workflow_output,
    get_rollout_context,
    get_sample,
    resolve_import_path,
    set_sample_source,
    set_status,
)

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


# ---------------------------------------------------------------------------- RolloutSample


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_sample_rejects_non_finite_reward_on_construction_and_assignment(bad: float) -> None:
    with pytest.raises(ValidationError, match="reward"):
        RolloutSample(messages=MESSAGES, reward=bad)
    sample = RolloutSample(messages=MESSAGES, reward=0.5)
    with pytest.raises(ValidationError, match="reward"):
        sample.reward = bad
    assert sample.reward == 0.5


def test_trajectory_messages_default_to_a_deep_copy_of_messages() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi", "nested": {"k": [1]}}]
    sample = RolloutSample(messages=messages)
    assert sample.trajectory_messages == messages
    messages[0]["nested"]["k"].append(2)
    assert sample.trajectory_messages is not None
    assert sample.trajectory_messages[0]["nested"]["k"] == [1]


def test_explicit_none_trajectory_turns_persistence_off_and_assignment_keeps_it() -> None:
    sample = RolloutSample(messages=MESSAGES, trajectory_messages=None)
    assert sample.trajectory_messages is None
    sample.reward = 1.0
    assert sample.trajectory_messages is None


def test_assignment_does_not_recompute_the_trajectory() -> None:
    sample = RolloutSample(messages=MESSAGES)
    sample.messages = [{"role": "user", "content": "changed"}]
    sample.reward = 1.0
    assert sample.trajectory_messages == MESSAGES


def test_json_safe_copy_normalizes_numbers_and_drops_the_unencodable() -> None:
    sample = RolloutSample(
        messages=MESSAGES,
        metrics={"ok": 1.0, "nan": math.nan, "frac": fractions.Fraction(1, 4), "obj": object()},
        extra_fields={"nested": {"inf": math.inf, "list": [1, math.nan, "x"], 3: "three"}},
    )
    safe = sample.json_safe_copy()
    assert safe.metrics == {"ok": 1.0, "frac": 0.25}
    assert safe.extra_fields == {"nested": {"list": [1, "x"], "3": "three"}}
    clean = RolloutSample(messages=MESSAGES, metrics={"a": 1})
    assert clean.json_safe_copy() is clean


# ---------------------------------------------------------------------------- configs and outputs


def test_configs_validate_and_keep_extra_fields() -> None:
    with pytest.raises(ValidationError, match="max_concurrent"):
        ConcurrencyConfig(max_concurrent=0)
    config = AgentWorkflowConfig(name="w", temperature=0.2)  # type: ignore[call-arg]
    assert config.concurrency.max_concurrent is None
    assert config.model_extra == {"temperature": 0.2}
    assert GraderConfig(name="g").concurrency.max_concurrent is None
    with pytest.raises(ValidationError, match="name"):
        BaseConfig.model_validate({})


def test_workflow_output_forbids_extra_fields_and_non_finite_metrics() -> None:
    with pytest.raises(ValidationError, match="extra"):
        AgentWorkflowOutput.model_validate({"messages": [], "surprise": 1})
    with pytest.raises(ValidationError, match="metrics"):
        AgentWorkflowOutput(messages=[], metrics={"m": math.nan})


def test_coerce_workflow_output() -> None:
    assert coerce_workflow_output(None) is None
    assert coerce_workflow_output(MESSAGES) == AgentWorkflowOutput(messages=MESSAGES)
    output = AgentWorkflowOutput(messages=MESSAGES, metrics={"m": 1.0})
    assert coerce_workflow_output(output) == output
    with pytest.raises(TypeError, match="got str"):
        coerce_workflow_output("messages")


def test_grader_context_set_reward() -> None:
    with pytest.raises(ValueError, match="no sample"):
        GraderContext().set_reward(1.0)
    context = GraderContext(sample=RolloutSample(messages=MESSAGES))
    context.set_reward(0.25)
    assert context.sample is not None and context.sample.reward == 0.25
    with pytest.raises(ValidationError):
        context.set_reward(math.inf)


# ---------------------------------------------------------------------------- ambient context


class _Source(SampleSource):
    async def get_sample(self) -> RolloutSample:
        return RolloutSample(messages=MESSAGES)


async def test_sample_source_registration_is_single() -> None:
    with RolloutContext(rollout_id="r1") as context:
        assert await get_sample() is None
        set_sample_source(_Source())
        with pytest.raises(ValueError, match="already has a sample source"):
            context.set_sample_source(_Source())
        sample = await get_sample()
        assert sample is not None and list(sample.messages) == MESSAGES
        assert await _Source().get_preview(5) is None
    with pytest.raises(RuntimeError, match="outside a rollout"):
        set_sample_source(_Source())


async def test_status_changes_reach_the_observer_and_stop_at_a_terminal_status() -> None:
    seen: list[RolloutStatus] = []
    with RolloutContext(rollout_id="r1", on_status=seen.append):
        assert await set_status(RolloutStatus.RUNNING)
        assert not await set_status(RolloutStatus.RUNNING)  # repeated: ignored
        assert await set_status(RolloutStatus.GRADING)
        assert await set_status(RolloutStatus.CANCELLED)
        assert not await set_status(RolloutStatus.RUNNING)  # after terminal: ignored
    assert seen == [RolloutStatus.RUNNING, RolloutStatus.GRADING, RolloutStatus.CANCELLED]
    assert not await set_status(RolloutStatus.RUNNING)  # no rollout: a no-op


async def test_a_failing_observer_does_not_fail_the_rollout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(status: RolloutStatus) -> None:
        raise RuntimeError("observer bug")

    context = RolloutContext(rollout_id="r1", on_status=broken)
    assert await context.set_status(RolloutStatus.RUNNING)
    assert context.status is RolloutStatus.RUNNING
    assert "observer failed" in caplog.text


async def test_nested_contexts_restore_the_outer_one_and_tasks_are_isolated() -> None:
    outer = RolloutContext(rollout_id="outer")
    with outer:
        with RolloutContext(rollout_id="inner") as inner:
            assert get_rollout_context() is inner
            with inner:  # re-entering the same context is allowed
                assert get_rollout_context() is inner
            assert get_rollout_context() is inner
        assert get_rollout_context() is outer

        async def other_task() -> RolloutContext | None:
            with RolloutContext(rollout_id="task"):
                await asyncio.sleep(0)
            return get_rollout_context()

        assert await asyncio.create_task(other_task()) is outer
        assert get_rollout_context() is outer
    assert get_rollout_context() is None


def test_empty_context_fields_fall_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OSMOSIS_CHAT_COMPLETIONS_URL", "http://chat.example/v1")
    monkeypatch.setenv("OSMOSIS_API_KEY", "env-key")
    monkeypatch.setenv("OSMOSIS_ROLLOUT_ID", "env-id")
    context = RolloutContext()
    assert (context.chat_completions_url, context.api_key, context.rollout_id) == (
        "http://chat.example/v1",
        "env-key",
        "env-id",
    )
    explicit = RolloutContext(chat_completions_url="http://x", api_key="k", rollout_id="r")
    assert (explicit.chat_completions_url, explicit.api_key, explicit.rollout_id) == (
        "http://x",
        "k",
        "r",
    )


# ---------------------------------------------------------------------------- import paths


def test_resolve_import_path() -> None:
    assert resolve_import_path("harbor_exec.authoring:RolloutSample") is RolloutSample
    assert resolve_import_path("harbor_exec.authoring:RolloutStatus.RUNNING") is (
        RolloutStatus.RUNNING
    )
    for bad in ("harbor_exec.authoring", ":x", "harbor_exec.authoring:"):
        with pytest.raises(ValueError, match="expected 'module:attr'"):
            resolve_import_path(bad)
    with pytest.raises(ImportError, match="Nope"):
        resolve_import_path("harbor_exec.authoring:Nope")
    with pytest.raises(ImportError):
        resolve_import_path("harbor_exec.no_such_module:X")


def test_enums_are_the_wire_strings() -> None:
    assert [s.value for s in RolloutStatus] == [
        "queued",
        "running",
        "grading",
        "success",
        "failure",
        "cancelled",
        "unknown",
    ]
    assert [c.value for c in authoring.RolloutErrorCategory] == [
        "timeout",
        "lease_expired",
        "validation_error",
        "http_error",
        "agent_error",
        "internal_error",
    ]


def test_authoring_imports_only_the_standard_library_and_pydantic() -> None:
    """It runs inside task containers where nothing else is installed."""
    code = (
        "import sys\n"
        "import harbor_exec.authoring\n"
        "names = {m.split('.')[0] for m in sys.modules}\n"
        "print('\\n'.join(sorted(names - set(sys.stdlib_module_names))))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    allowed = {"harbor_exec", "pydantic", "pydantic_core", "typing_extensions"}
    allowed |= {"annotated_types", "typing_inspection"}
    # Underscored names are interpreter internals (__main__, _sysconfigdata...).
    foreign: list[Any] = [n for n in output if n not in allowed and not n.startswith("_")]
    assert foreign == [], f"harbor_exec.authoring pulled in {foreign}"
    assert "harbor_exec" in output
