"""mini-swe-agent's pieces without Docker: its name, its layer's launcher, the runner's
``forward`` mode (a real process piping a loopback port onto a real unix socket) and
the relay's record of the last chat call (a real relay before a scripted model)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harbor_exec.agents.native.config import (
    IN_CONTAINER_AGENT_NAMES,
    check_agent_name,
    check_native_kwargs,
    is_in_container_agent,
)
from harbor_exec.agents.native.layer import AGENT_PACKAGES, launcher
from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.container.exchange import AGENT_SITE, RUNTIME_PYTHON
from harbor_exec.network.relay import ModelRelay
from tests.fake_chat import ScriptedChat, tool_call_reply
from tests.task_factory import make_task

ROOT = Path(__file__).resolve().parent.parent
FORWARD = (sys.executable, "-m", "harbor_exec.container.runner", "forward")


def test_an_unknown_agent_name_lists_mini_swe_agent(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mini-swe-agent") as raised:
        check_agent_name("mini-swe")
    assert "terminus-2" in str(raised.value) and "oracle" in str(raised.value)
    task = make_task(tmp_path / "tasks", "t")
    with pytest.raises(ValueError, match=r"unknown agent 'mini'.*mini-swe-agent"):
        HarborBackend(tasks_dir=task, agent="mini")
    backend = HarborBackend(tasks_dir=task, agent="mini-swe-agent")  # constructs
    assert backend.native is not None and backend.native.name == "mini-swe-agent"
    assert is_in_container_agent("mini-swe-agent") and not is_in_container_agent("terminus-2")
    assert set(IN_CONTAINER_AGENT_NAMES) <= set(AGENT_PACKAGES)


def test_the_user_may_not_turn_harbors_install_back_on() -> None:
    with pytest.raises(ValueError, match="skip_install"):
        check_native_kwargs({"skip_install": False})


def test_the_layers_launcher_runs_on_the_runtimes_interpreter_isolated() -> None:
    text = launcher("minisweagent.run.mini:app")
    first, *rest = text.splitlines()
    assert first == f"#!{RUNTIME_PYTHON} -I"  # no PYTHON* variable, no user site
    assert f"sys.path.append({AGENT_SITE!r})" in rest  # after the standard library
    assert "from minisweagent.run.mini import app" in rest
    compile(text, "launcher", "exec")
    pins = AGENT_PACKAGES["mini-swe-agent"].requirements
    assert "mini-swe-agent==2.4.6" in pins  # what Harbor 0.26's adapter drives


class _EchoSocket:
    """A unix socket server that answers every connection with what it read, upper-cased."""

    def __init__(self, path: Path) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(conn.recv(1024).upper())

    def close(self) -> None:
        self.server.close()


def _forwarder_pids(socket_path: Path) -> list[int]:
    """Processes whose command line names ``socket_path`` (the detached forwarder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(socket_path).encode() in cmdline and b"forward" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.fixture
def relay_socket(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "relay.sock"
    echo = _EchoSocket(path)
    yield path
    echo.close()


def test_runner_forward_prints_its_port_detaches_and_pipes_to_the_socket(
    relay_socket: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    done = subprocess.run(
        [*FORWARD, "--socket", str(relay_socket)],
        capture_output=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    port = int(done.stdout.strip())  # the exec ended: the forwarder left it behind
    pids = _forwarder_pids(relay_socket)
    assert len(pids) == 1
    try:
        assert os.getsid(pids[0]) == pids[0]  # a session of its own
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"hello relay")
            assert conn.recv(1024) == b"HELLO RELAY"
        assert time.monotonic() - started < 30
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)


def test_runner_forward_without_the_socket_is_a_setup_failure(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*FORWARD, "--socket", str(tmp_path / "missing.sock")],
        capture_output=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert b"missing" in done.stderr and done.stdout == b""


async def test_the_relay_keeps_the_last_chat_call_when_asked(tmp_path: Path) -> None:
    replies = [
        tool_call_reply("ls", call_id="c1"),
        tool_call_reply("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", call_id="c2"),
    ]
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    with ScriptedChat(replies) as chat:
        for record in (True, False):
            relay = ModelRelay(
                upstream_url=chat.base_url,
                api_key="sk-real",
                directory=tmp_path / f"relay-{record}",
                record_chat=record,
            )
            async with relay:
                transport = httpx.AsyncHTTPTransport(uds=str(relay.socket_path))
                async with httpx.AsyncClient(transport=transport, timeout=10) as client:
                    history: list[dict[str, object]] = [{"role": "user", "content": "go"}]
                    for _ in range(2):
                        response = await client.post(
                            "http://relay/v1/chat/completions",
                            json={"model": "m", "messages": history, "tools": tools},
                            headers={"Authorization": f"Bearer {relay.token}"},
                        )
                        assert response.status_code == 200
                        answer = response.json()["choices"][0]["message"]
                        history = [*history, answer, {"role": "tool", "content": "ok"}]
            if record:
                assert relay.last_chat is not None
                assert relay.last_chat["messages"] == history[:-2]  # the last call's
                assert relay.last_chat["response"] == json.loads(json.dumps(replies[1]))
                assert relay.last_chat["tools"] == tools
            else:
                assert relay.last_chat is None
            assert relay.usage.requests == 2


def test_prewarm_installs_the_agent_layer_once_with_its_launchers(tmp_path: Path) -> None:
    from harbor_exec.agents.native.layer import AGENT_MARKER, AgentLayer
    from harbor_exec.container.exchange import AGENT_BIN, AGENT_MOUNT
    from harbor_exec.jobs.prewarm import prepare_prewarm_agent, prewarm_tasks
    from harbor_exec.tasks.discovery import discover_tasks
    from tests.fake_runtime import FakeRuntime

    for name in ("a", "b", "c"):
        make_task(tmp_path / "ds", name)
    tasks = discover_tasks(tmp_path / "ds").tasks
    layer = AgentLayer(
        agent="mini-swe-agent",
        wheelhouse=tmp_path / "wheels",
        wheels=("pip-1-py3-none-any.whl", "x-1-py3-none-any.whl"),
        pip_wheel="pip-1-py3-none-any.whl",
        programs={"mini-swe-agent": launcher("minisweagent.run.mini:app")},
        digest="d" * 64,
    )
    runtime = FakeRuntime()
    outcomes = prewarm_tasks(runtime, tasks, jobs=2, agent_layer=layer)
    assert [o.status for o in outcomes].count("failed") == 0
    fill = runtime.volumes[layer.volume_name]
    assert layer.volume_name == "harbor-exec-agent-mini-swe-agent-" + "d" * 16
    assert fill.mount == AGENT_MOUNT and fill.marker == AGENT_MARKER
    assert fill.labels == {"harbor-exec.kind": "agent"}
    launchers = json.loads(fill.command[7])  # the install script's launchers argument
    assert launchers == {f"{AGENT_BIN}/mini-swe-agent": launcher("minisweagent.run.mini:app")}
    assert runtime.calls.count("fill_volume") == 3  # asked per task, filled once
    with pytest.raises(ValueError, match=r"no agent layer.*mini-swe-agent"):
        prepare_prewarm_agent("terminus-2")
