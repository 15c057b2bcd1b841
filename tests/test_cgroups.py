"""The kill between phases tells the container's own command (the keep-alive) from the
rest by what the host sees in ``/proc``; here on processes of this test's own."""

from __future__ import annotations

import os
import subprocess
import time

from harbor_exec.sandbox.cgroups import _first_child
from tests.server_utils import wait_until


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_a_dead_child_not_yet_reaped_is_not_the_first_child() -> None:
    """The command server starts before the keep-alive; killed by the agent and not yet
    reaped by the init (a busy machine), it must not be taken for the container's own
    command: that would kill the keep-alive and end the container."""
    dead = subprocess.Popen(["true"])
    assert wait_until(lambda: _state(dead.pid) == "Z"), "never a zombie"  # not reaped yet
    time.sleep(0.02)  # a later start: /proc's start times tick at 10 ms
    alive = subprocess.Popen(["sleep", "30"])
    try:
        assert _first_child(os.getpid(), {dead.pid, alive.pid}) == {alive.pid}
        assert _first_child(os.getpid(), {dead.pid, alive.pid}, os.getuid()) == {alive.pid}
    finally:
        alive.kill()
        alive.wait()
        dead.wait()


def test_an_earlier_child_of_another_uid_is_not_the_first_child() -> None:
    """The command server (root) starts before the keep-alive (the runtime's uid); killed
    by the agent, it may still be alive (its SIGKILL pending, not yet a zombie) when the
    host looks. The keep-alive is the first child *of its uid*: taking the server for the
    first child kept nothing, killed the keep-alive and ended the container (CI, under
    load: the channel's kill attack ended as ``AgentEndedContainerError``)."""
    server = subprocess.Popen(["sleep", "30"])  # root, as the command server
    time.sleep(0.02)  # a later start: /proc's start times tick at 10 ms
    keep_alive = subprocess.Popen(["sleep", "30"], user=65534)
    try:
        pids = {server.pid, keep_alive.pid}
        assert _first_child(os.getpid(), pids, 65534) == {keep_alive.pid}
        assert _first_child(os.getpid(), pids) == {server.pid}
    finally:
        for process in (server, keep_alive):
            process.kill()
            process.wait()
