"""``harbor-exec validate``: every task of a dataset with the oracle (``solution/solve.sh``
must earn full reward from the task's own tests)."""

from __future__ import annotations

import typer

from harbor_exec.backends.harbor.config import SandboxConfig
from harbor_exec.cli.helpers import open_ray_executor, open_runtime, run_dataset_job, select_dataset
from harbor_exec.cli.options import (
    DEFAULT_JOBS_DIR,
    DEFAULT_N_CONCURRENT,
    AllowUnpinnedOption,
    DatasetRefOption,
    JobNameOption,
    JobsDirOption,
    NAttemptsOption,
    NConcurrentOption,
    PackageSourceOption,
    RayOption,
    RegistryPathOption,
    RegistryUrlOption,
    TaskRefOption,
    TasksPathArgument,
    takes_sandbox,
)
from harbor_exec.trial.spec import TrialSpec

_SANDBOX = SandboxConfig()


@takes_sandbox()
def validate(
    path: TasksPathArgument = None,
    dataset: DatasetRefOption = None,
    task: TaskRefOption = None,
    package_source: PackageSourceOption = None,
    registry_path: RegistryPathOption = None,
    registry_url: RegistryUrlOption = None,
    task_git_allow_unpinned: AllowUnpinnedOption = False,
    n_concurrent: NConcurrentOption = DEFAULT_N_CONCURRENT,
    n_attempts: NAttemptsOption = 1,
    jobs_dir: JobsDirOption = DEFAULT_JOBS_DIR,
    job_name: JobNameOption = None,
    sandbox: SandboxConfig = _SANDBOX,
    ray: RayOption = None,
) -> None:
    """Run the oracle (solution/solve.sh) on every task; exit 1 unless all earn full reward."""
    selected = select_dataset(
        path,
        dataset,
        registry_path,
        registry_url,
        task_git_allow_unpinned,
        task=task,
        package_source=package_source,
    )
    executor = open_ray_executor(ray) if ray else None
    runtime = None if executor is not None else open_runtime()
    engine = executor if executor is not None else runtime
    assert engine is not None
    policy = sandbox.policy(max_concurrent_trials=n_concurrent, pid_max=engine.pid_max)
    outcome = run_dataset_job(
        "validate",
        selected,
        runtime,
        jobs_dir=jobs_dir,
        job_name=job_name,
        n_concurrent=n_concurrent,
        n_attempts=n_attempts,
        make_spec=lambda task, job_dir: TrialSpec(task, job_dir, policy=policy),
        executor=executor,
    )
    raise typer.Exit(0 if outcome.all_passed else 1)


__all__ = ["validate"]
