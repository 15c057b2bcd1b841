"""A hostile agent against its container's command channel (real Docker).

The task's honest verifier gives 0 (``test.sh``: reward 0, and a note that it ran).
Each oracle ``solve.sh`` attacks the channel that the trial's commands, the
verifier's included, run over:

- ``kill``: reads the server's token from its command line, kills it, and puts an
  impostor in its place: a process that connects to the host's socket with that
  token, says hello, and would answer every command with exit 0 and write reward 1;
- ``noise``: floods its own output, writes forged frames (a command's exit, a reward
  in its output) to every descriptor of every process it can open, connects to the
  host's socket with frames of its own, holds a flood of connections to it open, and
  tries to replace the socket;
- ``stop``: stops the server (``SIGSTOP``) and leaves: its own command cannot end;
- ``limits``: lowers the server's resource limits (``prlimit``: open files, file
  size) so that its later work fails, the verifier's files and ``test.sh`` included;
- ``links``: leaves ``/logs/verifier`` and ``/tests`` as links to a directory holding
  reward 1, a link to ``/etc`` and a fifo in ``/logs/agent``, where the server will put
  and read files.

Every trial ends with the honest verifier's 0 and its note, never a host-side crash,
in the default (shared) verifier mode and a separate one: the impostor is never
heard, the noise is data, the stopped server is continued by the kill after the phase
(the agent's command ends as its timeout), a server whose limits changed is dropped by
that kill (the engine runs the rest), links are replaced where files go and read back
as links.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
from tests.task_factory import make_task

pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]

DOCKERFILE = "FROM python:3.11-slim-bookworm\nWORKDIR /app\n"
HONEST_TEST = "echo 0 > /logs/verifier/reward.txt; echo verified > /logs/verifier/ran.txt\n"

#: A frame as the channel writes one: length, kind, request id, payload.
FRAMES = r"""
import json, struct
def frame(kind, request, payload=b""):
    return struct.pack(">IBI", len(payload) + 5, kind, request) + payload
FORGED = b"".join(
    frame(1, r, b"reward 1\n") + frame(3, r, json.dumps({"exit_code": 0}).encode())
    for r in range(1, 40)
)
"""

IMPOSTOR = (
    FRAMES
    + r"""
import os, socket, sys, time
token, server = sys.argv[1], int(sys.argv[2])
report = open("/logs/agent/impostor.txt", "w", buffering=1)


def attempt():
    # Say hello as the server would; if heard, answer every command with exit 0.
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(2)
    try:
        sock.connect("/run/harbor-exec/commands/c.sock")
        sock.sendall(frame(0, 0, json.dumps({"token": token, "pid": os.getpid()}).encode()))
        while True:
            head = sock.recv(9)
            if not head:
                return "closed by the host"
            length, kind, request = struct.unpack(">IBI", head)
            sock.recv(length - 5)
            os.makedirs("/logs/verifier", exist_ok=True)
            open("/logs/verifier/reward.txt", "w").write("1\n")
            sock.sendall(FORGED)
            report.write(f"heard command {request}\n")
    except OSError as exc:
        return type(exc).__name__


report.write(f"while the server lives: {attempt()}\n")
while os.path.exists(f"/proc/{server}"):
    time.sleep(0.005)
for _ in range(100):
    report.write(f"after it was killed: {attempt()}\n")
"""
)

KILL = f"""
server=$(grep -l 'commands/c[.]sock' /proc/[0-9]*/cmdline | cut -d/ -f3 | grep -vx 1 | head -1)
token=$(tr '\\0' '\\n' < /proc/$server/cmdline | grep -A1 -x -- --token | tail -1)
echo "server=$server token=${{#token}}" > /logs/agent/attack.txt
cat > /tmp/impostor.py <<'PY'
{IMPOSTOR}
PY
setsid nohup python3 /tmp/impostor.py "$token" "$server" > /dev/null 2>&1 &
for i in $(seq 1500); do [ -s /logs/agent/impostor.txt ] && break; sleep 0.02; done
echo killed >> /logs/agent/attack.txt
kill -9 "$server"
sleep 5  # (the trial's kill after the phase ends this)
"""

NOISE_SCRIPT = (
    FRAMES
    + r"""
import os, socket, sys, time
opened = 0
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        try:
            with open(f"/proc/{pid}/fd/{fd}", "wb", buffering=0) as out:
                out.write(FORGED)
                opened += 1
        except OSError:
            pass
sys.stdout.buffer.write(FORGED * 100)
answers = []
for attempt in range(3):
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect("/run/harbor-exec/commands/c.sock")
        sock.settimeout(5)
        sock.sendall(frame(0, 0, b'{"token": "guess", "pid": 1}') + FORGED)
        answers.append(sock.recv(64))
    except OSError as exc:
        answers.append(type(exc).__name__)
# A flood of connections, held open (bounded: 1000 tries, 10 s): the host reads none.
held, flood, deadline = [], 0, time.monotonic() + 10
while flood < 1000 and time.monotonic() < deadline:
    flood += 1
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(0.2)
        sock.connect("/run/harbor-exec/commands/c.sock")
        held.append(sock)
    except OSError:
        sock.close()
try:
    os.unlink("/run/harbor-exec/commands/c.sock")
    replaced = "unlinked"
except OSError as exc:
    replaced = type(exc).__name__
print(
    f"opened={opened} answers={answers} replaced={replaced} flood={flood}",
    file=open("/logs/agent/attack.txt", "w"),
)
"""
)

NOISE = f"""
cat > /tmp/noise.py <<'PY'
{NOISE_SCRIPT}
PY
python3 /tmp/noise.py
head -c 50000000 /dev/zero | tr '\\0' x
"""

STOP = """
server=$(grep -l 'commands/c[.]sock' /proc/[0-9]*/cmdline | cut -d/ -f3 | grep -vx 1 | head -1)
kill -STOP "$server" && echo "stopped $server" > /logs/agent/attack.txt
"""

#: Lowers the server's limits (same uid: no ptrace needed) so that its later work, the
#: verifier's files and commands included, fails.
LIMITS = """
server=$(grep -l 'commands/c[.]sock' /proc/[0-9]*/cmdline | cut -d/ -f3 | grep -vx 1 | head -1)
python3 - "$server" <<'PY'
import resource, sys
pid = int(sys.argv[1])
for limit, value in ((resource.RLIMIT_NOFILE, 5), (resource.RLIMIT_FSIZE, 0)):
    resource.prlimit(pid, limit, (value, value))
print("limited", pid, resource.prlimit(pid, resource.RLIMIT_NOFILE), file=open("/logs/agent/attack.txt", "w"))
PY
"""

#: Leaves links, a fifo and a planted reward where the server will put and read files.
LINKS = """
mkdir -p /tmp/fake && echo 1 > /tmp/fake/reward.txt
rm -rf /logs/verifier && ln -s /tmp/fake /logs/verifier
rm -rf /tests && ln -s /tmp/fake /tests
ln -s /etc /logs/agent/etc-link
mkfifo /logs/agent/pipe
echo planted > /logs/agent/attack.txt
"""

ATTACKS = {"kill": KILL, "noise": NOISE, "stop": STOP, "limits": LIMITS, "links": LINKS}


@pytest.mark.parametrize("verifier", ["shared", "separate"])
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_an_attack_on_the_channel_leaves_the_honest_reward(
    docker_runtime: DockerRuntime, tmp_path: Path, attack: str, verifier: str
) -> None:
    mode = 'environment_mode = "separate"\n' if verifier == "separate" else ""
    toml = f"""
[agent]
timeout_sec = {8.0 if attack == "stop" else 60.0}

[verifier]
timeout_sec = 60.0
{mode}"""
    task = make_task(
        tmp_path, f"channel-{attack}", solve=ATTACKS[attack], test=HONEST_TEST,
        toml=toml, dockerfile=DOCKERFILE,
    )  # fmt: skip
    spec = TrialSpec(task=load_task(task), trials_dir=tmp_path / "trials")
    result = run_trial(docker_runtime, TrialRequest(spec))
    trial = tmp_path / "trials" / result.trial_name
    assert result.verifier_result is not None, result.exception_info
    assert result.verifier_result.rewards == {"reward": 0.0}
    assert (trial / "verifier" / "ran.txt").read_text() == "verified\n"
    record = json.loads((trial / "result.json").read_text())
    assert record["config"]["verifier_environment_mode"] == verifier
    attack_report = (trial / "agent" / "attack.txt").read_text()
    if attack == "kill":
        # The attack had the token and the server; the impostor was never heard.
        assert "token=32" in attack_report and "killed" in attack_report, attack_report
        impostor = (trial / "agent" / "impostor.txt").read_text()
        # Closed unread (an end of stream, or a reset: its hello was never read).
        first = impostor.splitlines()[0]
        refused = ("closed by the host", "ConnectionResetError", "BrokenPipeError")
        assert first.split(": ")[1] in refused, impostor
        assert "heard" not in impostor, impostor
        assert result.exception_info is None, result.exception_info
    elif attack == "noise":
        assert "opened=" in attack_report and "replaced=unlinked" not in attack_report
        assert "opened=0 " not in attack_report, attack_report  # it did write somewhere
        # The host answered none of its connections a single byte.
        answers = attack_report.split("answers=")[1].split(" replaced")[0]
        assert "\\x" not in answers, answers
        assert result.exception_info is None, result.exception_info
        # It did flood the socket with connections, and the trial went on as ever.
        assert int(attack_report.split("flood=")[1]) >= 100, attack_report
    elif attack == "limits":
        # The kill after the phase found the server changed: the engine took over.
        assert "limited" in attack_report and "(5, 5)" in attack_report, attack_report
        assert result.exception_info is None, result.exception_info
    elif attack == "links":
        assert "planted" in attack_report
        assert result.exception_info is None, result.exception_info
        # Read back as links and nothing more: never followed, never a fifo.
        assert (trial / "agent" / "etc-link").is_symlink() or not (
            trial / "agent" / "etc-link"
        ).exists()
        assert not (trial / "agent" / "etc-link" / "passwd").exists()
        assert not (trial / "agent" / "pipe").exists()
    else:
        assert "stopped" in attack_report
        # Its own command could not end: its timeout, then the verifier as ever.
        assert result.exception_info is not None
        assert result.exception_info.exception_type == "AgentTimeoutError"
