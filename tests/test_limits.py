"""Limits by default: which limits a container gets (task, operator, built-in), engine-free.

The Docker suite (``tests/test_limits_docker.py``) shows that the engine applies them.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.backends.harbor.config import SandboxConfig
from harbor_exec.errors import DiskBudgetExceededError, TrialPhase, is_exception, policy_for
from harbor_exec.sandbox import disk
from harbor_exec.sandbox.disk import WritableLayer, walk
from harbor_exec.tasks.config import EnvironmentConfig
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import (
    DEFAULT_CPUS,
    DEFAULT_MEMORY_MB,
    DEFAULT_NOFILE_LIMIT,
    DEFAULT_SHM_MB,
    DEFAULT_STORAGE_MB,
    ContainerLimits,
    SandboxPolicy,
)
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
from tests.fake_runtime import HOLD, FakeContainer, FakeRuntime
from tests.task_factory import DEFAULT_TOML, make_task


def test_a_task_without_limits_gets_the_documented_defaults() -> None:
    limits = ContainerLimits.resolve(SandboxPolicy(), EnvironmentConfig())
    assert limits == ContainerLimits(
        cpus=DEFAULT_CPUS,
        memory_mb=DEFAULT_MEMORY_MB,
        storage_mb=DEFAULT_STORAGE_MB,
        shm_mb=DEFAULT_SHM_MB,
        nofile_limit=DEFAULT_NOFILE_LIMIT,
        pids_limit=SandboxPolicy().pids_limit,
    )
    assert (DEFAULT_CPUS, DEFAULT_MEMORY_MB, DEFAULT_STORAGE_MB) == (2.0, 4096, 10240)
    assert (DEFAULT_SHM_MB, DEFAULT_NOFILE_LIMIT) == (256, 16384)


def test_a_tasks_own_limits_win_over_the_defaults_both_ways() -> None:
    policy = SandboxPolicy(default_cpus=2, default_memory_mb=4096, default_storage_mb=10240)
    raised = EnvironmentConfig(cpus=8, memory_mb=16384, storage_mb=50000)
    limits = ContainerLimits.resolve(policy, raised)
    assert (limits.cpus, limits.memory_mb, limits.storage_mb) == (8.0, 16384, 50000)
    # A task asking for less gets less: its task.toml is what Harbor would run it with.
    lowered = ContainerLimits.resolve(policy, EnvironmentConfig(cpus=0.5, memory_mb=512))
    assert (lowered.cpus, lowered.memory_mb, lowered.storage_mb) == (0.5, 512, 10240)


def test_dev_shm_never_exceeds_the_containers_memory() -> None:
    limits = ContainerLimits.resolve(
        SandboxPolicy(default_shm_mb=1024), EnvironmentConfig(memory_mb=300)
    )
    assert limits.shm_mb == 300


def test_harbors_deprecated_size_keys_still_set_the_limits() -> None:
    env = EnvironmentConfig.model_validate({"memory": "2G", "storage": "512M"})
    limits = ContainerLimits.resolve(SandboxPolicy(), env)
    assert (limits.memory_mb, limits.storage_mb) == (2048, 512)


def test_operator_defaults_replace_the_built_in_ones() -> None:
    options = SandboxConfig(
        default_cpus=1.5,
        default_memory_mb=1024,
        default_storage_mb=2048,
        default_shm_mb=64,
        default_nofile=4096,
    )
    policy = options.policy(max_concurrent_trials=4, pid_max=32768)
    limits = ContainerLimits.resolve(policy, EnvironmentConfig())
    assert (limits.cpus, limits.memory_mb, limits.storage_mb) == (1.5, 1024, 2048)
    assert (limits.shm_mb, limits.nofile_limit) == (64, 4096)
    # ... and a task's own values still win over the operator's.
    own = ContainerLimits.resolve(policy, EnvironmentConfig(cpus=4, memory_mb=8192))
    assert (own.cpus, own.memory_mb) == (4.0, 8192)


def test_harbor_backend_keeps_the_built_in_defaults_for_what_it_is_not_given(
    tmp_path: Path,
) -> None:
    (tmp_path / "tasks").mkdir()
    backend = HarborBackend(
        tasks_dir=tmp_path / "tasks",
        runtime=FakeRuntime(),
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        default_memory_mb=1024,
        default_nofile=2048,
    )
    policy = backend.policy
    assert (policy.default_memory_mb, policy.default_nofile) == (1024, 2048)
    assert (policy.default_cpus, policy.default_storage_mb) == (DEFAULT_CPUS, DEFAULT_STORAGE_MB)
    assert policy.default_shm_mb == DEFAULT_SHM_MB


def test_trial_containers_carry_the_limits_agent_and_separate_verifier(tmp_path: Path) -> None:
    toml = DEFAULT_TOML + "\n[environment]\nmemory_mb = 768\n"
    task = load_task(make_task(tmp_path / "tasks", "t", toml=toml))
    runtime = FakeRuntime()
    request = TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "trials"))
    request.spec = replace(
        request.spec,
        policy=SandboxPolicy(verifier_mode="separate", default_cpus=1.25, default_nofile=999),
    )
    result = run_trial(runtime, request)
    assert result.exception_info is None
    specs = [c.spec for c in runtime.containers.values()]
    assert len(specs) == 2  # the agent's container and the verifier's
    for spec in specs:
        assert (spec.cpus, spec.memory_mb, spec.nofile_limit) == (1.25, 768, 999)
        assert spec.shm_mb == DEFAULT_SHM_MB and spec.pids_limit == request.spec.policy.pids_limit


def test_cli_help_documents_every_default_option() -> None:
    from harbor_exec.cli.app import app

    for command in ("serve", "validate"):
        out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        for option in (
            "--default-cpus",
            "--default-memory-mb",
            "--default-storage-mb",
            "--default-shm-mb",
            "--default-nofile",
        ):
            assert option in out, (command, option)


# ----------------------------------------------------------------- disk budget


def test_an_agent_past_its_disk_budget_is_stopped_and_graded(tmp_path: Path) -> None:
    def fill(container: FakeContainer) -> int:
        container.write("/tmp/big", b"x" * (3 << 20))
        return HOLD  # runs on until its processes are killed

    toml = DEFAULT_TOML + "\n[environment]\nstorage_mb = 2\n"
    task = load_task(make_task(tmp_path / "tasks", "t", toml=toml))
    runtime = FakeRuntime(solve=fill)
    request = TrialRequest(TrialSpec(task=task, trials_dir=tmp_path / "trials"))
    started = time.monotonic()
    result = run_trial(runtime, request)
    assert time.monotonic() - started < 5  # not the gate's own limit
    assert result.exception_info is not None
    assert is_exception(result.exception_info.exception_type, DiskBudgetExceededError)
    assert "2 MB disk budget" in result.exception_info.exception_message
    # Agent-side and graded, like a timeout: the verifier's reward stands.
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 1}
    assert policy_for("DiskBudgetExceededError").phase is TrialPhase.AGENT
    assert not (tmp_path / "trials" / result.trial_name / "agent" / "exit-code.txt").exists()


def test_an_agent_within_its_disk_budget_runs_on(tmp_path: Path) -> None:
    def small(container: FakeContainer) -> int:
        container.write("/tmp/small", b"x" * (1 << 20))
        return 0

    toml = DEFAULT_TOML + "\n[environment]\nstorage_mb = 2\n"
    task = load_task(make_task(tmp_path / "tasks", "t", toml=toml))
    result = run_trial(
        FakeRuntime(solve=small), TrialRequest(TrialSpec(task=task, trials_dir=tmp_path))
    )
    assert result.exception_info is None


def test_the_walk_counts_allocated_bytes_once_and_stops_past_its_bounds(tmp_path: Path) -> None:
    root = tmp_path / "upper"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "data").write_bytes(os.urandom(256 << 10))
    os.link(root / "a" / "b" / "data", root / "a" / "hardlink")
    with (root / "sparse").open("wb") as sparse:
        sparse.truncate(1 << 30)  # 1 GiB long, nothing allocated
    (root / "loop").symlink_to(root)
    usage = walk(root, stop_above=1 << 30)
    assert not usage.incomplete and usage.entries == 6
    assert 256 << 10 <= usage.bytes_used < (256 << 10) + (64 << 10)
    assert walk(root, stop_above=100 << 10).incomplete == "past the budget"
    assert walk(root, stop_above=1 << 30, max_entries=3).incomplete == "more than 3 files"


def test_between_walks_the_filesystems_loss_bounds_the_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free = [100 << 20]
    monkeypatch.setattr(disk, "_free_bytes", lambda directory: free[0])
    (tmp_path / "file").write_bytes(os.urandom(64 << 10))
    layer = WritableLayer(tmp_path)
    walked = layer.usage(1 << 30)  # the first ask walks
    assert walked.entries == 1 and walked.bytes_used >= 64 << 10
    free[0] -= 5 << 20  # someone wrote 5 MiB: no walk, the estimate is an upper bound
    estimate = layer.usage(1 << 30)
    assert estimate.bytes_used == walked.bytes_used + (5 << 20)
    # An estimate past the budget is never the verdict: a walk decides (the loss was
    # another container's).
    decided = layer.usage(1 << 20)
    assert decided == walked and not decided.incomplete


def test_a_tree_too_deep_for_path_max_counts_as_over_budget(tmp_path: Path) -> None:
    root = tmp_path / "upper"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY)
    try:
        for _ in range(40):  # 40 * 200 characters: past PATH_MAX (4096)
            os.mkdir("d" * 200, dir_fd=fd)
            deeper = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = deeper
    finally:
        os.close(fd)
    usage = walk(root, stop_above=1 << 40)
    assert usage.incomplete == "paths too deep to measure"
    shutil.rmtree(root)  # rmtree walks by file descriptors
