"""``harbor-exec validate``: every task of a dataset with the oracle (``solution/solve.sh``
must earn full reward from the task's own tests)."""

from __future__ import annotations

from typing import Annotated

import typer

from harbor_exec.backends.harbor.config import SandboxConfig
from harbor_exec.cli.helpers import (
    filter_tasks,
    open_ray_executor,
    open_runtime,
    run_dataset_job,
    select_dataset,
)
from harbor_exec.cli.options import (
    DEFAULT_JOBS_DIR,
    DEFAULT_N_CONCURRENT,
    JOB,
    AllowUnpinnedOption,
    DatasetRefOption,
    ExcludeTaskOption,
    IncludeTaskOption,
    JobNameOption,
    JobsDirOption,
    MaxRetriesOption,
    NAttemptsOption,
    NConcurrentOption,
    NTasksOption,
    PackageSourceOption,
    RayOption,
    RegistryPathOption,
    RegistryUrlOption,
    TaskRefOption,
    TasksPathArgument,
    takes_package_cache,
    takes_sandbox,
)
from harbor_exec.jobs.dataset import no_scalar_reward
from harbor_exec.network.packages.config import PackageCacheConfig
from harbor_exec.trial.spec import TrialSpec

_SANDBOX = SandboxConfig()


@takes_sandbox()
@takes_package_cache
def validate(
    path: TasksPathArgument = None,
    dataset: DatasetRefOption = None,
    task: TaskRefOption = None,
    package_source: PackageSourceOption = None,
    include_task_name: IncludeTaskOption = None,
    exclude_task_name: ExcludeTaskOption = None,
    n_tasks: NTasksOption = None,
    registry_path: RegistryPathOption = None,
    registry_url: RegistryUrlOption = None,
    task_git_allow_unpinned: AllowUnpinnedOption = False,
    n_concurrent: NConcurrentOption = DEFAULT_N_CONCURRENT,
    n_attempts: NAttemptsOption = 1,
    max_retries: MaxRetriesOption = 0,
    jobs_dir: JobsDirOption = DEFAULT_JOBS_DIR,
    job_name: JobNameOption = None,
    sandbox: SandboxConfig = _SANDBOX,
    package_cache: PackageCacheConfig | None = None,
    ray: RayOption = None,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            rich_help_panel=JOB,
            help="Also fail tasks a trainer cannot use: rewards without a `reward` key.",
        ),
    ] = False,
) -> None:
    """Run the oracle (solution/solve.sh) on every task; exit 1 unless all earn full reward
    (and, with --strict, unless every task writes the `reward` key a trainer reads)."""
    selected = select_dataset(
        path,
        dataset,
        registry_path,
        registry_url,
        task_git_allow_unpinned,
        task=task,
        package_source=package_source,
    )
    selected = filter_tasks(selected, include_task_name, exclude_task_name, n_tasks)
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
        package_cache=package_cache,
        max_retries=max_retries,
        make_spec=lambda task, job_dir: TrialSpec(task, job_dir, policy=policy),
        executor=executor,
    )
    usable = not strict or not any(no_scalar_reward(r) for r in outcome.results)
    raise typer.Exit(0 if outcome.all_passed and usable else 1)


__all__ = ["validate"]
