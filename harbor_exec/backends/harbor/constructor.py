"""osmosis-ai 0.3.8's ``HarborBackend`` keywords, read into harbor-exec's settings.

One job: turn what the migration guide's constructor passes (a Harbor ``TrialQueue`` as
``orchestrator=``, Harbor's ``EnvironmentConfig`` as ``environment_config=``, the removed
v0.2 keywords) into the one ``HarborConfig`` (``harbor_config``), or refuse with a
message naming the field and what to use instead. Harbor itself is not imported (it is
an optional extra): its objects are read by attribute, and a dict of
``EnvironmentConfig`` fields works as well.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from harbor_exec.agents.native.config import DEFAULT_MODEL_NAME
from harbor_exec.backends.harbor.config import (
    AgentChoice,
    Capacity,
    HarborConfig,
    Paths,
    SandboxConfig,
    TaskSources,
)
from harbor_exec.backends.harbor.resolver import TaskMode
from harbor_exec.network.packages.config import PackageCacheConfig, package_cache_setting

if TYPE_CHECKING:
    from harbor_exec.bundler.bundle import Bundle
    from harbor_exec.sandbox.archives import OutputLimits
    from harbor_exec.sources.packages import PackageSource

#: v0.2 (and v0.3-only) keywords this backend does not take, with what replaces them.
REPLACED_KEYWORDS: dict[str, str] = {
    "task_dir": "was removed in v0.3; use tasks_dir= with task_mode='template' (one task) "
    "or task_mode='dataset' (a directory of tasks)",
    "dataset_path": "was removed in v0.3; use tasks_dir= with task_mode='dataset'",
    "user_code_dir": "was removed in v0.3; use code_dir= (the project with pyproject.toml) "
    "or bundle= (a prebuilt bundle)",
    "workflow": "was removed in v0.3; use agent= (an AgentWorkflow class or 'module:attr')",
    "custom_tests_dir": "was removed in v0.3; put the tests under each task's tests/, or "
    "pass grader=",
    "prebuild_local_image": "was removed in v0.3; call await backend.prewarm() or "
    "create_rollout_server(lifespan=backend.prewarm_lifespan()) before serving",
    "symlink_environment": "was removed in v0.3; each rollout runs a snapshot of its task",
    "_sdk_source_dir": "was removed in v0.3; harbor-exec's runtime comes from its read-only volume",
    "prewarm": "is not a keyword here; call await backend.prewarm(), use "
    "create_rollout_server(lifespan=backend.prewarm_lifespan()) or `serve --prewarm`",
    "verified_tasks": "is not a keyword here; check a dataset with `harbor-exec validate`",
}


def reject_unknown_keywords(extra: Mapping[str, object]) -> None:
    """TypeError for the first keyword ``HarborBackend`` does not take, saying what
    replaces it when it is a removed one."""
    for name in extra:
        hint = REPLACED_KEYWORDS.get(name)
        if hint is not None:
            raise TypeError(f"HarborBackend({name}=...) {hint}")
        raise TypeError(f"HarborBackend() got an unexpected keyword argument {name!r}")


def orchestrator_concurrency(orchestrator: object) -> int:
    """The trial concurrency of a Harbor ``TrialQueue`` (or any object with
    ``n_concurrent``). Trials never run through the object itself, so a retry policy
    it carries cannot be honoured: a queue that retries (``max_retries`` > 0) is
    refused rather than silently run without retries."""
    n_concurrent = getattr(orchestrator, "n_concurrent", None)
    if n_concurrent is None:  # Harbor 0.26's TrialQueue keeps it private
        n_concurrent = getattr(orchestrator, "_n_concurrent", None)
    if isinstance(n_concurrent, bool) or not isinstance(n_concurrent, int):
        raise TypeError(
            "orchestrator must be a Harbor TrialQueue or an object with an integer "
            f"n_concurrent; got {type(orchestrator).__name__}"
        )
    if n_concurrent < 1:
        raise ValueError(f"orchestrator.n_concurrent must be at least 1; got {n_concurrent}")
    retry = getattr(orchestrator, "retry_config", None) or getattr(
        orchestrator, "_retry_config", None
    )
    max_retries = getattr(retry, "max_retries", 0) if retry is not None else 0
    if max_retries:
        raise ValueError(
            f"orchestrator retries failed trials (retry_config.max_retries={max_retries}); "
            "harbor-exec runs each rollout's trial once (a rollout is one execution, the "
            "trainer decides on retries): pass a TrialQueue without retry_config"
        )
    return n_concurrent


@dataclass(frozen=True)
class EnvironmentSettings:
    """What of Harbor's ``EnvironmentConfig`` applies here (see ``environment_settings``)."""

    override_cpus: float | None = None
    override_memory_mb: int | None = None
    override_storage_mb: int | None = None


#: Harbor 0.26's ``EnvironmentConfig`` defaults, for the fields that have no effect here:
#: one set to anything else is refused, naming the field.
_INERT_DEFAULTS: dict[str, object] = {
    "import_path": None,
    "delete": True,
    "stream": False,
    "cpu_enforcement_policy": "auto",
    "memory_enforcement_policy": "auto",
    "override_gpus": None,
    "override_tpu": None,
    "mounts": None,
    "extra_docker_compose": [],
    "env": {},
    "kwargs": {},
    "extra_allowed_hosts": [],
}
_WHY_NOT: dict[str, str] = {
    "type": "trials run on this machine's Docker engine (or a Ray node's): only "
    "EnvironmentType.DOCKER (or None)",
    "import_path": "custom Harbor environments do not run here",
    "delete": "a trial's containers are always removed (they hold the rollout's relay); "
    "keep trial files with cleanup_successful_trials=False",
    "stream": "streamed Harbor environments do not run here",
    "cpu_enforcement_policy": "limits are always enforced here (cgroup limits)",
    "memory_enforcement_policy": "limits are always enforced here (cgroup limits)",
    "override_gpus": "GPUs are not given to trial containers",
    "override_tpu": "TPUs are not given to trial containers",
    "mounts": "nothing of the host is mounted into a trial's containers",
    "extra_docker_compose": "docker-compose environments are not supported",
    "env": "set a task's variables in its task.toml [environment.env]",
    "kwargs": "there is no Harbor environment to pass them to",
    "extra_allowed_hosts": "trial containers reach only the rollout's relay",
}
#: Ignored, each for its reason: ``suppress_override_warnings`` is deprecated with no
#: effect in Harbor; ``force_build`` either way means what harbor-exec always does (a task
#: with ``environment/Dockerfile`` is built from it, the image cached by content as Harbor's
#: build cache does), except that with ``force_build=False`` Harbor would run a task's
#: ``[environment].docker_image`` instead when the task sets both.
_IGNORED = frozenset({"suppress_override_warnings", "force_build"})
_APPLIED = frozenset({"override_cpus", "override_memory_mb", "override_storage_mb"})


def _plain(value: object) -> object:
    return value.value if isinstance(value, Enum) else value


def environment_settings(config: object) -> EnvironmentSettings:
    """Read Harbor's ``EnvironmentConfig`` (or a dict of its fields).

    Applied: ``override_cpus``, ``override_memory_mb``, ``override_storage_mb`` (as in
    Harbor, they replace what each task's task.toml says). ``force_build`` and the
    deprecated ``suppress_override_warnings`` are ignored (see ``_IGNORED``). Every other
    field must keep Harbor's default: ValueError naming it otherwise.
    """
    if isinstance(config, Mapping):
        fields: dict[str, Any] = dict(config)
    elif callable(getattr(config, "model_dump", None)):
        fields = dict(config.model_dump())  # type: ignore[attr-defined]
    else:
        raise TypeError(
            "environment_config must be Harbor's EnvironmentConfig or a dict of its fields; "
            f"got {type(config).__name__}"
        )
    env_type = _plain(fields.pop("type", None))
    if env_type not in (None, "docker"):
        raise ValueError(f"environment_config.type={env_type!r}: {_WHY_NOT['type']}")
    for name, value in fields.items():
        if name in _APPLIED or name in _IGNORED:
            continue
        if name not in _INERT_DEFAULTS:
            raise ValueError(f"environment_config.{name}: not an EnvironmentConfig field here")
        plain = _plain(value)
        default = _INERT_DEFAULTS[name]
        if plain != default and not (default in ([], {}) and not plain):
            raise ValueError(
                f"environment_config.{name}={plain!r} is not supported: {_WHY_NOT[name]}"
            )
    cpus = fields.get("override_cpus")
    memory = fields.get("override_memory_mb")
    storage = fields.get("override_storage_mb")
    for name, value in (
        ("override_cpus", cpus),
        ("override_memory_mb", memory),
        ("override_storage_mb", storage),
    ):
        if value is not None and (isinstance(value, bool) or not value > 0):
            raise ValueError(f"environment_config.{name} must be positive; got {value!r}")
    return EnvironmentSettings(
        override_cpus=float(cpus) if cpus is not None else None,
        override_memory_mb=int(memory) if memory is not None else None,
        override_storage_mb=int(storage) if storage is not None else None,
    )


class HarborKeywords(TypedDict, total=False):
    """osmosis-ai 0.3.8's ``HarborBackend`` keywords, typed (``harbor_config`` reads them)."""

    tasks_dir: str | Path  # required (``harbor_config`` says so when it is missing)
    task_mode: TaskMode
    agent: str | type | None
    workflow_config: Any
    grader: str | type | None
    grader_config: Any
    code_dir: str | Path | None
    bundle: Bundle | str | Path | None
    trials_dir: str | Path | None
    artifacts_dir: str | Path | None
    cleanup_successful_trials: bool
    max_concurrent_trials: int | None
    max_queue_depth: int | None
    orchestrator: object
    environment_config: object
    patch_dockerfile_with_sdk: bool | None
    task_roots: Sequence[str | Path]
    task_env_allow: Sequence[str]
    task_git_allow: Sequence[str]
    task_git_allow_unpinned: bool
    package_source: str | PackageSource | None
    verifier_mode: Literal["task", "separate"]
    grader_verifier_mode: Literal["separate", "shared"]
    default_cpus: float | None
    default_memory_mb: int | None
    default_storage_mb: int | None
    default_shm_mb: int | None
    default_nofile: int | None
    pids_limit: int | None
    output_limits: OutputLimits | None
    command_channel: bool
    warm_containers: int
    relay_extra_routes: Sequence[str]
    strict_grader_isolation: bool
    prefer_grader: bool
    grader_env: Sequence[str]
    package_cache: PackageCacheConfig | None
    native_agent_kwargs: Mapping[str, Any] | None
    model_name: str
    agent_setup_timeout_sec: float | None


def harbor_config(
    *,
    tasks_dir: str | Path,
    task_mode: TaskMode = "template",
    agent: str | type | None = None,
    workflow_config: Any = None,
    grader: str | type | None = None,
    grader_config: Any = None,
    code_dir: str | Path | None = None,
    bundle: Bundle | str | Path | None = None,
    trials_dir: str | Path | None = None,
    artifacts_dir: str | Path | None = None,
    cleanup_successful_trials: bool = True,
    max_concurrent_trials: int | None = None,
    max_queue_depth: int | None = None,
    orchestrator: object = None,
    environment_config: object = None,
    patch_dockerfile_with_sdk: bool | None = None,
    task_roots: Sequence[str | Path] = (),
    task_env_allow: Sequence[str] = (),
    task_git_allow: Sequence[str] = (),
    task_git_allow_unpinned: bool = False,
    package_source: str | PackageSource | None = None,
    verifier_mode: Literal["task", "separate"] = "task",
    grader_verifier_mode: Literal["separate", "shared"] = "separate",
    default_cpus: float | None = None,
    default_memory_mb: int | None = None,
    default_storage_mb: int | None = None,
    default_shm_mb: int | None = None,
    default_nofile: int | None = None,
    pids_limit: int | None = None,
    output_limits: OutputLimits | None = None,
    command_channel: bool = True,
    warm_containers: int = 4,
    relay_extra_routes: Sequence[str] = (),
    strict_grader_isolation: bool = False,
    prefer_grader: bool = False,
    grader_env: Sequence[str] = (),
    package_cache: PackageCacheConfig | bool | None = True,
    native_agent_kwargs: Mapping[str, Any] | None = None,
    model_name: str = DEFAULT_MODEL_NAME,
    agent_setup_timeout_sec: float | None = None,
    **unknown: object,
) -> HarborConfig:
    """The ``HarborConfig`` of osmosis-ai 0.3.8's ``HarborBackend`` keywords (the migration
    guide's constructor, ``HarborBackend(**keywords)``), taken as
    docs/migrating-from-osmosis.md tabulates; in short:

    ``orchestrator``: a Harbor ``TrialQueue`` (or any object with ``n_concurrent``):
    its ``n_concurrent`` is ``max_concurrent_trials`` (default 4; both given and
    different: ValueError). Trials do not run through it: hooks added to it are not
    called, and a queue with retries (``retry_config.max_retries`` > 0) is refused.

    ``environment_config``: Harbor's ``EnvironmentConfig`` (or a dict of its fields):
    ``override_cpus``/``override_memory_mb``/``override_storage_mb`` replace every
    task's own, as in Harbor; ``force_build`` is ignored (tasks with a Dockerfile are
    always built from it, cached by content); any other field not at Harbor's default
    is a ValueError naming it (``delete=False`` included: containers are always
    removed; ``cleanup_successful_trials=False`` keeps trial files).

    ``bundle``: a ``Bundle`` (``build_bundle``), or a path: a bundle directory, its
    wheel, or a bundle wheel built by osmosis-ai's SDK (``bundler.prebuilt``); the
    workflow and grader are then the bundle's (``agent`` may be omitted; given, it must
    be the bundle's workflow).

    ``patch_dockerfile_with_sdk``: where a workflow's dependencies live in the agent's
    container. False/None (the default): installed once, by the runtime's Python,
    into a volume keyed by the requirement set alone and mounted read-only
    (``sandbox.deps``); the task image stays untouched. True: that same install is
    baked into a layer on top of each task image (``bake_deps_into_image``, once per
    image and requirement set), as osmosis-ai patches the Dockerfile; verifier
    containers keep the volume. ``True`` without a bundle is a ValueError, as in
    osmosis-ai.

    Removed v0.2 keywords (``task_dir``, ``user_code_dir``, ``workflow``, ...) raise
    TypeError saying what replaces them (``constructor.REPLACED_KEYWORDS``).

    ``agent``: "oracle" (the default without a bundle), one of Harbor's own agents,
    run unchanged (``NATIVE_AGENT_NAMES``: "terminus-2", on this host;
    "mini-swe-agent" and "opencode", inside the trial's container from a prebuilt
    read-only agent layer fetched at ``start()`` or prewarm; each reaches the model
    only through the rollout's relay, with the per-rollout token as its key), or a
    workflow (a class or ``module:attr``). A native agent takes
    ``native_agent_kwargs`` (its options), ``model_name`` (an ``openai/<id>`` route; a rollout's
    ``metadata["harbor_model"]`` overrides it) and ``agent_setup_timeout_sec`` (the
    bound on its install). A workflow has no in-container setup to bound (its
    bundle is copied in, its dependencies are prebuilt): there
    ``agent_setup_timeout_sec`` is accepted and has no effect.

    ``task_git_allow``: URL prefixes a rollout's ``metadata.git_url`` may fetch a
    task from (none by default), pinned by ``git_commit_id`` unless
    ``task_git_allow_unpinned``.

    ``package_source``: where a rollout's ``metadata.harbor_task`` ``org/name[@ref]``
    (a Harbor package) comes from: a directory laid out as Harbor's package cache or
    a mirror URL (``harbor_exec.sources.packages``); none by default, when packages
    are refused as a path outside the served roots is.
    ``package_cache``: the package cache (docs/package-cache.md): on by default (``True``:
    the default settings, or a ``PackageCacheConfig``); ``False`` or ``None``: off.

    ``relay_extra_routes``: POST routes under the model URL's path (e.g.
    ``/completions``) a workflow's relay forwards besides ``/chat/completions``.

    ``prefer_grader``: the bundled grader verifies tasks that have a ``tests/test.sh``
    too (by default their tests do, as in Harbor; ``start()`` logs which tasks that is).

    ``grader_env``: names of this process's environment variables only the bundled
    grader's process gets (a judge's key), in its own verifier container (refused with
    ``grader_verifier_mode="shared"``); their values never enter the bundle, the agent's
    container or a trial file.

    ``strict_grader_isolation``: refuse a project whose grader (or its config) is in a
    module the workflow imports (by default such a project, osmosis-ai's usual layout,
    runs: the grader still runs only in the verifier's container, and bundling says
    that the agent's container can read its source).

    ``verifier_mode``: "task" (each task's ``[verifier].environment_mode``) or
    "separate" (always a fresh container). ``grader_verifier_mode``: where the
    bundled grader verifies; "shared" (the agent's container) only when asked,
    being weaker: there what the grader's interpreter reads besides the read-only
    runtime (``/etc/ld.so.preload``, ``/tmp``, ...) is the agent's."""
    reject_unknown_keywords(unknown)
    if orchestrator is not None:
        concurrency = orchestrator_concurrency(orchestrator)
        if max_concurrent_trials is not None and max_concurrent_trials != concurrency:
            raise ValueError(
                f"max_concurrent_trials={max_concurrent_trials} conflicts with the "
                f"orchestrator's n_concurrent={concurrency}: pass one of them"
            )
        max_concurrent_trials = concurrency
    overrides = (
        environment_settings(environment_config)
        if environment_config is not None
        else EnvironmentSettings()
    )
    capacity = Capacity(max_queue_depth=max_queue_depth)
    if max_concurrent_trials is not None:
        capacity = Capacity(max_concurrent_trials, max_queue_depth)
    # A keyword left out (None) keeps SandboxConfig's default.
    defaults = SandboxConfig()
    sandbox = SandboxConfig(
        verifier_mode=verifier_mode,
        grader_verifier_mode=grader_verifier_mode,
        default_cpus=defaults.default_cpus if default_cpus is None else default_cpus,
        default_memory_mb=(
            defaults.default_memory_mb if default_memory_mb is None else default_memory_mb
        ),
        default_storage_mb=(
            defaults.default_storage_mb if default_storage_mb is None else default_storage_mb
        ),
        default_shm_mb=defaults.default_shm_mb if default_shm_mb is None else default_shm_mb,
        default_nofile=defaults.default_nofile if default_nofile is None else default_nofile,
        output=output_limits or defaults.output,
        pids_limit=pids_limit,
        override_cpus=overrides.override_cpus,
        override_memory_mb=overrides.override_memory_mb,
        override_storage_mb=overrides.override_storage_mb,
        deps_in_image=bool(patch_dockerfile_with_sdk),
        command_channel=command_channel,
        warm_containers=warm_containers,
    )
    return HarborConfig(
        tasks=TaskSources(
            Path(tasks_dir),
            task_mode=task_mode,
            task_roots=tuple(Path(root) for root in task_roots),
            task_env_allow=tuple(task_env_allow),
            task_git_allow=tuple(task_git_allow),
            task_git_allow_unpinned=task_git_allow_unpinned,
            package_source=package_source,
        ),
        agent=AgentChoice(
            agent=("oracle" if bundle is None else None) if agent is None else agent,
            workflow_config=workflow_config,
            grader=grader,
            grader_config=grader_config,
            code_dir=Path(code_dir) if code_dir is not None else None,
            bundle=bundle,
            native_agent_kwargs=dict(native_agent_kwargs) if native_agent_kwargs else None,
            model_name=model_name,
            agent_setup_timeout_sec=agent_setup_timeout_sec,
            relay_extra_routes=tuple(relay_extra_routes),
            strict_grader_isolation=strict_grader_isolation,
            prefer_grader=prefer_grader,
            grader_env=tuple(grader_env),
        ),
        sandbox=sandbox,
        capacity=capacity,
        package_cache=package_cache_setting(package_cache),
        paths=Paths(
            trials_dir=Path(trials_dir) if trials_dir else None,
            artifacts_dir=Path(artifacts_dir) if artifacts_dir else None,
            cleanup_successful_trials=cleanup_successful_trials,
        ),
    )
