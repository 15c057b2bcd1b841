"""Every option the commands share, declared once, with the help panel it shows in.

A command takes an option by naming its type here (``dataset: DatasetRefOption = None``)
and its default from here or from the configuration it builds; an option two commands
spell alike but mean differently (``--agent``, ``--api-key-env``) has one declaration per
meaning, both here, so that ``tests/test_cli_options.py`` can check that nothing shared
is declared twice.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from harbor_exec.agents.native.config import NATIVE_AGENT_NAMES
from harbor_exec.backends.harbor.config import CommandLine, SandboxConfig
from harbor_exec.network.packages.config import PackageCacheConfig
from harbor_exec.sources.packages import PACKAGE_SOURCE_ENV

# The help panels, in the order a reader meets them.
TASKS = "Tasks"
JOB = "Job"
AGENT = "Agent"
LIMITS = "Limits"
SANDBOX = "Sandbox"
NETWORK = "Network and cache"
SERVER = "Server"
RAY = "Ray"

# ---- Tasks: where they come from ----

TasksPathArgument = Annotated[
    Path | None, typer.Argument(help="A task directory or a dataset of tasks.", show_default=False)
]
DatasetRefOption = Annotated[
    str | None,
    typer.Option(
        "-d",
        "--dataset",
        metavar="NAME[@VERSION]|ORG/NAME[@REF]",
        rich_help_panel=TASKS,
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
        rich_help_panel=TASKS,
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
        rich_help_panel=TASKS,
        help="Where Harbor packages (org/name@ref) come from: a directory laid out as "
        "Harbor's package cache, or a mirror URL (docs/datasets.md).",
    ),
]
RegistryPathOption = Annotated[
    Path | None,
    typer.Option(
        "--registry-path",
        rich_help_panel=TASKS,
        help="A registry JSON file (Harbor's format).",
    ),
]
RegistryUrlOption = Annotated[
    str | None,
    typer.Option("--registry-url", rich_help_panel=TASKS, help="A registry JSON file's URL."),
]
AllowUnpinnedOption = Annotated[
    bool,
    typer.Option(
        "--task-git-allow-unpinned",
        rich_help_panel=TASKS,
        help="Run a registry task without a full git_commit_id at its remote's HEAD.",
    ),
]
# ``serve``'s spelling has its ``--no-`` form: kept, as every option keeps its names.
ServeAllowUnpinnedOption = Annotated[
    bool,
    typer.Option(
        "--task-git-allow-unpinned/--no-task-git-allow-unpinned",
        rich_help_panel=TASKS,
        help="Run git tasks without git_commit_id (the remote's HEAD at the time).",
    ),
]

IncludeTaskOption = Annotated[
    list[str] | None,
    typer.Option(
        "-i",
        "--include-task-name",
        metavar="PATTERN",
        rich_help_panel=TASKS,
        help="Run only tasks whose name matches (glob; repeatable), as Harbor's.",
    ),
]
ExcludeTaskOption = Annotated[
    list[str] | None,
    typer.Option(
        "-x",
        "--exclude-task-name",
        metavar="PATTERN",
        rich_help_panel=TASKS,
        help="Leave out tasks whose name matches (glob; repeatable), as Harbor's.",
    ),
]
NTasksOption = Annotated[
    int | None,
    typer.Option(
        "-l",
        "--n-tasks",
        min=1,
        rich_help_panel=TASKS,
        help="At most this many tasks (after -i and -x), as Harbor's.",
    ),
]

# ---- Job: validate's and run's trials and where they are written ----

DEFAULT_N_CONCURRENT = 4
NConcurrentOption = Annotated[
    int,
    typer.Option(
        "-n",
        "--n-concurrent",
        min=1,
        rich_help_panel=JOB,
        help="Trials run at once (a trial gives its slot back once its reward is read).",
    ),
]
NAttemptsOption = Annotated[
    int,
    typer.Option(
        "-k", "--n-attempts", min=1, rich_help_panel=JOB, help="Trials per task (pass@k)."
    ),
]
MaxRetriesOption = Annotated[
    int,
    typer.Option(
        "-r",
        "--max-retries",
        min=0,
        rich_help_panel=JOB,
        help="Run a trial again (a new trial) when it ended with an exception Harbor "
        "retries (a failed build, an engine fault, ...), up to this many times.",
    ),
]
DEFAULT_JOBS_DIR = Path("jobs")
JobsDirOption = Annotated[
    Path, typer.Option("--jobs-dir", rich_help_panel=JOB, help="Where job directories go.")
]
JobNameOption = Annotated[
    str | None,
    typer.Option(
        "--job-name",
        rich_help_panel=JOB,
        help="The job's directory name (default: the start time); an existing job of "
        "that name is resumed, its finished trials kept.",
    ),
]

# ---- Agent: what runs, and with which model ----

RunAgentOption = Annotated[
    str,
    typer.Option(
        "--agent",
        "-a",
        rich_help_panel=AGENT,
        help=f"Harbor's agent to run: {', '.join(NATIVE_AGENT_NAMES)}.",
    ),
]
ServeAgentOption = Annotated[
    str | None,
    typer.Option(
        "--agent",
        rich_help_panel=AGENT,
        help="With --tasks-dir: oracle, terminus-2, mini-swe-agent, opencode (Harbor's "
        "own agents), or an AgentWorkflow module:Class.",
    ),
]
PrewarmAgentOption = Annotated[
    str | None,
    typer.Option(
        "--agent",
        rich_help_panel=AGENT,
        help="Also prepare this in-container native agent's layer (mini-swe-agent, "
        "opencode): its wheels (and opencode's binary) are fetched now, its volume "
        "installed with the first task.",
    ),
]
RunModelNameOption = Annotated[
    str,
    typer.Option(
        "--model-name",
        "-m",
        rich_help_panel=AGENT,
        help="The model route, openai/<id> (an OpenAI-compatible API).",
    ),
]
ServeModelNameOption = Annotated[
    str | None,
    typer.Option(
        "--model-name",
        rich_help_panel=AGENT,
        help="With a native --agent: the model route, openai/<id> \\[default: "
        "openai/osmosis-rollout]; a rollout's metadata.harbor_model overrides it.",
    ),
]
AgentKwargOption = Annotated[
    list[str] | None,
    typer.Option(
        "--agent-kwarg",
        metavar="KEY=VALUE",
        rich_help_panel=AGENT,
        help="With a native --agent: an option of the agent (VALUE as JSON when it "
        "parses, e.g. max_turns=30, collect_rollout_details=true; repeatable).",
    ),
]
# ``run`` checks the bound as the command line is read; ``serve``'s is checked by the
# backend (a workflow agent accepts any value and ignores it).
RunAgentSetupTimeoutOption = Annotated[
    float | None,
    typer.Option(
        "--agent-setup-timeout-sec",
        min=0.001,
        rich_help_panel=AGENT,
        help="The agent's setup timeout.",
    ),
]
ServeAgentSetupTimeoutOption = Annotated[
    float | None,
    typer.Option(
        "--agent-setup-timeout-sec",
        rich_help_panel=AGENT,
        help="With a native --agent: the agent's setup timeout.",
    ),
]

StrictGraderIsolationOption = Annotated[
    bool,
    typer.Option(
        "--strict-grader-isolation",
        rich_help_panel=AGENT,
        help="Refuse a project whose grader (or its config) is in a module the workflow "
        "imports; by default it runs (the grader only in the verifier's container) and "
        "bundling says that the agent's container can read its source.",
    ),
]

GraderEnvOption = Annotated[
    list[str] | None,
    typer.Option(
        "--grader-env",
        metavar="NAME",
        rich_help_panel=AGENT,
        help="A variable of this server's environment only the bundled grader gets (a "
        "judge's key), in its own verifier container (repeatable; never in the bundle).",
    ),
]
PreferGraderOption = Annotated[
    bool,
    typer.Option(
        "--prefer-grader",
        rich_help_panel=AGENT,
        help="The --grader verifies tasks that have a tests/test.sh too (by default their "
        "tests do, as in Harbor, and serve says which tasks that is).",
    ),
]

# ---- Sandbox: where verifiers run; Limits: what a container may use ----


def _sandbox_option(config_field: dataclasses.Field[Any]) -> tuple[str, Any, Any]:
    """The (parameter, declaration, default) of one ``SandboxConfig`` field's option."""
    cli: CommandLine = config_field.metadata["cli"]
    name = cli.parameter or config_field.name
    kind: Any = cli.option_type or _SANDBOX_HINTS[config_field.name]
    default = getattr(_SANDBOX, config_field.name)
    if cli.from_field is not None:
        default = cli.from_field(default)
    if typing.get_origin(kind) is typing.Literal:
        # typer takes choices as an enum: one of the literal's values, in its order.
        choices: Any = StrEnum  # the functional API, which mypy reads as a class statement
        kind = choices(f"{name}_choice", {value: value for value in typing.get_args(kind)})
        default = kind(default)
    declaration = Annotated[
        kind,
        typer.Option(
            cli.flag,
            min=cli.min,
            rich_help_panel=cli.panel,
            help=cli.help,
        ),
    ]
    return name, declaration, default


_SANDBOX = SandboxConfig()
_SANDBOX_HINTS = typing.get_type_hints(SandboxConfig)
# The Limits panel shows before the Sandbox one, as the panels' order above says.
_SANDBOX_FIELDS = {
    _sandbox_option(f)[0]: f
    for f in sorted(
        (f for f in dataclasses.fields(SandboxConfig) if "cli" in f.metadata),
        key=lambda f: f.metadata["cli"].panel != "Limits",
    )
}
#: The sandbox and limits options, by parameter: (declaration, default), made from the
#: fields of ``SandboxConfig`` that say how the command line gives them. A command
#: decorated with ``takes_sandbox`` gets them all, read into one ``sandbox: SandboxConfig``.
SANDBOX_OPTIONS: dict[str, tuple[Any, Any]] = {
    name: _sandbox_option(config_field)[1:] for name, config_field in _SANDBOX_FIELDS.items()
}


def sandbox_config(values: dict[str, Any]) -> SandboxConfig:
    """The ``SandboxConfig`` the sandbox and limits options describe (an option not
    given: the field's default)."""
    given: dict[str, Any] = {}
    for name, value in values.items():
        config_field = _SANDBOX_FIELDS[name]
        cli: CommandLine = config_field.metadata["cli"]
        value = str(value) if isinstance(value, StrEnum) else value
        given[config_field.name] = cli.to_field(value) if cli.to_field is not None else value
    return SandboxConfig(**given)


def _expand(
    command: Callable[..., None],
    placeholder: str,
    added: list[inspect.Parameter],
    make: Callable[[dict[str, Any]], Any],
) -> Callable[..., None]:
    """``command`` taking the ``added`` options in the place of its ``placeholder``
    parameter, which gets ``make`` of their values."""
    hints = typing.get_type_hints(command, include_extras=True)
    names = [parameter.name for parameter in added]

    @functools.wraps(command)
    def expanded(*args: Any, **kwargs: Any) -> None:
        values = {name: kwargs.pop(name) for name in names}
        command(*args, **{placeholder: make(values)}, **kwargs)

    # In the place of the placeholder: the help shows the panels in the parameters' order.
    parameters: list[inspect.Parameter] = []
    for parameter in inspect.signature(command).parameters.values():
        if parameter.name == placeholder:
            parameters += added
        else:
            parameters.append(
                parameter.replace(
                    kind=inspect.Parameter.KEYWORD_ONLY,
                    annotation=hints.get(parameter.name, parameter.annotation),
                )
            )
    expanded.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    expanded.__annotations__ = {p.name: p.annotation for p in parameters}
    return expanded


def takes_sandbox(*, grader: bool = False) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A command with a ``sandbox: SandboxConfig`` parameter takes the sandbox and limits
    options in its place (``--grader-verifier-mode`` too with ``grader``): one list of
    them, here, for every command."""
    names = [
        name
        for name, config_field in _SANDBOX_FIELDS.items()
        if grader or not config_field.metadata["cli"].grader_only
    ]
    added = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            annotation=SANDBOX_OPTIONS[name][0],
            default=SANDBOX_OPTIONS[name][1],
        )
        for name in names
    ]

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        return _expand(command, "sandbox", added, sandbox_config)

    return decorate


# ---- Network and cache ----

PackageCacheOption = Annotated[
    bool,
    typer.Option(
        "--package-cache/--no-package-cache",
        rich_help_panel=NETWORK,
        help="Trial containers with network, and image builds, fetch through a host-side "
        "package cache (apt, PyPI, npm, uv, GitHub releases; HTTPS terminated only for "
        "those hosts, with a local CA only our containers trust), so later trials get "
        "what earlier ones downloaded. On by default; a task opts out with \\[metadata] "
        "harbor_exec_package_cache = false (docs/package-cache.md).",
    ),
]
PackageCacheMaxGbOption = Annotated[
    float | None,
    typer.Option(
        "--package-cache-max-gb",
        min=0.001,
        rich_help_panel=NETWORK,
        help="The package cache's bound (GB, LRU eviction; default: 10% of its disk, at "
        "most 20 GB).",
    ),
]
PackageCacheDirOption = Annotated[
    Path | None,
    typer.Option(
        "--package-cache-dir",
        rich_help_panel=NETWORK,
        help="Where the package cache keeps its stores and CA (default: the harbor-exec "
        "cache dir); several harbor-exec processes share it.",
    ),
]
PackageCacheHostOption = Annotated[
    list[str] | None,
    typer.Option(
        "--package-cache-host",
        rich_help_panel=NETWORK,
        help="A host (glob) whose HTTPS the cache terminates and stores, besides the "
        "package ecosystems' (PyPI, npm, Debian and Ubuntu mirrors, uv's installer, "
        "GitHub releases); every other host's HTTPS is tunnelled untouched. Repeatable.",
    ),
]
_PACKAGE_CACHE_OPTIONS = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=hint, default=default)
    for name, hint, default in (
        ("package_cache", PackageCacheOption, True),
        ("package_cache_max_gb", PackageCacheMaxGbOption, None),
        ("package_cache_dir", PackageCacheDirOption, None),
        ("package_cache_host", PackageCacheHostOption, None),
    )
]


def package_cache_config(values: dict[str, Any]) -> PackageCacheConfig | None:
    """The ``PackageCacheConfig`` the package cache options describe; None: off."""
    if not values["package_cache"]:
        return None
    try:
        return PackageCacheConfig.from_options(
            values["package_cache_dir"],
            values["package_cache_max_gb"],
            values["package_cache_host"] or (),
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--package-cache-host") from None


def takes_package_cache(command: Callable[..., None]) -> Callable[..., None]:
    """A command with a ``package_cache: PackageCacheConfig | None`` parameter takes the
    package cache options in its place (one declaration for every command)."""
    return _expand(command, "package_cache", _PACKAGE_CACHE_OPTIONS, package_cache_config)


# ---- Ray ----

RayOption = Annotated[
    str | None,
    typer.Option(
        "--ray",
        metavar="ADDRESS",
        rich_help_panel=RAY,
        help="Run on the trial nodes of this Ray cluster (host:port of its head, or "
        "'auto'); nodes offer slots with the harbor_exec_trial resource (docs/ray.md).",
    ),
]

__all__ = [
    "AGENT",
    "DEFAULT_JOBS_DIR",
    "DEFAULT_N_CONCURRENT",
    "JOB",
    "LIMITS",
    "NETWORK",
    "RAY",
    "SANDBOX",
    "SANDBOX_OPTIONS",
    "SERVER",
    "TASKS",
    "AgentKwargOption",
    "AllowUnpinnedOption",
    "DatasetRefOption",
    "ExcludeTaskOption",
    "GraderEnvOption",
    "IncludeTaskOption",
    "JobNameOption",
    "JobsDirOption",
    "MaxRetriesOption",
    "NAttemptsOption",
    "NConcurrentOption",
    "NTasksOption",
    "PackageCacheDirOption",
    "PackageCacheHostOption",
    "PackageCacheMaxGbOption",
    "PackageCacheOption",
    "PackageSourceOption",
    "PreferGraderOption",
    "PrewarmAgentOption",
    "RayOption",
    "RegistryPathOption",
    "RegistryUrlOption",
    "RunAgentOption",
    "RunAgentSetupTimeoutOption",
    "RunModelNameOption",
    "ServeAgentOption",
    "ServeAgentSetupTimeoutOption",
    "ServeAllowUnpinnedOption",
    "ServeModelNameOption",
    "StrictGraderIsolationOption",
    "TaskRefOption",
    "TasksPathArgument",
    "package_cache_config",
    "sandbox_config",
    "takes_package_cache",
    "takes_sandbox",
]
