"""The narrow boundary between trial logic and containers, in two halves.

Like an httpx transport: trials call a small interface of plain values
(``ContainerRuntime``) and never touch the Docker SDK; executors, jobs and the CLI
administer the engine through another (``EngineAdmin``). An executor holds both
(``ContainerEngine``). ``harbor_exec.sandbox.docker.DockerRuntime`` implements them;
unit tests (``tests/fake_runtime.py``) and a Ray node use the same interfaces.
Moving files in and out as tar streams is ``harbor_exec.sandbox.archives``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal, NotRequired, Protocol, TypedDict, Unpack

from harbor_exec.sandbox.cgroups import Companion
from harbor_exec.sandbox.users import ImageAccounts

NetworkKind = Literal["bridge", "none"]

#: Label keys every object we create carries.
LABEL_MANAGED = "harbor-exec.managed"
LABEL_OWNER = "harbor-exec.owner"
LABEL_TRIAL = "harbor-exec.trial"
LABEL_TASK = "harbor-exec.task"
LABEL_ROLLOUT = "harbor-exec.rollout"
LABEL_KIND = "harbor-exec.kind"


#: Capabilities every trial container loses on top of Docker's defaults: none of them
#: is needed to install packages or run tests, and each widens what a hostile agent
#: can do (raw sockets, device nodes, audit writes, file capabilities, chroot).
DROPPED_CAPABILITIES = ("NET_RAW", "MKNOD", "AUDIT_WRITE", "SETFCAP", "SYS_CHROOT")


@dataclass(frozen=True)
class Mount:
    """A host directory bind-mounted into a container."""

    source: str  # absolute host path
    target: str  # absolute container path
    read_only: bool = True


@dataclass(frozen=True)
class VolumeMount:
    """A per-trial named volume (``ContainerRuntime.create_volume``) in a container."""

    volume: str
    target: str
    read_only: bool = False
    #: False: an empty volume is first filled from the image's files at ``target``
    #: (Docker's and Compose's default for named volumes).
    no_copy: bool = False


@dataclass(frozen=True)
class Healthcheck:
    """Docker's HEALTHCHECK for a container (a compose service's ``healthcheck``)."""

    test: Sequence[str]  # ["CMD-SHELL", "..."], ["CMD", ...] or ["NONE"]
    interval_sec: float = 30.0
    timeout_sec: float = 30.0
    retries: int = 3
    start_period_sec: float = 0.0


@dataclass(frozen=True)
class ServiceProcess:
    """A sidecar's own main process, run under the runtime's init instead of the
    keep-alive. ``None`` fields are the image's (an ``entrypoint`` given clears the
    image's ``CMD``, as in Docker)."""

    entrypoint: Sequence[str] | None = None
    command: Sequence[str] | None = None
    user: str | None = None  # None: the image's USER
    workdir: str | None = None  # None: the image's WORKDIR


@dataclass(frozen=True)
class ContainerStatus:
    """What ``ContainerRuntime.container_status`` reports."""

    exists: bool
    running: bool
    exit_code: int | None = None
    health: str | None = None  # starting, healthy, unhealthy; None: no healthcheck


@dataclass(frozen=True)
class ContainerSpec:
    """Everything needed to create one trial container.

    Containers never get host networking (``network`` is ``bridge`` or ``none``);
    they always run with ``no-new-privileges``, Docker's default seccomp profile
    without ``seccomp.DENIED_SYSCALLS`` (``syscalls_allowed`` may give back some of
    those only) and without ``DROPPED_CAPABILITIES`` (``cap_add`` may give back some
    of those only).
    """

    image: str
    name: str
    labels: Mapping[str, str]
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: float | None = None  # None: no CPU quota
    memory_mb: int | None = None  # None: unlimited; else memory+swap is this too (no swap)
    pids_limit: int = 4096
    shm_mb: int | None = None  # size of /dev/shm; None: the engine's default
    nofile_limit: int | None = None  # open files (soft = hard); None: the engine's default
    network: NetworkKind = "bridge"
    mounts: Sequence[Mount] = ()
    cap_add: Sequence[str] = ()
    #: Syscalls of ``seccomp.DENIED_SYSCALLS`` the task asked back (``ptrace``, ...).
    syscalls_allowed: Sequence[str] = ()
    gpus: int = 0  # requested through the engine's device requests
    #: The bundle's dependency environment (``harbor_exec.sandbox.deps``), mounted
    #: read-only at ``DEPS_MOUNT``; the runtime volume is mounted into every container.
    deps_volume: str | None = None
    #: An in-container native agent's layer (``harbor_exec.agents.native.layer``),
    #: mounted read-only at ``AGENT_MOUNT``.
    agent_volume: str | None = None
    #: A per-trial network of ours (``create_network``) to join instead of the default
    #: bridge (``network`` must be "bridge"), reachable there as ``aliases``.
    network_name: str | None = None
    aliases: Sequence[str] = ()
    volumes: Sequence[VolumeMount] = ()
    #: A compose sidecar's process (None: the keep-alive, as every trial container).
    process: ServiceProcess | None = None
    #: Run first in the keep-alive's place, as its user, with the keep-alive's argv
    #: appended, which it must exec (the egress forwarder: started with the container,
    #: no exec; ``harbor_exec.network.egress.container.forwarder_with_container``).
    before_keep_alive: Sequence[str] = ()
    healthcheck: Healthcheck | None = None
    workdir: str | None = None  # the container's working directory (None: the image's)
    #: Run later commands over a command server started with the container (one stream
    #: the runtime holds, ``harbor_exec.sandbox.channel``) instead of an engine exec each.
    #: Not for a sidecar's ``process``, which keeps its own command.
    command_channel: bool = False


@dataclass(frozen=True)
class VolumeFill:
    """How to fill a named volume once: ``files`` placed, then ``command`` run on the
    read-only runtime with the volume at ``mount``; complete once ``marker`` exists."""

    volume: str
    mount: str
    marker: str  # a container path under ``mount``, written last by ``command``
    files: Sequence[tuple[Path, str]]  # (host file, container path) placed before
    command: Sequence[str]
    labels: Mapping[str, str]
    timeout_sec: float


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command run in a container."""

    exit_code: int | None
    output: bytes  # stdout
    timed_out: bool
    duration_sec: float
    errors: bytes = b""  # stderr


@dataclass(frozen=True)
class DiskUsage:
    """What a container has written to the host's disk, as far as one count went."""

    bytes_used: int  # allocated bytes (a sparse file counts what it occupies)
    entries: int  # files, directories and links counted
    #: Why the count stopped before the end ("" when it did not): the container has
    #: then written at least ``bytes_used`` and is over its budget.
    incomplete: str = ""


@dataclass(frozen=True)
class BuildResult:
    """Outcome of ``ensure_image``: the tag, and whether this call built it."""

    tag: str
    built: bool
    duration_sec: float
    log_path: Path | None


@dataclass(frozen=True)
class ImageInfo:
    """One image we made."""

    tag: str
    kind: str
    size_bytes: int


class ImageBuild(TypedDict):
    """What ``ContainerRuntime.ensure_image`` builds (its keyword arguments)."""

    context_dir: Path
    tag: str
    timeout_sec: float
    labels: Mapping[str, str]
    build_args: NotRequired[Mapping[str, str] | None]
    dockerfile: NotRequired[str | None]  # relative to context_dir; None: Dockerfile
    target: NotRequired[str | None]  # a multi-stage build's stage
    #: The RUN steps' network: None, the engine's default; ``container:<id>``, that
    #: container's network namespace (the package cache's build gateway). Only the
    #: legacy builder has it (BuildKit takes none/host/default), so it selects that.
    network: NotRequired[str | None]
    #: Files sent in the build context in place of (or beside) the context's own, by
    #: path in the context: a cached build's rewritten Dockerfile and the package
    #: cache's public trust files (``harbor_exec.network.packages.build_trust``).
    context_files: NotRequired[Mapping[str, bytes] | None]
    #: Called once, under the tag's build lock, right before a build (never when the
    #: image is there already): the task's base images made present as allowed.
    before_build: NotRequired[Callable[[], None] | None]


class ExecOptions(TypedDict, total=False):
    """``ContainerRuntime.exec``'s keyword options; each defaults to None."""

    env: Mapping[str, str] | None  # added to the container's environment
    user: str | None  # None: the image's USER
    workdir: str | None  # None: the image's WORKDIR
    timeout_sec: float | None  # None: no limit
    stdin: bytes | None  # None: the command reads no input


class ContainerRuntime(Protocol):
    """What a trial needs from a container engine: images, then one container's life
    (create, start, files in and out, commands, kills, removal). Every method blocks.

    Engine faults surface as ``EngineUnavailableError``.
    """

    def ensure_image(self, **build: Unpack[ImageBuild]) -> BuildResult:
        """Build ``context_dir`` as ``tag`` unless that tag exists; one build per tag at a time.

        Raises ``SandboxBuildFailedError`` (with the log tail) or
        ``EnvironmentStartTimeoutError``.
        """
        ...

    def image_exists(self, tag: str) -> bool: ...

    def image_user(self, tag: str) -> str:
        """The image's configured USER ("" for the default, root)."""
        ...

    def image_labels(self, tag: str) -> Mapping[str, str]:
        """The image's labels (a task asks for capabilities back through one)."""
        ...

    def image_accounts(self, image: str, container_id: str) -> ImageAccounts:
        """``image``'s ``/etc/passwd`` and ``/etc/group``, read through the archive API
        from ``container_id``, a container of ``image`` created but not yet started
        (so nothing in it has run); an engine may keep them per image."""
        ...

    def ensure_present(self, image: str, *, any_registry: bool = False) -> None:
        """Make sure a prebuilt image exists locally, pulled only from a registry the
        operator allows (any with ``any_registry``: the operator's own images);
        ``EnvironmentStartError`` if not, never with the registry's answer in it."""
        ...

    def gpu_count(self) -> int:
        """GPUs the engine can give containers (0: none; -1: some, count unknown)."""
        ...

    def create(self, spec: ContainerSpec) -> str:
        """Create (not start) a container; returns its id."""
        ...

    def fill_volume(self, fill: VolumeFill, image: str) -> bool:
        """Make ``fill.volume`` complete (once per engine: a complete one is kept);
        True when it was filled by this call. ``image`` (present) hosts the helper
        container; the command runs on the runtime, not on the image's programs."""
        ...

    def start(self, container_id: str) -> None: ...

    def put_archive(self, container_id: str, data: bytes | IO[bytes]) -> None:
        """Extract a tar archive (bytes, or a file read as a stream) at ``/`` in the
        container (works before start too)."""
        ...

    def get_archive(self, container_id: str, path: str) -> Iterator[bytes] | None:
        """A tar archive of ``path`` in the container as a stream of chunks, or None if
        it does not exist. Read by the engine from the container's filesystem: no
        program inside the container takes part. Closing the iterator (``close()``)
        drops the rest of the stream at once."""
        ...

    def container_running(self, container_id: str) -> bool:
        """Whether the container's init still runs (False for a missing container)."""
        ...

    def stop_processes(self, container_id: str, companion: Companion | None = None) -> bool:
        """Kill every process in the container but its init (and init's own child),
        however they detached, without running anything inside the container;
        ``companion`` (ours, ``cgroups.Companion``) is spared while it is exactly
        itself. True when it was.

        Raises ``EnvironmentStartError`` when that cannot be confirmed.
        """
        ...

    def exec(
        self, container_id: str, command: list[str], **options: Unpack[ExecOptions]
    ) -> ExecResult:
        """Run ``command`` (fed ``stdin`` when given); past ``timeout_sec`` every
        process it started is killed."""
        ...

    def disk_usage(self, container_id: str, *, budget_bytes: int) -> DiskUsage | None:
        """What the container has written to disk (its writable layer, ``/logs``
        included), exact up to ``budget_bytes``; cheap enough to ask every fraction of a
        second. None when this engine cannot tell (no disk budget is kept then)."""
        ...

    def remove(self, container_id: str) -> None:
        """Kill and remove the container; a missing container is not an error."""
        ...

    def container_status(self, container_id: str) -> ContainerStatus:
        """Whether the container exists and runs, its exit code and health."""
        ...

    def create_network(self, name: str, labels: Mapping[str, str], *, internal: bool) -> str:
        """Create a bridge network of ours (``internal``: no route out); returns its id."""
        ...

    def remove_network(self, name: str) -> None:
        """Remove one of our networks; a missing one is not an error."""
        ...

    def create_volume(self, name: str, labels: Mapping[str, str]) -> None:
        """Create a per-trial named volume of ours (removed with the trial, or reaped)."""
        ...

    def remove_volume(self, name: str) -> None:
        """Remove a named volume; a missing one is not an error."""
        ...


class EngineAdmin(Protocol):
    """What executors, jobs and the CLI ask of the engine as its administrator: whether
    it answers, its size, our images, and clean-up. Every method blocks.

    ``engine_available`` says whether the engine answered last time.
    """

    @property
    def engine_available(self) -> bool: ...

    @property
    def engine_url(self) -> str: ...

    @property
    def builder(self) -> str:
        """The image builder in use (``buildkit`` or ``legacy``)."""
        ...

    def pid_max(self) -> int:
        """The engine host's ``kernel.pid_max``."""
        ...

    def engine_cpus(self) -> int: ...

    def list_images(self) -> list[ImageInfo]:
        """Every image carrying our label."""
        ...

    def reap(self) -> list[str]:
        """Retry owed removals and remove dead owners' containers; never raises."""
        ...

    def reap_orphans(self) -> list[str]: ...

    def remove_owned(self) -> int:
        """Remove every container this runtime's owner created; returns how many."""
        ...


class ContainerEngine(ContainerRuntime, EngineAdmin, Protocol):
    """Both sides of one engine: what an executor holds (it runs trials on the engine
    and administers it). ``DockerRuntime`` is one."""
