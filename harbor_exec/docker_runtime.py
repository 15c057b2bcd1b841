"""``DockerRuntime``: the ContainerRuntime over the Docker Engine API.

The only module that imports ``docker``. No ``docker`` CLI subprocesses: every
operation is an API call (build, create, exec, archive transfer, remove).

Why the details are as they are:

* containers run ``sleep infinity`` under Docker's init (tini) as PID 1, so a
  forced removal takes milliseconds instead of the 10 s stop timeout;
* each exec carries a unique ``HARBOR_EXEC_PHASE`` marker in its environment;
  past its deadline every process that inherited the marker is SIGKILLed inside
  the container, so a hung ``solve.sh`` cannot keep writing during verification;
* image builds are serialised per tag inside the process, and an existing tag is
  never rebuilt: tags are content hashes of the environment directory;
* builds go through BuildKit (``POST /build?version=2``, the tar context in the body,
  no session) when the engine has it: faster cold builds, and a missing ``COPY``
  source fails in milliseconds instead of after every earlier step. The legacy
  builder is the fallback (old engine, or ``builder="legacy"`` /
  ``HARBOR_EXEC_BUILDER=legacy``); BuildKit's progress is decoded by
  ``harbor_exec.buildkit`` into the same readable log.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tarfile
import tempfile
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import docker
import docker.errors
import docker.utils.build
import requests.exceptions
import urllib3.exceptions
from docker.utils.socket import frames_iter

from harbor_exec.buildkit import TRACE_ID, BuildkitProgress
from harbor_exec.errors import (
    DockerUnavailableError,
    EnvironmentStartError,
    EnvironmentStartTimeoutError,
    HarborExecError,
    SandboxBuildFailedError,
)
from harbor_exec.runtime import (
    LABEL_KIND,
    LABEL_MANAGED,
    LABEL_OWNER,
    BuildResult,
    ContainerSpec,
    ExecResult,
)

PHASE_MARKER = "HARBOR_EXEC_PHASE"
_LOG_TAIL_LINES = 25
# Kills every process whose environment carries the phase marker (argument $1).
_KILL_MARKED = (
    "for p in /proc/[0-9]*; do "
    'if tr "\\0" "\\n" < "$p/environ" 2>/dev/null | grep -qx "$1"; then '
    'kill -9 "${p#/proc/}" 2>/dev/null; fi; done; true'
)


BuilderKind = Literal["buildkit", "legacy"]
BUILDER_ENV = "HARBOR_EXEC_BUILDER"
_BUILDER_CHOICES = ("auto", "buildkit", "legacy")
_MIN_BUILDKIT_API = (1, 39)


class _BuildkitUnavailable(Exception):
    """The engine refused a BuildKit build: fall back to the legacy builder."""


def _refuses_buildkit(message: str) -> bool:
    lowered = message.lower()
    return "buildkit" in lowered and ("not enabled" in lowered or "not supported" in lowered)


@contextlib.contextmanager
def _context_tar(context_dir: Path) -> Iterator[IO[bytes]]:
    """The build context as a tar file, ``.dockerignore`` applied as ``docker build`` does.

    BuildKit tells a tar context from a bare Dockerfile by parsing the first tar
    header within the body's first 1 KiB. docker-py's ``utils.tar`` writes PAX
    headers (for sub-second mtimes) that push it past that, so BuildKit would read
    the archive as a Dockerfile. Hence GNU format, whole-second mtimes and the
    Dockerfile first, which both builders read the same way.
    """
    ignore = context_dir / ".dockerignore"
    patterns: list[str] = []
    if ignore.is_file():
        lines = (line.strip() for line in ignore.read_text(encoding="utf-8").splitlines())
        patterns = [line for line in lines if line and not line.startswith("#")]
    files = sorted(
        docker.utils.build.exclude_paths(str(context_dir), patterns),
        key=lambda name: (name != "Dockerfile", name),
    )
    with tempfile.TemporaryFile() as context:
        with tarfile.open(fileobj=context, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for name in files:
                info = tar.gettarinfo(str(context_dir / name), arcname=name)
                if info is None:  # a socket or similar: nothing to send
                    continue
                info.mtime = int(info.mtime)
                if info.isfile():
                    with (context_dir / name).open("rb") as data:
                        tar.addfile(info, data)
                else:
                    tar.addfile(info)
        context.seek(0)
        yield context


def default_cache_dir() -> Path:
    """Where build logs and other host-side caches live."""
    base = os.environ.get("HARBOR_EXEC_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "harbor-exec"


# --------------------------------------------------------------------------- owners


def _proc_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 (starttime) follows the parenthesised command name.
    return stat.rsplit(")", 1)[1].split()[19]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def current_owner() -> str:
    """This process's owner id: ``boot_id/pid-namespace/pid/start-time``.

    Stable for the life of the process and never reused, so the reaper can tell
    a live owner from a dead one without any heartbeat.
    """
    pid = os.getpid()
    return f"{_boot_id()}/{_pid_namespace()}/{pid}/{_proc_start_time(pid)}"


def owner_is_alive(owner: str) -> bool:
    """Whether the process that wrote ``owner`` still runs (unknowable means alive)."""
    try:
        boot, namespace, pid_text, start = owner.split("/", 3)
        pid = int(pid_text)
    except ValueError:
        return True
    if boot != _boot_id():
        return False  # the machine rebooted since: that process is gone
    if namespace != _pid_namespace():
        return True  # another PID namespace; we cannot see it, so leave it alone
    return _proc_start_time(pid) == start


# --------------------------------------------------------------------------- runtime


@dataclass(frozen=True)
class ImageInfo:
    """One image we made."""

    tag: str
    kind: str
    size_bytes: int


class DockerRuntime:
    """ContainerRuntime over the Docker Engine API (see ``harbor_exec.runtime``)."""

    def __init__(
        self,
        *,
        owner: str | None = None,
        base_url: str | None = None,
        max_workers: int = 64,
        max_concurrent_starts: int = 4,
        cache_dir: Path | None = None,
        builder: str | None = None,
    ) -> None:
        choice = (builder or os.environ.get(BUILDER_ENV) or "auto").strip().lower()
        if choice not in _BUILDER_CHOICES:
            raise ValueError(
                f"image builder {choice!r} (the builder option or ${BUILDER_ENV}) must be one of "
                + ", ".join(_BUILDER_CHOICES)
            )
        self._builder_choice = choice
        self._builder: BuilderKind | None = None
        #: Builds started per tag by this runtime (a tag is built once unless it failed).
        self.build_counts: Counter[str] = Counter()
        self.owner = owner or current_owner()
        self.cache_dir = cache_dir or default_cache_dir()
        self._base_url = base_url
        try:
            # Control calls are short; exec streams can last as long as an agent runs,
            # so they use a client without a read timeout (deadlines are enforced here).
            self._api = self._client(timeout=120, max_pool_size=max_workers)
            self._exec_api = self._client(timeout=None, max_pool_size=max_workers)
            self._api.ping()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            raise DockerUnavailableError(
                f"the Docker engine does not answer ({exc}); run scripts/setup.sh, or start "
                "dockerd and check that /var/run/docker.sock is reachable"
            ) from None
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="hx-exec")
        self._start_gate = threading.BoundedSemaphore(max_concurrent_starts)
        self._build_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _client(self, *, timeout: int | None, max_pool_size: int) -> Any:
        kwargs: dict[str, Any] = {"timeout": timeout, "max_pool_size": max_pool_size}
        if self._base_url:
            return docker.APIClient(base_url=self._base_url, **kwargs)
        return docker.from_env(**kwargs).api

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._api.close()
        self._exec_api.close()

    # ----------------------------------------------------------------- images

    def image_exists(self, tag: str) -> bool:
        try:
            self._api.inspect_image(tag)
        except docker.errors.ImageNotFound:
            return False
        return True

    def _lock_for(self, tag: str) -> threading.Lock:
        with self._locks_guard:
            return self._build_locks.setdefault(tag, threading.Lock())

    def ensure_image(
        self,
        *,
        context_dir: Path,
        tag: str,
        timeout_sec: float,
        labels: Mapping[str, str],
        build_args: Mapping[str, str] | None = None,
    ) -> BuildResult:
        started = time.monotonic()
        if self.image_exists(tag):
            return BuildResult(tag, built=False, duration_sec=0.0, log_path=None)
        with self._lock_for(tag):
            if self.image_exists(tag):  # another thread built it while we waited
                return BuildResult(tag, False, time.monotonic() - started, None)
            log_path = self.cache_dir / "build-logs" / f"{tag.replace('/', '_')}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._build(context_dir, tag, timeout_sec, labels, build_args or {}, log_path)
            return BuildResult(tag, True, time.monotonic() - started, log_path)

    # ----------------------------------------------------------------- builder

    @property
    def builder(self) -> BuilderKind:
        """The image builder this engine gets: ``buildkit`` or ``legacy`` (chosen once)."""
        if self._builder is None:
            with self._locks_guard:
                if self._builder is None:
                    self._builder = self._choose_builder()
        return self._builder

    def _choose_builder(self) -> BuilderKind:
        if self._builder_choice == "legacy":
            return "legacy"
        if self._builder_choice == "buildkit":
            return "buildkit"
        version = self._api.version()
        try:
            api = tuple(int(part) for part in str(version.get("ApiVersion", "")).split(".")[:2])
        except ValueError:
            api = ()
        # BuildKit through the Engine API needs no experimental flag from API 1.39 (Docker
        # 19.03) on; Windows engines have no BuildKit.
        if api >= _MIN_BUILDKIT_API and str(version.get("Os", "linux")).lower() == "linux":
            return "buildkit"
        return "legacy"

    def _build(
        self,
        context_dir: Path,
        tag: str,
        timeout_sec: float,
        labels: Mapping[str, str],
        build_args: Mapping[str, str],
        log_path: Path,
    ) -> None:
        builder = self.builder
        with self._locks_guard:
            self.build_counts[tag] += 1
        try:
            self._run_build(builder, context_dir, tag, timeout_sec, labels, build_args, log_path)
        except _BuildkitUnavailable:
            # The engine looked able but refuses BuildKit (disabled in daemon.json, or a
            # platform without it): fall back for good, once per engine.
            with self._locks_guard:
                self._builder = "legacy"
            self._run_build("legacy", context_dir, tag, timeout_sec, labels, build_args, log_path)

    def _run_build(
        self,
        builder: BuilderKind,
        context_dir: Path,
        tag: str,
        timeout_sec: float,
        labels: Mapping[str, str],
        build_args: Mapping[str, str],
        log_path: Path,
    ) -> None:
        deadline = time.monotonic() + timeout_sec
        # A read timeout on a dedicated client bounds a build step that prints nothing;
        # dropping the connection makes the daemon cancel the build.
        client = self._client(timeout=max(1, int(timeout_sec) + 1), max_pool_size=1)
        params: dict[str, Any] = {
            "t": tag,
            "rm": True,
            "forcerm": True,
            "pull": False,
            "labels": json.dumps({**labels, LABEL_MANAGED: "true"}),
            "buildargs": json.dumps(dict(build_args)),
        }
        progress: BuildkitProgress | None = None
        if builder == "buildkit":
            # version=2 selects BuildKit; the tar context travels in the body, no session.
            params["version"] = "2"
            progress = BuildkitProgress()
        # Only the tail stays in memory; the whole log streams to its file.
        tail: deque[str] = deque(maxlen=_LOG_TAIL_LINES)
        error: str | None = None
        timed_out = False
        with log_path.open("w", encoding="utf-8") as log, _context_tar(context_dir) as context:

            def emit(lines: Iterable[str]) -> None:
                for line in lines:
                    log.write(line + "\n")
                    tail.append(line)

            try:
                # docker-py's build() has no ``version`` parameter, so the request is made
                # with the same client calls it uses, on the same connection settings.
                response = client._post(
                    client._url("/build"),
                    data=context,
                    params=params,
                    headers={"Content-Type": "application/tar"},
                    stream=True,
                )
                client._raise_for_status(response)
                chunk: dict[str, Any]
                for chunk in client._stream_helper(response, decode=True):
                    if "stream" in chunk:
                        emit(str(chunk["stream"]).splitlines())
                    if progress is not None and chunk.get("id") == TRACE_ID and "aux" in chunk:
                        emit(progress.feed(chunk["aux"]))
                    if "error" in chunk:
                        error = str(chunk["error"]).strip()
                        emit([error])
                    if time.monotonic() > deadline:
                        timed_out = True
                        break
            except (
                requests.exceptions.ReadTimeout,
                requests.exceptions.ConnectionError,
                # Reading the progress stream itself raises urllib3's own errors.
                urllib3.exceptions.ReadTimeoutError,
                urllib3.exceptions.ProtocolError,
            ):
                timed_out = True
            except docker.errors.APIError as exc:
                error = str(exc.explanation or exc)
                if builder == "buildkit" and _refuses_buildkit(error):
                    raise _BuildkitUnavailable(error) from None
                emit([error])
            finally:
                client.close()
                if progress is not None:
                    emit(progress.close())
        tail_text = "\n".join(tail)
        if timed_out:
            raise EnvironmentStartTimeoutError(
                f"building the environment took longer than build_timeout_sec={timeout_sec:g}s "
                f"(log: {log_path})\n{tail_text}"
            )
        if error is not None:
            where = ""
            if progress is not None and progress.errors:
                where = f" at step {progress.errors[-1][0]!r}"
            raise SandboxBuildFailedError(
                f"docker build of {context_dir} failed{where}: {error}\n"
                f"--- last lines of the build log ({log_path}) ---\n{tail_text}"
            )

    def build_cache_usage(self) -> tuple[int, int]:
        """The engine's build cache: ``(records, bytes)`` (BuildKit's, and nothing in use)."""
        records = self._api.df().get("BuildCache") or []
        return len(records), sum(int(r.get("Size") or 0) for r in records)

    def prune_build_cache(self, *, older_than: str | None = None) -> int:
        """Remove the engine's unused build cache (only records unused for ``older_than``,
        a Go duration such as ``"24h"``, when given); returns the bytes reclaimed."""
        filters = {"until": older_than} if older_than else None
        result = self._api.prune_builds(filters=filters)
        return int(result.get("SpaceReclaimed") or 0)

    def import_rootfs(self, tarball: Path, tag: str, *, changes: list[str]) -> None:
        """``docker import`` a root filesystem tarball as ``tag`` (base image bootstrap)."""
        repository, _, version = tag.rpartition(":")
        self._api.import_image_from_file(
            str(tarball), repository=repository, tag=version, changes=changes
        )

    def list_images(self) -> list[ImageInfo]:
        """Every image carrying our label."""
        images = self._api.images(filters={"label": f"{LABEL_MANAGED}=true"})
        found: list[ImageInfo] = []
        for image in images:
            labels = image.get("Labels") or {}
            for tag in image.get("RepoTags") or [image["Id"]]:
                found.append(ImageInfo(tag, labels.get(LABEL_KIND, ""), int(image["Size"])))
        return found

    def image_user(self, tag: str) -> str:
        """The image's configured USER ("" for the default, root)."""
        return str(self._api.inspect_image(tag).get("Config", {}).get("User") or "")

    def remove_image(self, tag: str) -> None:
        with contextlib.suppress(docker.errors.ImageNotFound):
            self._api.remove_image(tag, force=True, noprune=False)

    # ----------------------------------------------------------------- containers

    def create(self, spec: ContainerSpec) -> str:
        host_config = self._api.create_host_config(
            init=True,
            nano_cpus=int(spec.cpus * 1e9) if spec.cpus else None,
            mem_limit=f"{spec.memory_mb}m" if spec.memory_mb else None,
            pids_limit=spec.pids_limit,
            security_opt=["no-new-privileges"],
            network_mode=spec.network if spec.network != "bridge" else None,
        )
        try:
            created = self._api.create_container(
                spec.image,
                command=["sleep", "infinity"],
                name=spec.name,
                labels={**spec.labels, LABEL_MANAGED: "true", LABEL_OWNER: self.owner},
                environment=dict(spec.env),
                host_config=host_config,
                detach=True,
            )
        except docker.errors.APIError as exc:
            raise EnvironmentStartError(
                f"cannot create a container from {spec.image}: {exc.explanation or exc}"
            ) from None
        return str(created["Id"])

    def start(self, container_id: str) -> None:
        try:
            # Starting is the daemon's most expensive step; too many at once topple it.
            with self._start_gate:
                self._api.start(container_id)
        except docker.errors.APIError as exc:
            raise EnvironmentStartError(
                f"cannot start container: {exc.explanation or exc}"
            ) from None

    def put_archive(self, container_id: str, data: bytes) -> None:
        self._api.put_archive(container_id, "/", data)

    def get_archive(self, container_id: str, path: str) -> bytes | None:
        try:
            stream, _stat = self._api.get_archive(container_id, path)
        except docker.errors.NotFound:
            return None
        return b"".join(stream)

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
        marker = f"{PHASE_MARKER}={uuid.uuid4().hex}"
        environment = [f"{k}={v}" for k, v in (env or {}).items()] + [marker]
        started = time.monotonic()
        try:
            exec_id = self._api.exec_create(
                container_id,
                command,
                environment=environment,
                user=user or "",
                workdir=workdir,
                stdin=stdin is not None,
            )["Id"]
        except docker.errors.APIError as exc:
            message = exc.explanation or exc
            raise EnvironmentStartError(f"cannot run {command[0]!r}: {message}") from None
        timed_out = False
        if timeout_sec is None:
            stdout, stderr = self._exec_start(exec_id, stdin)
        else:
            future = self._pool.submit(self._exec_start, exec_id, stdin)
            try:
                stdout, stderr = future.result(timeout=max(timeout_sec, 0.0))
            except FutureTimeout:
                timed_out = True
                self.kill_marked(container_id, marker)
                try:
                    stdout, stderr = future.result(timeout=5)
                except (FutureTimeout, HarborExecError):
                    stdout, stderr = b"", b""
        duration = time.monotonic() - started
        exit_code = self._api.exec_inspect(exec_id).get("ExitCode")
        return ExecResult(exit_code, stdout, timed_out, duration, stderr)

    def _exec_start(self, exec_id: str, stdin: bytes | None) -> tuple[bytes, bytes]:
        """Run a created exec to its end: ``(stdout, stderr)``."""
        try:
            sock = self._exec_api.exec_start(exec_id, socket=True)
        except docker.errors.APIError as exc:
            message = str(exc.explanation or exc)
            hint = ""
            if "chdir" in message or "no such file or directory" in message.lower():
                hint = " (does [environment].workdir exist in the image?)"
            raise EnvironmentStartError(f"exec failed: {message}{hint}") from None
        raw = getattr(sock, "_sock", sock)
        streams: dict[int, list[bytes]] = {1: [], 2: []}
        try:
            if stdin is not None:
                raw.sendall(stdin)
                raw.shutdown(socket.SHUT_WR)  # EOF on the process's stdin
            for stream, data in frames_iter(sock, tty=False):
                streams.setdefault(stream, []).append(data)
        except OSError as exc:
            raise EnvironmentStartError(f"exec stream broke: {exc}") from None
        finally:
            sock.close()
        return b"".join(streams[1]), b"".join(streams[2])

    def kill_marked(self, container_id: str, marker: str) -> None:
        """SIGKILL every process in the container whose environment holds ``marker``."""
        try:
            exec_id = self._api.exec_create(
                container_id, ["sh", "-c", _KILL_MARKED, "kill-marked", marker], user="0"
            )["Id"]
            self._api.exec_start(exec_id)
        except docker.errors.APIError:
            pass  # the container is gone: so are its processes

    def ensure_present(self, image: str) -> None:
        """Make sure a prebuilt ``docker_image`` is available locally (pull if we can)."""
        if self.image_exists(image):
            return
        try:
            self._api.pull(image)
        except docker.errors.APIError as exc:
            raise EnvironmentStartError(
                f"[environment].docker_image {image!r} is not present locally and cannot be "
                f"pulled ({exc.explanation or exc}); build or load it first"
            ) from None

    def remove(self, container_id: str) -> None:
        try:
            self._api.remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if "already in progress" not in str(exc):
                raise

    # ----------------------------------------------------------------- housekeeping

    def our_containers(self, *, owner: str | None = None) -> list[dict[str, Any]]:
        """Containers carrying our label (optionally only ``owner``'s)."""
        label = [f"{LABEL_MANAGED}=true"]
        if owner is not None:
            label.append(f"{LABEL_OWNER}={owner}")
        return list(self._api.containers(all=True, filters={"label": label}))

    def reap_orphans(self) -> list[str]:
        """Remove our containers whose owner process is gone; returns their names."""
        reaped: list[str] = []
        for container in self.our_containers():
            owner = (container.get("Labels") or {}).get(LABEL_OWNER, "")
            if owner != self.owner and not owner_is_alive(owner):
                self.remove(container["Id"])
                reaped.append((container.get("Names") or [container["Id"]])[0].lstrip("/"))
        return reaped

    def remove_owned(self) -> int:
        """Remove every container this runtime's owner created; returns how many."""
        containers = self.our_containers(owner=self.owner)
        for container in containers:
            self.remove(container["Id"])
        return len(containers)

    def engine_info(self) -> dict[str, Any]:
        info = self._api.version()
        return {
            "version": info.get("Version"),
            "api": info.get("ApiVersion"),
            "builder": self.builder,
        }

    def engine_cpus(self) -> int:
        """How many CPUs the engine has (prewarm's default parallelism)."""
        return int(self._api.info().get("NCPU") or os.cpu_count() or 1)
