"""The command channel runs a command exactly as an engine exec does (real Docker).

Two containers of one image, one with the channel (``ContainerSpec.command_channel``)
and one without (every command an Engine API exec): the same commands in both give
the same exit code, stdout and stderr (users and their groups and ``HOME`` from the
container's account files, working directory, environment, stdin, exit codes of
signals, a command that cannot start, a missing working directory, output past the
bound, a process left holding the output), and a timeout kills the command's
processes in both while the channel's server lives on.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import ExecResult
from tests.channel_utils import channel_pair, probe_spec
from tests.server_utils import wait_until

# engine_lane: its own two containers; its bounds are generous (seconds, not ms).
pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]

#: An account with a supplementary group and a home, as a task's Dockerfile makes one.
ACCOUNTS = (
    "groupadd -g 1500 team && useradd -m -u 1000 -U alice && usermod -aG team alice"
    " && mkdir -p /work/sub && chown alice /work/sub"
)


@pytest.fixture(scope="module")
def pair(docker_runtime: DockerRuntime) -> Iterator[dict[str, Any]]:
    with channel_pair(
        docker_runtime, "hx-channel-probe", ACCOUNTS, env={"FROM_SPEC": "spec value"},
        workdir="/work",
    ) as created:  # fmt: skip
        yield created


def both(pair: dict[str, Any], command: list[str], **options: Any) -> tuple[ExecResult, ExecResult]:
    runtime: DockerRuntime = pair["runtime"]
    return (
        runtime.exec(pair["on"], command, **options),
        runtime.exec(pair["off"], command, **options),
    )


def same(on: ExecResult, off: ExecResult) -> None:
    assert (on.exit_code, on.output, on.errors, on.timed_out) == (
        off.exit_code,
        off.output,
        off.errors,
        off.timed_out,
    )


#: Who, where and the whole environment (but the container's own host name).
SHOW = "id; pwd; env | grep -v ^HOSTNAME= | sort"


@pytest.mark.parametrize(
    ("user", "workdir"),
    [(None, None), ("0:0", "/tmp"), ("1000:1000", "/work/sub"), ("1234:1234", None)],
)
def test_users_groups_home_workdir_and_environment_as_an_engine_exec(
    pair: dict[str, Any], user: str | None, workdir: str | None
) -> None:
    options: dict[str, Any] = {"env": {"GIVEN": "given value"}}
    if user is not None:
        options["user"] = user
    if workdir is not None:
        options["workdir"] = workdir
    on, off = both(pair, ["sh", "-c", SHOW], **options)
    same(on, off)
    assert b"FROM_SPEC=spec value" in on.output and b"GIVEN=given value" in on.output
    if user == "1000:1000":
        # uid:gid: that group alone, as runc gives it; the account's home.
        assert b"groups=1000(alice)\n" in on.output and b"HOME=/home/alice" in on.output
    if user == "1234:1234":
        assert b"HOME=/\n" in on.output


def test_stdin_exit_codes_and_commands_that_cannot_start(pair: dict[str, Any]) -> None:
    data = bytes(range(256)) * 8192  # 2 MiB, every byte value
    on, off = both(pair, ["sh", "-c", "sha256sum; echo done >&2"], stdin=data)
    same(on, off)
    assert on.output.startswith(hashlib.sha256(data).hexdigest().encode())
    assert on.errors == b"done\n"
    for command in (["sh", "-c", "exit 3"], ["sh", "-c", "kill -9 $$"], ["true"]):
        same(*both(pair, command))
    on, off = both(pair, ["sh", "-c", "kill -9 $$"])
    assert on.exit_code == 137
    on, off = both(pair, ["no-such-program"])
    assert on.exit_code == off.exit_code == 126
    assert b"executable file not found" in on.output and b"executable file not found" in off.output
    on, off = both(pair, ["true"], workdir="/no/such/dir")
    assert on.exit_code == off.exit_code == 126
    assert b"chdir to cwd" in on.output and b"chdir to cwd" in off.output


def test_output_past_the_bound_and_a_process_left_holding_it(pair: dict[str, Any]) -> None:
    # 20 MiB on each stream: both keep the same tail, after the same marker.
    flood = "head -c 20971520 /dev/zero | tr '\\0' a; head -c 20971520 /dev/zero | tr '\\0' b >&2"
    same(*both(pair, ["sh", "-c", flood]))
    # A background process holding stdout: the command ends within docker's grace.
    started = time.monotonic()
    on = pair["runtime"].exec(pair["on"], ["sh", "-c", "sleep 30 & echo hi"])
    assert on.exit_code == 0 and on.output == b"hi\n"
    assert time.monotonic() - started < 10


def test_a_timeout_kills_the_command_and_the_channel_lives_on(pair: dict[str, Any]) -> None:
    runtime: DockerRuntime = pair["runtime"]
    started = time.monotonic()
    on = runtime.exec(pair["on"], ["sh", "-c", "echo begun; sleep 60"], timeout_sec=1)
    assert on.timed_out and on.output == b"begun\n"
    assert time.monotonic() - started < 15
    left = runtime.exec(pair["on"], ["sh", "-c", "ps -eo args 2>/dev/null || ls /proc"])
    assert b"sleep 60" not in left.output
    # The server was spared by the kill: the next command still goes over the channel.
    channel = runtime._channels[pair["on"]]
    assert channel.alive
    timed = time.monotonic()
    for _ in range(20):
        assert runtime.exec(pair["on"], ["true"]).exit_code == 0
    assert channel.alive
    per_command = (time.monotonic() - timed) / 20
    assert per_command < 0.05, per_command


#: Run through the engine (the "agent"): the server's token from its command line, the
#: server killed, an impostor saying hello with that token as long as it is let in.
IMPOSTOR = r"""
import json, os, socket, struct, sys, time
server = next(
    p for p in os.listdir("/proc")
    if p.isdigit() and p != "1" and b"commands/c.sock" in open(f"/proc/{p}/cmdline", "rb").read()
)
argv = open(f"/proc/{server}/cmdline", "rb").read().split(b"\0")
token = argv[argv.index(b"--token") + 1].decode()
os.kill(int(server), 9)
while os.path.exists(f"/proc/{server}"):
    time.sleep(0.005)
report = open("/tmp/impostor.txt", "w", buffering=1)
if os.fork():
    os._exit(0)
os.setsid()
exit_0 = json.dumps({"exit_code": 0}).encode()
knocks = 0
for _ in range(200):
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(0.5)
    hello = json.dumps({"token": token, "pid": os.getpid()}).encode()
    try:
        sock.connect("/run/harbor-exec/commands/c.sock")
        sock.sendall(struct.pack(">IBI", len(hello) + 5, 0, 0) + hello)
        head = sock.recv(9)
    except OSError:
        head = b""
    knocks += 1
    report.write(f"knocked {knocks}\n")
    if head:
        length, kind, request = struct.unpack(">IBI", head)
        report.write(f"heard {request}\n")
        forged = b"forged\n"
        sock.sendall(struct.pack(">IBI", len(forged) + 5, 1, request) + forged)
        sock.sendall(struct.pack(">IBI", len(exit_0) + 5, 3, request) + exit_0)
        time.sleep(5)
    sock.close()
"""


def test_a_killed_server_is_never_replaced(docker_runtime: DockerRuntime) -> None:
    """The server killed and an impostor knocking with its token: every later command
    runs through the engine (exactly as before), never through the impostor."""
    spec = probe_spec("hx-channel-impostor", True)
    container = docker_runtime.create(spec)
    try:
        docker_runtime.start(container)
        channel = docker_runtime._channels[container]
        assert docker_runtime.exec(container, ["true"]).exit_code == 0 and channel.alive
        # Through the engine (the channel's server is what it kills).
        attack = docker_runtime._api.exec_create(container, ["python3", "-c", IMPOSTOR])
        docker_runtime._api.exec_start(attack["Id"])
        assert wait_until(lambda: not channel.alive, timeout=5), "the server was not killed"
        for _ in range(10):  # while the impostor knocks
            ran = docker_runtime.exec(container, ["sh", "-c", "echo real; exit 3"])
            assert (ran.exit_code, ran.output) == (3, b"real\n")
        report = docker_runtime.exec(container, ["cat", "/tmp/impostor.txt"]).output
        assert b"knocked 1\n" in report, report  # it did knock, while commands ran
        assert b"heard" not in report, report
        assert not channel.alive
    finally:
        docker_runtime.remove(container)
