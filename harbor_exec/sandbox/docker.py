"""``DockerRuntime``: the ContainerRuntime and EngineAdmin over the Docker Engine API.

The only module that imports ``docker``. No ``docker`` CLI subprocesses: every
operation is an API call (build, create, exec, archive transfer, remove).

Why the details are as they are:

* containers run a keep-alive under an init (tini) as PID 1, so a forced removal
  takes milliseconds instead of the 10 s stop timeout; both are static binaries from
  the read-only runtime volume (``harbor_exec.sandbox.runtime_volume``), by absolute
  path, run as a uid of their own from execute-only files, so neither a start nor a
  restart runs anything the agent could plant or replace, and no agent can ptrace
  them or write their memory;
* past an exec's deadline, and between the agent and the verifier, every process
  in the container but its init is killed from the host through the container's
  cgroup (``harbor_exec.sandbox.cgroups``), or, without the host's view, by restarting
  the container: nothing has to fork inside a container whose pids limit a fork
  bomb has filled, and nothing the agent detached survives;
* containers drop ``DROPPED_CAPABILITIES``, keep ``no-new-privileges``, run under
  Docker's default seccomp profile without ``ptrace`` (``harbor_exec.sandbox.seccomp``),
  never get host networking, and log to nowhere (what a
  container prints to its init's stdout would otherwise fill the host's disk);
* image builds are serialised per tag inside the process, and an existing tag is
  never rebuilt: tags are content hashes of the environment directory;
* builds go through BuildKit (``POST /build?version=2``, the tar context in the body,
  no session) when the engine has it: faster cold builds, and a missing ``COPY``
  source fails in milliseconds instead of after every earlier step. The legacy
  builder is the fallback (old engine, or ``builder="legacy"`` /
  ``HARBOR_EXEC_BUILDER=legacy``); BuildKit's progress is decoded by
  ``harbor_exec.sandbox.buildkit`` into the same readable log.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import io
import json
import os
import socket
import tarfile
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import IO, Any, Final, Literal, ParamSpec, TypeVar, Unpack

import docker
import docker.errors
import docker.types
import docker.utils.build
import requests.exceptions
import urllib3.exceptions
from docker.utils.socket import frames_iter

from harbor_exec.cache import BUILD_LOGS, cache_root
from harbor_exec.container.exchange import AGENT_MOUNT, DEPS_MOUNT, RUNTIME_TINI
from harbor_exec.errors import (
    DockerUnavailableError,
    EngineUnavailableError,
    EnvironmentStartError,
    EnvironmentStartTimeoutError,
    HarborExecError,
    SandboxBuildFailedError,
)
from harbor_exec.sandbox.buildkit import TRACE_ID, BuildkitProgress
from harbor_exec.sandbox.cgroups import Companion, HostCgroup
from harbor_exec.sandbox.channel import MISSING, CommandChannel, OutputTail
from harbor_exec.sandbox.disk import WritableLayer
from harbor_exec.sandbox.runtime import (
    DROPPED_CAPABILITIES,
    LABEL_KIND,
    LABEL_MANAGED,
    LABEL_OWNER,
    BuildResult,
    ContainerSpec,
    ContainerStatus,
    DiskUsage,
    ExecOptions,
    ExecResult,
    ImageBuild,
    ImageInfo,
    VolumeFill,
)
from harbor_exec.sandbox.runtime_volume import (
    INIT_COMMAND,
    KEEP_ALIVE_COMMAND,
    KEEP_ALIVE_UID,
    LABEL_RUNTIME_DIGEST,
    RUNTIME_MARKER,
    RUNTIME_MOUNT,
    RuntimeContent,
)
from harbor_exec.sandbox.seccomp import SeccompProfiles
from harbor_exec.sandbox.users import ACCOUNT_FILES, MAX_ACCOUNT_FILE_BYTES, ImageAccounts

_LOG_TAIL_LINES = 25
# What one exec may return on stdout/stderr (the tail is kept): phases redirect
# their output to files under /logs, so only a hostile process prints more.
_MAX_EXEC_OUTPUT = 8 * 2**20
#: How long a container whose command server went with it is watched for the engine
#: going away (a daemon stopping ends its containers before it stops answering).
_ENGINE_GONE_SEC = 2.0
_ARCHIVE_CHUNK = 1 << 20
#: A get through the command channel holds the whole archive: past this size the
#: engine streams it instead (its reader may stop early).
_CHANNEL_GET_CAP = 16 << 20
#: A put or get the command server has not finished by then is the engine's.
_CHANNEL_FILES_SEC = 300.0

BuilderKind = Literal["buildkit", "legacy"]
BUILDER_ENV = "HARBOR_EXEC_BUILDER"
#: Registries a task-named image (``docker_image``, a sidecar's ``image:``) may be pulled
#: from, comma-separated (``docker.io,ghcr.io``); unset: none, only images present here.
PULL_REGISTRIES_ENV = "HARBOR_EXEC_PULL_REGISTRIES"
_BUILDER_CHOICES = ("auto", "buildkit", "legacy")
_MIN_BUILDKIT_API = (1, 39)


class _BuildkitUnavailable(Exception):
    """The engine refused a BuildKit build: fall back to the legacy builder."""


def _refuses_buildkit(message: str) -> bool:
    lowered = message.lower()
    return "buildkit" in lowered and ("not enabled" in lowered or "not supported" in lowered)


@contextlib.contextmanager
def _context_tar(
    context_dir: Path, dockerfile: str = "Dockerfile", extra: Mapping[str, bytes] | None = None
) -> Iterator[IO[bytes]]:
    """The build context as a tar file, ``.dockerignore`` applied as ``docker build`` does,
    with ``extra`` (context path -> content: a rewritten Dockerfile, the package cache's
    trust files) in place of the context's own files of those names.

    BuildKit tells a tar context from a bare Dockerfile by parsing the first tar
    header within the body's first 1 KiB. docker-py's ``utils.tar`` writes PAX
    headers (for sub-second mtimes) that push it past that, so BuildKit would read
    the archive as a Dockerfile. Hence GNU format, whole-second mtimes and the
    Dockerfile first, which both builders read the same way.
    """
    extra = dict(extra or {})
    ignore = context_dir / ".dockerignore"
    patterns: list[str] = []
    if ignore.is_file():
        lines = (line.strip() for line in ignore.read_text(encoding="utf-8").splitlines())
        patterns = [line for line in lines if line and not line.startswith("#")]
    files = sorted(
        set(docker.utils.build.exclude_paths(str(context_dir), patterns, dockerfile)) - set(extra),
        key=lambda name: (name != dockerfile, name),
    )
    # Parent directories the extra files need (0755, root's), unless the context has them.
    parents = sorted(
        {str(parent) for name in extra for parent in Path(name).parents if str(parent) != "."}
        - set(files)
    )
    first = [(dockerfile, extra[dockerfile])] if dockerfile in extra else []
    rest = sorted((name, data) for name, data in extra.items() if name != dockerfile)
    with tempfile.TemporaryFile() as context:
        with tarfile.open(fileobj=context, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for name, data in first:
                tar.addfile(_tar_entry(name, len(data)), io.BytesIO(data))
            for name in files:
                info = tar.gettarinfo(str(context_dir / name), arcname=name)
                if info is None:  # a socket or similar: nothing to send
                    continue
                info.mtime = int(info.mtime)
                if info.isfile():
                    with (context_dir / name).open("rb") as data_file:
                        tar.addfile(info, data_file)
                else:
                    tar.addfile(info)
            for name in parents:
                tar.addfile(_tar_entry(name, 0, directory=True))
            for name, data in rest:
                tar.addfile(_tar_entry(name, len(data)), io.BytesIO(data))
        context.seek(0)
        yield context


def _tar_entry(name: str, size: int, *, directory: bool = False) -> tarfile.TarInfo:
    """A root-owned entry of ours: a ``0644`` file or a ``0755`` directory."""
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.mode = 0o755 if directory else 0o644
    info.size = 0 if directory else size
    info.mtime = 0
    return info


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


def image_registry(image: str) -> str:
    """The registry an image reference pulls from, as Docker reads it: the first path
    component when it names a host (a dot, a port or ``localhost``), else ``docker.io``."""
    first, slash, _rest = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first.lower()
    return "docker.io"


def current_owner(namespace: str | None = None) -> str:
    """This process's owner id: ``boot_id/pid-namespace/pid/start-time``.

    Stable for the life of the process and never reused, so the reaper can tell
    a live owner from a dead one without any heartbeat. ``namespace`` replaces the
    PID namespace with a name (a Ray node's): only runtimes with that same owner
    namespace reap such containers.
    """
    pid = os.getpid()
    return f"{_boot_id()}/{namespace or _pid_namespace()}/{pid}/{_proc_start_time(pid)}"


def owner_is_alive(owner: str, *, own_namespace: str | None = None) -> bool:
    """Whether the process that wrote ``owner`` still runs (unknowable means alive).
    ``own_namespace``: the reaper's own owner namespace, when it is a name."""
    try:
        boot, namespace, pid_text, start = owner.split("/", 3)
        pid = int(pid_text)
    except ValueError:
        return True
    if boot != _boot_id():
        return False  # the machine rebooted since: that process is gone
    if namespace not in (_pid_namespace(), own_namespace):
        return True  # another PID namespace or node; we cannot see it, so leave it alone
    return _proc_start_time(pid) == start


# --------------------------------------------------------------------------- engine faults

_P = ParamSpec("_P")
_R = TypeVar("_R")
# What a daemon that stopped, restarted or hung looks like from the SDK: the socket
# is gone or refuses, the connection drops mid-call, or a call times out.
_ENGINE_FAULTS = (
    requests.exceptions.ConnectionError,
    requests.exceptions.ChunkedEncodingError,
    requests.exceptions.Timeout,
    ConnectionError,
    FileNotFoundError,
)


def _is_engine_fault(exc: BaseException) -> bool:
    if isinstance(exc, _ENGINE_FAULTS):
        return True
    return isinstance(exc, docker.errors.APIError) and bool(exc.is_server_error())


def _engine_boundary(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Turn any engine fault escaping ``method`` into one ``EngineUnavailableError``
    (one line, naming the engine), so callers never see raw urllib3/requests text."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(*args, **kwargs)
        except HarborExecError:
            raise
        except Exception as exc:
            if not _is_engine_fault(exc):
                raise
            runtime = args[0]
            assert isinstance(runtime, DockerRuntime)
            if isinstance(exc, _ENGINE_FAULTS):
                # Not answering. A 5xx answer is the engine failing one operation (a
                # racing removal, say): it answers, and other rollouts are admitted.
                runtime.engine_down(exc)
            raise EngineUnavailableError(
                runtime.engine_url, f"{type(exc).__name__} in {method.__name__.lstrip('_')}"
            ) from None

    return wrapper


# --------------------------------------------------------------------------- runtime


class DockerRuntime:
    """ContainerRuntime and EngineAdmin over the Docker Engine API (see
    ``harbor_exec.sandbox.runtime``)."""

    def __init__(
        self,
        *,
        owner: str | None = None,
        base_url: str | None = None,
        max_workers: int = 64,
        max_concurrent_starts: int = 4,
        cache_dir: Path | None = None,
        builder: str | None = None,
        seccomp_profile: Path | str | None = None,
        pull_registries: Sequence[str] | None = None,
    ) -> None:
        choice = (builder or os.environ.get(BUILDER_ENV) or "auto").strip().lower()
        if pull_registries is None:
            pull_registries = os.environ.get(PULL_REGISTRIES_ENV, "").split(",")
        #: Where a task-named image may be pulled from (``ensure_present``).
        self.pull_registries = frozenset(r.strip().lower() for r in pull_registries if r.strip())
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
        #: The harbor-exec cache root (build logs go to its build-logs/).
        self.cache_dir = cache_dir or cache_root()
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
        #: Whether processes are killed through the host's cgroups (False: by restart).
        self.host_kill: bool | None = None
        # Image configs by tag; task and dependency tags are content hashes.
        self._image_configs: dict[str, dict[str, Any]] = {}
        self._image_accounts: dict[str, ImageAccounts] = {}
        self._accounts_locks: dict[str, threading.Lock] = {}
        # Containers whose removal failed while the engine was away; reap() retries them.
        self._unremoved: set[str] = set()
        self._cpus: int | None = None  # the engine's CPU count, asked once
        # Each container's writable layer on this host (None: not visible from here).
        self._layers: dict[str, WritableLayer | None] = {}
        # Each container's command channel (those created with one).
        self._channels: dict[str, CommandChannel] = {}
        self.engine_available = True
        self.last_engine_error: str | None = None
        self._seccomp = SeccompProfiles(seccomp_profile)
        self._runtime_content: RuntimeContent | None = None
        # Volumes (the runtime's, dependency environments) checked complete by this runtime.
        self._volumes_ready: set[str] = set()
        self._volume_locks: dict[str, threading.Lock] = {}
        # A shared host lock on each volume this runtime may mount: a prune (another
        # process's `images prune`) leaves it alone while this process lives.
        self._volume_holds: dict[str, IO[str]] = {}
        # Fail at start-up, not at the first trial, when no profile can be read.
        self._seccomp.security_opt()

    @property
    def engine_url(self) -> str:
        """The engine's address, for messages."""
        return str(self._base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock")

    def engine_down(self, exc: BaseException | None = None) -> None:
        """Record that the engine stopped answering (``ping`` clears it)."""
        self.engine_available = False
        if exc is not None:
            self.last_engine_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

    def ping(self) -> bool:
        """Whether the engine answers now (updates ``engine_available``); never raises."""
        try:
            self._api.ping()
        except Exception as exc:
            self.engine_down(exc)
            return False
        self.engine_available = True
        return True

    def _client(self, *, timeout: int | None, max_pool_size: int) -> Any:
        kwargs: dict[str, Any] = {"timeout": timeout, "max_pool_size": max_pool_size}
        if self._base_url:
            return docker.APIClient(base_url=self._base_url, **kwargs)
        return docker.from_env(**kwargs).api

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for handle in self._volume_holds.values():
            handle.close()  # releases its shared lock
        self._volume_holds.clear()
        self._api.close()
        self._exec_api.close()

    # ----------------------------------------------------------------- images

    @_engine_boundary
    def image_exists(self, tag: str) -> bool:
        try:
            self._api.inspect_image(tag)
        except docker.errors.ImageNotFound:
            return False
        return True

    def _lock_for(self, key: str, locks: dict[str, threading.Lock] | None = None) -> threading.Lock:
        """The lock of ``key`` in ``locks`` (the image builds' by default), made once."""
        with self._locks_guard:
            return (self._build_locks if locks is None else locks).setdefault(key, threading.Lock())

    @_engine_boundary
    def ensure_image(self, **build: Unpack[ImageBuild]) -> BuildResult:
        tag = build["tag"]
        started = time.monotonic()
        if self.image_exists(tag):
            return BuildResult(tag, built=False, duration_sec=0.0, log_path=None)
        with self._lock_for(tag):
            if self.image_exists(tag):  # another thread built it while we waited
                return BuildResult(tag, False, time.monotonic() - started, None)
            if (before_build := build.get("before_build")) is not None:
                before_build()
            log_path = self.cache_dir / BUILD_LOGS / f"{tag.replace('/', '_')}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._build(build, log_path)
            return BuildResult(tag, True, time.monotonic() - started, log_path)

    # ----------------------------------------------------------------- builder

    @property
    def builder(self) -> BuilderKind:
        """The image builder this engine gets: ``buildkit`` or ``legacy`` (chosen once)."""
        if self._builder is None:
            with self._locks_guard:
                if self._builder is None:
                    try:
                        self._builder = self._choose_builder()
                    except (requests.exceptions.RequestException, docker.errors.DockerException):
                        # The engine does not answer (``/health`` asks while it is down):
                        # what it would most likely be, chosen for good once it answers.
                        return "legacy" if self._builder_choice == "legacy" else "buildkit"
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

    def _build(self, build: ImageBuild, log_path: Path) -> None:
        # A build in another container's network namespace is the legacy builder's.
        builder: BuilderKind = "legacy" if build.get("network") else self.builder
        with self._locks_guard:
            self.build_counts[build["tag"]] += 1
        try:
            self._run_build(builder, build, log_path)
        except _BuildkitUnavailable:
            # The engine looked able but refuses BuildKit (disabled in daemon.json, or a
            # platform without it): fall back for good, once per engine.
            with self._locks_guard:
                self._builder = "legacy"
            self._run_build("legacy", build, log_path)

    def _run_build(self, builder: BuilderKind, build: ImageBuild, log_path: Path) -> None:
        context_dir, timeout_sec = build["context_dir"], build["timeout_sec"]
        deadline = time.monotonic() + timeout_sec
        # A read timeout on a dedicated client bounds a build step that prints nothing;
        # dropping the connection makes the daemon cancel the build.
        client = self._client(timeout=max(1, int(timeout_sec) + 1), max_pool_size=1)
        params: dict[str, Any] = {
            "t": build["tag"],
            "rm": True,
            "forcerm": True,
            "pull": False,
            "labels": json.dumps({**build["labels"], LABEL_MANAGED: "true"}),
            "buildargs": json.dumps(dict(build.get("build_args") or {})),
        }
        if build.get("dockerfile"):
            params["dockerfile"] = build.get("dockerfile")
        if build.get("target"):
            params["target"] = build.get("target")
        if build.get("network"):
            params["networkmode"] = build.get("network")
        progress: BuildkitProgress | None = None
        if builder == "buildkit":
            # version=2 selects BuildKit; the tar context travels in the body, no session.
            params["version"] = "2"
            progress = BuildkitProgress()
        # Only the tail stays in memory; the whole log streams to its file.
        tail: deque[str] = deque(maxlen=_LOG_TAIL_LINES)
        error: str | None = None
        timed_out = False
        dockerfile = build.get("dockerfile") or "Dockerfile"
        with (
            log_path.open("w", encoding="utf-8") as log,
            _context_tar(context_dir, dockerfile, build.get("context_files")) as context,
        ):

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
            step = progress.failed_step(error) if progress is not None else None
            where = f" at step {step!r}" if step else ""
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

    @_engine_boundary
    def import_rootfs(self, tarball: Path, tag: str, *, changes: list[str]) -> None:
        """``docker import`` a root filesystem tarball as ``tag`` (base image bootstrap)."""
        repository, _, version = tag.rpartition(":")
        self._api.import_image_from_file(
            str(tarball), repository=repository, tag=version, changes=changes
        )

    @_engine_boundary
    def list_images(self) -> list[ImageInfo]:
        """Every image carrying our label."""
        images = self._api.images(filters={"label": f"{LABEL_MANAGED}=true"})
        found: list[ImageInfo] = []
        for image in images:
            labels = image.get("Labels") or {}
            # Engines before API 1.43 name an untagged image "<none>:<none>": by id then.
            tags = [t for t in image.get("RepoTags") or [] if t != "<none>:<none>"]
            for tag in tags or [image["Id"]]:
                found.append(ImageInfo(tag, labels.get(LABEL_KIND, ""), int(image["Size"])))
        return found

    def _image_config(self, tag: str) -> dict[str, Any]:
        config = self._image_configs.get(tag)
        if config is None:
            try:
                config = self._api.inspect_image(tag).get("Config") or {}
            except docker.errors.ImageNotFound:
                raise EnvironmentStartError(f"image {tag} is not present") from None
            self._image_configs[tag] = config
        return config

    @_engine_boundary
    def image_user(self, tag: str) -> str:
        """The image's configured USER ("" for the default, root)."""
        return str(self._image_config(tag).get("User") or "")

    @_engine_boundary
    def image_labels(self, tag: str) -> Mapping[str, str]:
        return dict(self._image_config(tag).get("Labels") or {})

    @_engine_boundary
    def image_accounts(self, image: str, container_id: str) -> ImageAccounts:
        accounts = self._image_accounts.get(image)
        if accounts is not None:
            return accounts
        # Read once per image (two archive calls, the daemon's costliest kind): the image
        # never changes, and a container that never started holds exactly the image's
        # files. One reader per image: a batch's first trials all start at once.
        with self._lock_for(image, self._accounts_locks):
            accounts = self._image_accounts.get(image)
            if accounts is None:
                passwd, group = (
                    self._read_small_file(container_id, path) for path in ACCOUNT_FILES
                )
                accounts = self._image_accounts[image] = ImageAccounts.parse(passwd, group)
        return accounts

    def _read_small_file(self, container_id: str, path: str) -> bytes:
        """A regular file's bytes (at most ``MAX_ACCOUNT_FILE_BYTES``; b"" if absent)."""
        stream = self.get_archive(container_id, path)
        if stream is None:
            return b""
        buffer = bytearray()
        try:
            for chunk in stream:
                buffer += chunk
                if len(buffer) > MAX_ACCOUNT_FILE_BYTES + (1 << 16):
                    break
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        with (
            contextlib.suppress(tarfile.TarError),
            tarfile.open(fileobj=io.BytesIO(bytes(buffer)), mode="r|") as tar,
        ):
            for member in tar:
                if member.isfile():
                    source = tar.extractfile(member)
                    return source.read(MAX_ACCOUNT_FILE_BYTES) if source is not None else b""
        return b""

    @_engine_boundary
    def remove_image(self, tag: str) -> None:
        self._image_configs.pop(tag, None)
        self._image_accounts.pop(tag, None)
        with contextlib.suppress(docker.errors.ImageNotFound):
            self._api.remove_image(tag, force=True, noprune=False)

    @_engine_boundary
    def prune_volumes(self, keep: set[str]) -> list[str]:
        """Remove our runtime and dependency volumes not in ``keep`` and not in use by a
        container; returns the removed names (each is made again when needed)."""
        removed = []
        for kind in ("runtime", "deps", "agent"):
            found = self._api.volumes(filters={"label": f"{LABEL_KIND}={kind}"})
            for volume in found.get("Volumes") or []:
                name = volume["Name"]
                if name in keep:
                    continue
                with _unused_on_this_host(f"volume-{name}") as unused:
                    if not unused:
                        continue  # a live process of this host may mount it any moment
                    try:
                        self._api.remove_volume(name)  # refused while a container uses it
                    except docker.errors.APIError:
                        continue
                self._volumes_ready.discard(name)
                removed.append(name)
        return removed

    @_engine_boundary
    def remove_volume(self, name: str) -> None:
        """Remove one of our volumes (a dependency environment: made again when needed)."""
        self._volumes_ready.discard(name)
        with contextlib.suppress(docker.errors.NotFound):
            self._api.remove_volume(name, force=True)

    # ----------------------------------------------------------------- containers

    @_engine_boundary
    def create(self, spec: ContainerSpec) -> str:
        if spec.network not in ("bridge", "none"):
            raise EnvironmentStartError(
                f"network {spec.network!r}: trial containers get "
                "'bridge' or 'none', never the host's network"
            )
        given_back = set(spec.cap_add)
        runtime_volume = self._ensure_runtime_volume(spec.image)
        if self._cpus is None:
            self._cpus = self.engine_cpus()
        # The engine refuses a quota above its CPU count: a task (or a default) asking
        # for more gets every CPU there is rather than a container that cannot start.
        cpus = min(spec.cpus, float(self._cpus)) if spec.cpus else None
        mounts = [_volume_mount(RUNTIME_MOUNT, runtime_volume)]
        mounts += [
            docker.types.Mount(
                v.target, v.volume, type="volume", read_only=v.read_only, no_copy=v.no_copy
            )
            for v in spec.volumes
        ]
        if spec.deps_volume is not None:
            mounts.append(_volume_mount(DEPS_MOUNT, spec.deps_volume))
        if spec.agent_volume is not None:
            mounts.append(_volume_mount(AGENT_MOUNT, spec.agent_volume))
        channel = None
        binds = list(spec.mounts)
        if spec.command_channel and spec.process is None:
            channel = CommandChannel(spec.name)
            binds.append(channel.mount())
        host_config = self._api.create_host_config(
            nano_cpus=int(cpus * 1e9) if cpus else None,
            mem_limit=f"{spec.memory_mb}m" if spec.memory_mb else None,
            # Equal to mem_limit: no swap, so a memory hog is OOM-killed instead of
            # thrashing the host's swap (Docker's default allows as much swap again).
            memswap_limit=f"{spec.memory_mb}m" if spec.memory_mb else None,
            pids_limit=spec.pids_limit,
            shm_size=f"{spec.shm_mb}m" if spec.shm_mb else None,
            ulimits=[
                docker.types.Ulimit(name="nofile", soft=spec.nofile_limit, hard=spec.nofile_limit)
            ]
            if spec.nofile_limit
            else None,
            security_opt=["no-new-privileges", self._seccomp.security_opt(spec.syscalls_allowed)],
            cap_drop=[c for c in DROPPED_CAPABILITIES if c not in given_back],
            cap_add=sorted(given_back & set(DROPPED_CAPABILITIES)) or None,
            network_mode=spec.network_name or (spec.network if spec.network != "bridge" else None),
            binds={
                m.source: {"bind": m.target, "mode": "ro" if m.read_only else "rw"} for m in binds
            }
            or None,
            mounts=mounts,
            log_config={"type": "none", "config": {}},
            device_requests=[docker.types.DeviceRequest(count=spec.gpus, capabilities=[["gpu"]])]
            if spec.gpus > 0
            else None,
        )
        # The init and keep-alive of the runtime, never the image's entrypoint; a
        # compose sidecar runs its own process under the runtime's init instead.
        entrypoint, user = list(INIT_COMMAND), "0:0"
        command = [*spec.before_keep_alive, *KEEP_ALIVE_COMMAND]
        if spec.process is not None:
            entrypoint, command = [RUNTIME_TINI, "--"], self._service_argv(spec)
            user = spec.process.user or self.image_user(spec.image) or "0:0"
        elif channel is not None:
            # The command server forks first, as root, then the init runs as always.
            image_env = self._image_config(spec.image).get("Env") or []
            configured = {*spec.env, *(str(e).partition("=")[0] for e in image_env)}
            entrypoint = [*channel.launcher(configured), *entrypoint]
        networking = None
        if spec.network_name is not None:
            if spec.network != "bridge":
                raise EnvironmentStartError(
                    f"network {spec.network!r} and the network {spec.network_name!r} at once"
                )
            networking = self._api.create_networking_config(
                {
                    spec.network_name: self._api.create_endpoint_config(
                        aliases=list(spec.aliases) or None
                    )
                }
            )
        try:
            created = self._api.create_container(
                spec.image,
                entrypoint=entrypoint,
                command=command,
                # Root for the keep-alive (setpriv in INIT_COMMAND drops the init to its
                # own uid); a sidecar's process runs as its service's (or image's) user.
                user=user,
                name=spec.name,
                labels={**spec.labels, LABEL_MANAGED: "true", LABEL_OWNER: self.owner},
                environment=dict(spec.env),
                host_config=host_config,
                networking_config=networking,
                healthcheck=_healthcheck(spec),
                working_dir=(spec.process.workdir if spec.process else None) or spec.workdir,
                detach=True,
            )
        except docker.errors.APIError as exc:
            if channel is not None:
                channel.close()
            raise EnvironmentStartError(
                f"cannot create a container from {spec.image}: {exc.explanation or exc}"
            ) from None
        if channel is not None:
            self._channels[str(created["Id"])] = channel
        return str(created["Id"])

    def _service_argv(self, spec: ContainerSpec) -> list[str]:
        """A sidecar's argv: its entrypoint and command, else the image's (Docker's rules)."""
        assert spec.process is not None
        config = self._image_config(spec.image)
        process = spec.process
        entry = list(
            process.entrypoint
            if process.entrypoint is not None
            else (config.get("Entrypoint") or [])
        )
        if process.command is not None:
            cmd = list(process.command)
        elif process.entrypoint is not None:
            cmd = []  # an entrypoint given clears the image's CMD
        else:
            cmd = list(config.get("Cmd") or [])
        if not entry + cmd:
            raise EnvironmentStartError(
                f"the service image {spec.image} has no command and the service sets none"
            )
        return entry + cmd

    @_engine_boundary
    def container_status(self, container_id: str) -> ContainerStatus:
        try:
            state = self._api.inspect_container(container_id)["State"]
        except docker.errors.NotFound:
            return ContainerStatus(exists=False, running=False)
        running = bool(state.get("Running")) and not state.get("Restarting")
        health = (state.get("Health") or {}).get("Status")
        exit_code = None if running else state.get("ExitCode")
        return ContainerStatus(True, running, exit_code, str(health) if health else None)

    @_engine_boundary
    def create_network(self, name: str, labels: Mapping[str, str], *, internal: bool) -> str:
        try:
            created = self._api.create_network(
                name,
                driver="bridge",
                internal=internal,
                check_duplicate=True,
                labels={**labels, LABEL_MANAGED: "true", LABEL_OWNER: self.owner},
            )
        except docker.errors.APIError as exc:
            raise EnvironmentStartError(
                f"cannot create the network {name}: {exc.explanation or exc}"
            ) from None
        return str(created["Id"])

    @_engine_boundary
    def remove_network(self, name: str) -> None:
        with contextlib.suppress(docker.errors.NotFound):
            self._api.remove_network(name)

    @_engine_boundary
    def create_volume(self, name: str, labels: Mapping[str, str]) -> None:
        self._api.create_volume(
            name, labels={**labels, LABEL_MANAGED: "true", LABEL_OWNER: self.owner}
        )

    def _ensure_runtime_volume(self, image: str) -> str:
        """The read-only runtime's volume, created and filled once per engine; its name."""
        content = self._runtime_content
        if content is None:
            content = self._runtime_content = RuntimeContent.load(self.cache_dir)
        name = content.volume_name
        if name in self._volumes_ready:
            return name

        def place(helper: str) -> None:
            with content.archive.open("rb") as archive:
                self._api.put_archive(helper, RUNTIME_MOUNT, archive)

        self._fill(
            name,
            image,
            mount=RUNTIME_MOUNT,
            marker=(RUNTIME_MARKER, content.marker_size),
            labels={LABEL_KIND: "runtime", LABEL_RUNTIME_DIGEST: content.digest},
            place=place,
        )
        return name

    @_engine_boundary
    def fill_volume(self, fill: VolumeFill, image: str) -> bool:
        if fill.volume in self._volumes_ready:
            return False
        runtime_volume = self._ensure_runtime_volume(image)

        def place(helper: str) -> None:
            with tempfile.TemporaryFile() as archive:
                with tarfile.open(fileobj=archive, mode="w") as tar:
                    for source, target in fill.files:
                        tar.add(source, target.lstrip("/"))
                archive.seek(0)
                self._api.put_archive(helper, "/", archive)
            self._api.start(helper)
            try:
                status = self._api.wait(helper, timeout=fill.timeout_sec)
            except (requests.exceptions.RequestException, docker.errors.APIError):
                raise EnvironmentStartError(
                    f"filling {fill.volume} took longer than {fill.timeout_sec:g}s"
                ) from None
            if status.get("StatusCode") != 0:
                tail = self._api.logs(helper, tail=_LOG_TAIL_LINES).decode(errors="replace")
                raise EnvironmentStartError(
                    f"filling {fill.volume} failed (exit {status.get('StatusCode')}):\n{tail}"
                )

        return self._fill(
            fill.volume,
            image,
            mount=fill.mount,
            marker=(fill.marker, None),
            labels=dict(fill.labels),
            place=place,
            command=list(fill.command),
            extra_mounts=[_volume_mount(RUNTIME_MOUNT, runtime_volume)],
        )

    def _fill(
        self,
        name: str,
        image: str,
        *,
        mount: str,
        marker: tuple[str, int | None],
        labels: dict[str, str],
        place: Callable[[str], None],
        command: list[str] | None = None,
        extra_mounts: list[Any] | None = None,
    ) -> bool:
        """Create volume ``name`` and, unless ``marker`` is in it, ``place`` its content
        through a helper container made from ``image`` (present: a trial is about to use
        it) with the volume at ``mount``. True when this call filled it."""
        with self._lock_for(name, self._volume_locks), _host_lock(f"volume-{name}"):
            if name in self._volumes_ready:
                return False
            # Held before the content is checked: a prune that removes it waits for none,
            # and none may remove it from now on (``prune_volumes``).
            if name not in self._volume_holds:
                held = _hold_on_this_host(f"volume-{name}")
                if held is not None:
                    self._volume_holds[name] = held
            helper: str | None = None
            filled = False
            try:
                # Not LABEL_MANAGED: like an image, it outlives trials and sessions (and
                # creating an existing volume is a no-op, so two services may race here).
                self._api.create_volume(name, labels=labels)
                helper = self._api.create_container(
                    image,
                    entrypoint=command[:1] if command else [KEEP_ALIVE_COMMAND[0]],
                    command=command[1:] if command else [],
                    user="0:0",
                    labels={LABEL_MANAGED: "true", LABEL_OWNER: self.owner, **labels},
                    host_config=self._api.create_host_config(
                        mounts=[_volume_mount(mount, name, read_only=False), *(extra_mounts or [])],
                        network_mode="none",
                    ),
                    network_disabled=True,
                )["Id"]
                path, size = marker
                found = self._archive_size(helper, path)
                # Content-named: a volume with its marker is complete. Writing over
                # files that running trials execute would fail (ETXTBSY).
                if found is None or (size is not None and found != size):
                    place(helper)
                    filled = True
            except docker.errors.APIError as exc:
                raise EnvironmentStartError(
                    f"cannot fill the volume {name}: {exc.explanation or exc}"
                ) from None
            finally:
                if helper is not None:
                    with contextlib.suppress(docker.errors.APIError):
                        self._api.remove_container(helper, force=True)
            self._volumes_ready.add(name)
            return filled

    def _archive_size(self, container_id: str, path: str) -> int | None:
        """The size of ``path`` in a container, from the archive API's stat header."""
        # APIClient is a requests session: HEAD asks for the stat without the body.
        url = self._api._url("/containers/{0}/archive", container_id)
        response = self._api.head(url, params={"path": path})
        header = response.headers.get("x-docker-container-path-stat")
        if response.status_code != 200 or not header:
            return None
        return int(json.loads(base64.b64decode(header)).get("size", -1))

    @_engine_boundary
    def start(self, container_id: str) -> None:
        try:
            # Starting is the daemon's most expensive step; too many at once topple it.
            with self._start_gate:
                channel = self._channels.get(container_id)
                if channel is not None:
                    channel.started()  # its server says hello anew, before any command
                self._api.start(container_id)
        except docker.errors.APIError as exc:
            # A volume removed behind our back (``docker volume prune`` between
            # trials) comes back empty from the next create: check them again then.
            self._volumes_ready.clear()
            hint = ""
            if "setting rlimit" in str(exc.explanation or exc):
                hint = (
                    " (a ulimit above the Docker daemon's own: lower --default-nofile to at "
                    "most the daemon's open-files limit)"
                )
            raise EnvironmentStartError(
                f"cannot start container: {exc.explanation or exc}{hint}"
            ) from None

    @_engine_boundary
    def put_archive(self, container_id: str, data: bytes | IO[bytes]) -> None:
        # Through the command server where it answers (no engine call: the engine
        # unpacks each archive in a process of its own); else, or when it failed, the
        # engine unpacks the whole archive again.
        channel = self._channels.get(container_id)
        if channel is not None and channel.alive:
            if isinstance(data, bytes):
                if channel.put(data, _CHANNEL_FILES_SEC):
                    return
            elif data.seekable():  # (one that is not goes to the engine alone)
                start = data.tell()
                if channel.put(data, _CHANNEL_FILES_SEC):
                    return
                data.seek(start)
        self._api.put_archive(container_id, "/", data)

    @_engine_boundary
    def get_archive(self, container_id: str, path: str) -> Iterator[bytes] | None:
        channel = self._channels.get(container_id)
        if channel is not None and channel.alive:
            got = channel.get(path, _CHANNEL_GET_CAP, _CHANNEL_FILES_SEC)
            if got is MISSING:
                return None
            if isinstance(got, bytes):
                return iter(
                    [got[at : at + _ARCHIVE_CHUNK] for at in range(0, len(got), _ARCHIVE_CHUNK)]
                )
            # Past its cap (an agent's flood), or the server failed: a stream the
            # reader may stop, from the engine.
        return self._engine_archive(container_id, path)

    def _engine_archive(self, container_id: str, path: str) -> Iterator[bytes] | None:
        # The SDK's get_archive hides its response; ours is kept so that a reader who
        # stops early (a spent budget) closes the connection and the daemon stops
        # tarring, instead of streaming gigabytes nobody reads.
        api = self._api
        url = api._url("/containers/{0}/archive", container_id)
        response = api._get(
            url, params={"path": path}, stream=True, headers={"Accept-Encoding": "identity"}
        )
        try:
            api._raise_for_status(response)
        except docker.errors.NotFound:
            response.close()
            return None
        except BaseException:
            response.close()
            raise
        api._disable_socket_timeout(api._get_raw_response_socket(response))

        def chunks() -> Iterator[bytes]:
            # The stream is read after this method returned: map its faults here too.
            try:
                yield from response.iter_content(_ARCHIVE_CHUNK, False)
            except Exception as exc:
                if not _is_engine_fault(exc):
                    raise
                if isinstance(exc, _ENGINE_FAULTS):
                    self.engine_down(exc)
                raise EngineUnavailableError(
                    self.engine_url, f"{type(exc).__name__} in get_archive"
                ) from None
            finally:
                response.close()

        return chunks()

    @_engine_boundary
    def container_running(self, container_id: str) -> bool:
        channel = self._channels.get(container_id)
        if channel is not None and channel.alive:
            return True  # its command server is connected: no engine call
        return bool(self._engine_says_running(container_id))

    def _engine_says_running(self, container_id: str) -> bool | None:
        """Whether the engine has the container running (None: it has no such one)."""
        try:
            state = self._api.inspect_container(container_id)["State"]
        except docker.errors.NotFound:
            return None
        return bool(state.get("Running")) and not state.get("Restarting")

    @_engine_boundary
    def stop_processes(self, container_id: str, companion: Companion | None = None) -> bool:
        channel = self._channels.get(container_id)
        init_pid = channel.init_pid() if channel is not None else None
        if init_pid is None:
            try:
                state = self._api.inspect_container(container_id)["State"]
            except docker.errors.NotFound:
                return False  # no container, no processes
            if not state.get("Running"):
                return False
            init_pid = int(state.get("Pid") or 0)
        # The cgroup's path names the container: a pid of another container never passes.
        cgroup = HostCgroup.of(init_pid, container_id) if init_pid else None
        self.host_kill = cgroup is not None
        if cgroup is not None:
            spared = None
            server = channel.companion if channel is not None else None
            companions = [c for c in (companion, server) if c is not None]
            with contextlib.suppress(OSError):
                spared = cgroup.kill_all_but_init(init_pid, KEEP_ALIVE_UID, companions)
            if spared is not None:
                if channel is not None:
                    channel.check_intact()  # what the phase did to the server stays
                return companion is not None and any(c is companion for c in spared)
        # Without the host's view: SIGKILL the init, which ends its PID namespace and
        # every process in it; the container's filesystem (and /logs) stays.
        try:
            self._api.kill(container_id)
            self._api.wait(container_id, timeout=10)
        except docker.errors.APIError as exc:
            raise EnvironmentStartError(
                f"could not stop the container's processes: {exc.explanation or exc}"
            ) from None
        self.start(container_id)  # through the start gate, as every start
        return False

    @_engine_boundary
    def exec(
        self, container_id: str, command: list[str], **options: Unpack[ExecOptions]
    ) -> ExecResult:
        channel = self._channels.get(container_id)
        if channel is not None:
            ran = self._exec_over(channel, container_id, command, options)
            if ran is not None:
                return ran
        environment = [f"{k}={v}" for k, v in (options.get("env") or {}).items()]
        stdin, timeout_sec = options.get("stdin"), options.get("timeout_sec")
        started = time.monotonic()
        try:
            exec_id = self._api.exec_create(
                container_id,
                command,
                environment=environment,
                # Never the image's USER by default: callers resolve users from the image.
                user=options.get("user") or "0:0",
                workdir=options.get("workdir"),
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
                self.stop_processes(container_id)
                try:
                    stdout, stderr = future.result(timeout=5)
                except (FutureTimeout, HarborExecError):
                    stdout, stderr = b"", b""
        duration = time.monotonic() - started
        exit_code = self._api.exec_inspect(exec_id).get("ExitCode")
        return ExecResult(exit_code, stdout, timed_out, duration, stderr)

    def _exec_over(
        self,
        channel: CommandChannel,
        container_id: str,
        command: list[str],
        options: ExecOptions,
    ) -> ExecResult | None:
        """``exec`` through the container's command channel (None: it has none that
        answers; the engine runs it). The same semantics: a command past its timeout
        has every process but ours killed and is reported timed out."""
        # Never the image's USER by default: callers resolve users from the image.
        user = options.get("user") or "0:0"
        if not user.replace(":", "", 1).isdigit():
            return None  # a user by name: the engine resolves it
        started = time.monotonic()
        reply = channel.submit(
            command,
            user=user,
            workdir=options.get("workdir"),
            env=options.get("env"),
            stdin=options.get("stdin"),
            output_cap=_MAX_EXEC_OUTPUT,
        )
        if reply is None:
            return None
        timeout_sec = options.get("timeout_sec")
        timed_out = not reply.done.wait(None if timeout_sec is None else max(timeout_sec, 0.0))
        if timed_out:
            self.stop_processes(container_id)
            reply.done.wait(5)
        elif reply.exit_code is None or (reply.exit_code > 128 and not channel.alive):
            # The channel went (or its command was killed as the container went).
            self._channel_broke(container_id)
        duration = time.monotonic() - started
        return ExecResult(
            reply.exit_code, reply.stdout.value(), timed_out, duration, reply.stderr.value()
        )

    def _channel_broke(self, container_id: str) -> None:
        """The command server went while a command ran: the agent's doing (it killed the
        server, or the container's init), unless the engine is going away (a daemon that
        stops closes its socket, then ends every container): that raises, as an engine
        exec's broken stream does. The engine gets a moment to say which; asked on a
        new connection each time (one kept open may still be served while it stops). A
        container that is no more was removed (a cancelled trial): nothing to wait for."""
        deadline = time.monotonic() + _ENGINE_GONE_SEC
        while True:
            self._engine_listening()
            running = self._engine_says_running(container_id)
            if running is None or running or time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def _engine_listening(self) -> None:
        """Raise ``EngineUnavailableError`` unless the engine takes a new connection."""
        try:
            client = self._client(timeout=5, max_pool_size=1)
            try:
                client.ping()
            finally:
                client.close()
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            self.engine_down(exc)
            raise EngineUnavailableError(
                self.engine_url, "the command channel broke and the engine stopped answering"
            ) from None

    @_engine_boundary
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
        streams = {1: OutputTail(_MAX_EXEC_OUTPUT), 2: OutputTail(_MAX_EXEC_OUTPUT)}
        try:
            if stdin is not None:
                raw.sendall(stdin)
                raw.shutdown(socket.SHUT_WR)  # EOF on the process's stdin
            for stream, data in frames_iter(sock, tty=False):
                if stream in streams:
                    streams[stream].add(data)
        except OSError as exc:
            # The daemon went away mid-stream (restart, socket gone).
            self.engine_down(exc)
            raise EngineUnavailableError(
                self.engine_url, f"exec stream broke: {type(exc).__name__}"
            ) from None
        finally:
            sock.close()
        return streams[1].value(), streams[2].value()

    @_engine_boundary
    def ensure_present(self, image: str, *, any_registry: bool = False) -> None:
        """Make sure an image is here: a task-named one is pulled only from a registry the
        operator allows (``pull_registries``); ``any_registry`` for the operator's own."""
        if self.image_exists(image):
            return
        registry = image_registry(image)
        if not any_registry and registry not in self.pull_registries:
            raise EnvironmentStartError(
                f"image {image!r} is not present on this engine, and its registry "
                f"{registry!r} is not one the operator allows pulls from (${PULL_REGISTRIES_ENV}"
                ", default none): build or load it first, or allow the registry"
            )
        try:
            self._api.pull(image)
        except docker.errors.APIError:
            # Never the registry's answer: a task chose where the engine asked.
            raise EnvironmentStartError(
                f"image {image!r} is not present on this engine and could not be pulled "
                f"from {registry!r}; build or load it first"
            ) from None

    @_engine_boundary
    def disk_usage(self, container_id: str, *, budget_bytes: int) -> DiskUsage | None:
        if container_id not in self._layers:
            try:
                graph = self._api.inspect_container(container_id).get("GraphDriver") or {}
            except docker.errors.NotFound:
                return None
            # overlay2's upper dir holds everything the container wrote; it is a path on
            # the engine's host, measurable only when that is this host (a local engine).
            upper = str((graph.get("Data") or {}).get("UpperDir") or "")
            readable = bool(upper) and os.access(upper, os.R_OK | os.X_OK)  # root, here
            self._layers[container_id] = WritableLayer(Path(upper)) if readable else None
        layer = self._layers[container_id]
        if layer is None:
            return None
        try:
            return layer.usage(budget_bytes)
        except FileNotFoundError:
            self._layers.pop(container_id, None)
            return None  # removed meanwhile

    def remove(self, container_id: str) -> None:
        """Force-remove; never raises for an engine fault: the container is kept in a
        list that ``reap`` retries once the engine answers again."""
        self._layers.pop(container_id, None)
        channel = self._channels.pop(container_id, None)
        if channel is not None:
            channel.close()
        try:
            self._api.remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except Exception as exc:
            # Another removal of it (a cancel beside the trial's own) is at it: done.
            in_progress = isinstance(exc, docker.errors.APIError) and "already in progress" in str(
                exc
            )
            if not in_progress:
                if not _is_engine_fault(exc):
                    raise
                if isinstance(exc, _ENGINE_FAULTS):
                    self.engine_down(exc)
                with self._locks_guard:
                    self._unremoved.add(container_id)
                return
        with self._locks_guard:
            self._unremoved.discard(container_id)

    @property
    def unremoved(self) -> set[str]:
        """Containers whose removal is still owed (the engine was away)."""
        with self._locks_guard:
            return set(self._unremoved)

    def reap(self) -> list[str]:
        """Periodic clean-up: retry owed removals, then remove dead owners' containers.
        Returns what was removed; never raises (an absent engine is recorded)."""
        if not self.ping():
            return []
        removed: list[str] = []
        for container_id in self.unremoved:
            self.remove(container_id)
            if container_id not in self.unremoved:
                removed.append(container_id)
        with contextlib.suppress(HarborExecError):
            removed += self.reap_orphans()
        return removed

    # ----------------------------------------------------------------- housekeeping

    @_engine_boundary
    def our_containers(self, *, owner: str | None = None) -> list[dict[str, Any]]:
        """Containers carrying our label (optionally only ``owner``'s)."""
        label = [f"{LABEL_MANAGED}=true"]
        if owner is not None:
            label.append(f"{LABEL_OWNER}={owner}")
        return list(self._api.containers(all=True, filters={"label": label}))

    def _orphaned(self, owner: str) -> bool:
        mine = self.owner.split("/")[1] if self.owner.count("/") >= 3 else None
        return owner != self.owner and not owner_is_alive(owner, own_namespace=mine)

    @_engine_boundary
    def reap_orphans(self) -> list[str]:
        """Remove our containers whose owner process is gone, then such owners' networks
        and per-trial volumes (a compose trial's); returns their names."""
        reaped: list[str] = []
        for container in self.our_containers():
            if self._orphaned((container.get("Labels") or {}).get(LABEL_OWNER, "")):
                self.remove(container["Id"])
                reaped.append((container.get("Names") or [container["Id"]])[0].lstrip("/"))
        reaped += self._remove_networks_and_volumes(self._orphaned)
        return reaped

    def _remove_networks_and_volumes(self, doomed: Callable[[str], bool]) -> list[str]:
        """Remove our labelled networks and volumes whose owner ``doomed`` says; a network
        still in use (a container of a live owner joined it) is left for the next reap."""
        removed: list[str] = []
        label = {"label": [f"{LABEL_MANAGED}=true"]}
        for network in self._api.networks(filters=label):
            if doomed((network.get("Labels") or {}).get(LABEL_OWNER, "")):
                try:
                    self.remove_network(network["Name"])
                except docker.errors.APIError:
                    continue
                removed.append(str(network["Name"]))
        for volume in self._api.volumes(filters=label).get("Volumes") or []:
            if doomed((volume.get("Labels") or {}).get(LABEL_OWNER, "")):
                try:
                    self._api.remove_volume(volume["Name"], force=True)
                except docker.errors.NotFound:
                    pass
                except docker.errors.APIError:
                    continue
                removed.append(str(volume["Name"]))
        return removed

    @_engine_boundary
    def remove_owned(self) -> int:
        """Remove every container (then network and per-trial volume) this runtime's
        owner created; returns how many containers."""
        containers = self.our_containers(owner=self.owner)
        for container in containers:
            self.remove(container["Id"])
        self._remove_networks_and_volumes(lambda owner: owner == self.owner)
        return len(containers)

    @_engine_boundary
    def gpu_count(self) -> int:
        """How many GPUs the engine can hand to containers (0 when it has no GPU runtime
        or GPU device; -1 when it has one but does not say how many)."""
        info = self._api.info()
        devices = [
            d
            for d in info.get("DiscoveredDevices") or []
            if "gpu" in str(d.get("ID", "")).lower() or "gpu" in str(d.get("Source", "")).lower()
        ]
        if devices:
            return len(devices)
        runtimes = info.get("Runtimes") or {}
        return -1 if "nvidia" in runtimes else 0

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

    def pid_max(self) -> int:
        """The host's ``kernel.pid_max`` (the limit every container's pids share)."""
        try:
            return int(Path("/proc/sys/kernel/pid_max").read_text())
        except (OSError, ValueError):
            return 32768


def _healthcheck(spec: ContainerSpec) -> dict[str, Any] | None:
    check = spec.healthcheck
    if check is None:
        return None
    nanos = 1_000_000_000
    return {
        "test": list(check.test),
        "interval": int(check.interval_sec * nanos) or None,
        "timeout": int(check.timeout_sec * nanos) or None,
        "retries": check.retries,
        "start_period": int(check.start_period_sec * nanos) or None,
    }


#: Where this host's processes take turns at what must happen once per engine.
HOST_LOCKS_DIR: Final = Path(tempfile.gettempdir()) / "harbor-exec-locks"


@contextlib.contextmanager
def _host_lock(name: str) -> Iterator[None]:
    """Exclusive across this host's processes (threads take their own locks first): two
    processes filling one volume at once would extract over each other's files (seen:
    ``lchown ...: no such file or directory``). Where the directory is another user's and
    not ours to use, nothing is locked (as before)."""
    handle = _lock_file(name)
    if handle is None:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _lock_file(name: str) -> IO[str] | None:
    """``HOST_LOCKS_DIR/<name>.lock``, open for ``flock``; None where it cannot be had
    (another user's directory)."""
    try:
        HOST_LOCKS_DIR.mkdir(mode=0o700, exist_ok=True)
        return (HOST_LOCKS_DIR / f"{name}.lock").open("a")
    except OSError:
        return None


def _hold_on_this_host(name: str) -> IO[str] | None:
    """A shared lock on ``name``'s use for as long as the returned file stays open
    (waits only while a prune removes it)."""
    handle = _lock_file(f"use-{name}")
    if handle is not None:
        fcntl.flock(handle, fcntl.LOCK_SH)
    return handle


@contextlib.contextmanager
def _unused_on_this_host(name: str) -> Iterator[bool]:
    """True (and held exclusively meanwhile) when no process of this host, this one
    included, holds ``name``'s use; False at once otherwise."""
    handle = _lock_file(f"use-{name}")
    if handle is None:
        yield True
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def _volume_mount(target: str, volume: str, *, read_only: bool = True) -> Any:
    """A named volume of ours at ``target``; never filled from the image's own files."""
    return docker.types.Mount(target, volume, type="volume", read_only=read_only, no_copy=True)
