"""The narrow boundary between trial logic and containers.

Like an httpx transport: trials call this small interface of plain values and
never touch the Docker SDK. ``harbor_exec.docker_runtime.DockerRuntime`` is the
implementation; unit tests and a future Ray worker use the same interface.
"""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal, Protocol

NetworkKind = Literal["bridge", "none", "host"]

#: Label keys every object we create carries.
LABEL_MANAGED = "harbor-exec.managed"
LABEL_OWNER = "harbor-exec.owner"
LABEL_TRIAL = "harbor-exec.trial"
LABEL_TASK = "harbor-exec.task"
LABEL_ROLLOUT = "harbor-exec.rollout"
LABEL_KIND = "harbor-exec.kind"


@dataclass(frozen=True)
class ContainerSpec:
    """Everything needed to create one trial container."""

    image: str
    name: str
    labels: Mapping[str, str]
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: float | None = None
    memory_mb: int | None = None
    pids_limit: int = 4096
    network: NetworkKind = "bridge"
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


class ContainerRuntime(Protocol):
    """What a trial needs from a container engine. Every method is blocking."""

    def ensure_image(
        self,
        *,
        context_dir: Path,
        tag: str,
        timeout_sec: float,
        labels: Mapping[str, str],
        build_args: Mapping[str, str] | None = None,
    ) -> BuildResult:
        """Build ``context_dir`` as ``tag`` unless that tag exists; one build per tag at a time.

        Raises ``SandboxBuildFailedError`` (with the log tail) or
        ``EnvironmentStartTimeoutError``.
        """
        ...

    def image_exists(self, tag: str) -> bool: ...

    def image_user(self, tag: str) -> str:
        """The image's configured USER ("" for the default, root)."""
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

    def get_archive(self, container_id: str, path: str) -> bytes | None:
        """A tar archive of ``path`` in the container, or None if it does not exist."""
        ...

    def exec(
        self,
        container_id: str,
        command: list[str],
        *,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        workdir: str | None = None,
        timeout_sec: float | None = None,
        stdin: bytes | None = None,
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


def build_archive(entries: Iterable[ArchiveEntry]) -> bytes:
    """A tar archive (owned by root) of ``entries``, for ``put_archive`` at ``/``."""
    buffer = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for entry in entries:
            info = tarfile.TarInfo(PurePosixPath(entry.path).relative_to("/").as_posix())
            info.mtime = int(now)
            info.mode = entry.mode
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


def extract_archive(data: bytes, dest: Path, *, strip: int = 1) -> None:
    """Extract a tar from ``get_archive`` into ``dest``, dropping ``strip`` leading parts.

    Only regular files and directories are written and nothing may land outside
    ``dest``: what a container wrote is untrusted.
    """
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts[strip:]
            if not parts or any(part in ("..", "") for part in parts):
                continue
            target = root.joinpath(*parts)
            if not target.resolve().is_relative_to(root):
                continue
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
            elif member.isfile():
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                if source is not None:
                    target.write_bytes(source.read())
