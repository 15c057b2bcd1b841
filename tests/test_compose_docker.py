"""Compose environments against a real Docker engine: the main service plus sidecars
on a network of their own per trial, hardened like the trial container, and nothing
left behind (after the trial, a cancel, a ``kill -9`` and the reaper)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import docker
import pytest

from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import DROPPED_CAPABILITIES, LABEL_MANAGED, LABEL_TRIAL
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import Trial, TrialRequest
from tests.server_utils import wait_until
from tests.task_factory import make_compose_task as compose_task
from tests.trial_utils import run_task

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]


def ours(trial: str) -> list[str]:
    """Containers, networks and volumes labelled with ``trial``."""
    client = docker.from_env()
    label = {"label": [f"{LABEL_MANAGED}=true", f"{LABEL_TRIAL}={trial}"]}
    found = [f"container {c['Id'][:12]}" for c in client.api.containers(all=True, filters=label)]
    found += [f"network {n['Name']}" for n in client.api.networks(filters=label)]
    found += [f"volume {v['Name']}" for v in client.api.volumes(filters=label).get("Volumes") or []]
    client.close()
    return found


def test_oracle_earns_1_through_its_sidecar_and_nothing_is_left(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    task = compose_task(
        tmp_path,
        "compose-ok",
        solve='echo 42 > /app/expected; echo "$FROM_COMPOSE" > /logs/agent/from-compose',
        extra="""
    volumes:
      - cache:/cache
volumes:
  cache:
""",
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None, result.exception_info
    assert result.verifier_result is not None
    assert result.verifier_result.rewards == {"reward": 1.0}
    # The Harbor variable reached main's environment through the compose file.
    out = tmp_path / "trials" / result.trial_name
    assert (out / "agent" / "from-compose").read_text().startswith("harbor-exec/env:")
    assert ours(result.trial_name) == []


def test_a_broken_sidecar_earns_0(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    task = compose_task(tmp_path, "compose-broken", command="exec sleep 600", healthcheck=False)
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None, result.exception_info
    assert result.verifier_result is not None
    assert result.verifier_result.rewards == {"reward": 0.0}
    assert ours(result.trial_name) == []


def test_compose_with_a_dockerfile_runs_its_compose_file_and_main_can_be_built_elsewhere(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    """Both a Dockerfile and a compose file: the compose file runs (the sidecar
    answers); and a main built from ``build: ./main`` without environment/Dockerfile."""
    for name, dockerfile in (("compose-both", True), ("compose-main-dir", False)):
        task = compose_task(tmp_path, name, dockerfile=dockerfile)
        result = run_task(docker_runtime, task, tmp_path / "trials")
        assert result.verifier_result is not None, result.exception_info
        assert result.verifier_result.rewards == {"reward": 1.0}, name


def test_sidecar_hardening_limits_labels_and_order(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    """While the agent runs: the sidecar was healthy before main started
    (depends_on service_healthy), runs under the init with the trial's hardening,
    limits and labels, on an internal-or-bridge network of the trial's own."""
    solve = "echo 42 > /app/expected; sleep 20"
    task = compose_task(tmp_path, "compose-inspect", solve=solve)
    trial = Trial(
        docker_runtime, TrialRequest(TrialSpec(task=load_task(task), trials_dir=tmp_path / "t"))
    )
    worker = threading.Thread(target=trial.run)
    worker.start()
    client = docker.from_env()
    try:
        label = {"label": [f"{LABEL_TRIAL}={trial.name}"]}
        assert wait_until(lambda: len(client.api.containers(filters=label)) == 2, timeout=60)
        containers = [
            client.api.inspect_container(c["Id"]) for c in client.api.containers(filters=label)
        ]
        by_kind = {c["Config"]["Labels"]["harbor-exec.kind"]: c for c in containers}
        sidecar, main = by_kind["sidecar"], by_kind["trial"]
        host = sidecar["HostConfig"]
        assert set(DROPPED_CAPABILITIES) <= set(host["CapDrop"])
        assert "no-new-privileges" in host["SecurityOpt"]
        assert any(opt.startswith("seccomp=") for opt in host["SecurityOpt"])
        assert host["PidsLimit"] and host["Memory"] and host["NanoCpus"]
        assert host["Memory"] == host["MemorySwap"]
        assert host["NetworkMode"] not in ("host", "default", "bridge")
        assert sidecar["Path"].endswith("/bin/tini")  # the runtime's init as PID 1
        assert sidecar["State"]["Health"]["Status"] == "healthy"
        # Started in order: the sidecar was healthy before main was even created.
        log = sidecar["State"]["Health"]["Log"]
        assert log and log[0]["End"] < main["Created"]
        network = host["NetworkMode"]
        assert main["HostConfig"]["NetworkMode"] == network
        assert "db" in sidecar["NetworkSettings"]["Networks"][network]["Aliases"]
        net = client.api.inspect_network(network)
        assert net["Labels"][LABEL_TRIAL] == trial.name and net["Driver"] == "bridge"
    finally:
        trial.cancel()
        worker.join(30)
        client.close()
    assert ours(trial.name) == []


@pytest.mark.quiet_engine  # a wall-clock bound on engine work
def test_cancel_mid_agent_leaves_nothing(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    task = compose_task(tmp_path, "compose-cancel", solve="sleep 60")
    trial = Trial(
        docker_runtime, TrialRequest(TrialSpec(task=load_task(task), trials_dir=tmp_path / "t"))
    )
    results: list[TrialResult] = []
    worker = threading.Thread(target=lambda: results.append(trial.run()))
    worker.start()
    client = docker.from_env()
    label = {"label": [f"{LABEL_TRIAL}={trial.name}", "harbor-exec.kind=trial"]}
    try:
        assert wait_until(lambda: bool(client.api.containers(filters=label)), timeout=60)
    finally:
        client.close()
    started = time.monotonic()
    trial.cancel()
    worker.join(30)
    assert time.monotonic() - started < 5
    assert results and results[0].exception_type == "CancelledError"
    assert ours(trial.name) == []


_KILLED_TRIAL = """
import sys
from pathlib import Path
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
run_trial(DockerRuntime(), TrialRequest(TrialSpec(task=load_task(sys.argv[1]),
          trials_dir=Path(sys.argv[2]), trial_name=sys.argv[3])))
"""


def test_kill_9_then_the_reaper_removes_sidecars_network_and_volumes(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    task = compose_task(
        tmp_path,
        "compose-kill",
        solve="sleep 120",
        extra="""
    volumes:
      - cache:/cache
volumes:
  cache:
""",
    )
    name = "compose-kill__killme"
    process = subprocess.Popen(
        [sys.executable, "-c", _KILLED_TRIAL, str(task), str(tmp_path / "t"), name],
        cwd=Path(__file__).resolve().parent.parent,
    )
    client = docker.from_env()
    label = {"label": [f"{LABEL_TRIAL}={name}", "harbor-exec.kind=trial"]}
    try:
        assert wait_until(lambda: bool(client.api.containers(filters=label)), timeout=90)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        left = ours(name)
        assert any(item.startswith("network") for item in left)
        assert any(item.startswith("volume") for item in left)
        assert len([item for item in left if item.startswith("container")]) == 2
        docker_runtime.reap_orphans()
        assert ours(name) == []
    finally:
        if process.poll() is None:
            process.kill()
        client.close()


def test_a_separate_verifier_gets_sidecars_of_its_own(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    """Separate mode (Harbor 0.26 starts a new project from environment/): the
    verifier's fresh container reaches a fresh sidecar; the agent's output reaches it
    only as a declared artifact."""
    toml = """
        artifacts = ["/app/expected"]
        [agent]
        timeout_sec = 30.0
        [verifier]
        timeout_sec = 30.0
        environment_mode = "separate"
    """
    task = compose_task(tmp_path, "compose-separate", toml=toml)
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.verifier_environment_mode == "separate"
    assert result.exception_info is None, result.exception_info
    assert result.verifier_result is not None
    assert result.verifier_result.rewards == {"reward": 1.0}
    assert ours(result.trial_name) == []


def test_a_no_network_task_reaches_its_sidecar_on_an_internal_network(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    """``no-network`` (which Harbor 0.26 refuses here): the trial's network is internal
    (no route out: ``tests/test_compose.py`` checks the flag) and the sidecar answers."""
    toml = """
        [agent]
        timeout_sec = 30.0
        [verifier]
        timeout_sec = 30.0
        [environment]
        network_mode = "no-network"
    """
    solve = """
        echo 42 > /app/expected
        getent hosts db > /logs/agent/db.txt
        true
    """
    task = compose_task(tmp_path, "compose-offline", toml=toml, solve=solve)
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None, result.exception_info
    assert result.verifier_result is not None
    assert result.verifier_result.rewards == {"reward": 1.0}
    agent = tmp_path / "trials" / result.trial_name / "agent"
    assert "db" in (agent / "db.txt").read_text()
    assert ours(result.trial_name) == []


def test_a_sidecar_that_exits_fails_the_environment_and_leaves_nothing(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    task = compose_task(tmp_path, "compose-exits", command="exit 3")
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_type == "EnvironmentStartError"
    assert result.exception_info is not None
    assert "'db'" in result.exception_info.exception_message
    assert ours(result.trial_name) == []


HARBOR = Path(__file__).resolve().parent.parent / ".venv-harbor" / "bin" / "harbor"


def test_harbor_and_harbor_exec_agree_on_compose_rewards(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    """Harbor 0.26 runs the same compose tasks (``docker compose``) here: its oracle's
    reward and exception agree with ours for a working and a broken sidecar."""
    if not HARBOR.exists():
        pytest.fail(".venv-harbor is missing: run scripts/setup.sh", pytrace=False)
    dataset = tmp_path / "ds"
    compose_task(dataset, "hx-sbs-compose-ok")
    compose_task(dataset, "hx-sbs-compose-broken", command="exec sleep 600", healthcheck=False)
    jobs = tmp_path / "jobs"
    done = subprocess.run(
        [
            str(HARBOR),
            "run",
            "-p",
            str(dataset),
            "-a",
            "oracle",
            "-n",
            "2",
            "-y",
            "-q",
            "-o",
            str(jobs),
            "--job-name",
            "harbor",
        ],
        env={**os.environ, "HARBOR_TELEMETRY": "0"},
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    try:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        theirs = {}
        for result in (jobs / "harbor").glob("*/result.json"):
            data = json.loads(result.read_text())
            rewards = (data.get("verifier_result") or {}).get("rewards")
            theirs[data["task_name"]] = (
                rewards,
                (data.get("exception_info") or {}).get("exception_type"),
            )
        mine = {}
        for task_dir in sorted(dataset.iterdir()):
            ran = run_task(docker_runtime, task_dir, tmp_path / "trials")
            mine_rewards = ran.verifier_result.rewards if ran.verifier_result else None
            mine[ran.task_name] = (mine_rewards, ran.exception_type)
        assert theirs == mine
        assert mine["hx-sbs-compose-ok"] == ({"reward": 1.0}, None)
        assert mine["hx-sbs-compose-broken"] == ({"reward": 0.0}, None)
    finally:
        listed = subprocess.run(
            ["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}"],
            capture_output=True,
            text=True,
            check=False,
        )
        tags = [t for t in listed.stdout.split() if t.startswith("hx-sbs-compose")]
        if tags:
            subprocess.run(["docker", "image", "rm", *tags], capture_output=True, check=False)
