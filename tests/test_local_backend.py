"""LocalBackend: execution semantics, deadlines, grading, artifacts, concurrency."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.authoring import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    ConcurrencyConfig,
    Grader,
    GraderContext,
    RolloutContext,
    RolloutErrorCategory,
    RolloutStatus,
)
from harbor_exec.backends.local import DEFAULT_MAX_CONCURRENT, LocalBackend, default_artifact_root
from harbor_exec.protocol import ExecutionOutcome, ExecutionRequest
from tests.server_utils import (
    NEVER,
    PROMPT,
    SINGLE_SLOT,
    UNLIMITED,
    ExactMatchGrader,
    ScriptedWorkflow,
    gate,
    wait_until_async,
)


def request(rollout_id: str = "r1", **fields: Any) -> ExecutionRequest:
    fields.setdefault("label", "4")
    return ExecutionRequest(id=rollout_id, prompt=PROMPT, **fields)


def backend(tmp_path: Path, **options: Any) -> LocalBackend:
    options.setdefault("workflow", ScriptedWorkflow)
    options.setdefault("grader", ExactMatchGrader)
    return LocalBackend(artifact_root=tmp_path, **options)


async def run(
    local: LocalBackend, req: ExecutionRequest
) -> tuple[ExecutionOutcome, list[RolloutStatus]]:
    seen: list[RolloutStatus] = []
    with RolloutContext(rollout_id=req.id, on_status=seen.append):
        outcome = await local.execute(req)
    return outcome, seen


async def test_graded_success_reports_running_then_grading(tmp_path: Path) -> None:
    outcome, seen = await run(backend(tmp_path), request())
    result = outcome.result
    assert result.status is RolloutStatus.SUCCESS
    assert result.sample is not None and result.sample.reward == 1.0
    assert result.sample.label == "4"
    assert result.sample.metrics == {"answer_length": 1.0}
    assert [m["content"] for m in result.sample.messages] == ["What is 2+2?", "4"]
    assert seen == [RolloutStatus.RUNNING, RolloutStatus.GRADING]


async def test_wrong_answer_gets_zero(tmp_path: Path) -> None:
    outcome, _ = await run(backend(tmp_path), request(metadata={"answer": "5"}))
    assert outcome.result.status is RolloutStatus.SUCCESS
    assert outcome.result.sample is not None and outcome.result.sample.reward == 0.0


async def test_grade_false_skips_the_grader(tmp_path: Path) -> None:
    outcome, seen = await run(backend(tmp_path), request(grade=False))
    assert outcome.grader is None
    assert outcome.result.status is RolloutStatus.SUCCESS
    assert outcome.result.sample is not None and outcome.result.sample.reward is None
    assert seen == [RolloutStatus.RUNNING]


async def test_remove_sample_passes_without_being_counted(tmp_path: Path) -> None:
    outcome, _ = await run(backend(tmp_path), request(metadata={"remove": True}))
    assert outcome.result.status is RolloutStatus.SUCCESS
    assert outcome.result.sample is not None and outcome.result.sample.remove_sample


async def test_sample_from_a_registered_source(tmp_path: Path) -> None:
    outcome, _ = await run(backend(tmp_path), request(metadata={"use_source": True}))
    sample = outcome.result.sample
    assert sample is not None and sample.metrics == {"from_source": 1.0} and sample.reward == 1.0


async def test_workflow_exception_is_an_agent_error(tmp_path: Path) -> None:
    outcome, _ = await run(backend(tmp_path), request(metadata={"raise": "boom"}))
    assert outcome.grader is None
    assert (outcome.result.status, outcome.result.err_message, outcome.result.err_category) == (
        RolloutStatus.FAILURE,
        "boom",
        RolloutErrorCategory.AGENT_ERROR,
    )


async def test_agent_deadline(tmp_path: Path) -> None:
    outcome, _ = await run(
        backend(tmp_path), request(metadata={"hold": NEVER}, agent_timeout_sec=0.2)
    )
    assert outcome.result.err_category is RolloutErrorCategory.TIMEOUT
    assert outcome.result.err_message == "workflow exceeded its 0.2s deadline"


async def test_a_workflow_that_blocks_past_its_deadline_is_still_a_timeout(tmp_path: Path) -> None:
    outcome, _ = await run(
        backend(tmp_path), request(metadata={"block": 0.3}, agent_timeout_sec=0.1)
    )
    assert outcome.result.status is RolloutStatus.FAILURE
    assert outcome.result.err_category is RolloutErrorCategory.TIMEOUT


async def test_queue_time_comes_off_the_agent_deadline(tmp_path: Path) -> None:
    # Wall-clock on purpose: the time a rollout waits for its slot is what is measured.
    local = backend(tmp_path, workflow_config=SINGLE_SLOT)
    first = asyncio.create_task(run(local, request("first", metadata={"sleep": 0.4})))

    async def counts(queued: int, running: int) -> bool:
        info = local.queue_info()
        return (info.queued, info.running) == (queued, running)

    assert await wait_until_async(lambda: counts(0, 1))
    assert local.queue_info().model_dump(exclude={"nodes"}) == {
        "queued": 0,
        "running": 1,
        "capacity": 1,
        "max_queue_depth": None,
    }
    second = asyncio.create_task(
        run(local, request("second", metadata={"sleep": 0.2}, agent_timeout_sec=0.5))
    )
    assert await wait_until_async(lambda: counts(1, 1))
    assert local.health().concurrency == {"max_concurrent": 1, "queued": 1, "running": 1}
    (first_outcome, _), (second_outcome, second_seen) = await asyncio.gather(first, second)
    assert first_outcome.result.status is RolloutStatus.SUCCESS
    # ~0.35 s queued leaves ~0.15 s of the 0.5 s budget for a 0.2 s workflow.
    assert second_outcome.result.err_category is RolloutErrorCategory.TIMEOUT
    assert second_outcome.result.err_message is not None
    assert "spent queued" in second_outcome.result.err_message
    assert second_seen[0] is RolloutStatus.RUNNING


async def test_grader_has_its_own_deadline(tmp_path: Path) -> None:
    outcome, _ = await run(
        backend(tmp_path),
        request(metadata={"grader_hold": NEVER}, agent_timeout_sec=10, grader_timeout_sec=0.2),
    )
    result = outcome.result
    assert (result.status, result.err_category, result.err_message) == (
        RolloutStatus.FAILURE,
        RolloutErrorCategory.TIMEOUT,
        "grader exceeded its 0.2s deadline",
    )
    assert result.sample is not None  # kept for the trajectory


async def test_grader_without_reward_or_with_error(tmp_path: Path) -> None:
    outcome, _ = await run(backend(tmp_path), request(metadata={"no_reward": True}))
    assert outcome.result.err_category is RolloutErrorCategory.VALIDATION_ERROR
    assert "set no reward" in (outcome.result.err_message or "")
    outcome, _ = await run(backend(tmp_path), request(metadata={"grader_raise": "bad grader"}))
    assert outcome.result.err_category is RolloutErrorCategory.AGENT_ERROR
    assert outcome.result.err_message == "bad grader"


async def test_ungradable_rollouts_say_why(tmp_path: Path) -> None:
    no_grader = LocalBackend(workflow=ScriptedWorkflow, artifact_root=tmp_path)
    outcome, seen = await run(no_grader, request())
    assert outcome.result.status is RolloutStatus.FAILURE
    assert outcome.result.err_category is RolloutErrorCategory.VALIDATION_ERROR
    assert "no grader is configured" in (outcome.result.err_message or "")
    assert outcome.result.sample is not None  # still saved
    assert RolloutStatus.GRADING not in seen

    outcome, _ = await run(backend(tmp_path), request(label=None, metadata=None))
    assert outcome.result.err_category is RolloutErrorCategory.VALIDATION_ERROR
    assert "neither a label nor metadata" in (outcome.result.err_message or "")
    # Metadata alone is enough for the grader to run.
    outcome, _ = await run(backend(tmp_path), request(label=None, metadata={"answer": "4"}))
    assert outcome.result.status is RolloutStatus.SUCCESS


class RecordingWorkflow(AgentWorkflow[AgentWorkflowConfig]):
    instances: list[RecordingWorkflow] = []
    contexts: list[AgentWorkflowContext[AgentWorkflowConfig]] = []

    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> list[dict[str, Any]]:
        RecordingWorkflow.instances.append(self)
        RecordingWorkflow.contexts.append(ctx)
        assert self.config is not None and ctx.config is self.config
        # Mutating the config must not leak into the next rollout.
        self.config.description = f"seen {getattr(self.config, 'counter', 0)}"
        assert ctx.artifacts_dir is not None
        (ctx.artifacts_dir / "note.txt").write_text("written by the workflow")
        return [*ctx.prompt, {"role": "assistant", "content": "4"}]


class RecordingGrader(Grader):
    contexts: list[GraderContext] = []

    async def grade(self, ctx: GraderContext) -> None:
        RecordingGrader.contexts.append(ctx)
        ctx.set_reward(1.0)


async def test_fresh_instances_deep_copied_config_and_artifacts_dir(tmp_path: Path) -> None:
    config = AgentWorkflowConfig(name="rec")
    local = LocalBackend(
        workflow=RecordingWorkflow,
        workflow_config=config,
        grader=RecordingGrader,
        artifact_root=tmp_path,
    )
    for rollout_id in ("a", "b"):
        outcome, _ = await run(local, request(rollout_id))
        assert outcome.result.status is RolloutStatus.SUCCESS
    assert len({id(w) for w in RecordingWorkflow.instances}) == 2
    assert config.description is None
    assert [c.artifacts_dir for c in RecordingWorkflow.contexts] == [
        tmp_path / "a" / "artifacts",
        tmp_path / "b" / "artifacts",
    ]
    assert RecordingGrader.contexts[0].artifacts_dir == tmp_path / "a" / "artifacts"
    assert (tmp_path / "b" / "artifacts" / "note.txt").read_text() == "written by the workflow"


async def test_artifacts_dir_is_made_on_first_use_or_is_none(tmp_path: Path) -> None:
    # A workflow that never reads ctx.artifacts_dir leaves no directory behind.
    outcome, _ = await run(backend(tmp_path), request("untouched"))
    assert outcome.result.status is RolloutStatus.SUCCESS
    assert not (tmp_path / "untouched").exists()

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    local = backend(blocker, workflow=RecordingWorkflow)
    RecordingWorkflow.contexts.clear()
    outcome, _ = await run(local, request())
    # RecordingWorkflow asserts a usable dir, so its failure proves None was passed.
    assert outcome.result.status is RolloutStatus.FAILURE
    assert RecordingWorkflow.contexts[-1].artifacts_dir is None
    # Assigning still works like on the plain dataclass.
    RecordingWorkflow.contexts[-1].artifacts_dir = tmp_path
    assert RecordingWorkflow.contexts[-1].artifacts_dir == tmp_path


async def test_concurrency_limits(tmp_path: Path) -> None:
    assert backend(tmp_path).health().concurrency["max_concurrent"] == DEFAULT_MAX_CONCURRENT
    unlimited = backend(tmp_path, workflow_config=UNLIMITED)
    assert unlimited.queue_info().capacity is None
    name, held = gate()
    runs = [
        asyncio.create_task(
            run(unlimited, request(f"u{i}", metadata={"hold": name}, agent_timeout_sec=5))
        )
        for i in range(12)
    ]

    async def all_running() -> bool:
        return unlimited.queue_info().running == 12

    assert await wait_until_async(all_running)  # all at once, not in waves
    held.open()
    outcomes = await asyncio.gather(*runs)
    assert all(o.result.status is RolloutStatus.SUCCESS for o, _ in outcomes)


async def test_import_paths_and_bad_classes(tmp_path: Path) -> None:
    local = LocalBackend(
        workflow="tests.server_utils:ScriptedWorkflow",
        workflow_config="tests.server_utils:SINGLE_SLOT",
        grader="tests.server_utils:ExactMatchGrader",
        artifact_root=tmp_path,
    )
    assert local.workflow_cls is ScriptedWorkflow and local.workflow_config is SINGLE_SLOT
    outcome, _ = await run(local, request())
    assert outcome.result.status is RolloutStatus.SUCCESS
    with pytest.raises(TypeError, match="AgentWorkflow subclass"):
        LocalBackend(workflow="tests.server_utils:ExactMatchGrader")
    with pytest.raises(TypeError, match="expected a GraderConfig"):
        LocalBackend(workflow=ScriptedWorkflow, grader_config="tests.server_utils:SINGLE_SLOT")
    with pytest.raises(ImportError):
        LocalBackend(workflow="tests.server_utils:Missing")
    with pytest.raises(ValueError, match="module:attr"):
        LocalBackend(workflow="no_colon")


async def test_execute_without_a_server_context(tmp_path: Path) -> None:
    outcome = await backend(tmp_path).execute(request())
    assert outcome.result.status is RolloutStatus.SUCCESS


def test_default_artifact_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HARBOR_EXEC_ARTIFACT_ROOT", str(tmp_path / "env-root"))
    assert default_artifact_root() == tmp_path / "env-root"
    assert LocalBackend(workflow=ScriptedWorkflow).artifact_root == tmp_path / "env-root"
    monkeypatch.delenv("HARBOR_EXEC_ARTIFACT_ROOT")
    monkeypatch.delenv("_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", raising=False)
    # HarborBackend's and the server's fallback stays ours...
    assert default_artifact_root() == Path.home() / ".harbor-exec" / "rollouts"
    # ...LocalBackend's is osmosis-ai 0.3.8's, with its override variable.
    assert LocalBackend(workflow=ScriptedWorkflow).artifact_root == Path.home() / ".osmosis"
    monkeypatch.setenv("_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", str(tmp_path / "osmosis-root"))
    assert LocalBackend(workflow=ScriptedWorkflow).artifact_root == tmp_path / "osmosis-root"
    explicit = LocalBackend(workflow=ScriptedWorkflow, artifact_root=tmp_path / "mine")
    assert explicit.artifact_root == tmp_path / "mine"
    assert ConcurrencyConfig().max_concurrent is None
