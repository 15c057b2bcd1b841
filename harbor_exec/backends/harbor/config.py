"""One typed, frozen configuration of a harbor-exec deployment, whatever builds it.

``serve`` builds a ``HarborConfig`` from its option groups (``cli/options.py``),
``validate`` and ``run`` build its ``SandboxConfig`` from the same groups, osmosis-ai's
keyword constructor (``constructor.harbor_config``) builds it from the guide's keywords,
and ``HarborBackend`` takes it. Each part says one thing: where tasks come from, which
agent runs, what a container may do and use, how many trials run, the package cache,
and where files go. Everything here is plain data: a live service (the package cache's,
an egress upstream) is made from it where trials run, never kept in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from harbor_exec.agents.native.config import (
    DEFAULT_MODEL_NAME,
    NATIVE_AGENT_NAMES,
    NativeAgentConfig,
    check_agent_name,
    is_native_agent,
    native_agent_config,
)
from harbor_exec.network.packages.config import PackageCacheConfig
from harbor_exec.sandbox.archives import OutputLimits
from harbor_exec.trial.policy import (
    DEFAULT_CPUS,
    DEFAULT_MEMORY_MB,
    DEFAULT_NOFILE_LIMIT,
    DEFAULT_SHM_MB,
    DEFAULT_STORAGE_MB,
    SandboxPolicy,
    default_pids_limit,
)

if TYPE_CHECKING:  # the resolver's module imports the task sources (git, packages)
    from harbor_exec.backends.harbor.resolver import TaskMode
    from harbor_exec.bundler.bundle import Bundle
    from harbor_exec.sources.packages import PackageSource

#: Trials run at once unless told otherwise (``--max-concurrent-trials``, ``-n``).
DEFAULT_MAX_CONCURRENT_TRIALS = 4
#: What ``--max-log-bytes`` caps unless told otherwise.
DEFAULT_MAX_LOG_BYTES = OutputLimits().max_file_bytes


@dataclass(frozen=True)
class TaskSources:
    """Where a rollout's task comes from: the served directory, other roots it may name,
    git remotes and a package source it may fetch from, and the host variables it may read."""

    tasks_dir: Path
    task_mode: TaskMode = "template"
    task_roots: tuple[Path, ...] = ()
    task_env_allow: tuple[str, ...] = ()
    task_git_allow: tuple[str, ...] = ()
    task_git_allow_unpinned: bool = False
    #: Where ``metadata.harbor_task`` ``org/name[@ref]`` packages come from; None: refused.
    package_source: str | PackageSource | None = None


@dataclass(frozen=True)
class AgentChoice:
    """What runs in a trial: the oracle, one of Harbor's own agents with its model route
    and options, or a bundled workflow (with its grader and configs)."""

    #: "oracle", a native agent's name, a workflow class or ``module:attr``; None: the
    #: prebuilt bundle's own workflow.
    agent: str | type | None = "oracle"
    workflow_config: Any = None
    grader: str | type | None = None
    grader_config: Any = None
    code_dir: Path | None = None
    bundle: Bundle | str | Path | None = None
    native_agent_kwargs: dict[str, Any] | None = None
    model_name: str = DEFAULT_MODEL_NAME
    agent_setup_timeout_sec: float | None = None
    #: POST routes a workflow's relay forwards besides ``/chat/completions``.
    relay_extra_routes: tuple[str, ...] = ()
    #: Refuse a project whose grader shares a module with the workflow (by default it
    #: runs, the grader's source readable in the agent's container, said at bundling).
    strict_grader_isolation: bool = False
    #: The bundled grader verifies every task, its own ``tests/test.sh`` too (by default
    #: a task's tests win, as in Harbor, and ``start`` says which tasks that concerns).
    prefer_grader: bool = False
    #: Names of the server's environment variables only the bundled grader gets (a
    #: judge's key), in a separate verifier container.
    grader_env: tuple[str, ...] = ()


def check_agent_choice(choice: AgentChoice, *, deps_in_image: bool) -> NativeAgentConfig | None:
    """The native agent's config when ``choice`` names one of Harbor's agents, else None;
    ValueError (or TypeError) when the choice's parts do not go together."""
    agent = choice.agent
    check_agent_name(agent)
    is_oracle = agent == "oracle"
    if isinstance(choice.bundle, str | Path):
        # Checked now, cheaply; the bundle itself is read (or, for an osmosis-ai wheel,
        # bundled here) by start().
        from harbor_exec.bundler.prebuilt import check_bundle_path  # the bundler extra

        check_bundle_path(choice.bundle)
    if is_oracle and choice.bundle is not None:
        raise ValueError("the oracle runs no bundle: pass agent= a workflow, or omit it")
    if is_oracle and choice.grader is not None:
        raise ValueError("a bundled grader needs a workflow agent (the oracle has no bundle)")
    native = None
    if is_native_agent(agent):
        if choice.workflow_config is not None:
            raise ValueError(
                f"workflow_config is a workflow's; the native agent {agent!r} takes "
                "native_agent_kwargs"
            )
        native = native_agent_config(
            str(agent),
            model_name=choice.model_name,
            kwargs=choice.native_agent_kwargs,
            setup_timeout_sec=choice.agent_setup_timeout_sec,
        )
    elif choice.native_agent_kwargs:
        raise ValueError(
            f"native_agent_kwargs are for Harbor's own agents ({', '.join(NATIVE_AGENT_NAMES)})"
            "; a workflow takes workflow_config"
        )
    elif choice.agent_setup_timeout_sec is not None and choice.agent_setup_timeout_sec <= 0:
        raise ValueError("agent_setup_timeout_sec must be positive (or None)")
    if deps_in_image and (is_oracle or (native is not None and choice.grader is None)):
        # As osmosis-ai: without a workflow or a grader there is no bundle to install.
        raise ValueError("patch_dockerfile_with_sdk requires a bundle (a workflow or grader)")
    return native


@dataclass(frozen=True)
class CommandLine:
    """How a ``SandboxConfig`` field is given on the command line: ``cli/options.py`` makes
    one option of it for every command that runs trials, so a new sandbox option is a
    field here (with this) and the ``SandboxPolicy`` field the trial reads."""

    flag: str
    panel: Literal["Sandbox", "Limits"]
    help: str
    min: float | None = None
    #: Only for commands that can run a bundled grader (``serve``).
    grader_only: bool = False
    #: The command's parameter and its type when they are not the field's own, with the
    #: conversions between the option's value and the field's.
    parameter: str | None = None
    option_type: type | None = None
    to_field: Callable[[Any], Any] | None = None
    from_field: Callable[[Any], Any] | None = None


def _cli(flag: str, panel: Literal["Sandbox", "Limits"], help: str, **more: Any) -> dict[str, Any]:
    return {"cli": CommandLine(flag, panel, help, **more)}


def _max_file_bytes(output: OutputLimits) -> int:
    return output.max_file_bytes


def _output_limits(max_file_bytes: int) -> OutputLimits:
    return OutputLimits(max_file_bytes=max_file_bytes)


@dataclass(frozen=True)
class SandboxConfig:
    """What every trial container may do and use. ``policy`` makes the trial's
    ``SandboxPolicy`` of it, the one place the two meet: a field of the same name there
    is copied as it is."""

    verifier_mode: Literal["task", "separate"] = field(
        default="task",
        metadata=_cli(
            "--verifier-mode",
            "Sandbox",
            "task: each task's own \\[verifier].environment_mode; separate: every verifier "
            "runs in a fresh container that sees only the artifacts (recommended for RL).",
        ),
    )
    grader_verifier_mode: Literal["separate", "shared"] = field(
        default="separate",
        metadata=_cli(
            "--grader-verifier-mode",
            "Sandbox",
            "Where a bundled grader verifies: separate (a fresh container, the default) or "
            "shared (the agent's container: weaker, the files the grader's interpreter reads "
            "besides the read-only runtime, such as /etc/ld.so.preload, are the agent's).",
            grader_only=True,
        ),
    )
    default_cpus: float = field(
        default=DEFAULT_CPUS,
        metadata=_cli(
            "--default-cpus", "Limits", "CPUs for tasks that set no \\[environment].cpus.", min=0.01
        ),
    )
    default_memory_mb: int = field(
        default=DEFAULT_MEMORY_MB,
        metadata=_cli(
            "--default-memory-mb",
            "Limits",
            "Memory (MB) for tasks that set no \\[environment].memory_mb; never any swap.",
            min=16,
        ),
    )
    default_storage_mb: int = field(
        default=DEFAULT_STORAGE_MB,
        metadata=_cli(
            "--default-storage-mb",
            "Limits",
            "Disk (MB) a container may write (writable layer and /logs) for tasks that set "
            "no \\[environment].storage_mb; past it the agent is stopped "
            "(DiskBudgetExceededError).",
            min=16,
        ),
    )
    default_shm_mb: int = field(
        default=DEFAULT_SHM_MB,
        metadata=_cli(
            "--default-shm-mb",
            "Limits",
            "Size (MB) of /dev/shm, at most the container's memory.",
            min=1,
        ),
    )
    default_nofile: int = field(
        default=DEFAULT_NOFILE_LIMIT,
        metadata=_cli(
            "--default-nofile",
            "Limits",
            "Open files per process in a container (nofile ulimit).",
            min=64,
        ),
    )
    output: OutputLimits = field(
        default_factory=OutputLimits,
        metadata=_cli(
            "--max-log-bytes",
            "Limits",
            "Cap on each file copied back from a container (oracle.txt, test-stdout.txt, "
            "artifacts); the tail is kept after a marker.",
            min=1024,
            parameter="max_log_bytes",
            option_type=int,
            to_field=_output_limits,
            from_field=_max_file_bytes,
        ),
    )
    command_channel: bool = field(
        default=True,
        metadata=_cli(
            "--command-channel/--no-command-channel",
            "Sandbox",
            "Run a container's commands over one stream to a command server started with "
            "it (the default), instead of an engine exec each.",
        ),
    )
    warm_containers: int = field(
        default=4,
        metadata=_cli(
            "--warm-containers",
            "Sandbox",
            "Containers kept created and started ahead of the trials of the tasks being run "
            "(per engine; 0: none), as many as the most trials of a task that ran at once "
            "lately; validate and run start this many of their next trials ahead instead.",
            min=0,
        ),
    )
    warm_memory_mb: int = field(
        default=8192,
        metadata=_cli(
            "--warm-memory-mb",
            "Sandbox",
            "Most memory (MB) the warm containers' limits may sum to.",
            min=0,
        ),
    )
    #: An idle warm container is removed after this many seconds.
    warm_idle_sec: float = 60.0
    #: None: from the trials run at once and the engine's ``pid_max``.
    pids_limit: int | None = None
    #: Harbor's ``EnvironmentConfig.override_*``: replace every task's own.
    override_cpus: float | None = None
    override_memory_mb: int | None = None
    override_storage_mb: int | None = None
    #: The workflow's dependencies baked into the task image (``patch_dockerfile_with_sdk``).
    deps_in_image: bool = False

    def __post_init__(self) -> None:
        if self.verifier_mode not in ("task", "separate"):
            raise ValueError(
                f"verifier_mode must be 'task' or 'separate'; got {self.verifier_mode!r}"
            )
        if self.grader_verifier_mode not in ("separate", "shared"):
            raise ValueError(
                "grader_verifier_mode must be 'separate' or 'shared'; "
                f"got {self.grader_verifier_mode!r}"
            )

    def policy(
        self, *, max_concurrent_trials: int, pid_max: int | Callable[[], int]
    ) -> SandboxPolicy:
        """The trial's ``SandboxPolicy``: every field both have, copied; ``pid_max`` (the
        engine's, or how to ask it) is read only when no ``pids_limit`` was given."""
        pids = self.pids_limit
        if pids is None:
            engine_pid_max = pid_max if isinstance(pid_max, int) else pid_max()
            pids = default_pids_limit(max_concurrent_trials, engine_pid_max)
        shared = {name: getattr(self, name) for name in _POLICY_FIELDS if name != "pids_limit"}
        return SandboxPolicy(pids_limit=pids, **shared)


_POLICY_FIELDS = frozenset(f.name for f in fields(SandboxPolicy)) & frozenset(
    f.name for f in fields(SandboxConfig)
)


@dataclass(frozen=True)
class Capacity:
    """How many trials run at once, and how many rollouts may wait (None: no bound)."""

    max_concurrent_trials: int = DEFAULT_MAX_CONCURRENT_TRIALS
    max_queue_depth: int | None = None

    def __post_init__(self) -> None:
        if self.max_queue_depth is not None and self.max_queue_depth < 1:
            raise ValueError("max_queue_depth must be at least 1 (or None for no limit)")
        if self.max_concurrent_trials < 1:
            raise ValueError("max_concurrent_trials must be at least 1")


@dataclass(frozen=True)
class Paths:
    """Where trials and artifacts are written (None: the defaults ``HarborBackend`` names)."""

    trials_dir: Path | None = None
    artifacts_dir: Path | None = None
    #: False keeps a successful trial's files.
    cleanup_successful_trials: bool = True


@dataclass(frozen=True)
class HarborConfig:
    """Everything ``HarborBackend`` is configured with."""

    tasks: TaskSources
    agent: AgentChoice = field(default_factory=AgentChoice)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    capacity: Capacity = field(default_factory=Capacity)
    #: The package cache's settings (the live service is made by the executor); on by
    #: default, None: off.
    package_cache: PackageCacheConfig | None = field(default_factory=PackageCacheConfig)
    paths: Paths = field(default_factory=Paths)


__all__ = [
    "DEFAULT_MAX_CONCURRENT_TRIALS",
    "DEFAULT_MAX_LOG_BYTES",
    "AgentChoice",
    "Capacity",
    "CommandLine",
    "HarborConfig",
    "Paths",
    "SandboxConfig",
    "TaskSources",
    "check_agent_choice",
]
