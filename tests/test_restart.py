"""A restarted server loses nothing it accepted: ``serve --data-dir`` keeps every
admitted rollout in SQLite; after a SIGKILL the finished result is served again
with the old lease token and the running one ends as ``internal_error``. Without
``--data-dir`` each port has its own default data dir."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.sandbox.runtime import LABEL_MANAGED, LABEL_OWNER, LABEL_ROLLOUT
from harbor_exec.server.store import (
    DB_NAME,
    RESTARTED_MESSAGE,
    DataDirLockedError,
    RolloutStore,
    default_data_dir,
)
from harbor_exec.trial.warm import LABEL_WARM
from tests.server_utils import (
    CHAT_URL,
    PROMPT,
    free_port,
    local_app,
    runs_command,
    serve,
    wait_until,
)
from tests.task_factory import make_task

SLEEPY_AGENT = "sleep 120"

ROOT = Path(__file__).resolve().parent.parent
LEASE = "X-Osmosis-Rollout-Lease"


LOCAL_BACKEND = (
    "--workflow", "tests.server_utils:ScriptedWorkflow",
    "--grader", "tests.server_utils:ExactMatchGrader",
)  # fmt: skip


def start(
    data_dir: Path | None, artifacts: Path, port: int, backend: tuple[str, ...] = LOCAL_BACKEND
) -> subprocess.Popen[bytes]:
    """``harbor-exec serve`` on ``port`` (without ``--data-dir`` when ``data_dir`` is
    None), once its ``/health`` answers."""
    data_dir_option = () if data_dir is None else ("--data-dir", str(data_dir))
    command = [
        sys.executable, "-m", "harbor_exec.cli", "serve", *backend,
        "--port", str(port), *data_dir_option, "--artifact-root", str(artifacts),
    ]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy()
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(process.stderr.read().decode() if process.stderr else "")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise AssertionError("serve did not come up")


def stored_status(data: Path, rollout_id: str) -> str | None:
    """The status the server's store has written for ``rollout_id`` in the data dir
    ``data`` (None: no row yet; the store writes in batches)."""
    database = data / DB_NAME
    if not database.exists():
        return None
    with contextlib.closing(sqlite3.connect(database, timeout=5)) as connection:
        row = connection.execute("SELECT status FROM rollouts WHERE id = ?", (rollout_id,))
        found = row.fetchone()
    return None if found is None else str(found[0])


def submit(url: str, rollout_id: str, **metadata: Any) -> str:
    """Admits a rollout and returns its lease token."""
    response = httpx.post(
        f"{url}/rollout",
        json={
            "initial_messages": PROMPT,
            "rollout_id": rollout_id,
            "chat_completions_url": CHAT_URL,
            "label": "4",
            "llm_api_key": "sk-never-on-disk",
            "metadata": metadata,
        },
    )
    assert response.status_code == 202, response.text
    return str(response.json()["polling_lease_token"])


def result(url: str, rollout_id: str, token: str) -> httpx.Response:
    return httpx.get(f"{url}/rollout/{rollout_id}/result", headers={LEASE: token}, timeout=10)


@pytest.mark.long(3)
def test_sigkilled_server_serves_finished_and_fails_running(tmp_path: Path) -> None:
    data, artifacts = tmp_path / "data", tmp_path / "artifacts"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first = start(data, artifacts, port)
    try:
        done_token = submit(url, "done-1")
        assert wait_until(
            lambda: result(url, "done-1", done_token).json()["status"] == "success", timeout=10
        )
        running_token = submit(url, "running-1", sleep=60)
        assert wait_until(
            lambda: httpx.get(f"{url}/rollout/running-1/status").json()["status"] == "running"
        )
        # Its running state has reached the disk (the store writes in batches).
        assert wait_until(lambda: stored_status(data, "running-1") == "running")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)

    second = start(data, artifacts, port)
    try:
        finished = result(url, "done-1", done_token)
        assert finished.status_code == 200
        body = finished.json()
        assert body["status"] == "success" and body["sample"]["reward"] == 1.0
        assert result(url, "done-1", "wrong-token").status_code == 403
        lost = result(url, "running-1", running_token).json()
        assert lost["status"] == "failure"
        assert lost["err_category"] == "internal_error"
        assert lost["err_message"] == RESTARTED_MESSAGE
        # Still held: a retry must use a new id, as for any retained result.
        again = httpx.post(
            f"{url}/rollout",
            json={
                "initial_messages": PROMPT,
                "rollout_id": "done-1",
                "chat_completions_url": CHAT_URL,
            },
        )
        assert again.status_code == 409
        # One server per data dir.
        with pytest.raises(DataDirLockedError, match="in use by another harbor-exec server"):
            RolloutStore(data)
        other = subprocess.run(
            [sys.executable, "-m", "harbor_exec.cli", "serve", "--workflow",
             "tests.server_utils:ScriptedWorkflow", "--port", str(free_port()),
             "--data-dir", str(data)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert other.returncode == 2 and "in use by another harbor-exec server" in other.stderr
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=30)
    database = (data / "rollouts.sqlite3").read_bytes()
    wal = data / "rollouts.sqlite3-wal"
    if wal.exists():
        database += wal.read_bytes()
    assert b"sk-never-on-disk" not in database


def test_default_data_dir_is_one_per_port(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HARBOR_EXEC_DATA_DIR", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    state = tmp_path / ".local" / "state" / "harbor-exec" / "server"
    assert default_data_dir(8000) == state / "port-8000"
    assert default_data_dir(8001) == state / "port-8001"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_data_dir(8000) == tmp_path / "xdg" / "harbor-exec" / "server" / "port-8000"
    # Named explicitly, the dir is used as it is (like --data-dir).
    monkeypatch.setenv("HARBOR_EXEC_DATA_DIR", str(tmp_path / "mine"))
    assert default_data_dir(8000) == tmp_path / "mine"


@pytest.mark.long(4)
def test_servers_without_data_dir_keep_their_rollouts_per_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ``serve`` without ``--data-dir`` on different ports both start (each owns
    its port's default data dir); after both are SIGKILLed and restarted on the same
    ports, each serves its own rollout's result again, and only its own."""
    # The default is under test: no HARBOR_EXEC_DATA_DIR (conftest sets one), and a
    # home of the test's own instead of the real one.
    monkeypatch.delenv("HARBOR_EXEC_DATA_DIR", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    ports = [free_port()]
    while len(ports) < 2:
        if (port := free_port()) not in ports:
            ports.append(port)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    ids = [f"kept-on-{port}" for port in ports]
    databases = [
        tmp_path / "home/.local/state/harbor-exec/server" / f"port-{port}" for port in ports
    ]
    artifacts = tmp_path / "artifacts"

    def finished_and_stored(url: str, rollout_id: str, token: str, data: Path) -> bool:
        # Durable before the kill: the row is written (batches are 0.1 s apart).
        return (
            result(url, rollout_id, token).json()["status"] == "success"
            and stored_status(data, rollout_id) == "success"
        )

    servers: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            servers.append(start(None, artifacts, port))
        tokens = [submit(url, rollout_id) for url, rollout_id in zip(urls, ids, strict=True)]
        for stored in zip(urls, ids, tokens, databases, strict=True):
            assert wait_until(partial(finished_and_stored, *stored), timeout=10), stored
    finally:
        for server in servers:
            server.send_signal(signal.SIGKILL)
        for server in servers:
            server.wait(timeout=10)

    servers = []
    try:
        for port in ports:
            servers.append(start(None, artifacts, port))
        for url, rollout_id, token, other in zip(urls, ids, tokens, ids[::-1], strict=True):
            recovered = result(url, rollout_id, token)
            assert recovered.status_code == 200, recovered.text
            body = recovered.json()
            assert body["status"] == "success" and body["sample"]["reward"] == 1.0
            assert result(url, other, token).status_code == 404
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
        for server in servers:
            server.wait(timeout=30)


def test_retention_applies_across_restarts(tmp_path: Path) -> None:
    """A result whose retention ended while the server was down is gone (404)."""
    app = local_app(tmp_path, data_dir=tmp_path / "data", result_retention_sec=1.0)
    with serve(app) as url:
        token = submit(url, "short-lived")
        assert wait_until(lambda: result(url, "short-lived", token).json()["status"] == "success")
    rows = sqlite3.connect(tmp_path / "data" / "rollouts.sqlite3").execute(
        "SELECT id, status FROM rollouts"
    )
    assert list(rows) == [("short-lived", "success")]
    time.sleep(1.2)
    with serve(local_app(tmp_path, data_dir=tmp_path / "data", result_retention_sec=1.0)) as url:
        assert result(url, "short-lived", token).status_code == 404


@pytest.mark.docker
def test_sigkilled_harbor_server_serves_finished_and_reaps_running(
    tmp_path: Path, base_images: dict[str, str]
) -> None:
    """The same with HarborBackend: after the restart the running rollout's container
    (its owner is dead) is reaped and its trial directory is gone or a failed trial."""
    import docker

    tasks = tmp_path / "tasks"
    make_task(tasks, "quick")
    make_task(tasks, "sleepy", solve=SLEEPY_AGENT, toml="[agent]\ntimeout_sec = 300.0\n")
    data, artifacts, trials = tmp_path / "data", tmp_path / "artifacts", tmp_path / "trials"
    backend = (
        "--tasks-dir", str(tasks), "--task-mode", "dataset", "--agent", "oracle",
        "--trials-dir", str(trials),
    )  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    client = docker.from_env()

    def containers(rollout_id: str) -> list[Any]:
        """The rollout's containers, from the engine's list alone (sparse: the SDK's full
        list inspects each, and one removed meanwhile raised NotFound in CI)."""
        labels = [f"{LABEL_MANAGED}=true", f"{LABEL_ROLLOUT}={rollout_id}"]
        return list(client.containers.list(all=True, filters={"label": labels}, sparse=True))

    def warm_containers(server: subprocess.Popen[bytes]) -> list[Any]:
        """``server``'s warm containers (its owner label names its pid)."""
        labels = [f"{LABEL_MANAGED}=true", f"{LABEL_WARM}=true"]
        # The engine's list alone: the SDK's full one inspects each container, and one
        # another lane removes meanwhile raises NotFound.
        found = client.containers.list(all=True, filters={"label": labels}, sparse=True)
        return [
            c
            for c in found
            if f"/{server.pid}/" in (c.attrs.get("Labels") or {}).get(LABEL_OWNER, "")
        ]

    def trial_dirs(rollout_id: str) -> list[Path]:
        return sorted(trials.glob(f"{rollout_id}__*"))

    first = start(data, artifacts, port, backend)
    try:
        done_token = submit(url, "hx-done-1", harbor_task_id="quick")
        assert wait_until(
            lambda: result(url, "hx-done-1", done_token).json()["status"] == "success",
            timeout=120,
        ), result(url, "hx-done-1", done_token).text
        # Asked for twice: the pool makes the quick task's next container ahead of it.
        again_token = submit(url, "hx-done-2", harbor_task_id="quick")
        assert wait_until(
            lambda: result(url, "hx-done-2", again_token).json()["status"] == "success",
            timeout=120,
        )
        assert wait_until(lambda: warm_containers(first) != [], timeout=60)
        running_token = submit(url, "hx-running-1", harbor_task_id="sleepy")
        assert wait_until(
            lambda: (
                httpx.get(f"{url}/rollout/hx-running-1/status").json()["status"] == "running"
                and any(c.status == "running" for c in containers("hx-running-1"))
            ),
            timeout=120,
        ), "the sleepy trial never started its container"
        assert wait_until(
            lambda: any(runs_command(c, SLEEPY_AGENT) for c in containers("hx-running-1")),
            timeout=60,
        ), "the sleepy trial never reached its agent phase"
        assert wait_until(lambda: stored_status(data, "hx-running-1") == "running")
        assert len(trial_dirs("hx-running-1")) == 1
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    # Nobody removed the killed server's container: it is an orphan now.
    assert containers("hx-running-1"), "the running trial's container vanished with its server"

    second = start(data, artifacts, port, backend)
    try:
        finished = result(url, "hx-done-1", done_token)
        assert finished.status_code == 200, finished.text
        body = finished.json()
        assert body["status"] == "success" and body["sample"]["reward"] == 1.0
        lost = result(url, "hx-running-1", running_token)
        assert lost.status_code == 200, lost.text
        assert lost.json()["status"] == "failure"
        assert lost.json()["err_category"] == "internal_error"
        assert lost.json()["err_message"] == RESTARTED_MESSAGE
        status = httpx.get(f"{url}/rollout/hx-running-1/status").json()
        assert (status["status"], status["err_category"]) == ("failure", "internal_error")
        # The reaper removed the dead owner's containers, its warm ones too.
        assert wait_until(lambda: warm_containers(first) == [], timeout=15)
        assert wait_until(lambda: containers("hx-running-1") == [], timeout=15), [
            c.attrs.get("Names") for c in containers("hx-running-1")
        ]
        # The interrupted trial's directory is gone, or kept only as a failed trial.
        for trial in trial_dirs("hx-running-1"):
            outcome = json.loads((trial / "result.json").read_text())
            assert outcome["exception_info"] is not None, outcome
            assert outcome["verifier_result"] is None, outcome
        # The finished one's artifacts stay (its successful trial directory is dropped,
        # as always); the interrupted one never got any.
        assert (artifacts / "hx-done-1" / "trajectory.json").is_file()
        assert trial_dirs("hx-done-1") == []
        assert not (artifacts / "hx-running-1").exists()
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=60)
    assert containers("hx-running-1") == [] and containers("hx-done-1") == []
    client.close()
