"""The narrow boundary between trial logic and containers.

Like an httpx transport: trials call this small interface of plain values and
never touch the Docker SDK. ``harbor_exec.sandbox.docker.DockerRuntime`` is the
implementation; unit tests and a future Ray worker use the same interface.
"""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal, NotRequired, Protocol, TypedDict, Unpack

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
class ContainerSpec:
    """Everything needed to create one trial container.

    Containers never get host networking (``network`` is ``bridge`` or ``none``);
    they always run with ``no-new-privileges``, Docker's seccomp profile and without
    ``DROPPED_CAPABILITIES`` (``cap_add`` may give back some of those only).
    """

    image: str
    name: str
    labels: Mapping[str, str]
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: float | None = None
    memory_mb: int | None = None
    pids_limit: int = 4096
    network: NetworkKind = "bridge"
    mounts: Sequence[Mount] = ()
    cap_add: Sequence[str] = ()
    gpus: int = 0  # requested through the engine's device requests


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command run in a container."""

    exit_code: int | None
    output: bytes  # stdout
    timed_out: bool
    duration_sec: float
    errors: bytes = b""  # stderr


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


class ExecOptions(TypedDict, total=False):
    """``ContainerRuntime.exec``'s keyword options; each defaults to None."""

    env: Mapping[str, str] | None  # added to the container's environment
    user: str | None  # None: the image's USER
    workdir: str | None  # None: the image's WORKDIR
    timeout_sec: float | None  # None: no limit
    stdin: bytes | None  # None: the command reads no input


class ContainerRuntime(Protocol):
    """What trials and executors need from a container engine. Every method blocks.

    Engine faults surface as ``EngineUnavailableError``; ``engine_available`` says
    whether the engine answered last time (``ping`` asks again).
    """

    @property
    def engine_available(self) -> bool: ...

    @property
    def engine_url(self) -> str: ...

    @property
    def builder(self) -> str:
        """The image builder in use (``buildkit`` or ``legacy``)."""
        ...

    def ping(self) -> bool: ...

    def pid_max(self) -> int:
        """The engine host's ``kernel.pid_max``."""
        ...

    def engine_cpus(self) -> int: ...

    def gpu_count(self) -> int:
        """GPUs the engine can give containers (0: none; -1: some, count unknown)."""
        ...

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

    def ensure_present(self, image: str) -> None:
        """Make sure a prebuilt image exists locally; ``EnvironmentStartError`` if not."""
        ...

    def create(self, spec: ContainerSpec) -> str:
        """Create (not start) a container; returns its id."""
        ...

    def start(self, container_id: str) -> None: ...

    def put_archive(self, container_id: str, data: bytes) -> None:
        """Extract a tar archive at ``/`` in the container (works before start too)."""
        ...

    def get_archive(self, container_id: str, path: str) -> Iterator[bytes] | None:
        """A tar archive of ``path`` in the container as a stream of chunks, or None if
        it does not exist. Read by the engine from the container's filesystem: no
        program inside the container takes part."""
        ...

    def stop_processes(self, container_id: str) -> None:
        """Kill every process in the container but its init (and init's own child),
        however they detached, without running anything inside the container.

        Raises ``EnvironmentStartError`` when that cannot be confirmed.
        """
        ...

    def exec(
        self, container_id: str, command: list[str], **options: Unpack[ExecOptions]
    ) -> ExecResult:
        """Run ``command`` (fed ``stdin`` when given); past ``timeout_sec`` every
        process it started is killed."""
        ...

    def remove(self, container_id: str) -> None:
        """Kill and remove the container; a missing container is not an error."""
        ...


# --------------------------------------------------------------------------- archives


@dataclass(frozen=True)
class ArchiveEntry:
    """One file or directory to place in a container."""

    path: str  # absolute container path
    data: bytes | None = None  # None: a directory
    mode: int = 0o644
    # A directory that replaces whatever is at ``path`` (a tree, a symlink, a file):
    # the engine's extraction removes an existing path whose type differs from the
    # archive's entry, so a file entry first and then the directory empties it.
    fresh: bool = False


def build_archive(entries: Iterable[ArchiveEntry]) -> bytes:
    """A tar archive (owned by root) of ``entries``, for ``put_archive`` at ``/``."""
    buffer = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for entry in entries:
            info = tarfile.TarInfo(PurePosixPath(entry.path).relative_to("/").as_posix())
            info.mtime = int(now)
            info.mode = entry.mode
            if entry.fresh:
                placeholder = tarfile.TarInfo(info.name)
                placeholder.mtime = int(now)
                tar.addfile(placeholder, io.BytesIO(b""))
            if entry.data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
    return buffer.getvalue()


def tree_entries(
    host_dir: Path, container_dir: str, *, executable: Iterable[str] = ()
) -> list[ArchiveEntry]:
    """Entries for every file under ``host_dir``, placed under ``container_dir``.

    Symlinks are followed (task loading already refused ones that escape); the
    files named in ``executable`` (relative paths) get mode 0755, as Harbor's
    ``chmod +x`` would give them.
    """
    forced = set(executable)
    entries = [ArchiveEntry(container_dir, None, 0o755)]
    for path in sorted(host_dir.rglob("*")):
        rel = path.relative_to(host_dir).as_posix()
        target = f"{container_dir}/{rel}"
        if path.is_dir():
            entries.append(ArchiveEntry(target, None, 0o755))
        elif path.is_file():
            mode = 0o755 if rel in forced or path.stat().st_mode & 0o111 else 0o644
            entries.append(ArchiveEntry(target, path.read_bytes(), mode))
    return entries


@dataclass(frozen=True)
class OutputLimits:
    """Bounds on what is copied back from a container (its content is hostile).

    A file over ``max_file_bytes`` keeps its last ``max_file_bytes`` bytes after a
    marker line saying how much was cut; past ``max_total_bytes`` or ``max_files``
    nothing more is written.
    """

    max_file_bytes: int = 4 * 2**20
    max_total_bytes: int = 256 * 2**20
    max_files: int = 10_000


@dataclass
class ExtractReport:
    """What ``extract_archive`` wrote and what it left out."""

    files: int = 0
    bytes_written: int = 0
    truncated: list[str] = field(default_factory=list)  # files cut to their tail
    skipped: list[str] = field(default_factory=list)  # links, devices, escaping paths
    incomplete: bool = False  # a total limit stopped the copy


class _ChunkReader(io.RawIOBase):
    """A read-only file over an iterator of chunks (no chunk kept once consumed)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks: Iterator[bytes] = iter(chunks)
        self._buffer = b""

    def readable(self) -> bool:
        return True

    def readinto(self, target: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._buffer:
            try:
                self._buffer = next(self._chunks)
            except StopIteration:
                return 0
        size = min(len(target), len(self._buffer))
        target[:size] = self._buffer[:size]
        self._buffer = self._buffer[size:]
        return size


def cut_marker(cut: int, kept: int) -> bytes:
    return f"[harbor-exec: {cut} bytes cut here; the last {kept} bytes follow]\n".encode()


def _copy_capped(source: io.BufferedReader | Any, target: Path, cap: int) -> tuple[int, bool]:
    """Copy ``source`` to ``target`` keeping at most ``cap`` bytes (the tail);
    returns (bytes read, truncated). Memory stays under 2 x ``cap``."""
    kept = bytearray()
    total = 0
    while True:
        block = source.read(1 << 20)
        if not block:
            break
        total += len(block)
        kept += block
        if len(kept) > 2 * cap:
            del kept[: len(kept) - cap]
    if total > cap:
        target.write_bytes(cut_marker(total - cap, cap) + bytes(kept[-cap:]))
        return total, True
    target.write_bytes(bytes(kept))
    return total, False


def extract_archive(
    data: bytes | Iterable[bytes],
    dest: Path,
    *,
    strip: int = 1,
    limits: OutputLimits | None = None,
) -> ExtractReport:
    """Extract a tar (bytes, or the chunk stream of ``get_archive``) into ``dest``,
    dropping ``strip`` leading path parts.

    What a container wrote is untrusted: only regular files and directories are
    written (symlinks, hardlinks and devices are skipped), nothing lands outside
    ``dest``, modes lose setuid/setgid, and ``limits`` bound every file and the total.
    The archive is read as a stream, so memory stays bounded whatever its size.
    """
    limits = limits or OutputLimits()
    report = ExtractReport()
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    chunks: Iterable[bytes] = [data] if isinstance(data, bytes) else data
    with tarfile.open(fileobj=_ChunkReader(chunks), mode="r|") as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts[strip:]
            if not parts:
                continue
            name = "/".join(parts)
            target = root.joinpath(*parts)
            if any(part in ("..", "") for part in parts) or not _inside(target, root):
                report.skipped.append(name)
                continue
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            if not member.isfile():
                report.skipped.append(name)
                continue
            if report.files >= limits.max_files or report.bytes_written >= limits.max_total_bytes:
                report.incomplete = True
                break
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink() or target.is_dir():
                report.skipped.append(name)
                continue
            source = tar.extractfile(member)
            if source is None:
                continue
            cap = min(limits.max_file_bytes, limits.max_total_bytes - report.bytes_written)
            _total, truncated = _copy_capped(source, target, max(cap, 0))
            target.chmod(member.mode & 0o777)
            report.files += 1
            report.bytes_written += target.stat().st_size
            if truncated:
                report.truncated.append(name)
    return report


def _inside(path: Path, root: Path) -> bool:
    # The parent is resolved (it exists or will be made by us); the leaf itself may
    # not exist yet and is checked for symlinks before writing.
    try:
        return path.parent.resolve().is_relative_to(root)
    except OSError:
        return False
