"""Trial phases, error mapping and HarborBackend over ``FakeRuntime``: no Docker,
milliseconds each. The Docker suites show what only Docker can."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.agents.base import AgentInfo, AgentRun, AgentSession
from harbor_exec.agents.oracle import OracleAgent
from harbor_exec.agents.workflow import WorkflowAgent
from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.backends.harbor.outcomes import OutcomeSpec, rollout_outcome
from harbor_exec.container.exchange import frame_sample
from harbor_exec.errors import AgentEndedContainerError, EnvironmentStartError, policy_for
from harbor_exec.executors.base import TrialRun
from harbor_exec.executors.local import LocalExecutor
from harbor_exec.protocol import ExecutionRequest, RolloutErrorCategory, RolloutStatus
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.tasks.task import Task, load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import Trial, TrialRequest, image_tag_for
from harbor_exec.trial.verifiers import grader_verifier
from tests.fake_runtime import HANG, FakeContainer, FakeRuntime
from tests.task_factory import make_task
from tests.trial_utils import rewards, run_task


def trial(
    runtime: FakeRuntime, tmp_path: Path, *, toml: str | None = None, **policy: object
) -> TrialResult:
    task_dir = make_task(
        tmp_path / "tasks", f"t{uuid.uuid4().hex[:6]}", **({"toml": toml} if toml else {})
    )
    sandbox = SandboxPolicy(**policy) if policy else None  # type: ignore[arg-type]
    return run_task(runtime, task_dir, tmp_path / "trials", sandbox)


def test_phases_in_harbor_order(tmp_path: Path) -> None:
    seen: list[str] = []

    def solve(container: FakeContainer) -> int:
        seen.append("solve")
        assert "/tests/test.sh" not in container.files  # tests arrive only after the agent
        container.write("/logs/agent/oracle.txt", "solved\n")
        return 0

    runtime = FakeRuntime(solve=solve)
    result = trial(runtime, tmp_path)
    assert result.exception_info is None and rewards(result) == {"reward": 1.0}
    # The agent's processes are stopped before the verifier, its leftovers after it.
    calls = [c for c in runtime.calls if c in ("exec", "stop_processes", "put_archive")]
    assert calls == ["exec", "stop_processes", "put_archive", "exec", "stop_processes"]
    assert all(c.removed for c in runtime.containers.values())
    out = tmp_path / "trials" / result.trial_name
    assert (out / "agent" / "oracle.txt").read_text() == "solved\n"
    assert json.loads((out / "result.json").read_text())["verifier_environment_mode"] == "shared"


def test_build_failure_is_named_and_nothing_starts(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    task_dir = make_task(tmp_path / "tasks", "broken")
    runtime.fail_builds.add(image_tag_for(load_task(task_dir)))
    result = run_trial(
        runtime, TrialRequest(TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "t"))
    )
    assert result.exception_type == "SandboxBuildFailedError"
    assert not runtime.containers and rewards(result) is None


def test_agent_timeout_still_verifies(tmp_path: Path) -> None:
    runtime = FakeRuntime(solve=lambda container: HANG)
    result = trial(runtime, tmp_path, toml="[agent]\ntimeout_sec = 0.05\n")
    assert result.exception_type == "AgentTimeoutError"
    assert rewards(result) == {"reward": 1.0} and result.reward_valid


def test_verifier_timeout_has_no_reward(tmp_path: Path) -> None:
    runtime = FakeRuntime(test=lambda container: HANG)
    result = trial(runtime, tmp_path, toml="[verifier]\ntimeout_sec = 0.05\n")
    assert result.exception_type == "VerifierTimeoutError" and rewards(result) is None


@pytest.mark.parametrize(("engine_gpus", "error"), [(0, "GpuUnavailableError"), (2, None)])
def test_gpus_are_asked_of_the_engine_before_anything_starts(
    tmp_path: Path, engine_gpus: int, error: str | None
) -> None:
    runtime = FakeRuntime(gpus=engine_gpus)
    result = trial(runtime, tmp_path, toml="[environment]\ngpus = 1\n")
    assert result.exception_type == error
    if error is not None:
        assert result.exception_info is not None and not runtime.containers
        assert "gpus = 1" in result.exception_info.exception_message
    else:
        assert [c.spec.gpus for c in runtime.containers.values()] == [1]


def test_planted_reward_is_gone_before_test_sh(tmp_path: Path) -> None:
    def plant(container: FakeContainer) -> int:
        container.write("/logs/verifier/reward.txt", "1")
        container.write("/logs/verifier/reward.json", '{"reward": 1}')
        return 0

    result = trial(FakeRuntime(solve=plant, test=lambda container: 0), tmp_path)
    assert result.exception_type == "RewardFileNotFoundError" and rewards(result) is None


def test_engine_fault_is_an_infrastructure_error_with_a_result(tmp_path: Path) -> None:
    runtime = FakeRuntime()

    def engine_dies(container: FakeContainer) -> int:
        runtime.engine_down = True
        return 0

    runtime.solve = engine_dies
    result = trial(runtime, tmp_path)
    assert result.exception_type == "EngineUnavailableError"
    assert (tmp_path / "trials" / result.trial_name / "result.json").is_file()


def test_separate_verifier_gets_a_fresh_container_with_the_artifacts(tmp_path: Path) -> None:
    def solve(container: FakeContainer) -> int:
        container.write("/app/result.txt", "42")
        container.write("/app/secret.txt", "agent-only")
        return 0

    def test(container: FakeContainer) -> int:
        ok = container.read("/app/result.txt") == b"42" and "/app/secret.txt" not in container.files
        container.write("/logs/verifier/reward.txt", "1" if ok else "0")
        return 0

    toml = 'artifacts = ["/app/result.txt"]\n[verifier]\nenvironment_mode = "separate"\n'
    runtime = FakeRuntime(solve=solve, test=test)
    result = trial(runtime, tmp_path, toml=toml)
    assert result.verifier_environment_mode == "separate"
    assert rewards(result) == {"reward": 1.0}
    kinds = [c.spec.labels["harbor-exec.kind"] for c in runtime.containers.values()]
    assert kinds == ["trial", "verifier"]


# --------------------------------------------------------------------------- outcomes


def finished_run(tmp_path: Path, runtime: FakeRuntime, toml: str | None = None) -> TrialRun:
    result = trial(runtime, tmp_path, toml=toml)
    return TrialRun(result, tmp_path / "trials" / result.trial_name)


@pytest.mark.parametrize(
    ("runtime", "toml", "status", "category"),
    [
        (FakeRuntime(), None, RolloutStatus.SUCCESS, None),
        (FakeRuntime(test=lambda c: 0), None, RolloutStatus.FAILURE, "validation_error"),
        (
            FakeRuntime(test=lambda c: HANG),
            "[verifier]\ntimeout_sec = 0.05\n",
            RolloutStatus.FAILURE,
            "timeout",
        ),
        # The agent's timeout: its verifier's reward stands (the timeout is named in the
        # sample's extra fields), so the agent cannot erase a zero by running out.
        (
            FakeRuntime(solve=lambda c: HANG),
            "[agent]\ntimeout_sec = 0.05\n",
            RolloutStatus.SUCCESS,
            None,
        ),
    ],
)
def test_outcome_mapping(
    tmp_path: Path,
    runtime: FakeRuntime,
    toml: str | None,
    status: RolloutStatus,
    category: str | None,
) -> None:
    run = finished_run(tmp_path, runtime, toml)
    request = ExecutionRequest(id="r1", prompt=[], label="x")
    outcome = rollout_outcome(request, run, OutcomeSpec("t", is_oracle=True, verify=True))
    assert outcome.result.status is status
    assert (outcome.result.err_category.value if outcome.result.err_category else None) == category
    if status is RolloutStatus.SUCCESS:
        assert outcome.grader is not None and outcome.grader.sample is not None
        assert outcome.grader.sample.reward == 1.0
        agent_error = outcome.grader.sample.extra_fields.get("agent_error")
        timed_out = toml is not None and "[agent]" in toml
        assert (agent_error or {}).get("category") == ("timeout" if timed_out else None)


def test_engine_fault_maps_to_internal_error(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    runtime.solve = lambda container: setattr(runtime, "engine_down", True) or 0  # type: ignore[func-returns-value]
    run = finished_run(tmp_path, runtime)
    request = ExecutionRequest(id="r1", prompt=[])
    outcome = rollout_outcome(request, run, OutcomeSpec("t", is_oracle=True, verify=True))
    assert outcome.result.err_category is RolloutErrorCategory.INTERNAL_ERROR


# --------------------------------------------------------------------------- HarborBackend


def dataset_rollouts(
    tmp_path: Path, runtime: FakeRuntime, task_ids: list[str]
) -> tuple[HarborBackend, list[Any]]:
    """One oracle rollout per task id of the dataset ``tmp_path/ds``, concurrently,
    through a ``HarborBackend`` over ``runtime``; the backend is shut down after."""
    backend = HarborBackend(
        tasks_dir=tmp_path / "ds",
        task_mode="dataset",
        executor=LocalExecutor(runtime),
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
    )

    async def run(task_id: str) -> object:
        request = ExecutionRequest(
            id=f"r-{task_id}", prompt=[], metadata={"harbor_task_id": task_id}
        )
        return await backend.execute(request)

    async def every() -> list[object]:
        results = await asyncio.gather(*(run(task_id) for task_id in task_ids))
        await backend.shutdown()
        return list(results)

    return backend, asyncio.run(every())


def test_harbor_backend_over_the_fake(tmp_path: Path) -> None:
    make_task(tmp_path / "ds", "good")
    make_task(tmp_path / "ds", "bad", test="true")

    def test_sh(container: FakeContainer) -> int:  # "bad"'s test.sh writes no reward
        if not (container.read("/tests/test.sh") or b"").rstrip().endswith(b"true"):
            container.write("/logs/verifier/reward.txt", "1")
        return 0

    backend, (good, bad, missing) = dataset_rollouts(
        tmp_path, FakeRuntime(test=test_sh), ["good", "bad", "missing"]
    )
    assert good.grader.sample.reward == 1.0
    assert bad.result.err_category is RolloutErrorCategory.VALIDATION_ERROR
    assert "no such task" in missing.result.err_message
    assert backend.health().backend == "harbor" and backend.queue_info().running == 0
    assert not (tmp_path / "trials" / "r-good").exists()  # successful trials are cleaned up


ORIGINAL = {"messages": [{"role": "assistant", "content": "original"}], "metrics": {}}
FORGED = {"messages": [{"role": "assistant", "content": "forged"}], "remove_sample": True}


def test_the_sample_is_the_one_handed_over_not_the_file_left_behind(tmp_path: Path) -> None:
    """The runner frames the sample on stdout; its file is rewritten after it exits (as a
    detached process would). The trial, its grader and its output keep the original."""
    graded: list[object] = []

    def runner(container: FakeContainer) -> tuple[int, bytes]:
        handed = json.dumps(ORIGINAL).encode()
        container.write("/logs/agent/sample.json", json.dumps(FORGED))  # after the fact
        return 0, b"runner noise\n" + frame_sample(handed) + frame_sample(b"{}")

    def grade(container: FakeContainer) -> int:
        graded.append(json.loads(container.read("/logs/agent/sample.json") or b"null"))
        container.write("/logs/verifier/reward.json", '{"reward": 0.5}')
        return 0

    runtime = FakeRuntime(runner=runner, test=grade)
    task_dir = make_task(tmp_path / "tasks", "handed-over")
    request = TrialRequest(
        TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "trials"),
        agent=WorkflowAgent(name="w", version="1", bundle_files=[], rollout_input=b"{}"),
        verifier=grader_verifier(b"{}", []),
    )
    trial_ = Trial(runtime, request)
    result = trial_.run()
    assert result.exception_info is None, result.exception_info
    assert graded == [ORIGINAL]
    assert trial_.output.agent.sample is not None
    assert trial_.output.agent.sample.messages == ORIGINAL["messages"]
    on_disk = json.loads((trial_.dir / "agent" / "sample.json").read_text())
    assert on_disk == ORIGINAL


def test_no_frame_means_no_sample_whatever_the_file_says(tmp_path: Path) -> None:
    def runner(container: FakeContainer) -> tuple[int, bytes]:
        container.write("/logs/agent/sample.json", json.dumps(FORGED))
        return 0, b"no frame here"

    graded: list[object] = []

    def grade(container: FakeContainer) -> int:
        graded.append(json.loads(container.read("/logs/agent/sample.json") or b"null"))
        return 1

    runtime = FakeRuntime(runner=runner, test=grade)
    request = TrialRequest(
        TrialSpec(
            task=load_task(make_task(tmp_path / "tasks", "no-frame")),
            trials_dir=tmp_path / "trials",
        ),
        agent=WorkflowAgent(name="w", version="1", bundle_files=[], rollout_input=b"{}"),
        verifier=grader_verifier(b"{}", []),
    )
    trial_ = Trial(runtime, request)
    trial_.run()
    assert trial_.output.agent.missing
    assert not (trial_.dir / "agent" / "sample.json").exists()
    # The grader was given the error form, not what the agent left at that path.
    assert isinstance(graded[0], dict) and "error" in graded[0]


def test_users_are_resolved_from_the_image_as_numeric_ids(tmp_path: Path) -> None:
    runtime = FakeRuntime(
        user="agent",
        passwd=b"root:x:0:0::/root:/bin/bash\nagent:x:1000:1000::/home/agent:/bin/bash\n",
        group=b"root:x:0:\nagent:x:1000:\n",
    )
    toml = "[agent]\ntimeout_sec = 30.0\n[verifier]\nuser = 'root'\n"
    result = trial(runtime, tmp_path, toml=toml)
    assert result.exception_info is None and rewards(result) == {"reward": 1.0}
    users = {("solve" if "solve.sh" in e.script else "test"): e.user for e in runtime.execs}
    assert users == {"solve": "1000:1000", "test": "0:0"}
    assert runtime.calls.index("image_accounts") < runtime.calls.index("start")


def test_an_unknown_user_is_a_task_config_error(tmp_path: Path) -> None:
    result = trial(FakeRuntime(), tmp_path, toml="[agent]\nuser = 'nobody2'\n")
    assert result.exception_type == "TaskConfigError"
    assert "nobody2" in (result.exception_info.exception_message if result.exception_info else "")


def test_an_agent_that_stops_its_container_is_restarted_and_verified(tmp_path: Path) -> None:
    def solve(container: FakeContainer) -> int:
        container.running = False  # as after ``kill -TERM 1``
        return 0

    def test(container: FakeContainer) -> int:
        container.write("/logs/verifier/reward.txt", "0")
        return 0

    runtime = FakeRuntime(solve=solve, test=test)
    original = runtime.exec

    def exec_(container_id: str, command: list[str], **options: object) -> object:
        if not runtime.containers[container_id].running:
            raise EnvironmentStartError("container is not running")
        return original(container_id, command, **options)  # type: ignore[arg-type]

    runtime.exec = exec_  # type: ignore[method-assign,assignment]
    result = trial(runtime, tmp_path)
    assert result.exception_type == AgentEndedContainerError.__name__
    assert not policy_for(result.exception_type).should_retry
    assert rewards(result) == {"reward": 0.0}


def test_a_task_without_solve_sh_is_still_verified(tmp_path: Path) -> None:
    """Harbor records the oracle's FileNotFoundError and still runs the verifier."""
    task_dir = make_task(tmp_path / "tasks", "no-solution")
    (task_dir / "solution" / "solve.sh").unlink()
    verified: list[str] = []

    def test(container: FakeContainer) -> int:
        verified.append(container.spec.name)
        container.write("/logs/verifier/reward.txt", "0\n")
        return 0

    request = TrialRequest(TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "trials"))
    result = run_trial(FakeRuntime(test=test), request)
    assert result.exception_info is not None
    assert result.exception_info.exception_type == "FileNotFoundError"
    assert "Solution script not found" in result.exception_info.exception_message
    assert len(verified) == 1
    assert rewards(result) == {"reward": 0.0}


ARTIFACTS_TOML = """
artifacts = [
  "/app/result.txt",
  {source = "/srv/other/result.txt", destination = "app/result.txt"},
  "/app/missing.txt",
  "relative.txt",
]

[agent]
timeout_sec = 30.0

[verifier]
timeout_sec = 30.0
"""


def test_declared_artifacts_are_kept_as_harbor_keeps_them(tmp_path: Path) -> None:
    """Shared mode too: collected after the agent and before the verifier (which here
    deletes the file), at the container path, with Harbor's manifest rows."""

    def solve(container: FakeContainer) -> int:
        container.write("/app/result.txt", "42\n")
        container.write("/srv/other/result.txt", "other\n")
        container.write("/logs/artifacts/note.txt", "art\n")
        return 0

    def test(container: FakeContainer) -> int:
        container.files.pop("/app/result.txt")
        container.write("/logs/verifier/reward.txt", "1\n")
        return 0

    task_dir = make_task(tmp_path / "tasks", "declares", toml=ARTIFACTS_TOML)
    request = TrialRequest(TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "trials"))
    result = run_trial(FakeRuntime(solve=solve, test=test), request)
    assert result.exception_info is None, result.exception_info
    out = tmp_path / "trials" / result.trial_name / "artifacts"
    assert (out / "app" / "result.txt").read_text() == "42\n"
    assert (out / "logs" / "artifacts" / "note.txt").read_text() == "art\n"
    rows = json.loads((out / "manifest.json").read_text())
    assert [(r["source"], r["destination"], r["type"], r["status"]) for r in rows] == [
        ("/logs/artifacts", "artifacts/logs/artifacts", "directory", "ok"),
        ("/app/result.txt", "artifacts/app/result.txt", "file", "ok"),
        # The same host path as the first: Harbor keeps the first claimant.
        ("/srv/other/result.txt", "artifacts/app/result.txt", "file", "skipped"),
        ("/app/missing.txt", "artifacts/app/missing.txt", "file", "failed"),
        ("relative.txt", "artifacts/relative.txt", "file", "skipped"),
    ]


def healthcheck_toml(**fields: object) -> str:
    values = ", ".join(f"{key} = {value!r}" for key, value in fields.items())
    return (
        "[agent]\ntimeout_sec = 30.0\n[verifier]\ntimeout_sec = 30.0\n"
        f"[environment]\nhealthcheck = {{ command = 'probe-ready', {values} }}\n"
    )


def probe_failing(times: int, calls: list[str]) -> Callable[[FakeContainer, str], int]:
    def other(container: FakeContainer, script: str) -> int:
        if "probe-ready" not in script:
            return 0
        calls.append("probe")
        return 1 if len(calls) <= times else 0

    return other


def test_healthcheck_passes_before_the_agent(tmp_path: Path) -> None:
    calls: list[str] = []
    solved: list[int] = []

    def solve(container: FakeContainer) -> int:
        solved.append(len(calls))
        return 0

    runtime = FakeRuntime(solve=solve, other=probe_failing(2, calls))
    toml = healthcheck_toml(retries=3, interval_sec=0.0)
    result = trial(runtime, tmp_path, toml=toml)
    assert result.exception_info is None, result.exception_info
    assert calls == ["probe"] * 3 and solved == [3]  # the agent ran after the third probe


def test_healthcheck_failures_end_the_trial_before_the_agent(tmp_path: Path) -> None:
    calls: list[str] = []
    solved: list[int] = []

    def solve(container: FakeContainer) -> int:
        solved.append(1)
        return 0

    runtime = FakeRuntime(solve=solve, other=probe_failing(99, calls))
    result = trial(runtime, tmp_path, toml=healthcheck_toml(retries=2, interval_sec=0.0))
    assert result.exception_info is not None
    assert result.exception_info.exception_type == "HealthcheckError"
    assert "after 2 consecutive retries: probe-ready" in result.exception_info.exception_message
    assert calls == ["probe"] * 2 and solved == []
    assert result.verifier is None  # Harbor's policy: not graded


def test_healthcheck_failures_in_the_start_period_do_not_count(tmp_path: Path) -> None:
    calls: list[str] = []
    runtime = FakeRuntime(other=probe_failing(5, calls))
    toml = healthcheck_toml(retries=1, start_period_sec=600.0, start_interval_sec=0.0)
    result = trial(runtime, tmp_path, toml=toml)
    assert result.exception_info is None, result.exception_info
    assert len(calls) == 6


ENV_FIELD_TOML = (
    "[agent]\ntimeout_sec = 30.0\n[verifier]\ntimeout_sec = 30.0\n[environment]\n{field}\n"
)


@dataclass
class NamedAgent:
    """An agent that is not the oracle (it does nothing)."""

    info: AgentInfo = field(default_factory=lambda: AgentInfo(name="some-workflow", version="1"))

    def files(self, task: Task) -> list[ArchiveEntry]:
        return []

    def run(self, session: AgentSession, timeout_sec: float | None) -> AgentRun:
        return AgentRun(exit_code=0, timed_out=False)


@pytest.mark.parametrize(
    ("field_line", "oracle_runs"),
    [
        ("tpu = { type = 'v6e', topology = '2x2' }", False),
        ("mcp_servers = [{ name = 'db', transport = 'stdio', command = 'db-mcp' }]", True),
        ("skills_dir = '/skills'", True),
    ],
)
def test_environment_fields_harbor_refuses_are_refused_by_name(
    tmp_path: Path, field_line: str, oracle_runs: bool
) -> None:
    name = field_line.split(" ", 1)[0]
    task_dir = make_task(tmp_path / "tasks", name, toml=ENV_FIELD_TOML.format(field=field_line))
    for agent in (OracleAgent(), NamedAgent()):
        runtime = FakeRuntime()
        request = TrialRequest(
            TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "trials"), agent=agent
        )
        result = run_trial(runtime, request)
        refused = not (oracle_runs and isinstance(agent, OracleAgent))
        if refused:
            assert result.exception_info is not None
            assert result.exception_info.exception_type == "TaskConfigError"
            assert f"[environment].{name}" in result.exception_info.exception_message
            assert runtime.builds == [] and runtime.containers == {}  # nothing built or run
        else:
            assert result.exception_info is None, result.exception_info


COLLECT_TOML = """
artifacts = ["/app/db.dump"]

[agent]
timeout_sec = 30.0

[verifier]
timeout_sec = 30.0

[[verifier.collect]]
command = "snapshot-db > /app/db.dump"

[[verifier.collect]]
command = "broken-hook"
timeout_sec = 5
"""


def test_collect_hooks_run_after_the_agent_and_before_the_artifacts(tmp_path: Path) -> None:
    order: list[str] = []

    def solve(container: FakeContainer) -> int:
        order.append("agent")
        return 0

    def other(container: FakeContainer, script: str) -> int:
        if "snapshot-db" in script:
            order.append("hook")
            container.write("/app/db.dump", "rows\n")
        return 1 if "broken-hook" in script else 0

    task_dir = make_task(tmp_path / "tasks", "collects", toml=COLLECT_TOML)
    request = TrialRequest(TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "trials"))
    result = run_trial(FakeRuntime(solve=solve, other=other), request)
    assert result.exception_info is None, result.exception_info  # a failed hook is no error
    out = tmp_path / "trials" / result.trial_name
    assert order == ["agent", "hook"]
    assert (out / "artifacts" / "app" / "db.dump").read_text() == "rows\n"
    assert "'broken-hook' exited with code 1" in (out / "collect-hooks.txt").read_text()


def test_a_collect_hook_for_a_sidecar_is_refused_by_name(tmp_path: Path) -> None:
    toml = COLLECT_TOML.replace('command = "broken-hook"', 'command = "dump"\nservice = "db"')
    task_dir = make_task(tmp_path / "tasks", "sidecar-hook", toml=toml)
    request = TrialRequest(TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "trials"))
    result = run_trial(FakeRuntime(), request)
    assert result.exception_info is not None
    assert result.exception_info.exception_type == "TaskConfigError"
    assert "service = 'db'" in result.exception_info.exception_message


def test_an_explicit_logs_artifacts_entry_replaces_harbors_implicit_one(tmp_path: Path) -> None:
    toml = (
        'artifacts = [{ source = "/logs/artifacts", exclude = ["*.tmp"] }]\n'
        "[agent]\ntimeout_sec = 30.0\n[verifier]\ntimeout_sec = 30.0\n"
    )

    def solve(container: FakeContainer) -> int:
        container.write("/logs/artifacts/keep.txt", "kept\n")
        container.write("/logs/artifacts/junk.tmp", "junk\n")
        return 0

    task_dir = make_task(tmp_path / "tasks", "explicit-convention", toml=toml)
    request = TrialRequest(TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "trials"))
    result = run_trial(FakeRuntime(solve=solve), request)
    assert result.exception_info is None, result.exception_info
    out = tmp_path / "trials" / result.trial_name / "artifacts"
    assert (out / "logs" / "artifacts" / "keep.txt").read_text() == "kept\n"
    assert not (out / "logs" / "artifacts" / "junk.tmp").exists()
    rows = json.loads((out / "manifest.json").read_text())
    assert [(r["source"], r["status"], r["exclude"]) for r in rows] == [
        ("/logs/artifacts", "ok", ["*.tmp"])
    ]


def test_a_collect_hook_runs_before_logs_artifacts_is_read_in_separate_mode(
    tmp_path: Path,
) -> None:
    """What a hook writes into ``/logs/artifacts`` is collected, and handed to the
    separate verifier, as in Harbor (hooks run before any collection)."""
    toml = (
        "[agent]\ntimeout_sec = 30.0\n[verifier]\ntimeout_sec = 30.0\n"
        '[[verifier.collect]]\ncommand = "dump-state > /logs/artifacts/state.txt"\n'
    )

    def other(container: FakeContainer, script: str) -> int:
        if "dump-state" in script:
            container.write("/logs/artifacts/state.txt", "snapshot\n")
        return 0

    seen: list[bytes | None] = []

    def test(container: FakeContainer) -> int:
        seen.append(container.files.get("/logs/artifacts/state.txt"))
        container.write("/logs/verifier/reward.txt", "1\n")
        return 0

    task_dir = make_task(tmp_path / "tasks", "hook-separate", toml=toml)
    request = TrialRequest(TrialSpec(task=load_task(task_dir), trials_dir=tmp_path / "trials"))
    request.spec = replace(request.spec, policy=SandboxPolicy(verifier_mode="separate"))
    result = run_trial(FakeRuntime(other=other, test=test), request)
    assert result.exception_info is None, result.exception_info
    out = tmp_path / "trials" / result.trial_name / "artifacts"
    assert (out / "logs" / "artifacts" / "state.txt").read_text() == "snapshot\n"
    assert seen == [b"snapshot\n"]


def test_a_failed_build_names_the_tasks_own_directory_not_the_cache(tmp_path: Path) -> None:
    """Builds read a checked snapshot in the cache; the error names the task's own
    environment (where the user edits the Dockerfile), and keeps the build log's path."""
    from harbor_exec.errors import SandboxBuildFailedError
    from harbor_exec.trial.trial import ensure_task_image, image_tag_for

    task = load_task(make_task(tmp_path / "tasks", "broken"))
    assert task.files is not None and task.files != task.path  # built from the snapshot
    runtime = FakeRuntime()
    runtime.fail_builds.add(image_tag_for(task))
    with pytest.raises(SandboxBuildFailedError) as caught:
        ensure_task_image(runtime, task)
    message = str(caught.value)
    assert str(task.path / "environment") in message and str(task.files) not in message


def test_a_5xx_from_the_engine_is_not_the_engine_gone() -> None:
    """An engine that answers 500 to one operation (a removal racing a cancel) still
    answers: rollouts stay admitted. Only a connection that fails marks it down."""
    import docker
    import requests

    from harbor_exec.errors import EngineUnavailableError
    from harbor_exec.sandbox.docker import DockerRuntime, _engine_boundary

    runtime = DockerRuntime.__new__(DockerRuntime)
    runtime.engine_available, runtime._base_url = True, "unix:///engine.sock"

    @_engine_boundary
    def fails(self: DockerRuntime, exc: Exception) -> None:
        raise exc

    response = requests.Response()
    response.status_code = 500
    server_error = docker.errors.APIError("500 Server Error", response=response)
    with pytest.raises(EngineUnavailableError):
        fails(runtime, server_error)
    assert runtime.engine_available
    with pytest.raises(EngineUnavailableError):
        fails(runtime, requests.exceptions.ConnectionError("connection refused"))
    assert not runtime.engine_available


def test_a_forwarder_that_never_announces_is_started_by_exec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forwarder started with the container did not say it listens (CI: twice in a
    first wave of four trials): after a short wait the trial starts one by exec, as for
    a warm container, and goes on; it never fails the rollout after 60 s."""
    from harbor_exec.network.egress import plan
    from tests import fake_runtime

    monkeypatch.setattr(plan, "FORWARDER_ANNOUNCE_SEC", 0.2)
    monkeypatch.setattr(fake_runtime, "_announce_forwarder", lambda spec: None)
    runtime = FakeRuntime()
    toml = '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["allowed.test"]\n'
    result = trial(runtime, tmp_path, toml=toml)
    assert result.exception_info is None and rewards(result) == {"reward": 1.0}
    started = [e for e in runtime.execs if "--in-use-ok" in e.script]
    assert len(started) >= 1, [e.script[-80:] for e in runtime.execs]
