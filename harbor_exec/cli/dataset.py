"""``harbor-exec validate`` and ``harbor-exec prewarm``: whole datasets with the oracle;
``run_dataset_job``, the job display ``validate`` and ``run`` share."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harbor_exec.agents.native.layer import AgentLayerError
from harbor_exec.bundler.errors import BundleError
from harbor_exec.cli import sandbox
from harbor_exec.cli.app import app
from harbor_exec.errors import DatasetError, DockerUnavailableError, HarborExecError, TaskError
from harbor_exec.executors.spec import TrialSecrets
from harbor_exec.jobs.dataset import (
    ORACLE_CONFIG,
    JobEvent,
    JobInterrupted,
    JobOutcome,
    JobResumeError,
    is_full_reward,
    run_job,
    summary_rows,
)
from harbor_exec.jobs.prewarm import PrewarmEvent, prepare_prewarm_agent, prewarm_tasks, tally
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sources.packages import (
    PACKAGE_SOURCE_ENV,
    FetchedPackage,
    PackageError,
    check_local_manifest,
    fetch_dataset_package,
    fetch_task,
    open_package_source,
)
from harbor_exec.sources.registry import RegistryError, fetch_dataset, find_dataset, read_registry
from harbor_exec.tasks.discovery import Discovery, discover_tasks
from harbor_exec.tasks.task import Task, load_task
from harbor_exec.trial.spec import TrialSpec

if TYPE_CHECKING:
    from harbor_exec.executors.base import TrialExecutor

console = Console()


def open_runtime() -> DockerRuntime:
    """The Docker runtime, or a clear message and exit code 2 when the engine is missing."""
    try:
        runtime = DockerRuntime()
    except DockerUnavailableError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    reaped = runtime.reap_orphans()
    if reaped:
        console.print(f"removed {len(reaped)} container(s) left by a dead harbor-exec process")
    return runtime


def load_dataset(path: Path) -> Discovery:
    try:
        return discover_tasks(path)
    except DatasetError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None


DatasetRefOption = Annotated[
    str | None,
    typer.Option(
        "-d",
        "--dataset",
        metavar="NAME[@VERSION]|ORG/NAME[@REF]",
        help="Instead of PATH: a dataset of Harbor's JSON registry (--registry-path or "
        "--registry-url; its tasks fetched from git by commit), or a dataset package "
        "org/name@ref from --package-source (every task digest checked).",
    ),
]
TaskRefOption = Annotated[
    str | None,
    typer.Option(
        "-t",
        "--task",
        metavar="ORG/NAME[@REF]",
        help="Instead of PATH: one task package (ref: latest, a tag, a revision or "
        "sha256:<hex>) from --package-source, its digest checked.",
    ),
]
PackageSourceOption = Annotated[
    str | None,
    typer.Option(
        "--package-source",
        metavar="DIR|URL",
        envvar=PACKAGE_SOURCE_ENV,
        help="Where Harbor packages (org/name@ref) come from: a directory laid out as "
        "Harbor's package cache, or a mirror URL (docs/datasets.md).",
    ),
]
RegistryPathOption = Annotated[
    Path | None, typer.Option("--registry-path", help="A registry JSON file (Harbor's format).")
]
RegistryUrlOption = Annotated[
    str | None, typer.Option("--registry-url", help="A registry JSON file's URL.")
]
AllowUnpinnedOption = Annotated[
    bool,
    typer.Option(
        "--task-git-allow-unpinned",
        help="Run a registry task without a full git_commit_id at its remote's HEAD.",
    ),
]


@dataclass(frozen=True)
class SelectedDataset:
    """What a job runs: its tasks, its name, and Harbor's ``datasets`` entry for it."""

    discovery: Discovery
    name: str
    config: dict[str, Any] | None  # None: no dataset (``-t``: ``tasks_config``)
    path: Path | None = None
    #: Harbor's job ``tasks`` entries (``-t``).
    tasks_config: list[dict[str, Any]] | None = None


def select_dataset(
    path: Path | None,
    ref: str | None,
    registry_path: Path | None,
    registry_url: str | None,
    allow_unpinned: bool,
    *,
    task: str | None = None,
    package_source: str | None = None,
) -> SelectedDataset:
    """PATH, ``-d name@version`` from a registry, ``-d org/name@ref`` or ``-t
    org/name@ref`` from the package source, as ``harbor run`` takes them; a bad
    choice, a failed fetch or a digest mismatch is exit 2 with the reason, before
    anything runs."""
    if sum(x is not None for x in (path, ref, task)) != 1:
        _usage_error(
            "give a task or dataset PATH, or -d NAME[@VERSION] with a registry, or -t/-d "
            "ORG/NAME[@REF] with a package source"
        )
    package = ref is not None and "/" in ref.partition("@")[0]
    if (path is not None or task is not None or package) and (registry_path or registry_url):
        _usage_error("--registry-path and --registry-url go with -d NAME[@VERSION] only")
    if path is not None:
        root = path.resolve()
        discovery = load_dataset(path)
        try:
            check_local_manifest(
                root, [t.path for t in discovery.tasks], [t.name for t in discovery.tasks]
            )
        except PackageError as exc:
            _usage_error(str(exc))
        return SelectedDataset(discovery, root.name, {"path": str(root)}, root)
    if task is not None or package:
        return _select_package(task, ref if package else None, package_source)
    assert ref is not None
    if (registry_path is None) == (registry_url is None):
        _usage_error("-d needs exactly one of --registry-path and --registry-url")
    try:
        datasets = read_registry(path=registry_path, url=registry_url)
        dataset = find_dataset(datasets, ref)
        fetched = fetch_dataset(dataset, allow_unpinned=allow_unpinned)
    except RegistryError as exc:
        _usage_error(str(exc))
    tasks: list[Task] = []
    broken: list[TaskError] = []
    for item in fetched:
        try:
            loaded = load_task(item.directory)
        except TaskError as exc:
            broken.append(exc)
            continue
        origin = {
            "git_url": str(item.task.git_url),
            "git_commit_id": item.commit,
            "path": item.task.path,
        }
        tasks.append(replace(loaded, origin=origin))
    registry: dict[str, Any] = (
        {"path": str(registry_path.resolve())} if registry_path else {"url": registry_url}
    )
    config = {"name": dataset.name, "version": dataset.version, "registry": registry}
    return SelectedDataset(Discovery(tasks=tasks, broken=broken), dataset.name, config)


def _select_package(task: str | None, dataset: str | None, location: str | None) -> SelectedDataset:
    """``-t org/name@ref`` or ``-d org/name@ref``: fetched and checked through the
    operator's package source; recorded as Harbor records package tasks."""
    flag = "-t" if task is not None else "-d"
    try:
        source = open_package_source(location)
        if source is None:
            _usage_error(
                f"{flag} {task or dataset} is a Harbor package: name where packages come "
                f"from with --package-source DIR|URL (or ${PACKAGE_SOURCE_ENV})"
            )
        if task is not None:
            fetched = fetch_task(source, task)
            ok, error = _load_package_task(fetched)
            discovery = Discovery(tasks=[ok] if ok else [], broken=[error] if error else [])
            entry = {
                "name": fetched.ref.full_name,
                "ref": fetched.ref.ref,
                "digest": fetched.digest,
                "package_source": source.location,
            }
            return SelectedDataset(discovery, "adhoc", None, tasks_config=[entry])
        assert dataset is not None
        fetched_dataset = fetch_dataset_package(source, dataset)
    except PackageError as exc:
        _usage_error(str(exc))
    tasks: list[Task] = []
    broken: list[TaskError] = []
    for item in fetched_dataset.tasks:
        ok, error = _load_package_task(item)
        if ok is not None:
            tasks.append(ok)
        if error is not None:
            broken.append(error)
    name = fetched_dataset.package.ref.full_name
    config = {
        "name": name,
        "ref": fetched_dataset.package.digest,
        "package_source": source.location,
    }
    return SelectedDataset(Discovery(tasks=tasks, broken=broken), name, config)


def _load_package_task(fetched: FetchedPackage) -> tuple[Task | None, TaskError | None]:
    try:
        task = load_task(fetched.directory)
    except TaskError as exc:
        return None, exc
    return replace(task, origin=fetched.task_id), None


def _usage_error(message: str) -> NoReturn:
    console.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(2)


class _Signalled(KeyboardInterrupt):
    """SIGTERM/SIGHUP, handled like Ctrl-C (cancel, remove containers, write the job)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def _signals_like_ctrl_c() -> Iterator[None]:
    """Job schedulers and ``timeout`` send SIGTERM, closed terminals SIGHUP: both
    interrupt the job the way Ctrl-C does instead of killing it mid-trial."""

    received: list[int] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        if received:
            return  # already cancelling: a second signal must not cut the clean-up short
        received.append(signum)
        raise _Signalled(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _print_summary(command: str, outcome: JobOutcome) -> None:
    table = Table(title=f"{command}: {outcome.job_dir}")
    table.add_column("task")
    table.add_column("reward", justify="right")
    table.add_column("time", justify="right")
    table.add_column("result")
    for row in summary_rows(outcome):
        rewards = row["rewards"]
        reward = ", ".join(f"{k}={v:g}" for k, v in rewards.items()) if rewards else "-"
        seconds = f"{row['seconds']:.1f}s" if row["seconds"] is not None else "-"
        verdict = (
            "[green]passed[/green]" if row["passed"] else f"[red]{escape(row['reason'])}[/red]"
        )
        table.add_row(row["task"], reward, seconds, verdict)
    console.print(table)
    n_passed = sum(1 for row in summary_rows(outcome) if row["passed"])
    n_rows = len(summary_rows(outcome))
    console.print(
        f"{n_passed}/{n_rows} passed; images built: {outcome.images_built}; "
        f"job result: {outcome.job_dir / 'result.json'}"
    )


RayOption = Annotated[
    str | None,
    typer.Option(
        "--ray",
        metavar="ADDRESS",
        help="Run on the trial nodes of this Ray cluster (host:port of its head, or 'auto').",
    ),
]


@app.command()
def validate(
    path: Annotated[
        Path | None, typer.Argument(help="A task directory or a dataset of tasks.")
    ] = None,
    dataset: DatasetRefOption = None,
    task: TaskRefOption = None,
    package_source: PackageSourceOption = None,
    registry_path: RegistryPathOption = None,
    registry_url: RegistryUrlOption = None,
    task_git_allow_unpinned: AllowUnpinnedOption = False,
    n_concurrent: Annotated[int, typer.Option("-n", "--n-concurrent", min=1)] = 4,
    n_attempts: Annotated[int, typer.Option("-k", "--n-attempts", min=1)] = 1,
    jobs_dir: Annotated[Path, typer.Option("--jobs-dir")] = Path("jobs"),
    job_name: Annotated[str | None, typer.Option("--job-name")] = None,
    verifier_mode: sandbox.VerifierModeOption = sandbox.VerifierModeChoice.TASK,
    default_cpus: sandbox.DefaultCpusOption = sandbox.DEFAULT_CPUS,
    default_memory_mb: sandbox.DefaultMemoryOption = sandbox.DEFAULT_MEMORY_MB,
    default_storage_mb: sandbox.DefaultStorageOption = sandbox.DEFAULT_STORAGE_MB,
    default_shm_mb: sandbox.DefaultShmOption = sandbox.DEFAULT_SHM_MB,
    default_nofile: sandbox.DefaultNofileOption = sandbox.DEFAULT_NOFILE_LIMIT,
    max_log_bytes: sandbox.MaxLogBytesOption = sandbox.DEFAULT_MAX_LOG_BYTES,
    ray: RayOption = None,
) -> None:
    """Run the oracle (solution/solve.sh) on every task; exit 1 unless all earn full reward."""
    from harbor_exec.cli.serve import open_ray_executor

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
    options = sandbox.SandboxOptions(
        verifier_mode,
        default_cpus,
        default_memory_mb,
        max_log_bytes,
        default_storage_mb=default_storage_mb,
        default_shm_mb=default_shm_mb,
        default_nofile=default_nofile,
    )
    policy = options.policy(
        max_concurrent_trials=n_concurrent,
        pid_max=(executor or runtime).pid_max(),  # type: ignore[union-attr]
    )
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


def run_dataset_job(
    command: str,
    selected: SelectedDataset,
    runtime: DockerRuntime | None,
    *,
    jobs_dir: Path,
    job_name: str | None,
    n_concurrent: int,
    n_attempts: int,
    make_spec: Callable[[Task, Path], TrialSpec],
    executor: TrialExecutor | None = None,
    agent: Mapping[str, Any] = ORACLE_CONFIG,
    make_secrets: Callable[[TrialSpec], TrialSecrets] | None = None,
) -> JobOutcome:
    """``run_job`` with a progress bar, Ctrl-C/SIGTERM/SIGHUP as a clean interruption
    (exit 128+signal), resume errors as exit 2, and the summary table at the end."""
    counts = {"queued": 0, "running": 0, "passed": 0, "failed": 0}
    progress = Progress(
        TextColumn(f"[bold]{command}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
        TimeElapsedColumn(),
        console=console,
    )
    total = len(selected.discovery.tasks) * n_attempts
    bar = progress.add_task("trials", total=total, counts="")

    def on_event(event: JobEvent) -> None:
        if event.kind == "queued":
            counts["queued"] += 1
        elif event.kind == "phase" and event.phase == "environment":
            counts["queued"] -= 1
            counts["running"] += 1
        elif event.kind == "finished" and event.result is not None:
            counts["running"] -= 1
            passed = is_full_reward(event.result)
            counts["passed" if passed else "failed"] += 1
            progress.advance(bar)
            mark = "[green]passed[/green]" if passed else "[red]failed[/red]"
            progress.console.print(f"{mark} {event.task.name}")
        progress.update(
            bar,
            counts=" ".join(f"{k} {v}" for k, v in counts.items()),
        )

    signum = int(signal.SIGINT)
    try:
        with _signals_like_ctrl_c(), progress:
            outcome = run_job(
                runtime,
                selected.discovery.tasks,
                jobs_dir=jobs_dir,
                job_name=job_name,
                n_concurrent=n_concurrent,
                n_attempts=n_attempts,
                dataset_name=selected.name,
                dataset_path=selected.path,
                dataset_config=selected.config,
                tasks_config=selected.tasks_config,
                invalid_tasks=selected.discovery.broken,
                make_spec=make_spec,
                on_event=on_event,
                executor=executor,
                agent=agent,
                make_secrets=make_secrets,
            )
    except JobResumeError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    except JobInterrupted as interrupted:
        if isinstance(interrupted.cause, _Signalled):
            signum = interrupted.cause.signum
        left = runtime.remove_owned() if runtime is not None else 0
        console.print(
            f"[yellow]interrupted ({signal.Signals(signum).name})[/yellow]: running trials "
            "were cancelled and their containers "
            f"removed ({left} removed at exit); partial job result in "
            f"{interrupted.outcome.job_dir / 'result.json'}"
        )
        raise typer.Exit(128 + signum) from None
    if outcome.reused:
        console.print(f"resumed: kept {outcome.reused} finished trial(s) of job {outcome.job_dir}")
    _print_summary(command, outcome)
    return outcome


@app.command()
def prewarm(
    path: Annotated[Path, typer.Argument(help="A task directory or a dataset of tasks.")],
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            "-j",
            "-n",
            "--n-concurrent",
            min=1,
            help="Images built at once (default: the engine's CPU count).",
        ),
    ] = None,
    ray: RayOption = None,
    node: Annotated[
        list[str] | None,
        typer.Option(
            "--node", help="With --ray: only this node (id prefix or address; repeatable)."
        ),
    ] = None,
    agent: Annotated[
        str | None,
        typer.Option(
            "--agent",
            help="Also prepare this in-container native agent's layer (mini-swe-agent, "
            "opencode): its wheels (and opencode's binary) are fetched now, its volume "
            "installed with the first task.",
        ),
    ] = None,
    run_verifier: Annotated[
        bool,
        typer.Option(
            "--run-verifier",
            help="Also run each task's oracle and verifier once through the package cache, "
            "so what solve.sh and test.sh fetch is cached before serving with "
            "--package-cache (docs/package-cache.md). Not while a server uses the cache.",
        ),
    ] = False,
    package_cache: Annotated[
        bool,
        typer.Option(
            "--package-cache",
            help="Build the images through the package cache (what RUN steps fetch over "
            "HTTP and HTTPS, apt, pip, npm and files, is fetched once; "
            "docs/package-cache.md); with --ray, each node's own. Implied by "
            "--run-verifier. Not while a server uses the cache.",
        ),
    ] = False,
    package_cache_max_gb: Annotated[
        float, typer.Option(min=0.001, help="With --package-cache: the package cache's bound (GB).")
    ] = 20.0,
    package_cache_dir: Annotated[
        Path | None,
        typer.Option(help="With --package-cache: the package cache's directory."),
    ] = None,
) -> None:
    """Build every task image ahead of time, in parallel; report built / cached / failed.
    With ``--agent mini-swe-agent`` (or ``opencode``), also that agent's layer (its
    wheels and binaries, then its volume)."""
    discovery = load_dataset(path)
    if ray:
        if run_verifier:
            console.print(
                "[red]error:[/] --run-verifier runs the verifiers on this machine, not with "
                "--ray; use --ray --package-cache to build through each node's cache"
            )
            raise typer.Exit(2)
        config = None
        if package_cache:
            from harbor_exec.network.packages.service import PackageCacheConfig

            config = PackageCacheConfig.from_options(package_cache_dir, package_cache_max_gb)
        _prewarm_ray(
            ray, discovery.tasks, node or None, broken=len(discovery.broken), package_cache=config
        )
    agent_layer = None
    if agent is not None:
        try:
            agent_layer = prepare_prewarm_agent(agent)
        except (ValueError, HarborExecError, BundleError, AgentLayerError) as exc:
            console.print(f"[red]error:[/] {escape(str(exc))}")
            raise typer.Exit(2) from None
    runtime = open_runtime()
    n_jobs = jobs or runtime.engine_cpus()
    cache = None
    if run_verifier or package_cache:
        from harbor_exec.network.packages.service import PackageCacheConfig, PackageCacheService

        cache = PackageCacheService(
            PackageCacheConfig.from_options(package_cache_dir, package_cache_max_gb)
        )
    counts = {"built": 0, "cached": 0, "failed": 0, "building": 0}
    colours = {"built": "green", "cached": "cyan", "failed": "red"}
    progress = Progress(
        TextColumn("[bold]prewarm[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
        TimeElapsedColumn(),
        console=console,
    )
    bar = progress.add_task("tasks", total=len(discovery.tasks), counts="")

    def on_event(event: PrewarmEvent) -> None:
        outcome = event.outcome
        if event.kind == "started":
            counts["building"] += 1
        elif outcome is not None:
            counts["building"] -= 1
            counts[outcome.status] += 1
            progress.advance(bar)
            if outcome.status != "cached":  # a warm dataset would print one line per task
                why = f": {escape(outcome.reason)}" if outcome.status == "failed" else ""
                progress.console.print(
                    f"[{colours[outcome.status]}]{outcome.status}[/] {escape(outcome.task)} "
                    f"{outcome.seconds:.1f}s{why}"
                )
        progress.update(bar, counts=" ".join(f"{k} {v}" for k, v in counts.items()))

    started = time.monotonic()
    try:
        with progress:
            outcomes = prewarm_tasks(
                runtime,
                discovery.tasks,
                jobs=n_jobs,
                on_event=on_event,
                agent_layer=agent_layer,
                package_cache=cache,
                run_verifier=run_verifier,
            )
    finally:
        if cache is not None:
            cache.close()
    wall = time.monotonic() - started
    table = Table(title=f"prewarm: {path}")
    for column in ("task", "status", "time", "image / reason"):
        table.add_column(column)
    for outcome in outcomes:
        table.add_row(
            outcome.task,
            f"[{colours[outcome.status]}]{outcome.status}[/]",
            f"{outcome.seconds:.1f}s",
            escape(outcome.detail if outcome.status != "failed" else outcome.reason),
        )
    for error in discovery.broken:
        table.add_row(error.task, "[red]failed[/]", "-", escape(f"{type(error).__name__}: {error}"))
    console.print(table)
    counted = tally(outcomes, extra_failed=len(discovery.broken))
    console.print(
        ", ".join(f"{k}: {v}" for k, v in counted.items())
        + f"; {wall:.1f}s with {n_jobs} job(s), builder {runtime.builder}"
    )
    raise typer.Exit(1 if counted["failed"] else 0)


def _prewarm_ray(
    address: str,
    tasks: list[Task],
    nodes: list[str] | None,
    *,
    broken: int,
    package_cache: Any = None,
) -> None:
    """``prewarm --ray``: build every task image on every trial node (or those named),
    through each node's own package cache with ``package_cache`` (a
    ``PackageCacheConfig``), one line per task and node; exit 1 if any failed."""
    import asyncio

    from harbor_exec.cli.serve import open_ray_executor

    executor = open_ray_executor(address)
    executor.package_cache = package_cache
    failed = broken

    async def run() -> None:
        nonlocal failed
        try:
            for task in tasks:
                started = time.monotonic()
                report = await executor.prewarm_nodes(task, None, nodes)
                seconds = time.monotonic() - started
                for name, outcome in sorted(report.items()):
                    if isinstance(outcome, str):
                        failed += 1
                        console.print(
                            f"[red]failed[/] {escape(task.name)} on {name}: {escape(outcome)}"
                        )
                    else:
                        status = "built" if outcome else "cached"
                        console.print(f"{status} {escape(task.name)} on node {name} {seconds:.1f}s")
        finally:
            await executor.aclose()

    asyncio.run(run())
    console.print(f"{len(tasks)} task(s) on {len(executor.live_nodes())} node(s); failed: {failed}")
    raise typer.Exit(1 if failed else 0)
