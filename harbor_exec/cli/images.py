"""``harbor-exec images bootstrap|list|prune``: the images harbor-exec makes."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from harbor_exec.cli.help import HelpCommand, HelpGroup
from harbor_exec.cli.helpers import console, open_runtime
from harbor_exec.sandbox.apt_mirror import MIRROR_ENV, BootstrapError
from harbor_exec.sandbox.images import bootstrap, build_cache_report, prune
from harbor_exec.sandbox.runtime_build import RuntimeBuildError

images_app = typer.Typer(
    cls=HelpGroup, help="Base images, task images and dependency layers we made."
)


@images_app.command(cls=HelpCommand, name="bootstrap")
def bootstrap_command(
    mirror: Annotated[
        str | None,
        typer.Option(
            "--mirror",
            envvar=MIRROR_ENV,
            metavar="URL",
            help="Debian mirror for debootstrap (default: the one the host's apt sources name)",
        ),
    ] = None,
) -> None:
    """Make the base images the examples build on (debootstrap when no registry answers)
    and the read-only container runtime every trial container mounts."""
    runtime = open_runtime()
    try:
        outcome = bootstrap(runtime, mirror=mirror, log=console.print)
    except (BootstrapError, RuntimeBuildError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    for tag, status in outcome.items():
        console.print(f"{tag}: {status}")


@images_app.command(cls=HelpCommand, name="list")
def list_command() -> None:
    """List the images we made, and the image builder this engine gets."""
    runtime = open_runtime()
    engine = runtime.engine_info()
    console.print(
        f"engine {engine['version']} (API {engine['api']}); image builder: {engine['builder']}"
    )
    table = Table()
    for column in ("image", "kind", "size"):
        table.add_column(column)
    for info in runtime.list_images():
        table.add_row(info.tag, info.kind, f"{info.size_bytes / 1e6:.0f} MB")
    console.print(table)


@images_app.command(cls=HelpCommand, name="prune")
def prune_command(
    include_base: Annotated[
        bool, typer.Option("--all", help="Also remove the bootstrapped base images.")
    ] = False,
    build_cache: Annotated[
        bool,
        typer.Option(
            "--build-cache",
            help="Also remove the engine's unused build cache (BuildKit's; engine-wide).",
        ),
    ] = False,
) -> None:
    """Remove the task images and dependency environments we made, and volumes of older
    container runtimes (and base images with --all)."""
    runtime = open_runtime()
    removed = prune(runtime, include_base=include_base)
    for tag in removed:
        console.print(f"removed {tag}")
    console.print(f"{len(removed)} image(s) and volume(s) removed")
    console.print(build_cache_report(runtime, prune=build_cache))
