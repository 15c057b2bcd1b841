"""The operator's sandbox policy for every trial container, its defaults, and the limits
one container runs under (``ContainerLimits.resolve``: the operator's overrides, else
the task's own, else the operator's defaults).

Its own module so that what reads the policy (the trial, compose environments) needs
nothing of the trial engine. It is plain data: live services (the package cache) travel
beside a trial request (``TrialRequest.package_cache``), never inside the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from harbor_exec.network.egress.plan import EgressSettings
from harbor_exec.sandbox.archives import VERIFIER_OUTPUT_LIMITS, OutputLimits
from harbor_exec.tasks.config import EnvironmentConfig

#: Where a task's verifier runs: in the agent's container, or in a fresh one.
VerifierMode = Literal["shared", "separate"]


def default_pids_limit(max_concurrent_trials: int, pid_max: int) -> int:
    """A per-container pids limit under which twice ``max_concurrent_trials`` full
    containers still leave a quarter of the host's ``pid_max`` free."""
    share = int(pid_max * 0.75) // max(2 * max_concurrent_trials, 1)
    return max(128, min(4096, share))


#: Limits for tasks whose ``[environment]`` sets none (Harbor 0.26 defaults them to
#: None, i.e. unlimited; one hostile rollout would then share the host's whole budget).
DEFAULT_CPUS = 2.0
DEFAULT_MEMORY_MB = 4096  # swap is never added: memory+swap equals this
DEFAULT_STORAGE_MB = 10240  # the writable layer, /logs included
DEFAULT_SHM_MB = 256  # /dev/shm (tmpfs: it counts against memory too)
# Open files per process (soft and hard). Docker's own default is the daemon's, often
# 1,048,576; this stays under the hard limit of daemons started without
# CAP_SYS_RESOURCE or with a low LimitNOFILE (runc cannot raise it past theirs).
DEFAULT_NOFILE_LIMIT = 16384


@dataclass(frozen=True)
class SandboxPolicy:
    """The operator's settings for every trial container.

    The ``default_*`` limits apply to tasks whose ``[environment]`` leaves the field
    unset; a task's own ``cpus``, ``memory_mb`` and ``storage_mb`` win over them, and the
    ``override_*`` ones (Harbor's ``EnvironmentConfig.override_*``) win over the task's
    (see ``ContainerLimits.resolve``).
    """

    #: "separate": every task's verifier runs in a fresh container (see ``Trial``);
    #: "task": each task's own ``[verifier].environment_mode``.
    verifier_mode: Literal["task", "separate"] = "task"
    #: Where a bundled grader verifies, whatever the task says: "separate" unless asked,
    #: since in the agent's container the files the grader's interpreter reads besides
    #: the read-only runtime (``/etc/ld.so.preload``, ``/tmp``) are the agent's.
    grader_verifier_mode: VerifierMode = "separate"
    pids_limit: int = 4096
    default_cpus: float = DEFAULT_CPUS
    default_memory_mb: int = DEFAULT_MEMORY_MB
    default_storage_mb: int = DEFAULT_STORAGE_MB
    override_cpus: float | None = None
    override_memory_mb: int | None = None
    override_storage_mb: int | None = None
    default_shm_mb: int = DEFAULT_SHM_MB  # /dev/shm (no task sets it)
    default_nofile: int = DEFAULT_NOFILE_LIMIT  # open files per process (no task sets it)
    #: A bundle's dependencies baked into a layer of the task image for the agent's
    #: container (osmosis-ai's ``patch_dockerfile_with_sdk=True``), instead of the
    #: read-only volume (the default; verifier containers always get the volume).
    deps_in_image: bool = False
    #: What the agent wrote: ``/logs/agent``, ``/logs/artifacts``, declared artifacts.
    output: OutputLimits = field(default_factory=OutputLimits)
    #: The verifier's own ``/logs/verifier``, read first.
    verifier_output: OutputLimits = VERIFIER_OUTPUT_LIMITS
    #: Allowlisted networks' egress proxy (``harbor_exec.network.egress.plan``).
    egress: EgressSettings = field(default_factory=EgressSettings)
    #: Later commands over a command server started with each container
    #: (``harbor_exec.sandbox.channel``), not an engine exec each.
    command_channel: bool = True
    #: Containers made ahead of the trials that take them (``harbor_exec.trial.warm``):
    #: at most this many idle at once per engine (0: none), their memory limits summed
    #: at most ``warm_memory_mb``, each removed after ``warm_idle_sec`` idle.
    warm_containers: int = 4
    warm_memory_mb: int = 8192
    warm_idle_sec: float = 60.0


@dataclass(frozen=True)
class ContainerLimits:
    """The limits one container runs under: the operator's overrides, else the task's
    own, else the operator's defaults."""

    cpus: float
    memory_mb: int
    storage_mb: int
    shm_mb: int
    nofile_limit: int
    pids_limit: int

    @classmethod
    def resolve(cls, policy: SandboxPolicy, env: EnvironmentConfig) -> ContainerLimits:
        # Harbor leaves these None unless task.toml sets them, so "unset" is exact;
        # 0 is as good as unset (Harbor's docker environment passes no limit for it).
        memory_mb = policy.override_memory_mb or env.memory_mb or policy.default_memory_mb
        cpus = policy.override_cpus or (float(env.cpus) if env.cpus else policy.default_cpus)
        return cls(
            cpus=cpus,
            memory_mb=memory_mb,
            storage_mb=policy.override_storage_mb or env.storage_mb or policy.default_storage_mb,
            shm_mb=min(policy.default_shm_mb, memory_mb),  # tmpfs pages are memory
            nofile_limit=policy.default_nofile,
            pids_limit=policy.pids_limit,
        )


__all__ = [
    "DEFAULT_CPUS",
    "DEFAULT_MEMORY_MB",
    "DEFAULT_NOFILE_LIMIT",
    "DEFAULT_SHM_MB",
    "DEFAULT_STORAGE_MB",
    "ContainerLimits",
    "SandboxPolicy",
    "VerifierMode",
    "default_pids_limit",
]
