"""Limits by default, against a real Docker engine: what the container's HostConfig
holds, and what a hostile agent that fills its memory or its disk ends as."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import docker
import pytest

from harbor_exec.backends.harbor.config import SandboxConfig
from harbor_exec.errors import DiskBudgetExceededError, is_exception
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_TRIAL
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.policy import (
    DEFAULT_CPUS,
    DEFAULT_MEMORY_MB,
    DEFAULT_NOFILE_LIMIT,
    DEFAULT_SHM_MB,
    SandboxPolicy,
)
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import Trial, TrialRequest
from tests.task_factory import make_task

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def client() -> Iterator[docker.DockerClient]:
    client = docker.from_env()
    yield client
    client.close()


def run_seeing_host_config(
    runtime: DockerRuntime,
    client: docker.DockerClient,
    task_dir: Path,
    trials: Path,
    policy: SandboxPolicy | None = None,
) -> tuple[TrialResult, dict[str, Any]]:
    """Run a trial; the agent container's HostConfig, as the engine reports it."""
    request = TrialRequest(TrialSpec(task=load_task(task_dir), trials_dir=trials))
    if policy is not None:
        request.spec = replace(request.spec, policy=policy)
    seen: dict[str, Any] = {}

    def on_phase(phase: str) -> None:
        if phase == "agent":
            label = f"{LABEL_TRIAL}={trial.name}"
            (container,) = client.containers.list(filters={"label": label})
            seen.update(container.attrs["HostConfig"])

    trial = Trial(runtime, request, on_phase=on_phase)
    return trial.run(), seen


def nofile(host: dict[str, Any]) -> tuple[int, int]:
    (limit,) = [u for u in host["Ulimits"] or [] if u["Name"] == "nofile"]
    return limit["Soft"], limit["Hard"]


def test_a_task_without_limits_gets_the_documented_defaults(
    docker_runtime: DockerRuntime, client: docker.DockerClient, tmp_path: Path
) -> None:
    task = make_task(tmp_path, "defaults", solve="ulimit -n > /logs/agent/nofile")
    result, host = run_seeing_host_config(docker_runtime, client, task, tmp_path / "t")
    assert result.exception_info is None
    assert host["Memory"] == DEFAULT_MEMORY_MB * MIB
    assert host["MemorySwap"] == host["Memory"]  # no swap
    assert host["NanoCpus"] == int(min(DEFAULT_CPUS, docker_runtime.engine_cpus()) * 1e9)
    assert host["PidsLimit"] == SandboxPolicy().pids_limit
    assert host["ShmSize"] == DEFAULT_SHM_MB * MIB
    assert nofile(host) == (DEFAULT_NOFILE_LIMIT, DEFAULT_NOFILE_LIMIT)
    seen = (tmp_path / "t" / result.trial_name / "agent" / "nofile").read_text()
    assert seen.strip() == str(DEFAULT_NOFILE_LIMIT)


def test_a_tasks_own_memory_and_cpus_raise_the_defaults(
    docker_runtime: DockerRuntime, client: docker.DockerClient, tmp_path: Path
) -> None:
    toml = """
        [agent]
        timeout_sec = 30.0
        [environment]
        cpus = 1.5
        memory_mb = 6144
    """
    task = make_task(tmp_path, "raised", toml=toml)
    low_cpus = SandboxPolicy(default_cpus=0.5)
    result, host = run_seeing_host_config(docker_runtime, client, task, tmp_path / "t", low_cpus)
    assert result.exception_info is None
    assert (host["NanoCpus"], host["Memory"]) == (1_500_000_000, 6144 * MIB)
    assert host["MemorySwap"] == host["Memory"]


def test_more_cpus_than_the_engine_has_get_every_cpu(
    docker_runtime: DockerRuntime, client: docker.DockerClient, tmp_path: Path
) -> None:
    toml = """
        [agent]
        timeout_sec = 30.0
        [environment]
        cpus = 512
    """
    task = make_task(tmp_path, "greedy", toml=toml)
    result, host = run_seeing_host_config(docker_runtime, client, task, tmp_path / "t")
    assert result.exception_info is None
    assert host["NanoCpus"] == docker_runtime.engine_cpus() * 1_000_000_000


def test_operator_defaults_override_the_built_in_ones(
    docker_runtime: DockerRuntime, client: docker.DockerClient, tmp_path: Path
) -> None:
    options = SandboxConfig(
        default_cpus=1.5, default_memory_mb=1024, default_shm_mb=32, default_nofile=4096
    )
    policy = options.policy(max_concurrent_trials=4, pid_max=docker_runtime.pid_max())
    task = make_task(tmp_path, "operator")
    result, host = run_seeing_host_config(docker_runtime, client, task, tmp_path / "t", policy)
    assert result.exception_info is None
    assert (host["NanoCpus"], host["Memory"], host["MemorySwap"]) == (
        1_500_000_000,
        1024 * MIB,
        1024 * MIB,
    )
    assert host["ShmSize"] == 32 * MIB and nofile(host) == (4096, 4096)
    assert host["PidsLimit"] == policy.pids_limit


def test_a_memory_hog_is_oom_killed_without_swap(
    docker_runtime: DockerRuntime, client: docker.DockerClient, tmp_path: Path
) -> None:
    toml = """
        [agent]
        timeout_sec = 60.0
        [environment]
        memory_mb = 128
    """
    # tail keeps a line without newlines whole: it grows until the kernel kills it.
    solve = "head -c 2G /dev/zero | tail > /dev/null; echo ${PIPESTATUS[1]} > /logs/agent/rc"
    task = make_task(tmp_path, "hog", solve=solve, toml=toml)
    started = time.monotonic()
    result, host = run_seeing_host_config(docker_runtime, client, task, tmp_path / "t")
    assert time.monotonic() - started < 45
    assert host["Memory"] == host["MemorySwap"] == 128 * MIB
    rc = (tmp_path / "t" / result.trial_name / "agent" / "rc").read_text().strip()
    assert rc == "137"  # SIGKILL from the OOM killer, not a swap-backed finish
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 1}


def _free_bytes() -> int:
    stat = os.statvfs("/var/lib/docker" if Path("/var/lib/docker").is_dir() else "/")
    return stat.f_bavail * stat.f_frsize


@pytest.mark.parametrize("target", ["/tmp/big", "/logs/agent/big"])
def test_a_3_gib_write_stops_at_the_disk_budget(
    docker_runtime: DockerRuntime, tmp_path: Path, target: str
) -> None:
    budget_mb, slack = 256, 768 * MIB
    assert _free_bytes() > 8 << 30, "not enough free disk to run this test safely"
    toml = f"""
        [agent]
        timeout_sec = 120.0
        [environment]
        storage_mb = {budget_mb}
    """
    # Bounded (3 GiB at most); the sleep shows the agent is stopped, not finished.
    task = make_task(
        tmp_path, "filler", solve=f"head -c 3G /dev/zero > {target}; sleep 100", toml=toml
    )
    before = _free_bytes()
    lowest = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            lowest[0] = min(lowest[0], _free_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    request = TrialRequest(TrialSpec(task=load_task(task), trials_dir=tmp_path / "t"))
    try:
        result = Trial(docker_runtime, request).run()
    finally:
        done.set()
        sampler.join()
    elapsed = time.monotonic() - started
    assert result.exception_info is not None
    assert is_exception(result.exception_info.exception_type, DiskBudgetExceededError)
    assert f"{budget_mb} MB disk budget" in result.exception_info.exception_message
    assert elapsed < 30
    drop = before - lowest[0]
    print(f"{target}: the host lost at most {drop // MIB} MiB; the trial took {elapsed:.1f}s")
    assert drop < budget_mb * MIB + slack, f"the host lost {drop // MIB} MiB"
    # Graded anyway (agent-side, like a timeout), and nothing huge was copied back.
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 1}
    copied = sum(f.stat().st_size for f in (tmp_path / "t").rglob("*") if f.is_file())
    assert copied < 64 * MIB
