"""Allowlisted networks in real containers (issue 20 point 5), entirely on loopback.

The task's container has network ``none``; its only way out is the trial's egress
proxy on a unix socket. The allowed names resolve, in the proxy's override map, to
HTTP servers on the host's 127.0.0.1; so does a name the task does not allow, whose
server must hear nothing. Inside the container, curl, Python's urllib and a raw
socket speaking CONNECT reach the allowed host and not the other; a raw socket to
an address reaches nothing. The verifier's phase has a policy of its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from harbor_exec.network.egress.plan import REFUSED_LOG, EgressSettings
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
from tests.task_factory import make_task
from tests.test_egress import _cert, _Server

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]

# The image's own glibc is used; curl's other libraries come from the host (both bookworm).
_GLIBC = ("libc.so", "libm.so", "libpthread.so", "libdl.so", "librt.so", "ld-linux")


def _curl_into(environment: Path) -> None:
    """The host's curl and its libraries (not glibc's) under environment/curl/."""
    curl = shutil.which("curl")
    assert curl is not None, "these tests need curl on the host (to copy into the image)"
    lib = environment / "curl" / "lib"
    lib.mkdir(parents=True)
    shutil.copy(curl, environment / "curl" / "curl")
    ldd = subprocess.run(["ldd", curl], capture_output=True, text=True, check=True).stdout
    for line in ldd.splitlines():
        parts = line.split("=>")
        if len(parts) == 2 and parts[1].split():
            path = parts[1].split()[0]
            if not any(Path(path).name.startswith(g) for g in _GLIBC):
                shutil.copy(path, lib / Path(path).name)


_DOCKERFILE = """\
FROM python:3.11-slim-bookworm
COPY curl /opt/curl
RUN printf '#!/bin/sh\\nLD_LIBRARY_PATH=/opt/curl/lib exec /opt/curl/curl "$@"\\n' \
    > /usr/local/bin/curl && chmod 0755 /usr/local/bin/curl /opt/curl/curl
COPY ca.pem checks.py /opt/checks/
WORKDIR /app
"""

# Run in both phases: prints one "name=value" line per check.
_CHECKS = r"""
import json, os, socket, ssl, subprocess, sys, urllib.error, urllib.request

allowed, refused = sys.argv[1], sys.argv[2]
out = {}

def run(*cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    return p.stdout.strip()

out["env"] = os.environ.get("HTTPS_PROXY", "")
out["curl_allowed"] = run("curl", "-s", f"http://{allowed}/curl")
out["curl_refused"] = run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"http://{refused}/")
out["curl_tls"] = run("curl", "-s", "--cacert", "/opt/checks/ca.pem", "https://secure.test/tls")
try:
    out["urllib_allowed"] = urllib.request.urlopen(f"http://{allowed}/py", timeout=10).read().decode()
except Exception as exc:
    out["urllib_allowed"] = repr(exc)
try:
    urllib.request.urlopen(f"http://{refused}/py", timeout=10)
    out["urllib_refused"] = "reached"
except urllib.error.HTTPError as exc:
    out["urllib_refused"] = str(exc.code)
except Exception as exc:
    out["urllib_refused"] = repr(exc)

def connect(host):
    with socket.create_connection(("127.0.0.1", 3128), timeout=10) as raw:
        raw.sendall(f"CONNECT {host}:80 HTTP/1.1\r\nHost: {host}:80\r\n\r\n".encode())
        head = raw.recv(4096)
        if not head.startswith(b"HTTP/1.1 200"):
            return head.split(b"\r\n")[0].decode()
        raw.sendall(f"GET /raw HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := raw.recv(4096):
            data += chunk
        return data.rsplit(b"\r\n\r\n", 1)[-1].decode()

out["connect_allowed"] = connect(allowed)
out["connect_refused"] = connect(refused)
for name, address in (("direct_host", ("127.0.0.1", int(sys.argv[3]))), ("direct_net", ("192.0.2.1", 80))):
    try:
        socket.create_connection(address, timeout=5).close()
        out[name] = "reached"
    except OSError as exc:
        out[name] = type(exc).__name__
try:
    socket.getaddrinfo(allowed, 80)
    out["dns"] = "resolved"
except OSError as exc:
    out["dns"] = type(exc).__name__
print(json.dumps(out))
"""

_SOLVE = r"""
python3 /opt/checks/checks.py allowed.test other.test {port} > /logs/agent/agent-checks.json
# The forwarder runs as the runtime's uid: an unprivileged process cannot end it.
# (Not the init, whose command line names the forwarder it started with the container.)
# (The command server's command line names the forwarder too: it started the init.)
pid=$(grep -l 'egress[.]sock' /proc/[0-9]*/cmdline | xargs grep -L 'commands/c[.]sock' \
    | cut -d/ -f3 | grep -vx 1 | head -1)
python3 -c "import os, sys; os.setgid(65534); os.setuid(65534)
try:
    os.kill(int(sys.argv[1]), 9); print('killed')
except PermissionError: print('denied')" "$pid" > /logs/agent/kill-as-nobody.txt
# The kill after the phase spares it, so nothing may get into it: not root, not a
# process that takes its uid (it is not dumpable).
python3 -c "import os, sys
out = []
for uid in (0, 2147481647):
    if uid:
        os.setgid(uid); os.setuid(uid)
    try:
        open(f'/proc/{{sys.argv[1]}}/mem', 'rb').close(); out.append('opened')
    except PermissionError: out.append('denied')
print(' '.join(out))" "$pid" > /logs/agent/mem.txt
# Root can end it: that only cuts the agent off ...
kill -9 "$pid"
curl -s -m 5 http://allowed.test/after-kill > /logs/agent/after-kill.txt; echo "exit=$?" >> /logs/agent/after-kill.txt
# ... and a listener of its own on the port, left behind, must not reach the verifier.
nohup python3 -c "
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header('Content-Length', '8'); self.end_headers(); self.wfile.write(b'hijacked')
http.server.HTTPServer(('127.0.0.1', 3128), H).serve_forever()
" > /dev/null 2>&1 &
for i in $(seq 100); do
    curl -s http://verifier.test/ > /logs/agent/fake.txt && [ -s /logs/agent/fake.txt ] && break
    sleep 0.1
done
"""

_TEST = r"""
python3 /opt/checks/checks.py verifier.test allowed.test {port} > /logs/verifier/verifier-checks.json
echo 1 > /logs/verifier/reward.txt
"""

_TOML = """
[environment]
network_mode = "allowlist"
allowed_hosts = ["allowed.test", "*.secure.test", "secure.test"]

[agent]
timeout_sec = 60.0

[verifier]
timeout_sec = 60.0
network_mode = "allowlist"
allowed_hosts = ["verifier.test", "secure.test"]
"""


class _CountingRuntime:
    """The engine, counting the execs that start an egress forwarder."""

    def __init__(self, inner: DockerRuntime) -> None:
        self._inner = inner
        self.forwarder_execs = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def exec(self, container_id: str, command: list[str], **options: Any) -> Any:
        if "--socket" in command:
            self.forwarder_execs += 1
        return self._inner.exec(container_id, command, **options)


def _run_allowlisted(
    runtime: DockerRuntime, tmp_path: Path, servers: dict[str, _Server], **task: str
) -> Path:
    """Make the task (the image with curl and the checks), run its oracle trial with every
    test name mapped to its server on 127.0.0.1 (DNS off), check reward 1, return its dir."""
    task_dir = make_task(tmp_path, "allowlisted", dockerfile=_DOCKERFILE, **task)
    environment = task_dir / "environment"
    _curl_into(environment)
    shutil.copy(tmp_path / "ca.pem", environment / "ca.pem")
    (environment / "checks.py").write_text(_CHECKS)
    overrides = {
        f"{name}.test": ("127.0.0.1", server.port)
        for name, server in servers.items()
        if name != "secure"
    }
    overrides["secure.test:443"] = ("127.0.0.1", servers["secure"].port)
    policy = SandboxPolicy(egress=EgressSettings(overrides=overrides, dns=False))
    trials = tmp_path / "trials"
    result = run_trial(
        runtime, TrialRequest(TrialSpec(task=load_task(task_dir), trials_dir=trials, policy=policy))
    )
    assert result.exception_info is None, result.exception_info
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 1.0}
    return trials / result.trial_name


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[dict[str, _Server]]:
    cert = _cert(tmp_path, "secure.test")
    made = {
        "allowed": _Server("allowed"),
        "other": _Server("other"),
        "verifier": _Server("verifier"),
        "secure": _Server("tls", tls=cert.server),
    }
    (tmp_path / "ca.pem").write_bytes(cert.ca_file.read_bytes())
    for server in made.values():
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield made
    for server in made.values():
        server.shutdown()
        server.server_close()


def test_allowlisted_task_reaches_only_its_hosts(
    docker_runtime: DockerRuntime, tmp_path: Path, servers: dict[str, _Server]
) -> None:
    port = servers["allowed"].port
    counting = _CountingRuntime(docker_runtime)
    out = _run_allowlisted(
        cast(DockerRuntime, counting),
        tmp_path,
        servers,
        solve=_SOLVE.format(port=port),
        test=_TEST.format(port=port),
        toml=_TOML,
    )
    agent = json.loads((out / "agent" / "agent-checks.json").read_text())
    verifier = json.loads((out / "verifier" / "verifier-checks.json").read_text())
    expected_agent = {
        "env": "http://127.0.0.1:3128",
        "curl_allowed": "hello from allowed",
        "curl_refused": "403",
        "curl_tls": "hello from tls",
        "urllib_allowed": "hello from allowed",
        "urllib_refused": "403",
        "connect_allowed": "hello from allowed",
        "connect_refused": "HTTP/1.1 403 ",
        "direct_host": "ConnectionRefusedError",  # the container's own loopback
        "direct_net": "OSError",  # network unreachable: no route at all
        "dns": "gaierror",
    }
    assert agent == expected_agent
    # The verifier's phase: its own host in, the agent's out (the agent's listener gone).
    assert verifier == {
        **expected_agent,
        "curl_allowed": "hello from verifier",
        "urllib_allowed": "hello from verifier",
        "connect_allowed": "hello from verifier",
    }
    assert (out / "agent" / "kill-as-nobody.txt").read_text() == "denied\n"
    assert (out / "agent" / "mem.txt").read_text() == "denied denied\n"
    # The forwarder the agent killed is not spared: the verifier's phase starts a new one.
    assert counting.forwarder_execs == 1
    assert (out / "agent" / "after-kill.txt").read_text().strip().endswith("exit=7")
    # The agent's listener answered the agent (loopback is its own) but nobody else.
    assert (out / "agent" / "fake.txt").read_text() == "hijacked"
    assert servers["other"].seen == []
    assert {path for _, path, _ in servers["allowed"].seen} == {"/curl", "/py", "/raw"}
    assert {path for _, path, _ in servers["verifier"].seen} == {"/curl", "/py", "/raw"}
    records = [json.loads(line) for line in (out / REFUSED_LOG).read_text().splitlines()]
    refused = sorted({(r["phase"], r["method"], r["host"], r["port"]) for r in records})
    assert refused == [
        ("agent", "CONNECT", "other.test", 80),
        ("agent", "GET", "other.test", 80),
        ("verifier", "CONNECT", "allowed.test", 80),
        ("verifier", "GET", "allowed.test", 80),
    ]
    assert all("allowed_hosts" in r["reason"] for r in records)


_PROBE = r"""
for host in allowed.test other.test; do
    echo "$host=$(curl -s -o /dev/null -w '%{{http_code}}' http://$host/{phase})"
done > /logs/{phase}/probe.txt
"""


@pytest.mark.parametrize(
    ("verifier_toml", "verifier_sees"),
    [
        # Shared container; the verifier's phase has no network at all.
        ('network_mode = "no-network"', "allowed.test=403\nother.test=403\n"),
        # A separate verifier container, with an allowlist of its own.
        (
            'environment_mode = "separate"\nnetwork_mode = "allowlist"\n'
            'allowed_hosts = ["other.test"]',
            "allowed.test=403\nother.test=200\n",
        ),
    ],
)
def test_the_verifier_phase_has_its_own_policy(
    docker_runtime: DockerRuntime,
    tmp_path: Path,
    servers: dict[str, _Server],
    verifier_toml: str,
    verifier_sees: str,
) -> None:
    toml = f"""
[environment]
network_mode = "allowlist"
allowed_hosts = ["allowed.test"]

[agent]
timeout_sec = 60.0

[verifier]
timeout_sec = 60.0
{verifier_toml}
"""
    counting = _CountingRuntime(docker_runtime)
    out = _run_allowlisted(
        cast(DockerRuntime, counting),
        tmp_path,
        servers,
        solve=_PROBE.format(phase="agent"),
        test=_PROBE.format(phase="verifier") + "echo 1 > /logs/verifier/reward.txt\n",
        toml=toml,
    )
    assert (out / "agent" / "probe.txt").read_text() == "allowed.test=200\nother.test=403\n"
    assert (out / "verifier" / "probe.txt").read_text() == verifier_sees
    # Each container's forwarder started with it, and the shared one was spared by the
    # kill between the phases: no exec started one.
    assert counting.forwarder_execs == 0
    records = [json.loads(line) for line in (out / REFUSED_LOG).read_text().splitlines()]
    assert ("agent", "other.test") in {(r["phase"], r["host"]) for r in records}
    assert {path for _, path, _ in servers["other"].seen} == (
        {"/verifier"} if "separate" in verifier_toml else set()
    )


#: The agent reads its forwarder's token (the keep-alive's command line names it), starts
#: a process of its own that looks as much like the forwarder as it can (orphaned, so the
#: keep-alive is its parent; the forwarder's uid), announces that process with the token,
#: through the forwarder and straight to the proxy's socket, then kills the real one and
#: announces again: the process must not be spared by the kill after the phase. On the
#: way it tries the forwarder's memory, as root and as the forwarder's uid.
_FORGE_ANNOUNCEMENT = r"""
fwd=$(grep -l 'egress[.]sock' /proc/[0-9]*/cmdline | xargs grep -L 'commands/c[.]sock' \
    | cut -d/ -f3 | grep -vx 1 | head -1)
token=$(tr '\0' '\n' < /proc/1/cmdline | grep -A1 -x -- --ready | tail -1)
uid=$(awk '/^Uid:/ {print $2}' /proc/$fwd/status)
echo "token=${#token} uid=$uid" > /logs/agent/forge.txt
# Its memory (where a reward or a key could be read or written): not as root, not as its uid.
python3 -c "import os, sys
out = []
for uid in (0, int(sys.argv[2])):
    if uid:
        os.setgid(uid); os.setuid(uid)
    try:
        open(f'/proc/{sys.argv[1]}/mem', 'rb').close(); out.append('opened')
    except PermissionError: out.append('denied')
print('mem=' + ' '.join(out))" "$fwd" "$uid" >> /logs/agent/forge.txt
python3 - "$uid" <<'PY'
import os, sys, time
uid = int(sys.argv[1])
if os.fork():
    os.wait(); sys.exit(0)
os.setsid()
if os.fork():
    os._exit(0)  # orphaned: the keep-alive is now its parent
os.setgroups([]); os.setgid(uid); os.setuid(uid)
open("/tmp/leftover.pid", "w").write(str(os.getpid()))
os.execv(sys.executable, [sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)", "hx-forged-companion"])
PY
for i in $(seq 50); do [ -s /tmp/leftover.pid ] && break; sleep 0.1; done
pid=$(cat /tmp/leftover.pid)
announce() {
    curl -s -m 5 "http://127.0.0.1:3128/.harbor-exec/forwarder-ready/$token/$pid" -o /dev/null -w "via-forwarder=%{http_code}\n"
    python3 -c "import socket, sys
s = socket.socket(socket.AF_UNIX); s.connect('/run/harbor-exec/egress/egress.sock')
s.sendall(f'GET /.harbor-exec/forwarder-ready/{sys.argv[1]}/{sys.argv[2]} HTTP/1.1\r\nHost: forwarder\r\nConnection: close\r\n\r\n'.encode())
print('via-socket=' + s.recv(64).split(b' ')[1].decode())" "$token" "$pid"
}
announce >> /logs/agent/forge.txt
kill -9 "$fwd"
announce >> /logs/agent/forge.txt 2>&1
grep -c . /proc/$pid/cmdline > /dev/null && echo "leftover=$(awk '/^PPid:/ {print $2}' /proc/$pid/status)" >> /logs/agent/forge.txt
"""

_SURVIVORS = r"""
grep -l 'hx-forged-compan[i]on' /proc/[0-9]*/cmdline 2>/dev/null > /logs/verifier/survivors.txt
echo 1 > /logs/verifier/reward.txt
"""


class _WatchingRuntime(_CountingRuntime):
    """Also lists, after each kill between phases, the processes left in the container
    that carry the forged companion's marker."""

    def __init__(self, inner: DockerRuntime) -> None:
        super().__init__(inner)
        self.left_after_kill: list[str] = []
        self.kills = 0

    def stop_processes(self, container_id: str, companion: Any = None) -> bool:
        spared = bool(self._inner.stop_processes(container_id, companion))
        self.kills += 1
        listed = self._inner.exec(
            container_id,
            ["sh", "-c", "grep -l 'hx-forged-compan[i]on' /proc/[0-9]*/cmdline; true"],
        )
        self.left_after_kill += listed.output.decode().splitlines()
        return spared


@pytest.mark.parametrize("verifier", ["shared", "separate"])
def test_a_forged_forwarder_announcement_spares_nothing(
    docker_runtime: DockerRuntime, tmp_path: Path, servers: dict[str, _Server], verifier: str
) -> None:
    toml = (
        _TOML
        if verifier == "shared"
        else _TOML.replace("[verifier]\n", '[verifier]\nenvironment_mode = "separate"\n')
    )
    watching = _WatchingRuntime(docker_runtime)
    out = _run_allowlisted(
        cast(DockerRuntime, watching),
        tmp_path,
        servers,
        solve=_FORGE_ANNOUNCEMENT,
        test=_SURVIVORS,
        toml=toml,
    )
    forged = (out / "agent" / "forge.txt").read_text()
    # The attack had what it needed: the token, the forwarder's uid, a process under the
    # keep-alive (pid 1) as that uid, and the announcements were delivered (answered).
    assert "token=0 " not in forged and "uid=0" not in forged, forged
    assert "leftover=1" in forged, forged
    assert forged.count("via-socket=") == 2, forged
    assert "mem=denied denied" in forged, forged
    # Nothing it announced was spared: gone after the kill, and never in the verifier.
    assert watching.kills >= 1 and watching.left_after_kill == []
    assert (out / "verifier" / "survivors.txt").read_text() == ""
