"""What the commands share: the console, the engine and Ray opened or a clear exit,
the tasks a job runs (``select_dataset``), ``run_dataset_job`` (the job display
``validate`` and ``run`` share) and ``parse_agent_kwargs``."""

from __future__ import annotations

import fnmatch
import json
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console, RenderableType
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harbor_exec.errors import DatasetError, DockerUnavailableError, TaskError
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
    from harbor_exec.network.packages.config import PackageCacheConfig
    from harbor_exec.network.packages.service import PackageCacheService

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


@dataclass(frozen=True)
class SelectedDataset:
    """What a job runs: its tasks, its name, and Harbor's ``datasets`` entry for it."""

    discovery: Discovery
    name: str
    config: dict[str, Any] | None  # None: no dataset (``-t``: ``tasks_config``)
    path: Path | None = None
    #: Harbor's job ``tasks`` entries (``-t``).
    tasks_config: list[dict[str, Any]] | None = None


def filter_tasks(
    selected: SelectedDataset,
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
    n_tasks: int | None,
) -> SelectedDataset:
    """Harbor's ``-i``, ``-x`` and ``-l`` on the selected tasks (glob patterns on task
    names, then at most ``n_tasks``); a filter that leaves nothing is exit 2."""

    def chosen(name: str) -> bool:
        wanted = not include or any(fnmatch.fnmatch(name, p) for p in include)
        return wanted and not any(fnmatch.fnmatch(name, p) for p in exclude or ())

    tasks = [t for t in selected.discovery.tasks if chosen(t.name)]
    broken = [e for e in selected.discovery.broken if chosen(e.task)]
    if (include or exclude) and not tasks and not broken:
        usage_error("no task is left by -i/--include-task-name and -x/--exclude-task-name")
    if n_tasks is not None:
        tasks = tasks[:n_tasks]
    return replace(selected, discovery=Discovery(tasks, broken))


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
        usage_error(
            "give a task or dataset PATH, or -d NAME[@VERSION] with a registry, or -t/-d "
            "ORG/NAME[@REF] with a package source"
        )
    package = ref is not None and "/" in ref.partition("@")[0]
    if (path is not None or task is not None or package) and (registry_path or registry_url):
        usage_error("--registry-path and --registry-url go with -d NAME[@VERSION] only")
    if path is not None:
        root = path.resolve()
        discovery = load_dataset(path)
        try:
            check_local_manifest(
                root, [t.path for t in discovery.tasks], [t.name for t in discovery.tasks]
            )
        except PackageError as exc:
            usage_error(str(exc))
        return SelectedDataset(discovery, root.name, {"path": str(root)}, root)
    if task is not None or package:
        return _select_package(task, ref if package else None, package_source)
    assert ref is not None
    if (registry_path is None) == (registry_url is None):
        usage_error("-d needs exactly one of --registry-path and --registry-url")
    try:
        datasets = read_registry(path=registry_path, url=registry_url)
        dataset = find_dataset(datasets, ref)
        fetched = fetch_dataset(dataset, allow_unpinned=allow_unpinned)
    except RegistryError as exc:
        usage_error(str(exc))
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
            usage_error(
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
        usage_error(str(exc))
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


def usage_error(message: str) -> NoReturn:
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


def print_summary(command: str, outcome: JobOutcome) -> None:
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
    unusable = {row["task"]: row["unusable"] for row in summary_rows(outcome) if row["unusable"]}
    if unusable:
        listed = "; ".join(f"{task}: {why}" for task, why in sorted(unusable.items()))
        console.print(
            f"[yellow]{len(unusable)} task(s) a trainer cannot use: {escape(listed)}. A trainer "
            "(and `serve`) reads only the `reward` key; `validate --strict` fails them.[/yellow]"
        )


def resume_command(job_dir: Path) -> str:
    """This command line again, naming ``job_dir``'s job: what resumes it."""
    args = list(sys.argv[1:])
    for option in ("--job-name", "--jobs-dir"):
        while option in args:
            at = args.index(option)
            del args[at : at + 2]
        args = [a for a in args if not a.startswith(f"{option}=")]
    args += ["--jobs-dir", str(job_dir.parent), "--job-name", job_dir.name]
    return shlex.join(["harbor-exec", *args])


@contextmanager
def _package_cache(
    config: PackageCacheConfig | None, executor: TrialExecutor | None
) -> Iterator[PackageCacheService | None]:
    """This process's package cache service for a job (None: off, or the executor's
    nodes each run their own), closed after it."""
    if config is None:
        yield None
        return
    if executor is not None:
        service = executor.package_cache_service(config)
    else:
        from harbor_exec.network.packages.service import PackageCacheService

        service = PackageCacheService(config)
    try:
        yield None if executor is not None else service
    finally:
        if service is not None:
            service.close()


#: Running trials listed under the progress bar, at most; the rest are counted on one line.
RUNNING_SHOWN = 8


class RunningTrials:
    """The trials of a job begun now (from their environment phase to their end), each
    with when it began and whether it is ``starting`` (its environment: a trial started
    ahead of its slot waits so) or ``running`` (its agent or verifier); thread-safe
    (events come from the job's threads)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._started: dict[tuple[str, int], float] = {}
        self._running: set[tuple[str, int]] = set()

    def start(self, name: str, attempt: int) -> None:
        with self._lock:
            self._started[(name, attempt)] = self._clock()

    def run(self, name: str, attempt: int) -> None:
        """Its agent started."""
        with self._lock:
            if (name, attempt) in self._started:
                self._running.add((name, attempt))

    def stop(self, name: str, attempt: int) -> float | None:
        """Ends it; its seconds (None when it never started)."""
        with self._lock:
            began = self._started.pop((name, attempt), None)
            self._running.discard((name, attempt))
        return None if began is None else self._clock() - began

    def counts(self) -> tuple[int, int]:
        """``(starting, running)``."""
        with self._lock:
            return len(self._started) - len(self._running), len(self._running)

    def longest_first(self) -> list[tuple[str, int, float, str]]:
        """``(name, attempt, seconds, "starting" or "running")``, longest first."""
        now = self._clock()
        with self._lock:
            items = [
                (n, a, now - t, "running" if (n, a) in self._running else "starting")
                for (n, a), t in self._started.items()
            ]
        return sorted(items, key=lambda item: -item[2])

    def renderable(self, limit: int = RUNNING_SHOWN) -> Table | None:
        """The running trials, longest first, with their seconds; at most ``limit`` lines
        and one more saying how many are not shown (None when none runs)."""
        running = self.longest_first()
        if not running:
            return None
        table = Table.grid(padding=(0, 2))
        table.add_column(style="dim")
        table.add_column()
        table.add_column(justify="right")
        for name, attempt, seconds, state in running[:limit]:
            label = name if attempt == 0 else f"{name} (attempt {attempt + 1})"
            table.add_row(state, escape(label), f"{seconds:.0f}s")
        if len(running) > limit:
            table.add_row("", f"and {len(running) - limit} more", "")
        return table


class _JobProgress(Progress):
    """The progress bar with, under it, the trials running now (``RunningTrials``)."""

    def __init__(self, *columns: Any, running: RunningTrials, **kwargs: Any) -> None:
        self.running = running  # before Progress's own init, which renders once
        super().__init__(*columns, **kwargs)

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        table = self.running.renderable()
        if table is not None:
            yield table


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
    package_cache: PackageCacheConfig | None = None,
    max_retries: int = 0,
) -> JobOutcome:
    """``run_job`` with a progress bar, Ctrl-C/SIGTERM/SIGHUP as a clean interruption
    (exit 128+signal), resume errors as exit 2, and the summary table at the end.
    On a terminal the trials running now are listed under the bar with their seconds
    (``RunningTrials``); elsewhere (a log) a line says when each starts; either way each
    finished trial's line has its seconds.
    ``package_cache``: the trials (and their image builds) fetch through the package
    cache (this process's, or each Ray node's own)."""
    counts = {"queued": 0, "passed": 0, "failed": 0, "cancelled": 0}
    running = RunningTrials()
    plain = not console.is_terminal
    progress = _JobProgress(
        TextColumn(f"[bold]{command}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
        TimeElapsedColumn(),
        console=console,
        running=running,
    )
    total = len(selected.discovery.tasks) * n_attempts
    bar = progress.add_task("trials", total=total, counts="")

    def on_event(event: JobEvent) -> None:
        if event.kind == "queued":
            counts["queued"] += 1
        elif event.kind == "phase" and event.phase == "environment":
            counts["queued"] -= 1
            running.start(event.task.name, event.attempt)
            if plain:
                progress.console.print(f"started {escape(event.task.name)}")
        elif event.kind == "phase" and event.phase == "agent":
            running.run(event.task.name, event.attempt)
        elif event.kind == "retry" and event.result is not None:
            counts["queued"] += 1
            running.stop(event.task.name, event.attempt)
            info = event.result.exception_info
            why = info.exception_type if info is not None else "an error"
            progress.console.print(f"[yellow]retrying[/yellow] {event.task.name} ({why})")
        elif event.kind == "finished" and event.result is not None:
            seconds = running.stop(event.task.name, event.attempt)
            info = event.result.exception_info
            if info is not None and info.exception_type == "CancelledError":
                verdict, mark = "cancelled", "[yellow]cancelled[/yellow]"
            elif is_full_reward(event.result):
                verdict, mark = "passed", "[green]passed[/green]"
            else:
                verdict, mark = "failed", "[red]failed[/red]"
            counts[verdict] += 1
            progress.advance(bar)
            took = f" ({seconds:.1f} s)" if seconds is not None else ""
            progress.console.print(f"{mark} {event.task.name}{took}")
        starting, running_now = running.counts()
        shown = {**counts, "starting": starting, "running": running_now}
        order = ("queued", "starting", "running", "passed", "failed", "cancelled")
        progress.update(bar, counts=" ".join(f"{k} {shown[k]}" for k in order))

    signum = int(signal.SIGINT)
    try:
        with _package_cache(package_cache, executor) as service, _signals_like_ctrl_c(), progress:
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
                package_cache=service,
                max_retries=max_retries,
            )
    except JobResumeError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    except JobInterrupted as interrupted:
        if isinstance(interrupted.cause, _Signalled):
            signum = interrupted.cause.signum
        left = runtime.remove_owned() if runtime is not None else 0
        job_dir = interrupted.outcome.job_dir
        console.print(
            f"[yellow]interrupted ({signal.Signals(signum).name})[/yellow]: running trials "
            "were cancelled and their containers "
            f"removed ({left} removed at exit); partial job result in "
            f"{job_dir / 'result.json'}"
        )
        console.print(f"resume it (finished trials are kept): {escape(resume_command(job_dir))}")
        raise typer.Exit(128 + signum) from None
    if outcome.reused:
        console.print(f"resumed: kept {outcome.reused} finished trial(s) of job {outcome.job_dir}")
    print_summary(command, outcome)
    return outcome


def open_ray_executor(address: str) -> Any:
    """A connected ``RayExecutor``, or a clear message and exit code 2."""
    try:
        from harbor_exec.executors.ray import RayExecutor, RayUnavailableError
    except ImportError as exc:  # pragma: no cover - the extra is missing
        typer.echo(
            f"error: --ray needs the ray extra (pip install 'harbor-exec[ray]'): {exc}", err=True
        )
        raise typer.Exit(2) from None
    executor = RayExecutor(address)
    try:
        executor.connect()
    except RayUnavailableError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return executor


def parse_agent_kwargs(pairs: list[str]) -> dict[str, Any]:
    """``k=v`` pairs as options: ``v`` as JSON when it parses (numbers, booleans,
    objects), else the string itself."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(
                f"expected key=value, got {pair!r}", param_hint="--agent-kwarg"
            )
        try:
            kwargs[key.strip()] = json.loads(value)
        except ValueError:
            kwargs[key.strip()] = value
    return kwargs
