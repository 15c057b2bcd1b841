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
