"""``harbor-exec serve``: serve rollouts over HTTP (the osmosis-ai 0.3.8 protocol).

Three ways to choose what runs:

* ``--workflow module:Class`` (with optional ``--grader`` and configs): ``LocalBackend``,
  in-process;
* ``--tasks-dir DIR --agent oracle|terminus-2|module:Class``: ``HarborBackend``, every rollout an
  isolated Docker trial of a Harbor task (template or dataset mode);
* ``--app module:attr``: an app built in code.
Building the backend is its own function (``build_backend``), so that other
backends can be chosen from more options without touching the rest.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from harbor_exec.backends.harbor.config import (
    DEFAULT_MAX_CONCURRENT_TRIALS,
    AgentChoice,
    Capacity,
    HarborConfig,
    Paths,
    SandboxConfig,
    TaskSources,
)
from harbor_exec.cli.helpers import open_ray_executor, parse_agent_kwargs
from harbor_exec.cli.options import (
    AGENT,
    NETWORK,
    SERVER,
    TASKS,
    AgentKwargOption,
    GraderEnvOption,
    PackageSourceOption,
    PreferGraderOption,
    RayOption,
    ServeAgentOption,
    ServeAgentSetupTimeoutOption,
    ServeAllowUnpinnedOption,
    ServeModelNameOption,
    StrictGraderIsolationOption,
    takes_package_cache,
    takes_sandbox,
)
from harbor_exec.network.packages.config import PackageCacheConfig

__all__ = [
    "ServeOptions",
    "build_app",
    "build_backend",
    "harbor_config_of",
    "serve",
    "serve_facts",
]

_SANDBOX = SandboxConfig()


@dataclass
class ServeOptions:
    """What ``serve`` was asked to run, independent of the CLI parsing."""

    workflow: str | None = None
    grader: str | None = None
    workflow_config: str | None = None
    grader_config: str | None = None
    artifact_root: Path | None = None
    tasks_dir: Path | None = None
    task_mode: str = "template"
    agent: str | None = None
    code_dir: Path | None = None
    trials_dir: Path | None = None
    max_concurrent_trials: int = DEFAULT_MAX_CONCURRENT_TRIALS
    max_queue_depth: int | None = None
    retry_after_sec: int = 5  # server.service.DEFAULT_RETRY_AFTER_SEC
    prewarm: bool = False
    task_roots: list[Path] = field(default_factory=list)
    task_env_allow: list[str] = field(default_factory=list)
    task_git_allow: list[str] = field(default_factory=list)
    task_git_allow_unpinned: bool = False
    package_source: str | None = None  # metadata.harbor_task org/name@ref come from here
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    data_dir: Path | None = None
    max_timeout_sec: float | None = None
    prewarm_jobs: int | None = None
    ray: str | None = None  # run trials on this Ray cluster ("auto": the one this node is in)
    port: int | None = None  # where it listens (see resolve_port); keys the default data dir
    # POST routes a workflow's relay forwards besides /chat/completions (--relay-allow-route).
    relay_extra_routes: list[str] = field(default_factory=list)
    # The package cache (--package-cache, on by default; docs/package-cache.md); None: off.
    package_cache: PackageCacheConfig | None = field(default_factory=PackageCacheConfig)
    # Harbor's own agents (--agent terminus-2): the model route, options and setup timeout.
    model_name: str | None = None
    agent_kwargs: list[str] = field(default_factory=list)
    agent_setup_timeout_sec: float | None = None
    strict_grader_isolation: bool = False
    prefer_grader: bool = False
    grader_env: list[str] = field(default_factory=list)
    # What the terminal shows (server.report.ServeReport): text or JSON lines, and how
    # often the summary line comes (0: never); url: where it listens, for the first lines.
    log_format: str = "text"
    summary_interval_sec: float = 30.0
    url: str | None = None


def build_harbor_backend(options: ServeOptions) -> Any:
    """``HarborBackend`` for ``--tasks-dir``; bundle and Docker errors end the command."""
    from harbor_exec.backends.harbor.backend import HarborBackend
    from harbor_exec.bundler.errors import BundleError
    from harbor_exec.errors import DockerUnavailableError
    from harbor_exec.sources.packages import PackageError

    if options.workflow is not None:
        raise typer.BadParameter("with --tasks-dir, name the workflow with --agent module:Class")
    if options.task_mode not in ("template", "dataset"):
        raise typer.BadParameter("--task-mode must be 'template' or 'dataset'")
    executor = open_ray_executor(options.ray) if options.ray else None
    try:
        backend = HarborBackend(harbor_config_of(options), executor=executor)
        # Build the bundle and open the engine now: their errors end `serve` before it binds.
        backend.start()
        return backend
    except BundleError as exc:
        typer.echo(f"error: the workflow bundle cannot be built: {exc}", err=True)
        raise typer.Exit(1) from None
    except DockerUnavailableError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except (ImportError, ValueError, TypeError, PackageError) as exc:
        raise typer.BadParameter(str(exc)) from exc


def harbor_config_of(options: ServeOptions) -> HarborConfig:
    """The ``HarborConfig`` ``serve --tasks-dir`` describes (PackageError for a package
    source that cannot be opened)."""
    from harbor_exec.sources.packages import open_package_source

    agent = AgentChoice(
        agent=options.agent or "oracle",
        workflow_config=options.workflow_config,
        grader=options.grader,
        grader_config=options.grader_config,
        code_dir=options.code_dir,
        relay_extra_routes=tuple(options.relay_extra_routes),
        native_agent_kwargs=parse_agent_kwargs(options.agent_kwargs) or None,
        agent_setup_timeout_sec=options.agent_setup_timeout_sec,
        strict_grader_isolation=options.strict_grader_isolation,
        prefer_grader=options.prefer_grader,
        grader_env=tuple(options.grader_env),
    )
    if options.model_name is not None:
        agent = replace(agent, model_name=options.model_name)
    return HarborConfig(
        tasks=TaskSources(
            options.tasks_dir or Path("."),
            task_mode="dataset" if options.task_mode == "dataset" else "template",
            task_roots=tuple(options.task_roots),
            task_env_allow=tuple(options.task_env_allow),
            task_git_allow=tuple(options.task_git_allow),
            task_git_allow_unpinned=options.task_git_allow_unpinned,
            package_source=open_package_source(options.package_source),
        ),
        agent=agent,
        sandbox=options.sandbox,
        capacity=Capacity(options.max_concurrent_trials, options.max_queue_depth),
        package_cache=options.package_cache,
        paths=Paths(trials_dir=options.trials_dir, artifacts_dir=options.artifact_root),
    )


def build_backend(options: ServeOptions) -> Any:
    """The ``ExecutionBackend`` for these options: Harbor with ``--tasks-dir``, else local."""
    from harbor_exec.backends.local import LocalBackend

    if options.tasks_dir is not None:
        return build_harbor_backend(options)
    if options.agent is not None or options.prewarm:
        raise typer.BadParameter("--agent and --prewarm need --tasks-dir")
    if options.relay_extra_routes:
        # In-process workflows call the model directly: there is no relay to configure.
        raise typer.BadParameter("--relay-allow-route needs --tasks-dir")
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


def serve_facts(options: ServeOptions, backend: Any) -> dict[str, Any]:
    """What ``serve`` says it serves at start (the server adds its data dir, what it
    restored and the Ray nodes)."""
    from harbor_exec.backends.local import LocalBackend

    facts: dict[str, Any] = {"url": options.url}
    if isinstance(backend, LocalBackend):
        facts["mode"] = "local (in-process workflows)"
        facts["workflow"] = _class_name(backend.workflow_cls)
        facts["grader"] = _class_name(backend.grader_cls) if backend.grader_cls else "none"
        config = backend.workflow_config
        limit = config.concurrency.max_concurrent if config is not None else 4
        facts["concurrency"] = f"{limit or 'no limit'} at once, queue bound none"
        return facts
    config = getattr(backend, "config", None)
    if config is None:
        facts["mode"] = type(backend).__name__
        return facts
    tasks = config.tasks
    facts["mode"] = "harbor (a Docker trial per rollout)" + (
        f" on Ray ({options.ray})" if options.ray else ""
    )
    if tasks.task_mode == "template":
        facts["tasks"] = f"1 task, {tasks.tasks_dir} (template mode: the prompt is its instruction)"
    else:
        try:
            found = str(len(backend.resolver.candidates(None)))
        except Exception as exc:  # an unreadable dir: say so, serving still starts
            found = f"? ({type(exc).__name__}: {exc})"
        facts["tasks"] = f"{found} tasks in {tasks.tasks_dir} (dataset mode)"
    if tasks.task_roots:
        facts["task_roots"] = [str(root) for root in tasks.task_roots]
    if tasks.task_git_allow:
        facts["git_allow"] = list(tasks.task_git_allow)
    if tasks.package_source is not None:
        facts["package_source"] = str(options.package_source)
    agent = getattr(backend, "agent_name", None) or str(config.agent.agent)
    model = getattr(config.agent, "model_name", None)
    native = getattr(backend, "native", None)  # Harbor's own agents name their model
    facts["agent"] = f"{agent} (model {model})" if model and native else agent
    verifier = config.sandbox.verifier_mode
    if config.agent.grader is not None:
        verifier += f", grader {config.sandbox.grader_verifier_mode}"
    facts["verifier"] = verifier
    capacity = config.capacity
    facts["concurrency"] = (
        f"{capacity.max_concurrent_trials} trials at once, queue bound "
        f"{capacity.max_queue_depth or 'none'}"
    )
    facts["trials_dir"] = str(getattr(backend, "trials_dir", "") or "")
    cache = config.package_cache
    facts["package_cache"] = f"on ({cache.directory('')})" if cache is not None else "off"
    return facts


def _class_name(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', cls)}"


def build_app(options: ServeOptions, *, api_key: str | None) -> Any:
    """The FastAPI rollout server for these options."""
    from harbor_exec.errors import HarborExecError
    from harbor_exec.server import create_rollout_server
    from harbor_exec.server.report import ServeReport
    from harbor_exec.server.run import resolve_port
    from harbor_exec.server.store import default_data_dir

    backend = build_backend(options)
    report = ServeReport(
        log_format="json" if options.log_format == "json" else "text",
        summary_interval_sec=options.summary_interval_sec,
        facts=serve_facts(options, backend),
    )
    extra: dict[str, Any] = {}
    if options.max_timeout_sec is not None:
        extra["max_timeout_sec"] = options.max_timeout_sec
    try:
        return create_rollout_server(
            backend=backend,
            api_key=api_key,
            data_dir=options.data_dir or default_data_dir(resolve_port(options.port)),
            retry_after_sec=options.retry_after_sec,
            artifact_root=options.artifact_root,
            lifespan=backend.prewarm_lifespan(jobs=options.prewarm_jobs)
            if options.prewarm
            else None,
            report=report,
            **extra,
        )
    except HarborExecError as exc:  # e.g. the data dir is owned by another server
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


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


@takes_sandbox(grader=True)
@takes_package_cache
def serve(
    tasks_dir: Annotated[
        Path | None,
        typer.Option(
            rich_help_panel=TASKS,
            help="Harbor task (template mode) or dataset dir: run rollouts in Docker.",
        ),
    ] = None,
    task_mode: Annotated[
        str, typer.Option(rich_help_panel=TASKS, help="template or dataset.")
    ] = "template",
    task_root: Annotated[
        list[Path] | None,
        typer.Option(
            rich_help_panel=TASKS,
            help="Another directory metadata.harbor_task may point into (repeatable).",
        ),
    ] = None,
    task_env_allow: Annotated[
        list[str] | None,
        typer.Option(
            rich_help_panel=TASKS,
            help="A host variable ${VAR} in a request-named task may read (repeatable).",
        ),
    ] = None,
    task_git_allow: Annotated[
        list[str] | None,
        typer.Option(
            rich_help_panel=TASKS,
            help="A URL prefix metadata.git_url may fetch tasks from (repeatable; none by "
            "default).",
        ),
    ] = None,
    task_git_allow_unpinned: ServeAllowUnpinnedOption = False,
    package_source: PackageSourceOption = None,
    workflow: Annotated[
        str | None, typer.Option(rich_help_panel=AGENT, help="AgentWorkflow class as module:Class.")
    ] = None,
    grader: Annotated[
        str | None, typer.Option(rich_help_panel=AGENT, help="Grader class as module:Class.")
    ] = None,
    workflow_config: Annotated[
        str | None,
        typer.Option(rich_help_panel=AGENT, help="AgentWorkflowConfig instance as module:attr."),
    ] = None,
    grader_config: Annotated[
        str | None,
        typer.Option(rich_help_panel=AGENT, help="GraderConfig instance as module:attr."),
    ] = None,
    agent: ServeAgentOption = None,
    model_name: ServeModelNameOption = None,
    agent_kwarg: AgentKwargOption = None,
    agent_setup_timeout_sec: ServeAgentSetupTimeoutOption = None,
    code_dir: Annotated[
        Path | None,
        typer.Option(
            rich_help_panel=AGENT, help="The workflow's project (default: found from --agent)."
        ),
    ] = None,
    strict_grader_isolation: StrictGraderIsolationOption = False,
    prefer_grader: PreferGraderOption = False,
    grader_env: GraderEnvOption = None,
    sandbox: SandboxConfig = _SANDBOX,
    relay_allow_route: Annotated[
        list[str] | None,
        typer.Option(
            rich_help_panel=NETWORK,
            metavar="PATH",
            help="With --tasks-dir and a workflow: another POST route the model relay "
            "forwards, relative to the model URL's path, e.g. /completions (repeatable; "
            "only /chat/completions otherwise).",
        ),
    ] = None,
    package_cache: PackageCacheConfig | None = None,
    app_ref: Annotated[
        str | None,
        typer.Option(
            "--app",
            rich_help_panel=SERVER,
            help="A rollout server app built in code, as module:attr.",
        ),
    ] = None,
    app_dir: Annotated[
        Path,
        typer.Option(
            rich_help_panel=SERVER,
            help="Where --workflow, --grader, their configs, --agent module:Class and --app "
            "are imported from, as uvicorn's --app-dir (put first on sys.path).",
        ),
    ] = Path("."),
    host: Annotated[
        str, typer.Option(rich_help_panel=SERVER, help="Interface to listen on.")
    ] = "127.0.0.1",
    port: Annotated[
        int | None,
        typer.Option(
            rich_help_panel=SERVER,
            help="Port to listen on \\[default: $_OSMOSIS_ROLLOUT_PORT, else 8000].",
        ),
    ] = None,
    api_key_env: Annotated[
        str | None,
        typer.Option(
            rich_help_panel=SERVER,
            help="Name of an environment variable holding the bearer key to require.",
        ),
    ] = None,
    artifact_root: Annotated[
        Path | None,
        typer.Option(
            rich_help_panel=SERVER, help="Where per-rollout artifacts and trajectories go."
        ),
    ] = None,
    access_log: Annotated[
        bool, typer.Option(rich_help_panel=SERVER, help="Log every HTTP request.")
    ] = False,
    trials_dir: Annotated[
        Path | None, typer.Option(rich_help_panel=SERVER, help="Where trial directories go.")
    ] = None,
    max_concurrent_trials: Annotated[
        int,
        typer.Option(
            rich_help_panel=SERVER,
            min=1,
            help="Trials run at once (a trial gives its slot back once its reward is read).",
        ),
    ] = DEFAULT_MAX_CONCURRENT_TRIALS,
    max_queue_depth: Annotated[
        int | None,
        typer.Option(
            rich_help_panel=SERVER, min=1, help="Answer 429 once this many rollouts wait."
        ),
    ] = None,
    retry_after: Annotated[
        int,
        typer.Option(
            rich_help_panel=SERVER,
            min=1,
            help="Seconds a 429 (or 503) asks clients to wait (Retry-After).",
        ),
    ] = 5,
    prewarm: Annotated[
        bool, typer.Option(rich_help_panel=SERVER, help="Build every task image before serving.")
    ] = False,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            rich_help_panel=SERVER,
            help="Where admitted rollouts are kept (SQLite) so a restart loses none; one "
            "server per dir \\[default: $HARBOR_EXEC_DATA_DIR, else "
            "~/.local/state/harbor-exec/server/port-<PORT>, one per port].",
        ),
    ] = None,
    max_timeout_sec: Annotated[
        float | None,
        typer.Option(
            rich_help_panel=SERVER,
            help="Largest agent/grader timeout a request may ask for \\[default: 86400].",
        ),
    ] = None,
    prewarm_jobs: Annotated[
        int | None,
        typer.Option(
            rich_help_panel=SERVER,
            min=1,
            help="Images --prewarm builds at once (default: engine CPUs).",
        ),
    ] = None,
    ray: RayOption = None,
    log_format: Annotated[
        str,
        typer.Option(
            rich_help_panel=SERVER,
            help="What the terminal shows, a line per finished rollout and a summary: "
            "text, or json (JSON lines, for log collectors).",
        ),
    ] = "text",
    summary_interval: Annotated[
        float,
        typer.Option(
            rich_help_panel=SERVER,
            min=0,
            help="Seconds between summary lines (queued, running, done, failed, mean "
            "reward); 0: none.",
        ),
    ] = 30.0,
) -> None:
    """Serve rollouts over HTTP for trainers and `osmosis eval run`."""
    from harbor_exec.server.run import bind_listener, resolve_port, serve_app

    # As uvicorn does: `serve --workflow my_rollout.workflow:Answer` from the project's
    # directory imports it without PYTHONPATH.
    sys.path.insert(0, str(app_dir.resolve()))

    if log_format not in ("text", "json"):
        raise typer.BadParameter("--log-format must be 'text' or 'json'")
    try:
        port = resolve_port(port)
        listener = bind_listener(host, port)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--port") from None
    except OSError as exc:
        typer.echo(f"error: {exc.strerror or exc}", err=True)
        raise typer.Exit(1) from None
    options = ServeOptions(
        workflow,
        grader,
        workflow_config,
        grader_config,
        artifact_root,
        tasks_dir=tasks_dir,
        task_mode=task_mode,
        agent=agent,
        code_dir=code_dir,
        trials_dir=trials_dir,
        max_concurrent_trials=max_concurrent_trials,
        max_queue_depth=max_queue_depth,
        retry_after_sec=retry_after,
        prewarm=prewarm,
        task_roots=list(task_root or []),
        task_env_allow=list(task_env_allow or []),
        task_git_allow=list(task_git_allow or []),
        task_git_allow_unpinned=task_git_allow_unpinned,
        package_source=package_source,
        sandbox=sandbox,
        data_dir=data_dir,
        max_timeout_sec=max_timeout_sec,
        prewarm_jobs=prewarm_jobs,
        ray=ray,
        port=port,
        relay_extra_routes=list(relay_allow_route or []),
        package_cache=package_cache,
        model_name=model_name,
        agent_kwargs=list(agent_kwarg or []),
        agent_setup_timeout_sec=agent_setup_timeout_sec,
        strict_grader_isolation=strict_grader_isolation,
        prefer_grader=prefer_grader,
        grader_env=list(grader_env or []),
        log_format=log_format,
        summary_interval_sec=summary_interval,
        url=f"http://{host}:{listener.getsockname()[1]}",
    )
    if app_ref is not None:
        if any((workflow, grader, workflow_config, grader_config, api_key_env, artifact_root)):
            raise typer.BadParameter(
                "--app serves an app built in code; configure its backend, api_key and "
                "artifact_root there instead of passing --workflow/--grader/--api-key-env/..."
            )
        application = _load_app(app_ref)
    else:
        application = build_app(options, api_key=_api_key(api_key_env))
    serve_app(application, host=host, port=port, access_log=access_log, listener=listener)
