"""The sandbox against a hostile agent: each attack is a task that tries it.

A policy under RL training finds every way to raise its reward that we leave
open. These tasks detach background writers, replace ``tar``/``rm``/``cat``,
fork-bomb their pids limit, print hundreds of megabytes, plant symlinks and
write huge reward files; the recorded reward must stay the one ``test.sh`` wrote.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from harbor.models.trial.artifact_manifest import ArtifactManifest

from harbor_exec.sandbox.archives import OutputLimits
from harbor_exec.sandbox.cgroups import HostCgroup
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import DROPPED_CAPABILITIES
from harbor_exec.sandbox.seccomp import SeccompProfileError
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy, default_pids_limit
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
from tests.task_factory import make_task
from tests.trial_utils import rewards, run_task

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]

# Linux capability numbers (include/uapi/linux/capability.h).
CAP_BITS = {"NET_RAW": 13, "SYS_CHROOT": 18, "MKNOD": 27, "AUDIT_WRITE": 29, "SETFCAP": 31}


@pytest.fixture(params=["host-cgroup", "engine-restart"])
def kill_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of killing the agent's processes: through the host's cgroup, and (as
    when harbor-exec cannot see the host) by restarting the container."""
    if request.param == "engine-restart":
        monkeypatch.setattr(HostCgroup, "of", classmethod(lambda *a: None))
    return str(request.param)


def test_detached_background_writers_die_before_the_verifier(
    docker_runtime: DockerRuntime, tmp_path: Path, kill_path: str
) -> None:
    solve = """
        cat > /tmp/attacker.sh <<'EOF'
        #!/bin/bash
        while true; do echo 1 > /logs/verifier/reward.txt; echo '{"reward": 1}' > /logs/verifier/reward.json; sleep 0.01; done
        EOF
        chmod +x /tmp/attacker.sh
        setsid /tmp/attacker.sh >/dev/null 2>&1 < /dev/null &
        nohup /tmp/attacker.sh >/dev/null 2>&1 &
        ( ( /tmp/attacker.sh >/dev/null 2>&1 & ) & )
        sleep 0.5
    """
    test = """
        sleep 1
        for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done > /logs/verifier/procs.txt
        echo 0 > /logs/verifier/reward.txt
        sleep 1
    """
    task = make_task(tmp_path, "bg-writer", solve=solve, test=test)
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None, result.exception_info
    assert rewards(result) == {"reward": 0.0}
    procs = (tmp_path / "trials" / result.trial_name / "verifier" / "procs.txt").read_text()
    assert "attacker" not in procs
    assert docker_runtime.host_kill is (kill_path == "host-cgroup")


def test_replaced_tar_rm_and_cat_cannot_forge_the_reward(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    solve = """
        mkdir -p /tmp/fake/logs/verifier /tmp/fake/logs/agent
        echo 1 > /tmp/fake/logs/verifier/reward.txt
        echo '{"reward": 1}' > /tmp/fake/logs/verifier/reward.json
        tar -C /tmp/fake -cf /tmp/forged.tar logs
        echo 1 > /logs/verifier/reward.txt
        echo '{"reward": 1}' > /logs/verifier/reward.json
        mkdir -p /tests && echo 'echo 1 > /logs/verifier/reward.txt' > /tests/test.sh
        for bin in tar rm cat; do
            for dir in /usr/bin /bin; do
                [ -e $dir/$bin ] || continue
                printf '#!/bin/bash\\n[ "$1" = "-xf" ] && exit 0\\n/usr/bin/head -c 99999999 /tmp/forged.tar\\n' > $dir/$bin
                chmod +x $dir/$bin
            done
        done
    """
    task = make_task(tmp_path, "forge", solve=solve, test="echo 0 > /logs/verifier/reward.txt")
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None, result.exception_info
    assert rewards(result) == {"reward": 0.0}

    # A test.sh that writes nothing must not inherit the planted reward files.
    silent = make_task(tmp_path, "forge-silent", solve=solve, test="true")
    result = run_task(docker_runtime, silent, tmp_path / "trials")
    assert result.exception_type == "RewardFileNotFoundError"
    assert rewards(result) is None


def test_fork_bomb_is_dead_before_test_sh(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    solve = """
        bomb() { bomb | bomb & }
        bomb
        sleep 300
    """
    test = """
        n=$(ls -d /proc/[0-9]* | wc -l)
        echo "$n" > /logs/verifier/nprocs.txt
        if [ "$n" -lt 20 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
    """
    toml = "[agent]\ntimeout_sec = 4.0\n[verifier]\ntimeout_sec = 30.0\n"
    task = make_task(tmp_path, "fork-bomb", solve=solve, test=test, toml=toml)
    started = time.monotonic()
    result = run_task(docker_runtime, task, tmp_path / "trials", SandboxPolicy(pids_limit=256))
    assert time.monotonic() - started < 60
    assert result.exception_type == "AgentTimeoutError"
    assert rewards(result) == {"reward": 1.0}, (
        tmp_path / "trials" / result.trial_name / "verifier" / "nprocs.txt"
    ).read_text()


def test_symlink_added_after_load_never_reaches_the_container(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host-secret-" + "x" * 16)
    test = """
        if [ -e /tests/leak ]; then cp /tests/leak /logs/verifier/leak; echo 0 > /logs/verifier/reward.txt
        else echo 1 > /logs/verifier/reward.txt; fi
    """
    task_dir = make_task(tmp_path, "late-symlink", test=test)
    task = load_task(task_dir)
    (task_dir / "tests" / "leak").symlink_to(secret)
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\necho 0 > /logs/verifier/reward.txt\n")
    result = run_trial(
        docker_runtime, TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "trials"))
    )
    # The snapshot taken at load runs: neither the link nor the rewritten test.sh.
    assert rewards(result) == {"reward": 1.0}
    for path in (tmp_path / "trials").rglob("*"):
        assert not path.is_file() or b"host-secret" not in path.read_bytes()


def test_hostile_output_is_bounded(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    solve = """
        head -c 200000000 /dev/zero | tr '\\0' 'x'
        echo THE-END
        ln -s /etc/shadow /logs/agent/shadow-link
        ln /etc/passwd /logs/agent/passwd-hardlink 2>/dev/null || true
        mknod /logs/agent/device c 1 3 2>/dev/null || true
    """
    task = make_task(tmp_path, "big-print", solve=solve)
    cap = 1 << 20
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS
    before = _rss_kib("VmRSS")
    result = run_task(
        docker_runtime,
        task,
        tmp_path / "trials",
        SandboxPolicy(output=OutputLimits(max_file_bytes=cap)),
    )
    peak = _rss_kib("VmHWM")
    assert result.exception_info is None and rewards(result) == {"reward": 1.0}
    agent = tmp_path / "trials" / result.trial_name / "agent"
    kept = (agent / "oracle.txt").read_bytes()
    assert len(kept) < cap + 200
    assert kept.startswith(b"[harbor-exec: ") and b"bytes cut here" in kept
    assert kept.endswith(b"THE-END\n")
    assert not (agent / "shadow-link").exists() and not (agent / "device").exists()
    assert (peak - before) < 64 * 1024, f"RSS grew by {(peak - before) // 1024} MiB"


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def test_huge_reward_file_is_a_named_error_fast(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    test = """
        awk 'BEGIN { printf "{"; for (i = 0; i < 400000; i++) printf "%s\\"k%d\\": 1", (i ? "," : ""), i; print "}" }' > /logs/verifier/reward.json
    """
    task = make_task(tmp_path, "huge-reward", test=test)
    started = time.monotonic()
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert time.monotonic() - started < 30
    assert result.exception_type == "VerifierOutputParseError"
    assert result.exception_info is not None
    assert "at most" in result.exception_info.exception_message


def test_capabilities_are_dropped_and_can_be_asked_back(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    solve = "grep CapEff /proc/self/status | awk '{print $2}' > /logs/agent/capeff"
    plain = make_task(tmp_path, "caps", solve=solve)
    result = run_task(docker_runtime, plain, tmp_path / "trials")
    capeff = int((tmp_path / "trials" / result.trial_name / "agent" / "capeff").read_text(), 16)
    for name in DROPPED_CAPABILITIES:
        assert not capeff & (1 << CAP_BITS[name]), name
    assert capeff & (1 << 0)  # CHOWN: package installs still work

    dockerfile = 'FROM debian:bookworm-slim\nLABEL harbor-exec.cap-add="SYS_CHROOT, NET_ADMIN"\nWORKDIR /app\n'
    asking = make_task(tmp_path, "caps-back", solve=solve, dockerfile=dockerfile)
    result = run_task(docker_runtime, asking, tmp_path / "trials")
    capeff = int((tmp_path / "trials" / result.trial_name / "agent" / "capeff").read_text(), 16)
    assert capeff & (1 << CAP_BITS["SYS_CHROOT"])
    assert not capeff & (1 << 12)  # NET_ADMIN is not one we give back


def test_default_pids_limit_keeps_twice_the_trials_under_pid_max() -> None:
    for concurrency in (1, 4, 8, 32):
        for pid_max in (32768, 4194304):
            limit = default_pids_limit(concurrency, pid_max)
            assert 2 * concurrency * limit < pid_max or limit == 128
            assert limit <= 4096


SEPARATE_TOML = """
artifacts = ["/app/result.txt", {source = "/app/out", destination = "out-dir", exclude = ["*.tmp"]}]

[agent]
timeout_sec = 30.0

[verifier]
timeout_sec = 30.0
environment_mode = "separate"
"""

SEPARATE_SOLVE = """
    echo 42 > /app/result.txt
    mkdir -p /app/out && echo kept > /app/out/a.txt && echo junk > /app/out/b.tmp
    echo agent-only > /app/other.txt
    mkdir -p /logs/artifacts && echo art > /logs/artifacts/a.txt
    echo 1 > /logs/verifier/reward.txt
"""

SEPARATE_TEST = """
    ok=1
    [ -f /opt/verifier-tool/marker ] || ok=0
    [ "$(cat /app/result.txt)" = 42 ] || ok=0
    [ -f /app/out/a.txt ] && [ ! -e /app/out/b.tmp ] || ok=0
    [ ! -e /app/other.txt ] || ok=0
    [ "$(cat /logs/artifacts/a.txt)" = art ] || ok=0
    [ -e /logs/verifier/reward.txt ] && ok=0
    echo $ok > /logs/verifier/reward.txt
"""


def test_separate_verifier_sees_only_the_artifacts(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    task = make_task(
        tmp_path, "separate", solve=SEPARATE_SOLVE, test=SEPARATE_TEST, toml=SEPARATE_TOML
    )
    # Harbor's tests/Dockerfile: the verifier image, built with tests/ as its context.
    (task / "tests" / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\nRUN mkdir -p /opt/verifier-tool /app && "
        "echo ok > /opt/verifier-tool/marker\nCOPY . /tests/\n"
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None, result.exception_info
    assert result.verifier_environment_mode == "separate"
    assert rewards(result) == {"reward": 1.0}
    out = tmp_path / "trials" / result.trial_name
    # Harbor's layout: at the container path, or at the declared destination.
    assert (out / "artifacts" / "app" / "result.txt").read_text() == "42\n"
    assert (out / "artifacts" / "out-dir" / "a.txt").read_text() == "kept\n"
    assert not (out / "artifacts" / "out-dir" / "b.tmp").exists()
    manifest = json.loads((out / "artifacts" / "manifest.json").read_text())
    assert [(m["source"], m["destination"], m["type"], m["status"]) for m in manifest] == [
        ("/logs/artifacts", "artifacts/logs/artifacts", "directory", "ok"),
        ("/app/result.txt", "artifacts/app/result.txt", "file", "ok"),
        ("/app/out", "artifacts/out-dir", "directory", "ok"),
    ]
    ArtifactManifest(entries=manifest)  # Harbor's own reader takes it
    written = json.loads((out / "result.json").read_text())
    assert written["verifier_environment_mode"] == "separate"


def test_forced_separate_mode_hides_the_agents_files(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    solve = "echo planted > /app/planted.txt; mkdir -p /logs/artifacts; echo art > /logs/artifacts/a.txt"
    test = """
        if [ -e /app/planted.txt ] || [ ! -f /logs/artifacts/a.txt ]; then echo 0 > /logs/verifier/reward.txt
        else echo 1 > /logs/verifier/reward.txt; fi
    """
    task = make_task(tmp_path, "force-separate", solve=solve, test=test)
    shared = run_task(docker_runtime, task, tmp_path / "trials")
    assert shared.verifier_environment_mode == "shared" and rewards(shared) == {"reward": 0.0}
    separate = run_task(
        docker_runtime, task, tmp_path / "trials", SandboxPolicy(verifier_mode="separate")
    )
    assert separate.verifier_environment_mode == "separate"
    assert rewards(separate) == {"reward": 1.0}
    assert not docker_runtime.our_containers(owner=docker_runtime.owner)


def test_hostile_artifacts_reach_the_separate_verifier_only_as_regular_files(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    """Declared artifacts that are symlinks, devices or huge files: the verifier gets
    only bounded regular files, never what a link points at."""
    toml = """
artifacts = ["/app/link.txt", "/app/out"]

[agent]
timeout_sec = 30.0

[verifier]
timeout_sec = 30.0
environment_mode = "separate"
"""
    solve = """
        echo host-side-secret > /root/secret.txt
        ln -s /root/secret.txt /app/link.txt
        mkdir -p /app/out
        ln -s /root/secret.txt /app/out/inner-link
        ln /root/secret.txt /app/out/hardlink 2>/dev/null || true
        mknod /app/out/device c 1 3 2>/dev/null || true
        head -c 3000000 /dev/zero | tr '\\0' 'y' > /app/out/big.txt
        echo fine > /app/out/ok.txt
    """
    test = """
        ok=1
        [ -e /app/link.txt ] && ok=0
        [ -e /app/out/inner-link ] && ok=0
        [ -e /app/out/device ] && ok=0
        grep -rq host-side-secret /app /logs 2>/dev/null && [ ! -f /app/out/hardlink ] && ok=0
        [ "$(cat /app/out/ok.txt)" = fine ] || ok=0
        [ "$(stat -c %s /app/out/big.txt)" -lt 1100000 ] || ok=0
        echo $ok > /logs/verifier/reward.txt
    """
    task = make_task(tmp_path, "hostile-artifacts", solve=solve, test=test, toml=toml)
    policy = SandboxPolicy(output=OutputLimits(max_file_bytes=1 << 20))
    result = run_task(docker_runtime, task, tmp_path / "trials", policy)
    assert result.exception_info is None, result.exception_info
    assert rewards(result) == {"reward": 1.0}
    kept = tmp_path / "trials" / result.trial_name / "artifacts" / "app"
    assert (kept / "out").is_dir()
    assert not (kept / "link.txt").exists() and not (kept / "out" / "inner-link").exists()
    assert (kept / "out" / "big.txt").stat().st_size < (1 << 20) + 200


# The agent's ptrace(PTRACE_ATTACH) of the keep-alive (the one process the kill between
# the agent and the verifier spares), and process_vm_readv of its memory: errno or 0.
# The agent's own child: ptrace would reach it but for seccomp (the keep-alive and the init
# are out of reach anyway, not dumpable: tests/test_runtime_images.py).
_PTRACE_OWN_CHILD = r"""
sleep 30 &
echo $! > /tmp/target
cat > /tmp/attach.py <<'EOF'
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
pid = int(open("/tmp/target").read())
attach = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH
attach_errno = ctypes.get_errno()
buf = ctypes.create_string_buffer(8)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
local = iovec(ctypes.cast(buf, ctypes.c_void_p), 8)
remote = iovec(0x400000, 8)
libc.syscall.restype = ctypes.c_long
vm = libc.syscall(310, pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)  # x86-64
vm_errno = ctypes.get_errno()
print(f"attach={attach} errno={attach_errno} vm={vm} vm_errno={vm_errno}")
EOF
python3 /tmp/attach.py > /logs/agent/ptrace.txt 2>&1
"""
_PYTHON_IMAGE = "FROM python:3.11-slim-bookworm\nWORKDIR /app\n"
# test.sh waits (without `sleep`: the agent's own, in shared mode) for anything the agent
# left to act, then lists what runs and writes 0.
_LIST_AND_FAIL = r"""
end=$((SECONDS + 2)); while [ $SECONDS -lt $end ]; do :; done
for p in /proc/[0-9]*; do tr '\0' ' ' < $p/cmdline 2>/dev/null; echo; done > /logs/verifier/procs.txt
echo 0 > /logs/verifier/reward.txt
end=$((SECONDS + 2)); while [ $SECONDS -lt $end ]; do :; done
"""
_KEEP_ALIVE = "/opt/harbor-exec-runtime/bin/busybox sleep 2147483647"


@pytest.mark.parametrize("agent_user", ["root", "nobody"])
def test_ptrace_of_the_keep_alive_is_denied(
    docker_runtime: DockerRuntime, tmp_path: Path, kill_path: str, agent_user: str
) -> None:
    toml = f'[agent]\ntimeout_sec = 30.0\nuser = "{agent_user}"\n[verifier]\ntimeout_sec = 30.0\n'
    task = make_task(
        tmp_path,
        f"ptrace-{agent_user}",
        solve=_PTRACE_OWN_CHILD,
        test=_LIST_AND_FAIL,
        toml=toml,
        dockerfile=_PYTHON_IMAGE,
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None, result.exception_info
    assert rewards(result) == {"reward": 0.0}
    trial = tmp_path / "trials" / result.trial_name
    # EPERM (1) from the seccomp profile, for root as for any user.
    assert (trial / "agent" / "ptrace.txt").read_text().split() == [
        "attach=-1",
        "errno=1",
        "vm=-1",
        "vm_errno=1",
    ]
    procs = (trial / "verifier" / "procs.txt").read_text().splitlines()
    assert _KEEP_ALIVE + " " in procs  # the keep-alive, unchanged, from the runtime
    assert docker_runtime.host_kill is (kill_path == "host-cgroup")


def test_a_task_can_ask_for_ptrace_back(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    dockerfile = _PYTHON_IMAGE + 'LABEL harbor-exec.seccomp-allow="ptrace, process_vm_readv"\n'
    task = make_task(
        tmp_path,
        "ptrace-back",
        solve=_PTRACE_OWN_CHILD,
        test=_LIST_AND_FAIL,
        dockerfile=dockerfile,
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None, result.exception_info
    found = (tmp_path / "trials" / result.trial_name / "agent" / "ptrace.txt").read_text()
    assert found.split()[:2] == ["attach=0", "errno=0"], found
    assert "vm_errno=1 " not in found + " "  # not EPERM: read (or EFAULT at that address)


def test_a_planted_sleep_never_runs(
    docker_runtime: DockerRuntime, tmp_path: Path, kill_path: str
) -> None:
    planted = (
        "#!/bin/bash\ntouch /tmp/planted-ran\n"
        "while true; do echo 1 > /logs/verifier/reward.txt; done\n"
    )
    solve = f"""
        for bin in /usr/local/bin/sleep /usr/bin/sleep /bin/sleep; do
            cat > $bin.new <<'EOF'
{planted}EOF
            chmod +x $bin.new && mv -f $bin.new $bin
        done
    """
    test = "[ -e /tmp/planted-ran ] && echo ran > /logs/verifier/marker.txt\n" + _LIST_AND_FAIL
    task = make_task(tmp_path, "planted-sleep", solve=solve, test=test)
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None, result.exception_info
    assert rewards(result) == {"reward": 0.0}
    trial = tmp_path / "trials" / result.trial_name
    assert not (trial / "verifier" / "marker.txt").exists()
    assert _KEEP_ALIVE + " " in (trial / "verifier" / "procs.txt").read_text().splitlines()


def test_deleting_sleep_is_no_environment_error(
    docker_runtime: DockerRuntime, tmp_path: Path, kill_path: str
) -> None:
    solve = "rm -f /usr/local/bin/sleep /usr/bin/sleep /bin/sleep"
    test = "! command -v sleep && echo 1 > /logs/verifier/reward.txt"
    task = make_task(tmp_path, "no-sleep", solve=solve, test=test)
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert result.exception_info is None, result.exception_info
    assert result.reward == 1.0


def test_a_missing_seccomp_profile_refuses_to_run(tmp_path: Path) -> None:
    with pytest.raises(SeccompProfileError, match="HARBOR_EXEC_SECCOMP_PROFILE"):
        DockerRuntime(seccomp_profile=tmp_path / "absent.json")


def test_the_runtime_volume_is_filled_once_per_engine(
    docker_runtime: DockerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    docker_runtime._ensure_runtime_volume("debian:bookworm-slim")
    # Another service on the same engine finds it complete and never writes over the
    # busybox running trials execute.
    other = DockerRuntime()
    try:
        monkeypatch.setattr(other._api, "put_archive", lambda *a, **k: pytest.fail("rewritten"))
        assert other._ensure_runtime_volume("debian:bookworm-slim") == (
            docker_runtime._ensure_runtime_volume("debian:bookworm-slim")
        )
    finally:
        other.close()
