"""``harbor-exec serve``: serve rollouts over HTTP (the osmosis-ai 0.3.8 protocol).

Either ``--workflow module:Class`` (with optional ``--grader`` and configs),
served by ``LocalBackend``, or ``--app module:attr`` for an app built in code.
Building the backend is its own function (``build_backend``), so that other
backends can be chosen from more options without touching the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from harbor_exec.cli.app import app

__all__ = ["ServeOptions", "build_app", "build_backend", "serve"]

# Outlives common load balancers' idle timeouts (2100 s), as the reference scaffold does.
KEEP_ALIVE_SEC = 2160


@dataclass
class ServeOptions:
    """What ``serve`` was asked to run, independent of the CLI parsing."""

    workflow: str | None = None
    grader: str | None = None
    workflow_config: str | None = None
    grader_config: str | None = None
    artifact_root: Path | None = None


def build_backend(options: ServeOptions) -> Any:
    """The ``ExecutionBackend`` for these options (today: ``LocalBackend``)."""
    from harbor_exec.backends.local import LocalBackend

    if options.workflow is None:
        raise typer.BadParameter("give --workflow module:Class (or --app module:attr)")
    try:
        return LocalBackend(
            workflow=options.workflow,
            workflow_config=options.workflow_config,
            grader=options.grader,
            grader_config=options.grader_config,
            artifact_root=options.artifact_root,
        )
    except (ImportError, ValueError, TypeError) as exc:
        raise typer.BadParameter(str(exc)) from exc


def build_app(options: ServeOptions, *, api_key: str | None) -> Any:
    """The FastAPI rollout server for these options."""
    from harbor_exec.server import create_rollout_server

    return create_rollout_server(
        backend=build_backend(options), api_key=api_key, artifact_root=options.artifact_root
    )


def _load_app(ref: str) -> Any:
    from harbor_exec.authoring import resolve_import_path

    try:
        target = resolve_import_path(ref)
    except (ImportError, ValueError) as exc:
        raise typer.BadParameter(f"--app {ref}: {exc}") from exc
    if not callable(target):
        raise typer.BadParameter(f"--app {ref} is not an ASGI application")
    return target


def _api_key(variable: str | None) -> str | None:
    if variable is None:
        return None
    value = os.environ.get(variable, "")
    if not value.strip():
        raise typer.BadParameter(f"environment variable {variable} is unset or empty")
    return value


@app.command()
def serve(
    workflow: Annotated[
        str | None, typer.Option(help="AgentWorkflow class as module:Class.")
    ] = None,
    grader: Annotated[str | None, typer.Option(help="Grader class as module:Class.")] = None,
    workflow_config: Annotated[
        str | None, typer.Option(help="AgentWorkflowConfig instance as module:attr.")
    ] = None,
    grader_config: Annotated[
        str | None, typer.Option(help="GraderConfig instance as module:attr.")
    ] = None,
    app_ref: Annotated[
        str | None,
        typer.Option("--app", help="A rollout server app built in code, as module:attr."),
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    api_key_env: Annotated[
        str | None,
        typer.Option(help="Name of an environment variable holding the bearer key to require."),
    ] = None,
    artifact_root: Annotated[
        Path | None,
        typer.Option(help="Where per-rollout artifacts and trajectories go."),
    ] = None,
    access_log: Annotated[bool, typer.Option(help="Log every HTTP request.")] = False,
) -> None:
    """Serve rollouts over HTTP for trainers and `osmosis eval run`."""
    import uvicorn

    options = ServeOptions(workflow, grader, workflow_config, grader_config, artifact_root)
    if app_ref is not None:
        if any((workflow, grader, workflow_config, grader_config, api_key_env, artifact_root)):
            raise typer.BadParameter(
                "--app serves an app built in code; configure its backend, api_key and "
                "artifact_root there instead of passing --workflow/--grader/--api-key-env/..."
            )
        application = _load_app(app_ref)
    else:
        application = build_app(options, api_key=_api_key(api_key_env))
    uvicorn.run(
        application,
        host=host,
        port=port,
        timeout_keep_alive=KEEP_ALIVE_SEC,
        access_log=access_log,
        log_level="info",
    )
