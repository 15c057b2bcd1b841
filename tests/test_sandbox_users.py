"""Hostile agents against users and outcomes: account files the agent rewrites,
``/logs/verifier`` it pre-fills, the container it ends itself, and images whose
USER is not root. The recorded reward must stay the one ``test.sh`` wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from harbor_exec.errors import AgentEndedContainerError, TrialPhase, policy_for
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.results import TrialResult
from tests.task_factory import make_task
from tests.trial_utils import rewards, run_task

# engine_lane: its own tasks; no engine-wide counts, no wall-clock bound.
pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]

NON_ROOT_IMAGE = (
    "FROM debian:bookworm-slim\n"
    "RUN useradd -m -u 1000 agent && mkdir /app && chown agent /app\n"
    "WORKDIR /app\n"
)


def toml(agent_user: str | None = None, verifier_user: str | None = None) -> str:
    agent = f'user = "{agent_user}"\n' if agent_user else ""
    verifier = f'user = "{verifier_user}"\n' if verifier_user else ""
    return f"[agent]\ntimeout_sec = 30.0\n{agent}\n[verifier]\ntimeout_sec = 30.0\n{verifier}"


def run(runtime: DockerRuntime, task_dir: Path, trials: Path, mode: str = "shared") -> TrialResult:
    return run_task(runtime, task_dir, trials, SandboxPolicy(verifier_mode=mode))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_wiped_account_files_still_get_the_verifiers_reward(
    docker_runtime: DockerRuntime, tmp_path: Path, mode: str
) -> None:
    solve = ": > /etc/passwd; : > /etc/group"
    test = '[ "$(id -u)" = 0 ] && echo 0 > /logs/verifier/reward.txt'
    task = make_task(tmp_path, "no-passwd", solve=solve, test=test, toml=toml(None, "root"))
    result = run(docker_runtime, task, tmp_path / "trials", mode)
    assert result.exception_info is None, result.exception_info
    assert rewards(result) == {"reward": 0.0}


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_non_root_agent_cannot_change_the_reward_through_logs_verifier(
    docker_runtime: DockerRuntime, tmp_path: Path, mode: str
) -> None:
    solve = """
        echo 1 > /logs/verifier/reward.txt; mkdir -p /logs/verifier/sub
        ln -s /tmp/x /logs/verifier/reward.json
        nohup bash -c 'while true; do echo 1 > /logs/verifier/reward.txt; sleep 0.01; done' \
            >/dev/null 2>&1 &
        sleep 0.3
    """
    test = """
        stat -c '%U %a' /logs/verifier > /logs/verifier/owner.txt
        echo 0 > /logs/verifier/reward.txt
        sleep 0.5
    """
    dockerfile = "FROM debian:bookworm-slim\nRUN useradd -m agent\nWORKDIR /app\n"
    task = make_task(
        tmp_path, "lv-owner", solve=solve, test=test, toml=toml("agent"), dockerfile=dockerfile
    )
    result = run(docker_runtime, task, tmp_path / "trials", mode)
    assert result.exception_info is None, result.exception_info
    assert rewards(result) == {"reward": 0.0}
    owner = (tmp_path / "trials" / result.trial_name / "verifier" / "owner.txt").read_text()
    assert owner.split() == ["root", "755"]


def test_agent_ending_its_container_is_the_agents_outcome_every_time(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    task = make_task(
        tmp_path, "kill-init", solve="kill -TERM 1", test="echo 0 > /logs/verifier/reward.txt"
    )
    for attempt in range(10):
        result = run(docker_runtime, task, tmp_path / "trials")
        # AgentEndedContainerError when the trial saw the container stopped; none when
        # its own between-phase kill (the engine-restart path) restarted it first.
        # Either way the verifier's 0 stands and nothing is retried.
        assert result.exception_type in (AgentEndedContainerError.__name__, None), attempt
        if result.exception_type is not None:
            policy = policy_for(result.exception_type)
            assert not policy.should_retry and policy.has_valid_reward
            assert policy.phase is TrialPhase.AGENT
        assert result.reward_valid and rewards(result) == {"reward": 0.0}, attempt


def test_agent_ending_its_container_in_separate_mode_gets_the_verifiers_reward(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    task = make_task(
        tmp_path,
        "kill-init-sep",
        solve="kill -TERM 1; sleep 1",
        test="echo 0 > /logs/verifier/reward.txt",
    )
    result = run(docker_runtime, task, tmp_path / "trials", "separate")
    assert rewards(result) == {"reward": 0.0}
    assert result.exception_type is None or not policy_for(result.exception_type).should_retry


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_image_with_a_non_root_user_runs_the_oracle(
    docker_runtime: DockerRuntime, tmp_path: Path, mode: str
) -> None:
    solve = '[ "$(id -u)" = 1000 ] && echo ok > /app/done'
    test = (
        '[ "$(id -u)" = 1000 ] && [ -f /app/done -o -f /logs/artifacts/x ] '
        "&& echo 1 > /logs/verifier/reward.txt"
    )
    if mode == "separate":  # the separate verifier sees only what was handed over
        solve += " && echo ok > /logs/artifacts/x"
    task = make_task(
        tmp_path, "user-1000", solve=solve, test=test, dockerfile=NON_ROOT_IMAGE + "USER 1000\n"
    )
    result = run(docker_runtime, task, tmp_path / "trials", mode)
    assert result.exception_info is None, result.exception_info
    assert rewards(result) == {"reward": 1.0}
