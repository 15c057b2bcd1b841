"""osmosis-ai 0.3.8's ``HarborBackend`` keywords, read into harbor-exec's settings.

One job: turn what the migration guide's constructor passes (a Harbor ``TrialQueue`` as
``orchestrator=``, Harbor's ``EnvironmentConfig`` as ``environment_config=``, the removed
v0.2 keywords) into this backend's settings, or refuse with a message naming the field
and what to use instead. Harbor itself is not imported (it is an optional extra): its
objects are read by attribute, and a dict of ``EnvironmentConfig`` fields works as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

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
