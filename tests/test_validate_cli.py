"""``harbor-exec validate`` / ``prewarm`` / ``images`` end to end, with a real engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import docker
import pytest

from harbor_exec.jobs.dataset import run_job
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.discovery import discover_tasks
from tests.server_utils import runs_command, task_containers, wait_until
from tests.task_factory import make_task

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "tasks_examples" / "dataset"
CLI = [sys.executable, "-m", "harbor_exec.cli"]

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(
        [*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


def test_examples_validate_and_second_run_builds_nothing(tmp_path: Path) -> None:
    first = cli("validate", str(EXAMPLES), "-n", "4", "--jobs-dir", str(tmp_path), cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "7/7 passed" in first.stdout
    # word-stats writes {"count", "longest"}: the oracle passes, a trainer cannot use it.
    said = " ".join(first.stdout.split())
    assert "1 task(s) a trainer cannot use:" in said
    assert "word-stats: no `reward` key (its keys: count, longest)" in said
    strict = cli(
        "validate", str(EXAMPLES), "--strict", "--jobs-dir", str(tmp_path), "--job-name", "strict",
        cwd=tmp_path,
    )  # fmt: skip
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "7/7 passed" in strict.stdout
    second = cli(
        "validate", str(EXAMPLES), "--jobs-dir", str(tmp_path), "--job-name", "again", cwd=tmp_path
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "images built: 0" in second.stdout
    job = json.loads((tmp_path / "again" / "result.json").read_text())
    assert job["n_total_trials"] == 7
    evals = job["stats"]["evals"]["oracle__dataset"]
    assert evals["n_trials"] == 7 and evals["n_errors"] == 0
    # Harbor's Mean with several keys: each key averaged over all trials, missing = 0.
    assert evals["metrics"][0] == pytest.approx({"count": 1 / 7, "longest": 1 / 7, "reward": 6 / 7})
    trial_dirs = [p for p in (tmp_path / "again").iterdir() if p.is_dir()]
    assert len(trial_dirs) == 7 and all((p / "result.json").is_file() for p in trial_dirs)


def test_build_happens_once_then_is_cached(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    make_task(
        tmp_path / "ds",
        "fresh",
        dockerfile=f"FROM debian:bookworm-slim\nRUN echo {marker} > /marker\n",
    )
    tasks = discover_tasks(tmp_path / "ds").tasks
    try:
        first = run_job(
            docker_runtime,
            tasks,
            jobs_dir=tmp_path / "jobs",
            job_name="a",
            n_attempts=2,
            n_concurrent=2,
        )
        assert first.images_built == 1 and first.all_passed
        second = run_job(docker_runtime, tasks, jobs_dir=tmp_path / "jobs", job_name="b")
        assert second.images_built == 0 and second.all_passed
        assert first.job_result.stats.evals["oracle__adhoc"].pass_at_k == {2: 1.0}
    finally:
        from harbor_exec.trial.trial import image_tag_for

        docker_runtime.remove_image(image_tag_for(tasks[0]))


def test_broken_dataset_reports_every_reason(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    make_task(ds, "good")
    make_task(ds, "no-reward", test="echo nothing here")
    make_task(ds, "wrong-answer", test="echo 0 > /logs/verifier/reward.txt")
    make_task(ds, "bad-build", dockerfile="FROM debian:bookworm-slim\nRUN exit 42\n")
    bad = make_task(ds, "bad-toml")
    (bad / "task.toml").write_text('[environment]\ncpus = "many"\n')
    done = cli(
        "validate", str(ds), "--jobs-dir", str(tmp_path / "jobs"), "--job-name", "j", cwd=tmp_path
    )
    assert done.returncode == 1
    out = done.stdout
    assert "1/5 passed" in out
    assert "RewardFileNotFoundError" in out
    assert "wrong reward {'reward': 0.0}" in out
    assert "SandboxBuildFailedError" in out and "42" in out
    assert "[environment].cpus" in out
    job = json.loads((tmp_path / "jobs" / "j" / "result.json").read_text())
    assert "bad-toml" in json.dumps(job["invalid_tasks"])
    stats = job["stats"]["evals"]["oracle__ds"]
    assert set(stats["exception_stats"]) == {"RewardFileNotFoundError", "SandboxBuildFailedError"}
    assert stats["metrics"] == [{"mean": 0.5}]


def test_ctrl_c_cancels_cleanly(tmp_path: Path) -> None:
    ds = tmp_path / "slow"
    for i in range(3):
        make_task(ds, f"slow-{i}", solve="sleep 120", toml="[agent]\ntimeout_sec = 300.0\n")
    env = {**os.environ, "COLUMNS": "200", "PYTHONFAULTHANDLER": "1"}
    # Ctrl-C at a terminal: a suite started in the background (`cmd &` without job
    # control) inherits SIGINT ignored, and an ignored signal stays ignored across exec,
    # so Python would install no KeyboardInterrupt handler. A handled one resets.
    ignored = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    process = subprocess.Popen(
        [
            *CLI,
            "validate",
            str(ds),
            "-n",
            "3",
            "--jobs-dir",
            str(tmp_path / "jobs"),
            "--job-name",
            "j",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    signal.signal(signal.SIGINT, ignored)
    client = docker.from_env()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            running = task_containers(client, "slow-")
            if len(running) == 3:
                break
            time.sleep(0.2)
        assert len(running) == 3, "the three trials never started"
        assert wait_until(lambda: all(runs_command(c, "sleep 120") for c in running), timeout=60), (
            "the three trials never reached their agent phase"
        )
        process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            # Still running: SIGABRT makes faulthandler print every thread's stack.
            process.send_signal(signal.SIGABRT)
            stacks, _ = process.communicate(timeout=30)
            raise AssertionError(f"validate did not stop after SIGINT:\n{stacks}") from None
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, output
    assert "interrupted" in output
    # Cancelled trials are shown as cancelled, never as failed, and the way back is said.
    assert output.count("cancelled slow-") == 3 and "failed slow-" not in output, output
    said = " ".join(output.split())
    resume = f"--jobs-dir {tmp_path / 'jobs'} --job-name j"
    assert f"resume it (finished trials are kept): harbor-exec validate {ds} -n 3 {resume}" in said
    left = [c.id for c in task_containers(client, "slow-", stopped=True)]
    assert left == []
    job = json.loads((tmp_path / "jobs" / "j" / "result.json").read_text())
    assert job["stats"]["n_cancelled_trials"] == 3
    client.close()


def test_prewarm_reports_built_cached_failed(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    marker = uuid.uuid4().hex
    make_task(ds, "ok", dockerfile=f"FROM debian:bookworm-slim\nRUN echo {marker}\n")
    make_task(ds, "broken", dockerfile="FROM debian:bookworm-slim\nRUN exit 3\n")
    first = cli("prewarm", str(ds), cwd=tmp_path)
    assert first.returncode == 1
    assert "built: 1" in first.stdout and "failed: 1" in first.stdout
    second = cli("prewarm", str(ds / "ok"), cwd=tmp_path)
    assert second.returncode == 0 and "cached: 1" in second.stdout
    listing = cli("images", "list", cwd=tmp_path)
    assert "harbor-exec/env:" in listing.stdout


def test_images_bootstrap_is_idempotent_and_fast(tmp_path: Path) -> None:
    started = time.monotonic()
    done = cli("images", "bootstrap", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "debian:bookworm-slim: present" in done.stdout
    assert "python:3.11-slim-bookworm: present" in done.stdout
    assert time.monotonic() - started < 15


def test_missing_dataset_is_a_clear_error(tmp_path: Path) -> None:
    done = cli("validate", str(tmp_path / "nope"), cwd=tmp_path)
    assert done.returncode == 2
    assert "not a directory" in done.stdout


def test_validate_sandbox_options(tmp_path: Path) -> None:
    """--verifier-mode separate, --default-cpus/--default-memory-mb and --max-log-bytes
    reach every trial."""
    solve = """
        echo planted > /app/planted.txt
        head -c 300000 /dev/zero | tr '\\0' 'x'
        cat /sys/fs/cgroup/memory/memory.limit_in_bytes > /logs/artifacts/memory 2>/dev/null || true
    """
    test = """
        if [ -e /app/planted.txt ]; then echo 0 > /logs/verifier/reward.txt
        else echo 1 > /logs/verifier/reward.txt; fi
    """
    make_task(tmp_path / "ds", "sandboxed", solve=solve, test=test)
    result = cli(
        "validate",
        str(tmp_path / "ds"),
        "--jobs-dir",
        str(tmp_path / "jobs"),
        "--job-name",
        "sandbox",
        "--verifier-mode",
        "separate",
        "--default-memory-mb",
        "300",
        "--max-log-bytes",
        "100000",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (trial,) = [p for p in (tmp_path / "jobs" / "sandbox").iterdir() if p.is_dir()]
    written = json.loads((trial / "result.json").read_text())
    assert written["verifier_environment_mode"] == "separate"
    assert (trial / "artifacts" / "logs" / "artifacts" / "memory").read_text().strip() == str(
        300 * 1024 * 1024
    )
    oracle = (trial / "agent" / "oracle.txt").read_bytes()
    assert len(oracle) < 100_200 and b"200000 bytes cut here" in oracle


def test_an_init_task_validates_as_it_stands(tmp_path: Path) -> None:
    made = cli("init", "task", "hello", cwd=tmp_path)
    assert made.returncode == 0, made.stdout + made.stderr
    checked = cli("validate", "hello", "--jobs-dir", str(tmp_path / "jobs"), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "1/1 passed" in checked.stdout
