"""The trial engine against a real Docker engine: Harbor's semantics, broken tasks,
and nothing left behind."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harbor_exec.container.exchange import RUNTIME_PYTHON
from harbor_exec.errors import UnsafeTaskPathError
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_TRIAL
from harbor_exec.sandbox.runtime_volume import INIT_COMMAND
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import Trial, TrialRequest
from tests.server_utils import wait_until
from tests.task_factory import make_task
from tests.trial_utils import run_task

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]


def trial_dir(trials: Path, result: TrialResult) -> Path:
    return trials / result.trial_name


def test_oracle_trial_layout_and_result(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    task = make_task(
        tmp_path,
        "layout",
        solve="""
            echo solving
            [ -d /tests ] && echo "tests visible during agent" > /app/leak
            echo "$DEBIAN_FRONTEND" > /app/frontend
            mkdir -p /logs/artifacts && echo art > /logs/artifacts/a.txt
        """,
        test="""
            echo testing
            [ -e /app/leak ] && { echo 0 > /logs/verifier/reward.txt; exit 0; }
            [ "$(cat /app/frontend)" = noninteractive ] || { echo 0 > /logs/verifier/reward.txt; exit 0; }
            echo 1 > /logs/verifier/reward.txt
        """,
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 1.0}
    out = trial_dir(tmp_path / "trials", result)
    assert (out / "agent" / "oracle.txt").read_text() == "solving\n"
    assert (out / "verifier" / "test-stdout.txt").read_text() == "testing\n"
    assert (out / "artifacts" / "logs" / "artifacts" / "a.txt").read_text() == "art\n"
    assert not (out / "agent" / "exit-code.txt").exists()
    written = json.loads((out / "result.json").read_text())
    for key in ("task_name", "trial_name", "verifier_result", "exception_info", "agent_info"):
        assert key in written
    for phase in ("environment_setup", "agent_setup", "agent_execution", "verifier"):
        assert written[phase]["started_at"].endswith("Z")
        assert written[phase]["finished_at"] >= written[phase]["started_at"]
    assert written["reward_valid"] is True
    assert written["agent_info"] == {"name": "oracle", "version": "1.0.0", "model_info": None}


def test_build_failure_is_named_with_log_tail(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    task = make_task(
        tmp_path,
        "build-fails",
        dockerfile="FROM debian:bookworm-slim\nRUN echo about-to-fail && exit 42\n",
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_type == "SandboxBuildFailedError"
    assert result.exception_info is not None
    message = result.exception_info.exception_message
    assert "42" in message and "about-to-fail" in message
    assert result.verifier_result is None and not result.reward_valid


@pytest.mark.parametrize(
    ("name", "test", "exception"),
    [
        ("no-reward", "echo nothing", "RewardFileNotFoundError"),
        ("empty-reward", ": > /logs/verifier/reward.txt", "RewardFileEmptyError"),
        ("passed-text", "echo PASSED > /logs/verifier/reward.txt", "VerifierOutputParseError"),
        (
            "nan-json",
            "echo '{\"reward\": NaN}' > /logs/verifier/reward.json",
            "VerifierOutputParseError",
        ),
    ],
)
def test_bad_reward_files(
    docker_runtime: DockerRuntime, tmp_path: Path, name: str, test: str, exception: str
) -> None:
    result = run_task(docker_runtime, make_task(tmp_path, name, test=test), tmp_path / "trials")
    assert result.exception_type == exception
    assert not result.reward_valid and result.reward is None
    assert result.exception_info is not None and result.exception_info.exception_message


def test_reward_json_wins_over_reward_txt(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    test = """
        echo 0.25 > /logs/verifier/reward.txt
        echo '{"a": 1, "b": 0.5, "c": true}' > /logs/verifier/reward.json
    """
    result = run_task(docker_runtime, make_task(tmp_path, "both", test=test), tmp_path / "trials")
    assert result.verifier_result is not None
    assert result.verifier_result.rewards == {"a": 1, "b": 0.5, "c": 1.0}


@pytest.mark.quiet_engine  # a wall-clock bound on engine work
def test_hung_agent_is_killed_then_verified(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    solve = """
        echo started > /app/started
        sleep 300 &
        while true; do date +%s%N > /app/alive; sleep 0.1; done
    """
    # The verifier checks that no process of the agent survived the timeout.
    test = """
        before=$(cat /app/alive); sleep 0.5; after=$(cat /app/alive)
        survivors=$(for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c -e '[s]leep 300' -e '[s]olve.sh')
        echo "before=$before after=$after survivors=$survivors"
        if [ -f /app/started ] && [ "$before" = "$after" ] && [ "$survivors" = 0 ]; then
          echo 1 > /logs/verifier/reward.txt
        else
          echo 0 > /logs/verifier/reward.txt
        fi
    """
    toml = "[agent]\ntimeout_sec = 2.0\n[verifier]\ntimeout_sec = 30.0\n"
    started = time.monotonic()
    result = run_task(
        docker_runtime,
        make_task(tmp_path, "agent-hang", solve=solve, test=test, toml=toml),
        tmp_path / "trials",
    )
    assert time.monotonic() - started < 20
    assert result.exception_type == "AgentTimeoutError"
    # Harbor's policy: an agent timeout is still graded and its reward is valid.
    assert result.reward_valid and result.reward == 1.0, (
        trial_dir(tmp_path / "trials", result) / "verifier" / "test-stdout.txt"
    ).read_text()


@pytest.mark.quiet_engine  # a wall-clock bound on engine work
def test_hung_verifier_times_out_without_reward(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    toml = "[agent]\ntimeout_sec = 30.0\n[verifier]\ntimeout_sec = 2.0\n"
    task = make_task(
        tmp_path, "verifier-hang", test="sleep 300; echo 1 > /logs/verifier/reward.txt", toml=toml
    )
    started = time.monotonic()
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert time.monotonic() - started < 20
    assert result.exception_type == "VerifierTimeoutError"
    assert result.verifier_result is None and not result.reward_valid


def test_nonzero_solve_exit_is_recorded_and_still_verified(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    task = make_task(
        tmp_path,
        "solve-exit-7",
        solve="echo done > /app/done; exit 7",
        test="[ -f /app/done ] && echo 1 > /logs/verifier/reward.txt",
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None and result.reward == 1.0
    assert (
        trial_dir(tmp_path / "trials", result) / "agent" / "exit-code.txt"
    ).read_text().strip() == "7"


def test_planted_reward_is_ignored(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    solve = """
        echo '{"reward": 1.0}' > /logs/verifier/reward.json
        echo 1 > /logs/verifier/reward.txt
    """
    task = make_task(tmp_path, "plant", solve=solve, test="echo 0 > /logs/verifier/reward.txt")
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.verifier_result is not None
    assert result.verifier_result.rewards == {"reward": 0.0}


def test_escaping_symlink_is_refused(tmp_path: Path) -> None:
    task = make_task(tmp_path, "symlink")
    (tmp_path / "outside.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (task / "tests" / "test.sh").unlink()
    (task / "tests" / "test.sh").symlink_to(tmp_path / "outside.sh")
    with pytest.raises(UnsafeTaskPathError, match=r"tests/test.sh.*outside the task"):
        load_task(task)


def test_limits_labels_and_no_new_privileges(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    toml = """
        [agent]
        timeout_sec = 30.0
        [environment]
        cpus = 0.5
        memory_mb = 300
        network_mode = "no-network"
    """
    seen: dict[str, object] = {}
    task = make_task(tmp_path, "limits", solve="sleep 1", toml=toml)

    import docker

    client = docker.from_env()

    def on_phase(phase: str) -> None:
        if phase == "agent":
            (container,) = client.containers.list(filters={"label": f"{LABEL_TRIAL}={trial.name}"})
            seen["host"] = container.attrs["HostConfig"]
            seen["entrypoint"] = container.attrs["Config"]["Entrypoint"]
            seen["labels"] = container.labels

    request = TrialRequest(TrialSpec(task=load_task(task), trials_dir=tmp_path / "t"))
    trial = Trial(docker_runtime, request, on_phase=on_phase)
    result = trial.run()
    assert result.exception_info is None
    host = seen["host"]
    assert isinstance(host, dict)
    # The runtime's init (tini under setpriv), not the engine's --init; before it, the
    # command server's launcher (the runtime's Python), which forks it and becomes the init.
    assert not host.get("Init")
    entrypoint = seen["entrypoint"]
    assert isinstance(entrypoint, list)
    assert entrypoint[0] == RUNTIME_PYTHON and "--then" in entrypoint
    assert entrypoint[entrypoint.index("--then") + 1 :] == list(INIT_COMMAND)
    assert host["NanoCpus"] == 500_000_000
    assert host["Memory"] == 300 * 1024 * 1024
    assert host["PidsLimit"] and host["PidsLimit"] > 0
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["NetworkMode"] == "none"
    labels = seen["labels"]
    assert isinstance(labels, dict)
    assert (
        labels["harbor-exec.task"] == "limits"
        and labels["harbor-exec.owner"] == docker_runtime.owner
    )
    assert not client.containers.list(all=True, filters={"label": f"{LABEL_TRIAL}={trial.name}"})
    client.close()


def runs_in(runtime: DockerRuntime, container_id: str | None, command: str) -> bool:
    """Whether a process of ``command`` runs in the container (as the engine sees it)."""
    if container_id is None:
        return False
    processes = runtime._api.top(container_id).get("Processes") or []
    return any(command in " ".join(process) for process in processes)


@pytest.mark.quiet_engine  # a wall-clock bound on engine work
def test_cancel_removes_the_container_within_a_second(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    import threading

    task = make_task(
        tmp_path, "cancel-me", solve="sleep 300", toml="[agent]\ntimeout_sec = 120.0\n"
    )
    running = threading.Event()
    trial = Trial(
        docker_runtime,
        TrialRequest(TrialSpec(task=load_task(task), trials_dir=tmp_path / "t")),
        on_phase=lambda phase: running.set() if phase == "agent" else None,
    )
    results: list[TrialResult] = []
    worker = threading.Thread(target=lambda: results.append(trial.run()))
    worker.start()
    assert running.wait(30)
    assert wait_until(lambda: runs_in(docker_runtime, trial.container_id, "sleep 300"), 30)
    started = time.monotonic()
    trial.cancel()
    trial.cancel()  # idempotent
    worker.join(10)
    assert time.monotonic() - started < 1.5
    assert results and results[0].exception_type == "CancelledError"
    assert not docker_runtime.our_containers(owner=docker_runtime.owner)


def test_reaper_removes_containers_of_dead_owners(docker_runtime: DockerRuntime) -> None:
    from harbor_exec.sandbox.runtime import ContainerSpec

    dead = DockerRuntime(owner=f"{docker_runtime.owner.rsplit('/', 2)[0]}/999999/1")
    container = dead.create(
        ContainerSpec(image="debian:bookworm-slim", name="hx-orphan-test", labels={})
    )
    live = docker_runtime.create(
        ContainerSpec(image="debian:bookworm-slim", name="hx-live-test", labels={})
    )
    try:
        reaped = docker_runtime.reap_orphans()
        assert "hx-orphan-test" in reaped
        assert "hx-live-test" not in reaped
    finally:
        docker_runtime.remove(container)
        docker_runtime.remove(live)
        dead.close()


def test_non_root_users_and_an_image_without_tar(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    """The fallbacks of the one-exec transfers: the archive API does the uploads."""
    toml = """
        [agent]
        timeout_sec = 30.0
        user = "nobody"
        [verifier]
        timeout_sec = 30.0
        user = "nobody"
    """
    solve = 'echo "$(id -un)" > /logs/agent/who; echo 1 > /tmp/solved'
    test = '[ "$(cat /logs/agent/who)" = nobody ] && [ "$(id -un)" = nobody ] && [ -f /tmp/solved ] && echo 1 > /logs/verifier/reward.txt'
    result = run_task(
        docker_runtime,
        make_task(tmp_path, "nobody", solve=solve, test=test, toml=toml),
        tmp_path / "trials",
    )
    assert result.exception_info is None and result.reward == 1.0
    no_tar = make_task(
        tmp_path,
        "no-tar",
        dockerfile="FROM debian:bookworm-slim\nRUN rm -f /usr/bin/tar /bin/tar\nWORKDIR /app\n",
        solve="echo done > /app/done",
        test="[ -f /app/done ] && ! command -v tar && echo 1 > /logs/verifier/reward.txt",
    )
    result = run_task(docker_runtime, no_tar, tmp_path / "trials")
    assert result.exception_info is None and result.reward == 1.0
    assert (tmp_path / "trials" / result.trial_name / "verifier" / "test-stdout.txt").is_file()


HEALTHCHECK_TOML = """
[agent]
timeout_sec = 30.0

[verifier]
timeout_sec = 30.0

[environment.healthcheck]
command = "n=$(cat /tmp/probes 2>/dev/null || echo 0); echo $((n + 1)) > /tmp/probes; [ $n -ge {ready_after} ]"
interval_sec = 0.1
retries = 3
"""


@pytest.mark.parametrize(("ready_after", "passes"), [(2, True), (5, False)])
def test_healthcheck_runs_in_the_container_before_the_agent(
    docker_runtime: DockerRuntime, tmp_path: Path, ready_after: int, passes: bool
) -> None:
    """Healthy on the third probe: the agent runs after it (it sees 3 probes). Never
    healthy within 3 retries: HealthcheckError, neither agent nor verifier ran."""
    task = make_task(
        tmp_path,
        f"healthcheck-{ready_after}",
        toml=HEALTHCHECK_TOML.format(ready_after=ready_after),
        solve="cp /tmp/probes /app/probes-seen",
        test='[ "$(cat /app/probes-seen)" = 3 ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt',
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    if passes:
        assert result.exception_info is None, result.exception_info
        assert result.verifier_result is not None
        assert result.verifier_result.rewards == {"reward": 1.0}
    else:
        assert result.exception_info is not None
        assert result.exception_info.exception_type == "HealthcheckError"
        assert result.agent_execution is None and result.verifier is None


def test_a_collect_hook_snapshots_state_for_the_separate_verifier(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    """``[[verifier.collect]]`` runs in the agent's container after the agent; what it
    wrote is a declared artifact, which reaches the separate verifier."""
    toml = """
artifacts = ["/srv/snapshot.txt"]

[agent]
timeout_sec = 30.0

[verifier]
timeout_sec = 30.0
environment_mode = "separate"

[[verifier.collect]]
command = "mkdir -p /srv && wc -l < /app/state.txt > /srv/snapshot.txt"
"""
    task = make_task(
        tmp_path,
        "collect-hook",
        toml=toml,
        solve="printf 'a\\nb\\nc\\n' > /app/state.txt",
        test='[ "$(cat /srv/snapshot.txt)" = 3 ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt',
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None, result.exception_info
    assert result.verifier_result is not None
    assert result.verifier_result.rewards == {"reward": 1.0}
    kept = trial_dir(tmp_path / "trials", result) / "artifacts" / "srv" / "snapshot.txt"
    assert kept.read_text() == "3\n"
