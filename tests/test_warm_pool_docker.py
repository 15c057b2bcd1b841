"""Warm containers on the real engine (``harbor_exec.trial.warm``), against an agent that
tries to leave something for the next trial.

Every oracle ``solve.sh`` records what it finds (its container's id, the relay socket
it was given, what an earlier agent left in ``/tmp`` and in the process table), then
leaves a file, a detached process and a rewritten ``/etc/hosts`` behind, and waits for
the honest verifier (reward 0). Trials run one after another on one pool, in the shared
and the separate verifier mode: after the second, each takes a container the pool made
ahead; each sees its own rollout's socket and nothing of another's or of an earlier
agent's; no container serves two trials; the verdict is the honest 0 every time. The
pool's idle containers age out and are gone once it closes. (A server killed with
SIGKILL: its warm containers are reaped by the next one, ``tests/test_restart.py``.)
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from harbor_exec.container.exchange import RELAY_DIR
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_MANAGED, LABEL_OWNER, Mount
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
from harbor_exec.trial.warm import LABEL_WARM, WarmPool
from tests.server_utils import wait_until
from tests.task_factory import make_task

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]

LEAVE_BEHIND = """
mkdir -p /logs/agent
cat /etc/hostname > /logs/agent/container.txt
stat -c %i /run/harbor-exec/relay/relay.sock > /logs/agent/relay.txt
ls -A /run/harbor-exec/relay | wc -l >> /logs/agent/relay.txt
ls -A /tmp > /logs/agent/tmp.txt
grep -l 'left[-]behind' /proc/[0-9]*/cmdline 2>/dev/null | wc -l > /logs/agent/procs.txt
grep -c poisoned /etc/hosts > /logs/agent/hosts.txt
echo left > /tmp/left-behind-by-an-earlier-agent
echo "127.0.0.1 poisoned" >> /etc/hosts
setsid nohup sh -c 'exec -a left-behind sleep 600' > /dev/null 2>&1 &
echo 1 > /logs/verifier/reward.txt 2>/dev/null || true
"""
HONEST_TEST = "echo 0 > /logs/verifier/reward.txt\n"


def relay_socket(name: str) -> Path:
    """A rollout's relay directory with a listening socket, where the executor makes one."""
    root = Path("/tmp/hx-relay")
    root.mkdir(mode=0o711, exist_ok=True)
    directory = root / f"t-{name}-{secrets.token_hex(3)}"
    directory.mkdir(mode=0o755)
    return directory


@pytest.fixture
def pool(docker_runtime: DockerRuntime) -> Iterator[WarmPool]:
    pool = WarmPool(docker_runtime)
    yield pool
    pool.close()


def warm_on_engine(runtime: DockerRuntime) -> list[str]:
    """This process's warm containers on the engine, idle or claimed."""
    import docker

    labels = [f"{LABEL_MANAGED}=true", f"{LABEL_WARM}=true", f"{LABEL_OWNER}={runtime.owner}"]
    # The engine's list alone: the SDK's full one inspects each, and the pool may remove
    # an idle one meanwhile (NotFound).
    listed = docker.from_env().containers.list(all=True, filters={"label": labels}, sparse=True)
    return [c.id for c in listed]


@pytest.mark.parametrize("verifier", ["shared", "separate"])
def test_each_trial_gets_a_fresh_container_and_only_its_own_rollouts_socket(
    docker_runtime: DockerRuntime, pool: WarmPool, tmp_path: Path, verifier: str
) -> None:
    mode = '[verifier]\nenvironment_mode = "separate"\n' if verifier == "separate" else ""
    task = load_task(
        make_task(
            tmp_path,
            f"leave-behind-{verifier}",
            solve=LEAVE_BEHIND,
            test=HONEST_TEST,
            toml=f'[agent]\ntimeout_sec = 60.0\n{mode}[environment]\nnetwork_mode = "no-network"\n',
        )
    )
    policy = SandboxPolicy(warm_containers=2)
    seen: list[dict[str, str]] = []
    for n in range(3):
        relay = relay_socket(str(n))
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(relay / "relay.sock"))
        listener.listen(1)
        try:
            spec = TrialSpec(
                task=task, trials_dir=tmp_path / "trials", policy=policy, rollout_id=f"r-{n}"
            )
            request = TrialRequest(
                spec, mounts=[Mount(str(relay), RELAY_DIR, read_only=True)], warm_pool=pool
            )
            result = run_trial(docker_runtime, request)
            inode = os.stat(relay / "relay.sock").st_ino
        finally:
            listener.close()
        assert result.exception_info is None, result.exception_info
        assert result.verifier_result is not None
        assert result.verifier_result.rewards == {"reward": 0.0}  # the honest verdict
        agent = Path(result.trial_uri.removeprefix("file://")) / "agent"
        seen.append({f.name: f.read_text().strip() for f in agent.iterdir() if f.is_file()})
        assert seen[-1]["relay.txt"].split() == [str(inode), "1"], seen[-1]
        assert seen[-1]["tmp.txt"] == "" and seen[-1]["procs.txt"] == "0", seen[-1]
        assert seen[-1]["hosts.txt"] == "0", seen[-1]
        if n == 1:  # asked for twice: the next trial's container is made ahead
            assert wait_until(lambda: pool.stats().idle >= 1, timeout=60)
    containers = [s["container.txt"] for s in seen]
    assert len(set(containers)) == 3, containers  # no container served two trials
    stats = pool.stats()
    assert stats.hits >= 1, stats  # the third trial's agent container, made ahead
    pool.close()
    assert warm_on_engine(docker_runtime) == []


def test_idle_warm_containers_age_out(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    task = load_task(
        make_task(tmp_path, "ages-out", toml='[environment]\nnetwork_mode = "no-network"\n')
    )
    pool = WarmPool(docker_runtime)
    try:
        policy = SandboxPolicy(warm_idle_sec=2.0)
        spec = TrialSpec(task=task, trials_dir=tmp_path / "trials", policy=policy)
        for _ in range(2):  # asked for twice: one is made ahead of the next
            result = run_trial(docker_runtime, TrialRequest(spec, warm_pool=pool))
            assert result.exception_info is None, result.exception_info
        assert wait_until(lambda: warm_on_engine(docker_runtime) != [], timeout=60)
        assert wait_until(lambda: warm_on_engine(docker_runtime) == [], timeout=30)
        assert pool.stats().expired >= 1 and pool.stats().idle == 0
    finally:
        pool.close()
