"""``FakeRuntime``: an in-memory ``ContainerEngine`` (both the trial side and engine
administration) for fast tests.

Like httpx's ``MockTransport``: trials, executors and ``HarborBackend`` run
against it unchanged, in milliseconds. Containers are dicts of files; an exec
is answered by a Python function chosen by what the command runs:

* ``solve``: the oracle's ``solve.sh`` (gets the container, returns an exit code
  or ``HANG``);
* ``test``: the task's ``test.sh`` (same; the default writes reward 1);
* ``runner``: the bundled workflow's runner (``runner agent``): returns its exit
  code and stdout (where the runner frames the sample); the default prints nothing.

A behaviour that returns ``HOLD`` waits at the runtime's ``gate`` until the test
opens it (then exits 0), its container is removed (exit 137, as the engine ends
an exec whose container it killed) or ``stop_processes`` kills it (137, too).
``gate.wait_held(n)`` returns once ``n`` commands have reached the gate, so tests
synchronise on events, never on sleeps. Every exec is recorded in ``execs`` (which
container, which rollout, its deadline).

The archive calls really pack and unpack tars, so the trial's file handling
(``/logs`` read back, a fresh ``/logs/verifier``, bounded extraction) is the
real code. Knobs: ``fail_builds`` (tags whose build fails), ``engine_down``
(every call raises ``EngineUnavailableError``), ``gpus`` (what ``gpu_count`` says).
"""

from __future__ import annotations

import io
import itertools
import tarfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO

from harbor_exec.container.forward import announce
from harbor_exec.errors import EngineUnavailableError, SandboxBuildFailedError
from harbor_exec.sandbox.cgroups import Companion
from harbor_exec.sandbox.runtime import (
    LABEL_KIND,
    LABEL_ROLLOUT,
    BuildResult,
    ContainerSpec,
    ContainerStatus,
    DiskUsage,
    ExecResult,
    ImageInfo,
    VolumeFill,
)
from harbor_exec.sandbox.users import ImageAccounts

HANG = -999  # a behaviour's answer: run until the exec's deadline
HOLD = -998  # a behaviour's answer: wait at the gate (see the module doc)
#: How long a held command waits at most: a test that forgets to open the gate
#: fails instead of hanging the suite.
HOLD_LIMIT_SEC = 10.0

Behaviour = Callable[["FakeContainer"], int]


@dataclass
class FakeContainer:
    spec: ContainerSpec
    files: dict[str, bytes | None] = field(default_factory=dict)  # None: a directory
    running: bool = False
    removed: bool = False
    processes_stopped: int = 0  # stop_processes calls (each ends a held command)

    def write(self, path: str, data: bytes | str) -> None:
        self.files[path] = data.encode() if isinstance(data, str) else data

    def read(self, path: str) -> bytes | None:
        data = self.files.get(path)
        return data if isinstance(data, bytes) else None

    def remove_tree(self, path: str) -> None:
        for name in [n for n in self.files if n == path or n.startswith(path + "/")]:
            del self.files[name]


@dataclass(frozen=True)
class FakeExec:
    """One exec the runtime was asked to run."""

    container_id: str
    rollout_id: str | None  # the container's rollout label
    script: str  # the ``bash -c`` argument
    timeout_sec: float | None
    user: str | None = None  # as the trial passed it (a resolved ``uid:gid``)


class Gate:
    """Where ``HOLD`` commands wait: until ``open()``, or until their container is
    removed (``FakeRuntime.remove`` calls ``container_removed``)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._open = False
        self.held: list[FakeContainer] = []  # every container whose command reached the gate
        self.ended_by_removal: list[FakeContainer] = []  # held until their container went

    def hold(self, container: FakeContainer) -> int:
        """Wait; the command's exit code: 0 once opened, 137 when its container was removed
        (and 0 past ``HOLD_LIMIT_SEC``, recorded nowhere, so that assertions fail)."""
        with self._condition:
            self.held.append(container)
            stops = container.processes_stopped
            self._condition.notify_all()
            self._condition.wait_for(
                lambda: self._open or container.removed or container.processes_stopped > stops,
                HOLD_LIMIT_SEC,
            )
            if container.removed:
                self.ended_by_removal.append(container)
                return 137
            return 137 if container.processes_stopped > stops else 0

    def wait_held(self, count: int = 1, timeout: float = 10.0) -> bool:
        """True once ``count`` commands have reached the gate (False past ``timeout``)."""
        with self._condition:
            return self._condition.wait_for(lambda: len(self.held) >= count, timeout)

    def open(self) -> None:
        """Let every held command, and every later one, through."""
        with self._condition:
            self._open = True
            self._condition.notify_all()

    def processes_stopped(self, container: FakeContainer) -> None:
        """``stop_processes`` ran: the container's held command ends (137)."""
        with self._condition:
            container.processes_stopped += 1
            self._condition.notify_all()

    def container_removed(self) -> None:
        with self._condition:
            self._condition.notify_all()


def _default_test(container: FakeContainer) -> int:
    container.write("/logs/verifier/reward.txt", "1\n")
    return 0


@dataclass
class FakeRuntime:
    """See the module doc. Records what it was asked to do."""

    solve: Behaviour = lambda container: 0
    test: Behaviour = _default_test
    runner: Callable[[FakeContainer], tuple[int, bytes]] = lambda container: (0, b"")
    #: Any other command (e.g. a healthcheck): its exit code; None: 0.
    other: Callable[[FakeContainer, str], int] | None = None
    fail_builds: set[str] = field(default_factory=set)
    engine_down: bool = False
    gpus: int = 0
    #: Every image's USER and account files (``image_accounts`` parses these).
    user: str = ""
    passwd: bytes = b"root:x:0:0:root:/root:/bin/bash\n"
    group: bytes = b"root:x:0:\n"
    images: set[str] = field(default_factory=set)
    volumes: dict[str, VolumeFill] = field(default_factory=dict)
    containers: dict[str, FakeContainer] = field(default_factory=dict)
    #: The package cache's build gateways, and the execs in them (apart from the rest).
    gateways: dict[str, FakeContainer] = field(default_factory=dict)
    gateway_execs: list[FakeExec] = field(default_factory=list)
    builds: list[str] = field(default_factory=list)
    build_args: dict[str, dict[str, str]] = field(default_factory=dict)  # tag -> its args
    build_networks: dict[str, str | None] = field(default_factory=dict)  # tag -> RUN network
    #: tag -> the files sent in place of the context's own (a cached build's trust).
    build_context_files: dict[str, dict[str, bytes]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    execs: list[FakeExec] = field(default_factory=list)
    gate: Gate = field(default_factory=Gate)
    owner: str = "fake-owner"
    #: Per-trial networks and volumes: name -> (labels, removed); ``health`` answers
    #: ``container_status`` for containers with a healthcheck (default "healthy").
    networks: dict[str, dict[str, str]] = field(default_factory=dict)
    trial_volumes: dict[str, dict[str, str]] = field(default_factory=dict)
    removed_objects: list[str] = field(default_factory=list)
    health: Callable[[FakeContainer], str] = lambda container: "healthy"
    _ids: Iterator[int] = field(default_factory=itertools.count)
    _accounts_read: set[str] = field(default_factory=set)

    # ----------------------------------------------------------------- engine

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.engine_down:
            raise EngineUnavailableError(self.engine_url, f"ConnectionError in {name}")

    @property
    def engine_available(self) -> bool:
        return not self.engine_down

    @property
    def engine_url(self) -> str:
        return "fake://engine"

    @property
    def builder(self) -> str:
        return "fake"

    def ping(self) -> bool:
        return not self.engine_down

    def pid_max(self) -> int:
        return 32768

    def engine_cpus(self) -> int:
        return 2

    def gpu_count(self) -> int:
        return self.gpus

    def list_images(self) -> list[ImageInfo]:
        return [ImageInfo(tag, "task-env", 0) for tag in sorted(self.images)]

    def reap(self) -> list[str]:
        return []

    def reap_orphans(self) -> list[str]:
        return []

    def remove_owned(self) -> int:
        live = [c for c in self.containers.values() if not c.removed]
        for container in live:
            container.removed = True
        return len(live)

    # ----------------------------------------------------------------- images

    def ensure_image(
        self,
        *,
        context_dir: Path,
        tag: str,
        timeout_sec: float,
        labels: Mapping[str, str],
        build_args: Mapping[str, str] | None = None,
        dockerfile: str | None = None,
        target: str | None = None,
        network: str | None = None,
        context_files: Mapping[str, bytes] | None = None,
        before_build: Callable[[], None] | None = None,
    ) -> BuildResult:
        self._call("ensure_image")
        if tag in self.images:
            return BuildResult(tag, built=False, duration_sec=0.0, log_path=None)
        if before_build is not None:
            before_build()
        if tag in self.fail_builds:
            raise SandboxBuildFailedError(f"docker build of {context_dir} failed: exit code 42")
        self.builds.append(tag)
        self.build_args[tag] = dict(build_args or {})
        self.build_networks[tag] = network
        self.build_context_files[tag] = dict(context_files or {})
        self.images.add(tag)
        return BuildResult(tag, built=True, duration_sec=0.0, log_path=None)

    def image_exists(self, tag: str) -> bool:
        return tag in self.images

    def image_user(self, tag: str) -> str:
        return self.user

    def image_accounts(self, image: str, container_id: str) -> ImageAccounts:
        self._call("image_accounts")
        if image not in self._accounts_read:  # once per image, as DockerRuntime
            assert not self._container(container_id).running, "read before the container starts"
            self._accounts_read.add(image)
        return ImageAccounts.parse(self.passwd, self.group)

    def image_labels(self, tag: str) -> Mapping[str, str]:
        return {}

    def ensure_present(self, image: str, *, any_registry: bool = False) -> None:
        self.images.add(image)

    def fill_volume(self, fill: VolumeFill, image: str) -> bool:
        self._call("fill_volume")
        if fill.volume in self.volumes:
            return False
        self.volumes[fill.volume] = fill
        return True

    # ----------------------------------------------------------------- containers

    def create(self, spec: ContainerSpec) -> str:
        self._call("create")
        container_id = f"fake-{next(self._ids)}"
        if spec.labels.get(LABEL_KIND) == "build-gateway":
            # The package cache's build gateway: kept apart from the trials' containers.
            self.gateways[container_id] = FakeContainer(spec)
        else:
            self.containers[container_id] = FakeContainer(spec)
        return container_id

    def _containers(self) -> dict[str, FakeContainer]:
        return {**self.containers, **self.gateways}

    def _container(self, container_id: str) -> FakeContainer:
        return self._containers()[container_id]

    def start(self, container_id: str) -> None:
        self._call("start")
        container = self._container(container_id)
        container.running = True
        _announce_forwarder(container.spec)

    def put_archive(self, container_id: str, data: bytes | IO[bytes]) -> None:
        self._call("put_archive")
        data = data if isinstance(data, bytes) else data.read()
        _extract(self._container(container_id), data)

    def get_archive(self, container_id: str, path: str) -> Iterator[bytes] | None:
        self._call("get_archive")
        container = self._container(container_id)
        if path not in container.files:
            return None
        buffer = io.BytesIO()
        base = PurePosixPath(path).parent
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name in sorted(container.files):
                if name != path and not name.startswith(path + "/"):
                    continue
                data = container.files[name]
                info = tarfile.TarInfo(str(PurePosixPath(name).relative_to(base)))
                if data is None:
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                else:
                    info.size, info.mode = len(data), 0o644
                    tar.addfile(info, io.BytesIO(data))
        payload = buffer.getvalue()
        return iter([payload[i : i + 4096] for i in range(0, len(payload), 4096)])

    def container_running(self, container_id: str) -> bool:
        self._call("container_running")
        container = self._containers().get(container_id)
        return container is not None and container.running and not container.removed

    def stop_processes(self, container_id: str, companion: Companion | None = None) -> bool:
        self._call("stop_processes")
        container = self._containers().get(container_id)
        if container is not None:
            self.gate.processes_stopped(container)
        return companion is not None and container is not None and container.running

    def disk_usage(self, container_id: str, *, budget_bytes: int) -> DiskUsage | None:
        # Not recorded in ``calls``: the trial's disk watch polls it on a timer.
        container = self._containers().get(container_id)
        if container is None or container.removed:
            return None
        used = sum(len(data) for data in container.files.values() if data)
        return DiskUsage(used, len(container.files))

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
        self._call("exec")
        container = self._container(container_id)
        script = command[-1]
        rollout_id = container.spec.labels.get(LABEL_ROLLOUT)
        record = FakeExec(container_id, rollout_id, script, timeout_sec, user)
        (self.gateway_execs if container_id in self.gateways else self.execs).append(record)
        if timeout_sec is not None and timeout_sec <= 0:
            # A deadline already passed: the engine's wait ends at once, as Docker's does.
            return ExecResult(None, b"", True, 0.0)
        if "tar -xf - -C /" in script and stdin is not None:
            _extract(container, stdin)
        if "/solution/solve.sh" in script:
            if "/solution/solve.sh" not in container.files:
                return ExecResult(127, b"", False, 0.0)
            code = self.solve(container)
            container.files.setdefault("/logs/agent/oracle.txt", b"")
        elif "/tests/test.sh" in script:
            code = self.test(container)
            container.files.setdefault("/logs/verifier/test-stdout.txt", b"")
        elif "harbor_exec.container.runner agent" in script:
            code, stdout = self.runner(container)
            return ExecResult(code, stdout, False, 0.0)
        else:
            code = 0 if self.other is None else self.other(container, script)
        if code == HOLD:
            code = self.gate.hold(container)
        if code == HANG:
            if timeout_sec is None:
                raise AssertionError("a hanging exec without a deadline would never end")
            time.sleep(min(timeout_sec, 0.01))
            return ExecResult(None, b"", True, timeout_sec)
        return ExecResult(code, b"", False, 0.0)

    def container_status(self, container_id: str) -> ContainerStatus:
        self._call("container_status")
        container = self._containers().get(container_id)
        if container is None or container.removed:
            return ContainerStatus(exists=False, running=False)
        health = self.health(container) if container.spec.healthcheck is not None else None
        return ContainerStatus(True, container.running, None, health)

    def create_network(self, name: str, labels: Mapping[str, str], *, internal: bool) -> str:
        self._call("create_network")
        self.networks[name] = {**labels, "internal": str(internal)}
        return name

    def remove_network(self, name: str) -> None:
        self._call("remove_network")
        self.networks.pop(name, None)
        self.removed_objects.append(name)

    def create_volume(self, name: str, labels: Mapping[str, str]) -> None:
        self._call("create_volume")
        self.trial_volumes[name] = dict(labels)

    def remove_volume(self, name: str) -> None:
        self._call("remove_volume")
        self.trial_volumes.pop(name, None)
        self.removed_objects.append(name)

    def remove(self, container_id: str) -> None:
        self.calls.append("remove")
        container = self._containers().get(container_id)
        if container is not None:
            container.removed = True
            container.running = False
            self.gate.container_removed()


def hold_first_removal(
    runtime: FakeRuntime, count: int = 1
) -> tuple[threading.Event, threading.Event]:
    """The runtime's first ``count`` container removals wait for the test: (set once they
    all wait, set it to let them go on; they go on by themselves after 10 s)."""
    held, release = threading.Event(), threading.Event()
    remove = runtime.remove
    holding = [0]
    guard = threading.Lock()

    def held_remove(container_id: str) -> None:
        with guard:
            mine = holding[0] < count
            holding[0] += mine
            if holding[0] == count:
                held.set()
        if mine:
            release.wait(10)
        remove(container_id)

    runtime.remove = held_remove  # type: ignore[method-assign]
    return held, release


def _extract(container: FakeContainer, data: bytes) -> None:
    """Apply a tar at ``/`` as the engine does: a path whose type changes is replaced."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for member in tar:
            path = "/" + member.name.lstrip("/")
            existing = container.files.get(path, ...)
            is_dir = member.isdir()
            if existing is not ... and (existing is None) != is_dir:
                container.remove_tree(path)
            if is_dir:
                container.files[path] = None
            else:
                source = tar.extractfile(member)
                container.files[path] = source.read() if source is not None else b""


def _announce_forwarder(spec: ContainerSpec) -> None:
    """What a forwarder started with the container does once it listens (``forward``'s
    ``--ready``): announce itself on the host side of its mounted socket."""
    argv = list(spec.before_keep_alive)
    if "--ready" not in argv or spec.process is not None:
        return
    socket_path = argv[argv.index("--socket") + 1]
    for mount in spec.mounts:
        if socket_path.startswith(mount.target.rstrip("/") + "/"):
            host_path = mount.source + socket_path[len(mount.target.rstrip("/")) :]
            announce(host_path, argv[argv.index("--ready") + 1], 4242)
            return
