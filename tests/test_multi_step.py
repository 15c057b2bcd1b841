"""Multi-step tasks (``[[steps]]``) over ``FakeRuntime``: parsing, gates, reward
strategies, the step loop and its layout. ``test_multi_step_docker.py`` runs them on a
real engine and beside Harbor 0.26."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from harbor_exec.agents.workflow import WorkflowAgent
from harbor_exec.container.exchange import RolloutInput, frame_sample
from harbor_exec.errors import TaskConfigError, TaskError
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.tasks.config import StepConfig, parse_task_config
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import create_trial, run_trial
from harbor_exec.trial.results import StepResult, TrialResult, VerifierResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.steps import (
    join_samples,
    min_reward_failure,
    select_reward,
    should_stop,
    step_verifier_mode,
)
from harbor_exec.trial.trial import TrialRequest
from tests.fake_runtime import FakeContainer, FakeRuntime
from tests.task_factory import make_multi_step_task
from tests.trial_utils import run_task


def _reward_from_test(container: FakeContainer) -> int:
    """The fake test.sh: writes what its script says after ``# reward ``."""
    script = (container.read("/tests/test.sh") or b"").decode()
    for line in script.splitlines():
        if line.startswith("# reward "):
            container.write(
                "/logs/verifier/reward.json" if "{" in line else "/logs/verifier/reward.txt",
                line[9:],
            )
    return 0


def _steps_task(tmp_path: Path, rewards: dict[str, str], **kwargs: object) -> Path:
    steps = {name: ("true", f"# reward {value}") for name, value in rewards.items()}
    return make_multi_step_task(tmp_path / "tasks", f"ms{uuid.uuid4().hex[:6]}", steps, **kwargs)  # type: ignore[arg-type]


def step_rewards(result: TrialResult) -> list[object]:
    """Each step's rewards (None: no verifier result), in step order."""
    return [
        s.verifier_result.rewards if s.verifier_result else None for s in result.step_results or []
    ]


def _run(tmp_path: Path, task_dir: Path, runtime: FakeRuntime | None = None) -> TrialResult:
    runtime = runtime or FakeRuntime(test=_reward_from_test)
    return run_task(runtime, task_dir, tmp_path / "trials")


# ----------------------------------------------------------------- parsing


def test_steps_parse_with_harbor_fields(tmp_path: Path) -> None:
    task_dir = _steps_task(
        tmp_path,
        {"one": "1", "two": "1"},
        toml='multi_step_reward_strategy = "final"\n',
        step_tables={
            "one": "min_reward = 0.5\n[steps.agent]\ntimeout_sec = 7\n[steps.verifier]\ntimeout_sec = 9\n",
            "two": "min_reward = {reward = 1.0, style = 0.5}\n",
        },
    )
    task = load_task(task_dir)
    assert [s.name for s in task.steps] == ["one", "two"]
    assert task.config.multi_step_reward_strategy == "final"
    assert task.steps[0].instruction == "Step one: do it.\n"
    one = task.for_step(task.steps[0])
    assert (one.agent_timeout_sec, one.verifier_timeout_sec) == (7, 9)
    two = task.for_step(task.steps[1])
    # Harbor reads the step's verifier timeout, whose default is 600 s.
    assert two.verifier_timeout_sec == 600.0
    assert task.steps[1].config.min_reward == {"reward": 1.0, "style": 0.5}
    assert one.solution_dir == task.root / "steps" / "one" / "solution"
    assert task.has_tests and task.instruction == ""


@pytest.mark.parametrize(
    ("tables", "expected"),
    [
        ('[[steps]]\nname = "a/b"\n', "[[steps]] #1 ('a/b').name"),
        ('[[steps]]\nname = "a"\n[[steps]]\nname = "A"\n', "steps: "),
        ('[[steps]]\nname = "a"\nmin_reward = "high"\n', "[[steps]] #1 ('a').min_reward"),
        (
            'multi_step_reward_strategy = "max"\n[[steps]]\nname = "a"\n',
            "multi_step_reward_strategy",
        ),
        (
            '[[steps]]\nname = "a"\n[steps.agent]\ntimeout_sec = "x"\n',
            "[[steps]] #1 ('a').agent.timeout_sec",
        ),
    ],
)
def test_malformed_steps_name_the_field(tables: str, expected: str) -> None:
    with pytest.raises(TaskConfigError) as caught:
        parse_task_config(tables, task="t")
    assert "task.toml" in str(caught.value)
    assert expected in str(caught.value)


def test_missing_step_files_are_named(tmp_path: Path) -> None:
    task_dir = _steps_task(tmp_path, {"one": "1", "two": "1"})
    (task_dir / "steps" / "two" / "instruction.md").unlink()
    with pytest.raises(TaskError, match=r"steps/two/instruction.md.*\[\[steps\]\] #2 \('two'\)"):
        load_task(task_dir)
    (task_dir / "steps" / "two" / "instruction.md").write_text("x")
    (task_dir / "steps" / "two" / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match=r"steps/two/tests/test.sh.*no test script"):
        load_task(task_dir)
    # A shared tests/test.sh serves steps without their own (Harbor's fallback).
    (task_dir / "tests").mkdir()
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\n")
    assert load_task(task_dir).has_tests
    import shutil

    shutil.rmtree(task_dir / "steps" / "two")
    with pytest.raises(TaskError, match=r"steps/two.*the directory of \[\[steps\]\] #2"):
        load_task(task_dir)


def test_verifier_mode_per_step() -> None:
    config = parse_task_config(
        '[verifier]\nenvironment_mode = "separate"\n[[steps]]\nname = "a"\n'
        '[steps.verifier]\nenvironment_mode = "shared"\n[[steps]]\nname = "b"\n',
        task="t",
    )
    assert config.steps is not None
    assert [step_verifier_mode_of(config, s) for s in config.steps] == ["shared", "separate"]


def step_verifier_mode_of(config: object, step: StepConfig) -> str:
    class _T:
        pass

    view = _T()
    view.config = config  # type: ignore[attr-defined]
    return step_verifier_mode(view, step)  # type: ignore[arg-type]


# ----------------------------------------------------------------- gates and strategies


def test_min_reward_gates_like_harbor() -> None:
    assert min_reward_failure({"reward": 1.0}, 1.0) is None
    assert min_reward_failure({"reward": 0.5}, 1.0) == "reward=0.5 below min_reward 1.0"
    assert min_reward_failure({"score": 1.0}, 0.5) == "reward=-inf below min_reward 0.5"
    assert min_reward_failure(None, 0.0) is not None
    assert min_reward_failure({"a": 1, "b": 0.2}, {"a": 1.0, "b": 0.1}) is None
    assert min_reward_failure({"a": 1}, {"a": 1.0, "b": 0.0}) == "b=-inf below min_reward 0.0"


def test_should_stop_on_exception_without_reward_and_on_gate() -> None:
    step = StepConfig(name="s", min_reward=1.0)
    passed = StepResult(step_name="s", verifier_result=VerifierResult(rewards={"reward": 1}))
    failed = StepResult(step_name="s", verifier_result=VerifierResult(rewards={"reward": 0}))
    assert not should_stop(step, passed, verify=True)
    assert should_stop(step, failed, verify=True)
    assert not should_stop(step, failed, verify=False)  # gates ignored without verification
    assert not should_stop(StepConfig(name="s"), failed, verify=True)
    crashed = StepResult.model_validate(
        {
            "step_name": "s",
            "exception_info": {
                "exception_type": "RewardFileNotFoundError",
                "exception_message": "",
                "exception_traceback": "",
                "occurred_at": "2026-01-01T00:00:00Z",
            },
        }
    )
    assert should_stop(StepConfig(name="s"), crashed, verify=True)


def test_reward_strategies() -> None:
    steps = [
        StepResult(step_name="a", verifier_result=VerifierResult(rewards={"reward": 1, "x": 1})),
        StepResult(step_name="b"),  # no verifier result: left out of the mean
        StepResult(step_name="c", verifier_result=VerifierResult(rewards={"reward": 0})),
    ]
    mean = select_reward(None, steps)
    assert mean is not None and mean.rewards == {"reward": 0.5, "x": 0.5}
    assert select_reward("mean", steps) == mean
    final = select_reward("final", steps)
    assert final is not None and final.rewards == {"reward": 0}
    assert select_reward("final", steps[:2]) is None
    assert select_reward("mean", [StepResult(step_name="a")]) is None
    assert select_reward("mean", []) is None


def test_forfeited_steps_count_zero() -> None:
    """A step the agent left unpreparable, and the steps it stops, count 0: the mean
    cannot be raised by dropping them; ``final`` is 0."""
    steps = [
        StepResult(step_name="a", verifier_result=VerifierResult(rewards={"reward": 1, "x": 1})),
        StepResult(step_name="b"),  # could not be prepared after a's agent
    ]
    mean = select_reward(None, steps, forfeited=2)  # b, and c that it stopped
    assert mean is not None and mean.rewards == {"reward": 1 / 3, "x": 1 / 3}
    final = select_reward("final", steps, forfeited=2)
    assert final is not None and final.rewards == {"reward": 0.0, "x": 0.0}
    alone = select_reward("mean", [StepResult(step_name="a")], forfeited=1)
    assert alone is not None and alone.rewards == {"reward": 0.0}


def test_samples_join_in_step_order() -> None:
    one = json.dumps({"messages": [{"role": "user", "content": "1"}], "metrics": {"a": 1}})
    two = json.dumps({"messages": [{"role": "user", "content": "2"}], "metrics": {"a": 2, "b": 3}})
    joined = json.loads(join_samples([one.encode(), two.encode()]))
    assert [m["content"] for m in joined["messages"]] == ["1", "2"]
    assert joined["metrics"] == {"a": 2, "b": 3}
    error = json.dumps({"error": {"type": "X", "message": "m"}}).encode()
    assert join_samples([one.encode(), error, two.encode()]) == error
    assert join_samples([one.encode(), b""]) == b""


def test_workflow_gets_each_steps_instruction(tmp_path: Path) -> None:
    task = load_task(_steps_task(tmp_path, {"one": "1", "two": "1"}))
    original = RolloutInput(rollout_id="r", prompt=[{"role": "user", "content": "x"}])
    agent = WorkflowAgent(
        name="w", version="1", bundle_files=[], rollout_input=original.model_dump_json().encode()
    )
    step_agent = agent.for_step(task.for_step(task.steps[1]))
    prompt = RolloutInput.model_validate_json(step_agent.rollout_input).prompt
    assert prompt == [{"role": "user", "content": "Step two: do it.\n"}]


# ----------------------------------------------------------------- the step loop


def test_all_steps_run_and_layout_matches_harbor(tmp_path: Path) -> None:
    task_dir = _steps_task(tmp_path, {"one": "1", "two": "0.5", "three": '{"reward": 0, "x": 1}'})
    result = _run(tmp_path, task_dir)
    assert result.exception_info is None
    assert result.verifier_environment_mode is None
    assert result.step_results is not None
    assert [s.step_name for s in result.step_results] == ["one", "two", "three"]
    assert [s.verifier_result.rewards for s in result.step_results if s.verifier_result] == [
        {"reward": 1},
        {"reward": 0.5},
        {"reward": 0, "x": 1},
    ]
    assert result.verifier_result is not None
    assert result.verifier_result.rewards == {"reward": 0.5, "x": pytest.approx(1 / 3)}
    assert result.agent_execution is None and result.verifier is None
    trial_dir = tmp_path / "trials" / result.trial_name
    for name in ("one", "two", "three"):
        assert (trial_dir / "steps" / name / "verifier" / "test-stdout.txt").is_file()
        assert (trial_dir / "steps" / name / "agent" / "oracle.txt").is_file()
        assert (trial_dir / "steps" / name / "artifacts" / "manifest.json").is_file()
    assert not (trial_dir / "agent").exists() and not (trial_dir / "verifier").exists()
    on_disk = json.loads((trial_dir / "result.json").read_text())
    assert set(on_disk["step_results"][0]) == {
        "step_name",
        "agent_result",
        "verifier_result",
        "exception_info",
        "agent_execution",
        "verifier",
    }


def test_each_step_runs_its_own_solution_and_tests(tmp_path: Path) -> None:
    task_dir = _steps_task(tmp_path, {"one": "1", "two": "1"})
    seen: list[tuple[bytes | None, bytes | None]] = []

    def solve(container: FakeContainer) -> int:
        seen.append(
            (container.read("/solution/solve.sh"), container.read("/logs/agent/oracle.txt"))
        )
        return 0

    _run(tmp_path, task_dir, FakeRuntime(solve=solve, test=_reward_from_test))
    assert [s[0] for s in seen] == [
        (task_dir / "steps" / n / "solution" / "solve.sh").read_bytes() for n in ("one", "two")
    ]
    # /logs/agent is emptied before each step (step one's oracle.txt is gone for two).
    assert seen[1][1] is None


def test_failed_gate_stops_later_steps(tmp_path: Path) -> None:
    task_dir = _steps_task(
        tmp_path,
        {"one": "1", "two": "0", "three": "1"},
        step_tables={"two": "min_reward = 1.0\n"},
    )
    result = _run(tmp_path, task_dir)
    assert result.step_results is not None
    assert [s.step_name for s in result.step_results] == ["one", "two"]
    assert result.exception_info is None
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 0.5}
    assert not (tmp_path / "trials" / result.trial_name / "steps" / "three").exists()


def test_step_without_reward_stops_and_is_recorded_on_the_step(tmp_path: Path) -> None:
    task_dir = _steps_task(tmp_path, {"one": "1", "two": "none", "three": "1"})
    (task_dir / "steps" / "two" / "tests" / "test.sh").write_text("#!/bin/bash\n")
    result = _run(tmp_path, task_dir)
    assert result.step_results is not None and len(result.step_results) == 2
    two = result.step_results[1]
    assert two.exception_info is not None
    assert two.exception_info.exception_type == "RewardFileNotFoundError"
    assert result.exception_info is None
    assert result.exception_type == "RewardFileNotFoundError"
    assert not result.reward_valid  # a step's exception voids the trial's reward, as in Harbor
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 1}


def test_final_strategy_takes_the_last_step_run(tmp_path: Path) -> None:
    task_dir = _steps_task(
        tmp_path, {"one": "1", "two": "0.25"}, toml='multi_step_reward_strategy = "final"\n'
    )
    result = _run(tmp_path, task_dir)
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 0.25}


def test_step_setup_failure_is_the_steps_runtime_error(tmp_path: Path) -> None:
    task_dir = _steps_task(tmp_path, {"one": "1", "two": "1"})
    workdir = task_dir / "steps" / "two" / "workdir"
    workdir.mkdir()
    (workdir / "setup.sh").write_text("exit 3\n")
    (workdir / "data.txt").write_text("hello")
    placed: list[bytes | None] = []

    def other(container: FakeContainer, script: str) -> int:
        if script == "pwd":
            return 0
        if "setup.sh" in script:
            placed.append(container.read("/data.txt"))
            return 3
        return 0

    result = _run(tmp_path, task_dir, FakeRuntime(test=_reward_from_test, other=other))
    assert placed == [b"hello"]  # the workdir's files were copied before setup.sh ran
    assert result.step_results is not None and len(result.step_results) == 2
    info = result.step_results[1].exception_info
    assert info is not None and info.exception_type == "RuntimeError"
    assert "Step 'two' setup.sh exited with code 3" in info.exception_message


def test_separate_verifiers_get_fresh_containers_and_the_agent_keeps_its_own(
    tmp_path: Path,
) -> None:
    task_dir = _steps_task(
        tmp_path, {"one": "1", "two": "0.5"}, toml='[verifier]\nenvironment_mode = "separate"\n'
    )

    def solve(container: FakeContainer) -> int:
        seen = container.read("/app/state") or b""
        container.write("/app/state", seen + b"x")
        container.write("/logs/artifacts/n.txt", str(len(seen) + 1))
        return 0

    def test(container: FakeContainer) -> int:
        # A fresh container: what the agent left in /app is not there; its artifacts are.
        assert container.read("/app/state") is None
        return _reward_from_test(container)

    runtime = FakeRuntime(solve=solve, test=test)
    result = _run(tmp_path, task_dir, runtime)
    assert result.step_results is not None
    assert [
        s.verifier_result.rewards if s.verifier_result else None for s in result.step_results
    ] == [
        {"reward": 1},
        {"reward": 0.5},
    ], [s.exception_info for s in result.step_results]
    solves = {e.container_id for e in runtime.execs if "/solution/solve.sh" in e.script}
    tests = [e.container_id for e in runtime.execs if "/tests/test.sh" in e.script]
    assert len(solves) == 1 and len(set(tests)) == 2 and not solves & set(tests)
    assert all(c.removed for c in runtime.containers.values())
    out = tmp_path / "trials" / result.trial_name / "steps"
    assert (out / "two" / "artifacts" / "logs" / "artifacts" / "n.txt").read_text() == "2"


def test_a_steps_own_network_policy_is_refused_clearly(tmp_path: Path) -> None:
    task_dir = _steps_task(
        tmp_path,
        {"one": "1"},
        step_tables={"one": '[steps.agent]\nnetwork_mode = "no-network"\n'},
    )
    result = _run(tmp_path, task_dir)
    assert result.exception_info is not None
    assert result.exception_info.exception_type == "TaskConfigError"
    assert "[steps.agent].network_mode" in result.exception_info.exception_message
    assert "'one'" in result.exception_info.exception_message


def test_a_steps_own_verifier_environment_is_refused_clearly(tmp_path: Path) -> None:
    task_dir = _steps_task(
        tmp_path,
        {"one": "1"},
        step_tables={"one": '[steps.verifier.environment]\ndocker_image = "x:1"\n'},
    )
    runtime = FakeRuntime(test=_reward_from_test)
    result = _run(tmp_path, task_dir, runtime)
    assert result.exception_info is not None
    assert result.exception_info.exception_type == "TaskConfigError"
    assert "[[steps]] #1 ('one')" in result.exception_info.exception_message
    assert not runtime.containers  # refused before anything started


def test_native_agents_are_refused_for_steps(tmp_path: Path) -> None:
    task = load_task(_steps_task(tmp_path, {"one": "1"}))

    class Plain:
        from harbor_exec.agents.base import AgentInfo

        info = AgentInfo(name="plain", version="1")

        def files(self, task: object) -> list[ArchiveEntry]:
            return []

    request = TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "trials"), agent=Plain())  # type: ignore[arg-type]
    result = run_trial(FakeRuntime(), request)
    assert result.exception_info is not None
    assert "cannot run with the agent 'plain'" in result.exception_info.exception_message


def test_workflow_sample_covers_all_steps(tmp_path: Path) -> None:
    task = load_task(_steps_task(tmp_path, {"one": "1", "two": "1"}))
    prompts: list[str] = []

    def runner(container: FakeContainer) -> tuple[int, bytes]:
        data = RolloutInput.model_validate_json(container.read("/logs/agent/rollout.json") or b"")
        content = str(data.prompt[0]["content"])
        prompts.append(content)
        sample = {"messages": [{"role": "assistant", "content": f"did {content.split(':')[0]}"}]}
        return 0, frame_sample(json.dumps(sample).encode())

    rollout = RolloutInput(rollout_id="r", prompt=[{"role": "user", "content": "ignored"}])
    agent = WorkflowAgent(
        name="w", version="1", bundle_files=[], rollout_input=rollout.model_dump_json().encode()
    )
    request = TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "trials"), agent=agent)
    runtime = FakeRuntime(test=_reward_from_test, runner=runner)
    trial = create_trial(runtime, request)
    result = trial.run()
    assert result.exception_info is None
    assert prompts == ["Step one: do it.\n", "Step two: do it.\n"]
    assert trial.output.agent.sample is not None
    assert [m["content"] for m in trial.output.agent.sample.messages or []] == [
        "did Step one",
        "did Step two",
    ]
    step_sample = trial.dir / "steps" / "one" / "agent" / "sample.json"
    assert json.loads(step_sample.read_text())["messages"][0]["content"] == "did Step one"


# ----------------------------------------------------------------- the HTTP rollout path


def test_harbor_backend_runs_a_multi_step_task(tmp_path: Path) -> None:
    from harbor_exec.protocol import RolloutStatus
    from tests.test_trials_fake import dataset_rollouts

    steps = {"one": ("true", "# reward 1"), "two": ("true", "# reward 0.5")}
    make_multi_step_task(tmp_path / "ds", "steps", steps)
    make_multi_step_task(
        tmp_path / "ds",
        "gated",
        {"one": ("true", "# reward 0"), "two": ("true", "# reward 1")},
        step_tables={"one": "min_reward = 1\n"},
    )
    runtime = FakeRuntime(test=_reward_from_test)
    _, (done, gated) = dataset_rollouts(tmp_path, runtime, ["steps", "gated"])
    assert done.grader.status is RolloutStatus.SUCCESS
    assert done.grader.sample.reward == 0.75  # mean of 1 and 0.5
    assert gated.grader.sample.reward == 0.0  # gate: step two never ran
    tests_run = [e.script for e in runtime.execs if "/tests/test.sh" in e.script]
    assert len(tests_run) == 3


def test_per_step_timeouts_and_users(tmp_path: Path) -> None:
    task_dir = _steps_task(
        tmp_path,
        {"one": "1", "two": "1"},
        toml='[agent]\ntimeout_sec = 50\nuser = "1000"\n[verifier]\ntimeout_sec = 60\n',
        step_tables={
            "one": '[steps.agent]\ntimeout_sec = 7\nuser = "0"\n[steps.verifier]\ntimeout_sec = 9\n'
        },
    )
    runtime = FakeRuntime(test=_reward_from_test)
    runtime.passwd += b"dev:x:1000:1000::/home/dev:/bin/bash\n"
    runtime.group += b"dev:x:1000:\n"
    _run(tmp_path, task_dir, runtime)
    solves = [e for e in runtime.execs if "/solution/solve.sh" in e.script]
    tests = [e for e in runtime.execs if "/tests/test.sh" in e.script]
    assert [(e.timeout_sec, e.user) for e in solves] == [(7, "0:0"), (50, "1000:1000")]
    assert tests[0].timeout_sec is not None and 8 < tests[0].timeout_sec <= 9
    # Harbor reads the step's verifier timeout (default 600 s), not the task's 60 s.
    assert tests[1].timeout_sec is not None and 599 < tests[1].timeout_sec <= 600


def test_a_failed_step_healthcheck_stops_the_trial(tmp_path: Path) -> None:
    task_dir = _steps_task(
        tmp_path,
        {"one": "1", "two": "1"},
        step_tables={
            "two": '[steps.healthcheck]\ncommand = "probe"\nretries = 1\ninterval_sec = 0\n'
        },
    )
    runtime = FakeRuntime(
        test=_reward_from_test, other=lambda c, script: 1 if script == "probe" else 0
    )
    result = _run(tmp_path, task_dir, runtime)
    assert result.step_results is not None and len(result.step_results) == 2
    info = result.step_results[1].exception_info
    assert info is not None and info.exception_type == "HealthcheckError"
    assert result.step_results[1].agent_execution is None
    # After step one's agent had the container, step two failing to come up is the
    # agent's doing: step two counts 0 (Harbor would leave it out of the mean).
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 0.5}
    assert result.exception_info is not None
    assert result.exception_info.exception_type == "StepPreparationError"
    assert result.reward_valid


def test_a_multi_step_trials_teardown_is_timed_from_its_last_step(tmp_path: Path) -> None:
    """The rollout's diagnostics of a multi-step trial: teardown from the end of its last
    step's verifier (not from its environment's start-up), the phase it ended in that
    verifier's."""
    from harbor_exec.backends.harbor.outcomes import OutcomeSpec, diagnostics_of
    from harbor_exec.executors.base import TrialRun

    class SlowRemoval(FakeRuntime):
        def remove(self, container_id: str) -> None:
            time.sleep(0.3)
            super().remove(container_id)

    task_dir = _steps_task(tmp_path, {"one": "1", "two": "0.5"})
    result = _run(tmp_path, task_dir, SlowRemoval(test=_reward_from_test))
    assert result.exception_info is None and result.step_results and result.finished_at
    diagnostics = diagnostics_of(
        TrialRun(result, tmp_path / "trials" / result.trial_name),
        OutcomeSpec(task_id="ms", is_oracle=True, verify=True),
    )
    timings = diagnostics["timings_sec"]
    last = result.step_results[-1].verifier
    assert last is not None and last.finished_at is not None
    expected = (result.finished_at - last.finished_at).total_seconds()
    assert timings["teardown"] == pytest.approx(expected)
    assert 0.3 <= timings["teardown"] < timings["total"]
    assert diagnostics["phase"] == "verifier"
