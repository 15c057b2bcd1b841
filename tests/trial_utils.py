"""One way for tests to run a trial of a task directory and read its rewards."""

from __future__ import annotations

from pathlib import Path

from harbor_exec.sandbox.runtime import ContainerRuntime
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest


def run_task(
    runtime: ContainerRuntime,
    task_dir: Path,
    trials: Path,
    policy: SandboxPolicy | None = None,
) -> TrialResult:
    """Run the task's oracle trial (its tests as verifier) under ``policy`` (default: ours)."""
    spec = TrialSpec(task=load_task(task_dir), trials_dir=trials, policy=policy or SandboxPolicy())
    return run_trial(runtime, TrialRequest(spec))


def rewards(result: TrialResult) -> dict[str, float | int] | None:
    """The verifier's rewards, or None when it gave none."""
    return result.verifier_result.rewards if result.verifier_result else None
