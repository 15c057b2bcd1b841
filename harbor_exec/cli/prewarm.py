"""``harbor-exec prewarm``: every task image built ahead of time (and, asked, a native
agent's layer, or what the oracle and verifier fetch, through the package cache)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harbor_exec.agents.native.layer import AgentLayerError
from harbor_exec.bundler.errors import BundleError
from harbor_exec.cli.helpers import console, load_dataset, open_ray_executor, open_runtime
from harbor_exec.cli.options import (
    JOB,
    NETWORK,
    RAY,
    PrewarmAgentOption,
    RayOption,
    takes_package_cache,
)
from harbor_exec.errors import HarborExecError
from harbor_exec.jobs.prewarm import PrewarmEvent, prepare_prewarm_agent, prewarm_tasks, tally
from harbor_exec.network.packages.config import PackageCacheConfig
from harbor_exec.tasks.task import Task


@takes_package_cache
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
            rich_help_panel=JOB,
            help="Images built at once (default: the engine's CPU count).",
        ),
    ] = None,
    ray: RayOption = None,
    node: Annotated[
        list[str] | None,
        typer.Option(
            "--node",
            rich_help_panel=RAY,
            help="With --ray: only this node (id prefix or address; repeatable).",
        ),
    ] = None,
    agent: PrewarmAgentOption = None,
    run_verifier: Annotated[
        bool,
        typer.Option(
            "--run-verifier",
            rich_help_panel=NETWORK,
            help="Also run each task's oracle and verifier once through the package cache, "
            "so what solve.sh and test.sh fetch is cached before serving "
            "(docs/package-cache.md).",
        ),
    ] = False,
    package_cache: PackageCacheConfig | None = None,
) -> None:
    """Build every task image ahead of time, in parallel; report built / cached / failed.
    With ``--agent mini-swe-agent`` (or ``opencode``), also that agent's layer (its
    wheels and binaries, then its volume)."""
    if run_verifier and package_cache is None:
        console.print(
            "[red]error:[/] --run-verifier fills the package cache: not with --no-package-cache"
        )
        raise typer.Exit(2)
    discovery = load_dataset(path)
    if ray:
        if run_verifier:
            console.print(
                "[red]error:[/] --run-verifier runs the verifiers on this machine, not with "
                "--ray (--ray builds through each node's own package cache)"
            )
            raise typer.Exit(2)
        _prewarm_ray(
            ray,
            discovery.tasks,
            node or None,
            broken=len(discovery.broken),
            package_cache=package_cache,
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
    if package_cache is not None:
        from harbor_exec.network.packages.service import PackageCacheService

        cache = PackageCacheService(package_cache)
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
        + f"; {wall:.1f}s with {n_jobs} job(s), builder "
        + ("legacy (through the package cache)" if cache is not None else runtime.builder)
    )
    raise typer.Exit(1 if counted["failed"] else 0)


def _prewarm_ray(
    address: str,
    tasks: list[Task],
    nodes: list[str] | None,
    *,
    broken: int,
    package_cache: PackageCacheConfig | None = None,
) -> None:
    """``prewarm --ray``: build every task image on every trial node (or those named),
    through each node's own package cache with ``package_cache`` (a
    ``PackageCacheConfig``), one line per task and node; exit 1 if any failed."""
    import asyncio

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
