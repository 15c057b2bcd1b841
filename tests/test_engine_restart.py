"""A Docker daemon restart under a running server, on a daemon of the test's own.

The test starts a second dockerd (own socket, data root, exec root and pidfile, its own
network namespace, no bridge and no iptables, so it leaves the shared daemon's
networking alone), loads the
base image into it from the main daemon, runs two rollouts there through the real
server, stops that daemon and starts it again. It never touches the shared daemon."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.executors.local import LocalExecutor
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_MANAGED, LABEL_TRIAL
from harbor_exec.server import create_rollout_server
from tests.server_utils import runs_command, serve, wait_until
from tests.task_factory import make_task

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]

LEASE = "X-Osmosis-Rollout-Lease"
BASE_IMAGE = "debian:bookworm-slim"


class OwnDaemon:
    """A private dockerd, bounded in time, torn down completely."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "docker.sock"
        self.url = f"unix://{self.socket}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            pytest.fail("this test needs dockerd on PATH", pytrace=False)
        log = open(self.root / "dockerd.log", "ab")  # noqa: SIM115 - closed with the process
        unshare = shutil.which("unshare")
        if unshare is None:
            pytest.fail("this test needs unshare (util-linux) on PATH", pytrace=False)
        self.process = subprocess.Popen(
            [
                # A network namespace of its own: a dockerd started with --bridge=none
                # deletes the host's docker0 (removeDefaultBridgeInterface), which would
                # break the shared daemon's bridge networking for everyone else.
                unshare, "--net", "--",
                dockerd,
                "--host", self.url,
                "--data-root", str(self.root / "data"),
                "--exec-root", str(self.root / "exec"),
                "--pidfile", str(self.root / "dockerd.pid"),
                "--bridge=none", "--iptables=false", "--ip6tables=false",
            ],
            stdout=log, stderr=log,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.root / "dockerd.log").read_text()[-3000:]
            try:
                client = docker.DockerClient(base_url=self.url, timeout=5)
                client.ping()
                client.close()
                return
            except Exception:
                time.sleep(0.2)
        raise AssertionError("the private dockerd did not come up")

    def stop(self, timeout: float = 60.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.url, timeout=30)


@pytest.fixture
def own_daemon() -> Iterator[OwnDaemon]:
    # A short path: unix socket paths are limited to 108 bytes.
    root = Path(f"/tmp/hx-dockerd-{uuid.uuid4().hex[:8]}")
    root.mkdir()
    daemon = OwnDaemon(root)
    try:
        daemon.start()
        main = docker.from_env(timeout=120)
        data = b"".join(main.api.get_image(BASE_IMAGE))
        main.close()
        client = daemon.client()
        client.images.load(data)
        client.close()
        yield daemon
    finally:
        daemon.stop()
        subprocess.run(["umount", "-R", str(root / "exec")], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


def poll(url: str, rollout_id: str, token: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/rollout/{rollout_id}/result", headers={LEASE: token}, timeout=40)
    return dict(answer.json())


def test_dockerd_restart_under_serve(own_daemon: OwnDaemon, tmp_path: Path) -> None:
    # no-network: the private daemon has no bridge (it must not touch the host's).
    task = make_task(
        tmp_path / "tasks",
        "engine-restart",
        solve="sleep 30",
        toml='[environment]\nnetwork_mode = "no-network"\n[agent]\ntimeout_sec = 120.0\n',
        dockerfile=f"FROM {BASE_IMAGE}\nWORKDIR /app\n",
    )
    fast = make_task(
        tmp_path / "tasks",
        "engine-fast",
        toml='[environment]\nnetwork_mode = "no-network"\n',
        dockerfile=f"FROM {BASE_IMAGE}\nWORKDIR /app\n",
    )
    runtime = DockerRuntime(base_url=own_daemon.url)
    backend = HarborBackend(
        tasks_dir=tmp_path / "tasks",
        task_mode="dataset",
        agent="oracle",
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        executor=LocalExecutor(runtime, reap_interval_sec=0.5),
    )
    app = create_rollout_server(
        backend=backend, artifact_root=tmp_path / "artifacts", result_wait_timeout_sec=5.0
    )

    def submit(rollout_id: str, task_id: str) -> httpx.Response:
        return httpx.post(
            f"{url}/rollout",
            json={
                "initial_messages": [],
                "rollout_id": rollout_id,
                "chat_completions_url": "http://127.0.0.1:9/v1",
                "metadata": {"harbor_task_id": task_id},
            },
            timeout=10,
        )

    with serve(app) as url:
        tokens = {}
        for rollout_id in ("slow-a", "slow-b"):
            admitted = submit(rollout_id, task.name)
            assert admitted.status_code == 202, admitted.text
            tokens[rollout_id] = admitted.json()["polling_lease_token"]
        # The trials' containers (not the package cache's build gateway, also ours).
        labels = {"label": [f"{LABEL_MANAGED}=true", LABEL_TRIAL]}
        client = own_daemon.client()
        assert wait_until(
            lambda: len(client.containers.list(filters=labels)) == 2, timeout=60, interval=0.2
        ), "the two trials never started"
        assert wait_until(
            lambda: all(
                runs_command(c, "sleep 30") for c in client.containers.list(filters=labels)
            ),
            timeout=60,
        ), "the two trials never reached their agent phase"
        client.close()

        stopped_at = time.monotonic()
        own_daemon.stop()
        finals = {}
        for rollout_id, token in tokens.items():
            # The engine's own shutdown takes longer with the warm pool's containers
            # (one may be in the making): the trials end once it has gone.
            deadline = stopped_at + 20
            while time.monotonic() < deadline:
                body = poll(url, rollout_id, token)
                if body["status"] in ("success", "failure", "cancelled"):
                    finals[rollout_id] = body
                    break
                time.sleep(0.1)
        assert set(finals) == {"slow-a", "slow-b"}, "rollouts did not end within 20 s"
        for body in finals.values():
            assert body["status"] == "failure"
            assert body["err_category"] == "internal_error", body
            assert body["err_message"].startswith(
                f"Docker engine at {own_daemon.url} stopped answering"
            )
            assert "Connection aborted" not in body["err_message"]

        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 200
        assert health.json()["docker"] == "unavailable"
        assert health.json()["lifecycle"]["accepting_rollouts"] is False
        refused = submit("while-down", fast.name)
        assert refused.status_code == 503 and "Docker engine" in refused.json()["detail"]
        for trial in (tmp_path / "trials").iterdir():
            assert (trial / "result.json").is_file(), f"{trial} has no result.json"

        own_daemon.start()
        assert wait_until(
            lambda: httpx.get(f"{url}/health").json()["lifecycle"]["accepting_rollouts"],
            timeout=15,
            interval=0.2,
        ), "the server did not notice the engine came back"
        admitted = submit("after", fast.name)
        assert admitted.status_code == 202, admitted.text
        token = admitted.json()["polling_lease_token"]
        assert wait_until(
            lambda: poll(url, "after", token)["status"] == "success", timeout=60, interval=0.2
        )
        client = own_daemon.client()
        assert wait_until(
            lambda: client.containers.list(all=True, filters=labels) == [], timeout=15, interval=0.2
        ), [c.name for c in client.containers.list(all=True, filters=labels)]
        client.close()
    runtime.close()
