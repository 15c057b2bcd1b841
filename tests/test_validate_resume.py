"""``validate`` under signals and restarts: SIGTERM is handled like Ctrl-C, a job
resumes under the same ``--job-name``, Harbor's viewer can read its configs, and
tasks we cannot run as written are reported by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.server_utils import task_containers
from tests.task_factory import make_task

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "harbor_exec.cli"]
HARBOR_PY = ROOT / ".venv-harbor" / "bin" / "python"

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]


def env() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "250", "NO_COLOR": "1"}


def ours(client: docker.DockerClient, prefix: str) -> list[str]:
    return [c.id for c in task_containers(client, prefix, stopped=True)]


def trial_results(job: Path) -> dict[str, dict[str, Any]]:
    return {
        p.name: json.loads((p / "result.json").read_text())
        for p in job.iterdir()
        if (p / "result.json").is_file()
    }


def test_sigterm_then_resume_runs_only_unfinished(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    for i in range(2):
        make_task(ds, f"rs-fast-{i}")
        make_task(ds, f"rs-slow-{i}", solve="sleep 6", toml="[agent]\ntimeout_sec = 60.0\n")
    jobs = tmp_path / "jobs"
    args = [*CLI, "validate", str(ds), "-n", "4", "--jobs-dir", str(jobs), "--job-name", "j"]
    process = subprocess.Popen(
        args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env()
    )
    client = docker.from_env()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            finished = trial_results(jobs / "j") if (jobs / "j").is_dir() else {}
            if len(finished) >= 2 and len(ours(client, "rs-slow-")) == 2:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the fast trials never finished while the slow ones ran")
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, output
    assert "SIGTERM" in output
    assert ours(client, "rs-") == []
    job = json.loads((jobs / "j" / "result.json").read_text())
    assert job["stats"]["n_cancelled_trials"] == 2
    kept = {
        name: result
        for name, result in trial_results(jobs / "j").items()
        if result["exception_info"] is None
    }
    assert sorted(r["task_name"] for r in kept.values()) == ["rs-fast-0", "rs-fast-1"]

    resumed = subprocess.run(
        args, cwd=tmp_path, capture_output=True, text=True, env=env(), timeout=120
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "kept 2 finished trial(s)" in resumed.stdout
    assert "4/4 passed" in resumed.stdout
    after = trial_results(jobs / "j")
    assert len(after) == 4
    for name, result in kept.items():  # reused, not re-run
        assert after[name]["id"] == result["id"]
    job = json.loads((jobs / "j" / "result.json").read_text())
    assert job["stats"]["evals"]["oracle__ds"]["n_trials"] == 4
    assert job["stats"]["n_cancelled_trials"] == 0
    client.close()

    # A changed dataset is refused, naming what changed.
    make_task(ds, "rs-new")
    refused = subprocess.run(
        args, cwd=tmp_path, capture_output=True, text=True, env=env(), timeout=60
    )
    assert refused.returncode == 2
    assert "task(s) added: rs-new" in refused.stdout
    refused = subprocess.run(
        [*args[:-1], "j", "-k", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert refused.returncode == 2 and "--n-attempts changed" in refused.stdout

    # Harbor's own models read the job and trial configs.
    check = subprocess.run(
        [
            str(HARBOR_PY),
            "-c",
            "import json, sys, pathlib\n"
            "from harbor.models.job.config import JobConfig\n"
            "from harbor.models.trial.config import TrialConfig\n"
            "job = pathlib.Path(sys.argv[1])\n"
            "c = JobConfig.model_validate_json((job / 'config.json').read_text())\n"
            "assert c.agents[0].name == 'oracle' and c.environment.type.value == 'docker', c\n"
            "assert str(c.datasets[0].path).endswith('/ds'), c.datasets\n"
            "n = 0\n"
            "for t in job.iterdir():\n"
            "    if (t / 'result.json').is_file():\n"
            "        tc = TrialConfig.model_validate_json((t / 'config.json').read_text())\n"
            "        assert tc.trial_name == t.name and tc.agent.name == 'oracle'\n"
            "        n += 1\n"
            "print(n)\n",
            str(jobs / "j"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == "4"


def test_gpu_task_and_missing_solution_are_named(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    make_task(ds, "needs-gpu", toml="[environment]\ngpus = 1\ngpu_types = ['H100']\n")
    (make_task(ds, "no-solution") / "solution" / "solve.sh").unlink()
    (ds / "no-solution" / "solution").rmdir()
    done = subprocess.run(
        [*CLI, "validate", str(ds), "--jobs-dir", str(tmp_path / "jobs"), "--job-name", "g"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env(),
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "GpuUnavailableError" in done.stdout
    assert "FileNotFoundError: Solution script not found" in done.stdout
    results = {r["task_name"]: r for r in trial_results(tmp_path / "jobs" / "g").values()}
    gpu = results["needs-gpu"]["exception_info"]
    assert gpu["exception_type"] == "GpuUnavailableError" and "gpus = 1" in gpu["exception_message"]
    assert results["needs-gpu"]["agent_execution"] is None  # refused before anything ran
    missing = results["no-solution"]["exception_info"]
    assert missing["exception_type"] == "FileNotFoundError"
    assert str(ds / "no-solution" / "solution" / "solve.sh") in missing["exception_message"]
    # As in Harbor, the verifier still runs: the task's tests give the reward
    # (validate still counts the task as failed).
    assert results["no-solution"]["verifier_result"]["rewards"] == {"reward": 1.0}
    assert results["no-solution"]["verifier"] is not None
