"""``harbor-exec bundle``: build (or reuse) a workflow project's bundle and show it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harbor_exec.cli.options import StrictGraderIsolationOption
from harbor_exec.container.exchange import RUNTIME_PYTHON_VERSION

_REF_HELP = "a 'module:attr' ref inside the project's package"
_GRADER_HELP = f"{_REF_HELP}, in a module the workflow does not import"


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1024 * 1024):.1f} MiB"


def bundle(
    code_dir: Annotated[Path, typer.Argument(help="the project dir (holds pyproject.toml)")],
    workflow: Annotated[str, typer.Option(help=f"the AgentWorkflow class: {_REF_HELP}")],
    grader: Annotated[str | None, typer.Option(help=f"the Grader class: {_GRADER_HELP}")] = None,
    workflow_config: Annotated[
        str | None, typer.Option(help=f"a module-level AgentWorkflowConfig: {_REF_HELP}")
    ] = None,
    grader_config: Annotated[
        str | None, typer.Option(help=f"a module-level GraderConfig: {_GRADER_HELP}")
    ] = None,
    python_version: Annotated[
        str, typer.Option(help="the container's Python, X.Y (trials run the runtime's)")
    ] = RUNTIME_PYTHON_VERSION,
    platform: Annotated[
        str | None,
        typer.Option(help="the container's wheel platform tag (default: manylinux_2_36_x86_64)"),
    ] = None,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            help="bundle cache (default: $HARBOR_EXEC_CACHE_DIR/bundles, "
            "else ~/.cache/harbor-exec/bundles)"
        ),
    ] = None,
    strict_grader_isolation: StrictGraderIsolationOption = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Build a workflow project into a bundle: its wheel, a dependency wheelhouse for
    the task container, and manifest.json. Reuses the cached bundle when nothing changed."""
    # Imported here: the bundler needs the 'bundler' extra, other commands do not.
    from harbor_exec.bundler import DEFAULT_PLATFORM, BundleError, build_bundle

    err = Console(stderr=True)
    try:
        built = build_bundle(
            code_dir,
            workflow=workflow,
            grader=grader,
            workflow_config=workflow_config,
            grader_config=grader_config,
            python_version=python_version,
            platform=platform or DEFAULT_PLATFORM,
            cache_dir=cache_dir,
            strict_grader_isolation=strict_grader_isolation,
        )
    except BundleError as exc:
        err.print(f"[bold red]bundle failed:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(code=1) from None

    manifest = built.manifest
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "root": str(built.root),
                    "wheel": str(built.wheel),
                    "wheelhouse": str(built.wheelhouse),
                    "digest": built.digest,
                    "requirements_digest": built.requirements_digest,
                    "cached": built.cached,
                    "manifest": manifest.model_dump(mode="json"),
                },
                indent=2,
            )
        )
        return

    out = Console()
    summary = Table(
        title=f"bundle of {manifest.distribution} {manifest.version}", show_header=False
    )
    summary.add_column(style="bold")
    summary.add_column(overflow="fold")
    rows = [
        ("status", "cache hit (reused)" if built.cached else "built (cache miss)"),
        ("wheel", f"{manifest.wheel.filename} ({_size(manifest.wheel.size)})"),
        ("workflow", manifest.workflow),
        ("grader", manifest.grader),
        ("workflow config", manifest.workflow_config),
        ("grader config", manifest.grader_config),
        ("requirements", ", ".join(manifest.requirements) or "(none)"),
        ("target", f"CPython {manifest.python_version}, {manifest.platform}"),
        ("digest", built.digest),
        ("requirements digest", built.requirements_digest),
        ("root", str(built.root)),
    ]
    for label, value in rows:
        if value:
            # Requirements such as "httpx[http2]" would otherwise read as markup.
            summary.add_row(label, escape(value))
    out.print(summary)

    wheels = Table(title=f"dependency wheelhouse ({len(manifest.wheelhouse)} wheels)")
    wheels.add_column("wheel", overflow="fold")
    wheels.add_column("size", justify="right")
    for entry in manifest.wheelhouse:
        wheels.add_row(escape(entry.filename), _size(entry.size))
    wheels.add_row("[bold]total[/]", _size(sum(w.size for w in manifest.wheelhouse)))
    out.print(wheels)
