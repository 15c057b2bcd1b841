"""Compose environments: a task's ``environment/docker-compose.yaml``, run as Harbor 0.26 runs it.

Compose semantics come from Docker Compose itself, not from a parser of ours: the
model is ``docker compose config --format json`` over the files Harbor 0.26 merges
(its ``docker-compose-build.yaml`` or ``docker-compose-prebuilt.yaml``, then the
task's ``docker-compose.yaml``, then the ``[environment].env`` override of ``main``)
with the variables Harbor sets (``MAIN_IMAGE_NAME``, ``CONTEXT_DIR``,
``PREBUILT_IMAGE_NAME``, ``CPUS``, ``MEMORY``) and the task's environment. Compose
interpolates, merges, applies ``extends``/``env_file`` and normalises every short
form; what it prints is turned into our own containers through ``ContainerRuntime``,
so that every service gets the trial container's hardening (dropped capabilities,
seccomp, ``no-new-privileges``, pids/memory/CPU limits, an init), labels (the
reaper's) and forced removal. Compose never creates a container here (``compose
up`` would give none of that, and its ``down`` stops services one by one with a
10 s grace each).

Per trial: one bridge network of ours (internal, no route out, unless the task's
main container has a public network), every service on it under its service name;
named volumes are per trial (created and removed with it, reaped by label); a bind
mount of a path inside ``environment/`` is a copy of that path placed in each
container that mounts it before it starts (the task's snapshot is never written, and
two services do not see each other's writes there: share a named volume for that). Sidecars start in
``depends_on`` order, each condition (``service_started``, ``service_healthy``,
``service_completed_successfully``) awaited, and ``main`` last, once every service
runs and every service with a healthcheck is healthy (``compose up --wait``).
What would give a container more than the trial container has (host networking,
``privileged``, capabilities, devices, host namespaces, a bind mount from outside
the task) is refused with a message naming the service and field.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harbor_exec.cache import cache_root
from harbor_exec.errors import (
    CancelledError,
    EnvironmentStartError,
    EnvironmentStartTimeoutError,
    HarborExecError,
    SandboxBuildFailedError,
    TaskConfigError,
)
from harbor_exec.network.packages.build_route import (
    BuildCache,
    cache_build_options,
    merge_build_args,
)
from harbor_exec.sandbox.archives import ArchiveEntry, build_archive, tree_entries
from harbor_exec.sandbox.runtime import (
    DROPPED_CAPABILITIES,
    LABEL_KIND,
    LABEL_TASK,
    ContainerRuntime,
    ContainerSpec,
    Healthcheck,
    ServiceProcess,
    VolumeMount,
)
from harbor_exec.tasks.config import resolve_env
from harbor_exec.tasks.task import Task
from harbor_exec.trial.base_images import ensure_base_images
from harbor_exec.trial.compose_inputs import check_compose_inputs, sanitized_dotenv

if TYPE_CHECKING:
    pass

COMPOSE_FILE = "docker-compose.yaml"
MAIN = "main"
#: Harbor 0.26's ``environments/docker/docker-compose-build.yaml`` and ``-prebuilt.yaml``.
_BUILD_YAML = """services:
  main:
    build:
      context: ${CONTEXT_DIR}
    pull_policy: build
    command: [ "sh", "-c", "sleep infinity" ]
"""
_PREBUILT_YAML = """services:
  main:
    image: ${PREBUILT_IMAGE_NAME}
    command: [ "sh", "-c", "sleep infinity" ]
"""
#: Service fields that would give a container more than the trial container has.
_REFUSED_FIELDS = (
    "privileged",
    "cap_add",
    "devices",
    "device_cgroup_rules",
    "pid",
    "ipc",
    "uts",
    "userns_mode",
    "cgroup_parent",
    "security_opt",
    "sysctls",
    "volumes_from",
    "runtime",
    "gpus",
)
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_POLL_SEC = 0.05
_CONFIG_TIMEOUT_SEC = 60.0
_config_cache: dict[str, dict[str, Any]] = {}
_config_lock = threading.Lock()


def compose_file(task: Task) -> Path | None:
    """The task's ``environment/docker-compose.yaml`` (Harbor's only compose file name)."""
    path = task.environment_dir / COMPOSE_FILE
    return path if path.is_file() else None


def is_compose_task(task: Task) -> bool:
    return compose_file(task) is not None


def go_duration(value: object, *, where: str) -> float:
    """Seconds in a Go duration (``1m30s``, ``500ms``) as Compose prints them."""
    if value is None:
        return 0.0
    if isinstance(value, int | float):
        return float(value) / 1e9  # Compose's JSON may give nanoseconds
    text = str(value).strip()
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise EnvironmentStartError(f"{where}: {text!r} is not a duration")
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)


@dataclass(frozen=True)
class ServiceVolume:
    """One ``volumes:`` entry: a per-trial named volume, or a copy of a path in the task."""

    kind: str  # "volume" or "copy"
    target: str
    source: str  # the volume's compose name, or a host path inside environment/
    read_only: bool = False
    no_copy: bool = False


@dataclass(frozen=True)
class ComposeService:
    """One service of the normalised model, in our terms."""

    name: str
    image: str | None  # its ``image`` (the name a built image gets, with ``build``)
    build: Mapping[str, Any] | None
    environment: Mapping[str, str]
    entrypoint: Sequence[str] | None
    command: Sequence[str] | None
    user: str | None
    workdir: str | None
    depends_on: Mapping[str, str]  # service -> condition
    healthcheck: Healthcheck | None
    volumes: Sequence[ServiceVolume]
    network_none: bool
    cpus: float | None
    memory_mb: int | None
    aliases: Sequence[str] = ()
    cap_add: Sequence[str] = ()  # of ``DROPPED_CAPABILITIES`` only (others are refused)


@dataclass(frozen=True)
class ComposeProject:
    """A task's compose model: its services (``main`` among them) and named volumes."""

    services: Mapping[str, ComposeService]
    volumes: Sequence[str]
    environment_dir: Path

    @property
    def main(self) -> ComposeService:
        return self.services[MAIN]

    def start_order(self) -> list[str]:
        """Sidecars in ``depends_on`` order (each after what it depends on)."""
        order: list[str] = []
        visiting: set[str] = set()

        def visit(name: str, chain: tuple[str, ...]) -> None:
            if name in order:
                return
            if name in visiting:
                raise EnvironmentStartError(
                    f"{COMPOSE_FILE}: depends_on cycle {' -> '.join((*chain, name))}"
                )
            visiting.add(name)
            for dependency in self.services[name].depends_on:
                visit(dependency, (*chain, name))
            visiting.discard(name)
            order.append(name)

        for name in sorted(self.services):
            if name != MAIN:
                visit(name, ())
        if MAIN in order:
            raise EnvironmentStartError(
                f"{COMPOSE_FILE}: a sidecar depends on 'main'; harbor-exec starts 'main' last"
            )
        return order


def harbor_variables(task: Task, *, cpus: float | None, memory_mb: int | None) -> dict[str, str]:
    """The variables Harbor 0.26 sets for compose files (``ComposeInfraEnvVars``)."""
    env = task.config.environment
    variables = {
        "MAIN_IMAGE_NAME": main_image_tag(task),
        "CONTEXT_DIR": str(task.environment_dir.resolve()),
    }
    if env.docker_image:
        variables["PREBUILT_IMAGE_NAME"] = env.docker_image
    if cpus:
        variables["CPUS"] = str(int(cpus) if float(cpus).is_integer() else cpus)
    if memory_mb:
        variables["MEMORY"] = f"{memory_mb}M"
    return variables


def main_image_tag(task: Task) -> str:
    """``main``'s image when it is built (``MAIN_IMAGE_NAME``): the task image's tag."""
    return f"harbor-exec/env:{task.environment_digest()[:32]}"


def _host_environment(task: Task) -> dict[str, str]:
    """What of the host's environment Compose may interpolate: all of it for an
    operator's task, only the allowed names for a task a request named."""
    keep = {"PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT", "TMPDIR"}
    if task.env_allow is None:
        return dict(os.environ)
    return {k: v for k, v in os.environ.items() if k in keep or k in task.env_allow}


def load_project(task: Task, *, cpus: float | None, memory_mb: int | None) -> ComposeProject:
    """The task's compose model, from ``docker compose config`` (cached by its inputs)."""
    path = compose_file(task)
    if path is None:
        raise EnvironmentStartError(f"task {task.name} has no environment/{COMPOSE_FILE}")
    env = task.config.environment
    task_env = resolve_env(
        env.env, task=task.name, field="[environment].env", allowed=task.env_allow
    )
    infra = harbor_variables(task, cpus=cpus, memory_mb=memory_mb)
    variables = {**_host_environment(task), **task_env, **infra}
    base = _PREBUILT_YAML if env.docker_image else _BUILD_YAML
    override = json.dumps({"services": {MAIN: {"environment": task_env}}}) if task_env else ""
    key = hashlib.sha256(
        json.dumps(
            [task.environment_digest(), str(task.environment_dir), base, override, task_env, infra],
            sort_keys=True,
        ).encode()
    ).hexdigest()
    model = _config(key, task, path, base, override, variables)
    return _project(task, model)


def _config(
    key: str, task: Task, path: Path, base: str, override: str, variables: dict[str, str]
) -> dict[str, Any]:
    with _config_lock:
        cached = _config_cache.get(key)
    if cached is not None:
        return cached  # checked when it was first loaded in this process
    # What Compose reads on the host: the task's own files only (refused by name else),
    # checked before a model is taken from the disk cache or made.
    check_compose_inputs(task, path)
    store = cache_root() / "compose-config"
    stored = store / f"{key}.json"
    if stored.is_file():
        try:
            model: dict[str, Any] = json.loads(stored.read_text())
        except (OSError, ValueError):
            model = {}
        if model:
            with _config_lock:
                _config_cache[key] = model
            return model
    docker = shutil.which("docker")
    if docker is None:
        raise EnvironmentStartError(
            f"task {task.name} has a compose environment and the docker CLI (with Compose "
            "v2) is not on PATH: run scripts/setup.sh"
        )
    dotenv = sanitized_dotenv(task) or ""
    with tempfile.TemporaryDirectory(prefix="hx-compose-") as scratch:
        files = [Path(scratch) / "harbor-base.yaml", path]
        files[0].write_text(base)
        if override:
            files.append(Path(scratch) / "docker-compose-environment.json")
            files[-1].write_text(override)
        # The project's .env as we checked it, never the file itself.
        env_file = Path(scratch) / "project.env"
        env_file.write_text(dotenv)
        argv = [docker, "compose", "--project-name", "hx", "--env-file", str(env_file)]
        argv += ["--project-directory", str(task.environment_dir.resolve())]
        for file in files:
            argv += ["-f", str(file)]
        argv += ["config", "--format", "json"]
        try:
            ran = subprocess.run(
                argv,
                env=variables,
                cwd=task.environment_dir,
                capture_output=True,
                timeout=_CONFIG_TIMEOUT_SEC,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise EnvironmentStartError(f"docker compose config of {path} timed out") from None
    if ran.returncode != 0:
        message = ran.stderr.decode(errors="replace").strip() or ran.stdout.decode(errors="replace")
        if "is not a docker command" in message or "unknown shorthand flag" in message:
            message += " (Docker Compose v2 is needed: run scripts/setup.sh)"
        raise TaskConfigError(task.name, message, file=f"environment/{COMPOSE_FILE}")
    model = json.loads(ran.stdout)
    # Private to the server's user: an operator's task may interpolate host values.
    store.mkdir(mode=0o700, parents=True, exist_ok=True)
    store.chmod(0o700)
    scratch_file = store / f".{key}.{secrets.token_hex(4)}"
    descriptor = os.open(scratch_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(json.dumps(model))
    scratch_file.replace(stored)
    with _config_lock:
        _config_cache[key] = model
    return model


def _argv(value: object) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return ["/bin/sh", "-c", value]
    return [str(part) for part in value] if isinstance(value, list) else None


def _unescape(value: Any) -> Any:
    """``config``'s output is itself a compose file: a literal ``$`` comes back as
    ``$$``; the values a container gets have it once."""
    if isinstance(value, str):
        return value.replace("$$", "$")
    if isinstance(value, list):
        return [_unescape(item) for item in value]
    if isinstance(value, dict):
        return {key: _unescape(item) for key, item in value.items()}
    return value


def _project(task: Task, model: Mapping[str, Any]) -> ComposeProject:
    model = _unescape(model)
    environment_dir = task.environment_dir.resolve()
    raw_services = model.get("services") or {}
    if MAIN not in raw_services:
        raise TaskConfigError(
            task.name, "has no 'main' service", file=f"environment/{COMPOSE_FILE}"
        )
    declared_volumes = model.get("volumes") or {}
    for name, volume in declared_volumes.items():
        if (volume or {}).get("external"):
            raise TaskConfigError(
                task.name,
                f"volumes.{name}: external volumes are not available to a trial (each "
                "trial gets volumes of its own)",
                file=f"environment/{COMPOSE_FILE}",
            )
    services = {
        name: _service(task, name, raw or {}, environment_dir, set(raw_services))
        for name, raw in raw_services.items()
    }
    return ComposeProject(services, sorted(declared_volumes), environment_dir)


def _service(
    task: Task, name: str, raw: Mapping[str, Any], environment_dir: Path, known: set[str]
) -> ComposeService:
    where = f"services.{name}"

    def refuse(detail: str) -> TaskConfigError:
        return TaskConfigError(task.name, f"{where}.{detail}", file=f"environment/{COMPOSE_FILE}")

    for key in _REFUSED_FIELDS:
        if raw.get(key):
            if key == "cap_add" and {str(c).upper().removeprefix("CAP_") for c in raw[key]} <= set(
                DROPPED_CAPABILITIES
            ):
                continue  # capabilities every trial container may get back
            raise refuse(f"{key}: not available to a trial's containers (refused for safety)")
    network_mode = str(raw.get("network_mode") or "")
    if network_mode and network_mode != "none":
        raise refuse(
            f"network_mode={network_mode!r}: services share the trial's own network "
            "(or 'none'); never the host's or another container's"
        )
    build = raw.get("build")
    if build is not None:
        context = Path(str(build.get("context") or environment_dir)).resolve()
        if not context.is_relative_to(environment_dir):
            raise refuse(f"build.context: {context} is outside the task's environment/")
        if "dockerfile_inline" in build:
            raise refuse("build.dockerfile_inline: write the Dockerfile into environment/")
    elif not raw.get("image"):
        raise refuse("image: the service has neither an image nor a build")
    volumes: list[ServiceVolume] = []
    for index, volume in enumerate(raw.get("volumes") or []):
        kind, target = str(volume.get("type") or ""), str(volume.get("target") or "")
        read_only = bool(volume.get("read_only"))
        if kind == "volume" and volume.get("source"):
            no_copy = bool((volume.get("volume") or {}).get("nocopy"))
            volumes.append(
                ServiceVolume("volume", target, str(volume["source"]), read_only, no_copy)
            )
        elif kind == "volume":  # anonymous: a volume of the trial's too
            volumes.append(ServiceVolume("volume", target, f"anon-{name}-{index}", read_only))
        elif kind == "bind":
            source = Path(str(volume.get("source") or "")).resolve()
            if not source.is_relative_to(environment_dir) or not source.exists():
                raise refuse(
                    f"volumes[{index}]: bind source {volume.get('source')} is not a path inside "
                    "the task's environment/ (only the task's own files can be mounted)"
                )
            volumes.append(ServiceVolume("copy", target, str(source), read_only))
        elif kind == "tmpfs":
            continue  # the container's own filesystem serves
        else:
            raise refuse(f"volumes[{index}].type={kind!r}: not supported")
    check = raw.get("healthcheck")
    healthcheck = None
    if check and not check.get("disable"):
        test = check.get("test")
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        if test:
            healthcheck = Healthcheck(
                test=[str(t) for t in test],
                interval_sec=go_duration(check.get("interval"), where=f"{where}.healthcheck")
                or 30.0,
                timeout_sec=go_duration(check.get("timeout"), where=f"{where}.healthcheck") or 30.0,
                retries=int(check.get("retries") or 3),
                start_period_sec=go_duration(
                    check.get("start_period"), where=f"{where}.healthcheck"
                ),
            )
    elif check and check.get("disable"):
        healthcheck = Healthcheck(test=["NONE"])
    depends = raw.get("depends_on") or {}
    depends_on = {
        dep: str((spec or {}).get("condition") or "service_started")
        for dep, spec in depends.items()
        if dep in known  # Compose itself refuses a missing dependency that is required
    }
    memory = raw.get("mem_limit")
    limits = ((raw.get("deploy") or {}).get("resources") or {}).get("limits") or {}
    cpus = raw.get("cpus") or limits.get("cpus")
    memory_bytes = int(memory) if memory else _bytes(limits.get("memory"))
    aliases: list[str] = [name]
    for network in (raw.get("networks") or {}).values():
        aliases += [str(a) for a in ((network or {}).get("aliases") or [])]
    if raw.get("hostname"):
        aliases.append(str(raw["hostname"]))
    environment = {
        str(k): str(v) for k, v in (raw.get("environment") or {}).items() if v is not None
    }
    return ComposeService(
        name=name,
        image=str(raw["image"]) if raw.get("image") else None,
        build=build,
        environment=environment,
        entrypoint=_argv(raw.get("entrypoint")),
        command=_argv(raw.get("command")),
        user=str(raw["user"]) if raw.get("user") not in (None, "") else None,
        workdir=str(raw["working_dir"]) if raw.get("working_dir") else None,
        depends_on=depends_on,
        healthcheck=healthcheck,
        volumes=volumes,
        network_none=network_mode == "none",
        cpus=float(cpus) if cpus else None,
        memory_mb=memory_bytes // (1024 * 1024) if memory_bytes else None,
        aliases=tuple(dict.fromkeys(aliases)),
        cap_add=sorted({str(c).upper().removeprefix("CAP_") for c in raw.get("cap_add") or []}),
    )


def _bytes(value: object) -> int | None:
    if value in (None, ""):
        return None
    text = str(value).strip().lower()
    units = {"k": 1024, "m": 1024**2, "g": 1024**3, "b": 1}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgb]?)b?", text)
    if match is None:
        return None
    return int(float(match.group(1)) * units.get(match.group(2) or "b", 1))


# --------------------------------------------------------------------------- images


def _build_tag(task: Task, service: ComposeService) -> str:
    if service.name == MAIN:
        return main_image_tag(task)
    assert service.build is not None
    key = json.dumps(
        [task.environment_digest(), service.name, dict(service.build)], sort_keys=True, default=str
    )
    return f"harbor-exec/service:{hashlib.sha256(key.encode()).hexdigest()[:32]}"


def service_image(
    runtime: ContainerRuntime,
    task: Task,
    project: ComposeProject,
    name: str,
    cache: BuildCache | None = None,
) -> tuple[str, bool]:
    """Build (content-addressed, cached) or find the image ``name`` runs; ``(tag, built)``.
    With ``cache`` a build goes through the package cache as a task image's does
    (``build_route``); the service's own build args win over the proxy's."""
    service = project.services[name]
    if service.build is None:
        assert service.image is not None
        if service.image == main_image_tag(task) and name != MAIN:
            return service_image(runtime, task, project, MAIN, cache)
        for other in project.services.values():
            # An image another service builds under that name (Compose shares it).
            if other.build is not None and other.image == service.image:
                return service_image(runtime, task, project, other.name, cache)
        runtime.ensure_present(service.image)
        return service.image, False
    context = Path(str(service.build.get("context") or project.environment_dir))
    args = {str(k): str(v) for k, v in (service.build.get("args") or {}).items() if v is not None}
    dockerfile = str(service.build.get("dockerfile") or "Dockerfile")
    tag = _build_tag(task, service)
    route = cache_build_options(runtime, task, cache, context / dockerfile, tag, context, args)
    try:
        result = runtime.ensure_image(
            context_dir=context,
            tag=tag,
            timeout_sec=task.config.environment.build_timeout_sec,
            labels={
                LABEL_KIND: "task-env" if name == MAIN else "service-env",
                LABEL_TASK: task.name,
            },
            dockerfile=dockerfile,
            target=str(service.build["target"]) if service.build.get("target") else None,
            before_build=partial(ensure_base_images, runtime, task, context / dockerfile, args),
            **merge_build_args(args, route),
        )
    except SandboxBuildFailedError as exc:
        raise SandboxBuildFailedError(task.in_own_terms(str(exc))) from None
    return result.tag, result.built


def ensure_service_images(
    runtime: ContainerRuntime,
    task: Task,
    project: ComposeProject,
    cache: BuildCache | None = None,
) -> tuple[dict[str, str], int]:
    """Every service's image (prewarm builds them all): ``({service: image}, built)``;
    builds through the package cache with ``cache``."""
    images: dict[str, str] = {}
    built = 0
    for name in sorted(project.services, key=lambda n: (n != MAIN, n)):
        images[name], now = service_image(runtime, task, project, name, cache)
        built += now
    return images, built


def harbor_limits(task: Task) -> dict[str, Any]:
    """``CPUS`` and ``MEMORY`` as Harbor derives them: the task's own values."""
    env = task.config.environment
    return {"cpus": float(env.cpus) if env.cpus else None, "memory_mb": env.memory_mb}


def prepare_images(
    runtime: ContainerRuntime, task: Task, cache: BuildCache | None = None
) -> tuple[ComposeProject, dict[str, str], int]:
    """The task's model and every service's image, built when missing (through the
    package cache with ``cache``)."""
    project = load_project(task, **harbor_limits(task))
    images, built = ensure_service_images(runtime, task, project, cache)
    return project, images, built


# --------------------------------------------------------------------------- running


@dataclass
class ComposeEnvironment:
    """One trial's compose services around its main container: ``up`` before the
    main container is created (returns its spec, joined to the trial's network),
    ``down`` after it is removed. ``down`` may come from any thread (a cancel), at
    any point of ``up``: what ``up`` creates afterwards is removed at once."""

    runtime: ContainerRuntime
    task: Task
    project: ComposeProject
    trial_name: str
    labels: Mapping[str, str]
    #: Makes a sidecar's spec from the trial's own (hardening, limits, labels).
    base_spec: Callable[[str, str], ContainerSpec]
    start_timeout_sec: float
    cancelled: Callable[[], bool] = lambda: False
    network: str | None = None
    containers: dict[str, str] = field(default_factory=dict)
    volumes: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False

    def _name(self, part: str) -> str:
        stem = re.sub(r"[^a-zA-Z0-9_.-]+", "-", self.trial_name)
        return f"hx-{stem}-{part}-{secrets.token_hex(3)}"

    def _guard(self) -> None:
        if self._closed or self.cancelled():
            raise CancelledError("the trial was cancelled")

    def up(self, main: ContainerSpec, images: Mapping[str, str]) -> ContainerSpec:
        """Network, volumes and sidecars (in order, conditions awaited, then every
        sidecar running and healthy); returns ``main`` joined to them."""
        deadline = time.monotonic() + self.start_timeout_sec
        internal = main.network != "bridge"
        labels = {**self.labels, LABEL_KIND: "compose"}
        with self._lock:
            self._guard()
            self.network = self._name("net")
            self.runtime.create_network(self.network, labels, internal=internal)
        for name in self.project.volumes:
            self._volume(name, labels)
        for service in self.project.services.values():
            for volume in service.volumes:
                if volume.kind == "volume" and volume.source not in self.volumes:
                    self._volume(volume.source, labels)
        for name in self.project.start_order():
            self._await_dependencies(name, deadline)
            spec = self._sidecar_spec(name, images[name])
            with self._lock:
                self._guard()
                container_id = self.runtime.create(spec)
                self.containers[name] = container_id
            self._copy_binds(container_id, self.project.services[name])
            self.runtime.start(container_id)
        self._await_dependencies(MAIN, deadline)
        for name in list(self.containers):
            self._await(name, "service_healthy_if_any", deadline)
        self._guard()
        service = self.project.main
        return replace(
            main,
            env={**service.environment, **main.env},
            network="bridge",
            network_name=self.network,
            aliases=service.aliases,
            volumes=self._volume_mounts(service),
            workdir=service.workdir,
        )

    def place_main_binds(self, container_id: str) -> None:
        """Copy ``main``'s bind-mounted task files into it (created, not started)."""
        self._copy_binds(container_id, self.project.main)

    def _volume(self, name: str, labels: Mapping[str, str]) -> None:
        with self._lock:
            self._guard()
            volume = self._name(f"vol-{name}")
            self.runtime.create_volume(volume, labels)
            self.volumes[name] = volume

    def _volume_mounts(self, service: ComposeService) -> list[VolumeMount]:
        return [
            VolumeMount(self.volumes[v.source], v.target, v.read_only, v.no_copy)
            for v in service.volumes
            if v.kind == "volume"
        ]

    def _copy_binds(self, container_id: str, service: ComposeService) -> None:
        entries: list[ArchiveEntry] = []
        for volume in service.volumes:
            if volume.kind != "copy":
                continue
            source = Path(volume.source)
            if source.is_dir():
                entries += tree_entries(source, volume.target.rstrip("/") or "/")
            elif source.is_file():
                mode = 0o755 if source.stat().st_mode & 0o111 else 0o644
                entries.append(ArchiveEntry(volume.target, source.read_bytes(), mode))
        if entries:
            self.runtime.put_archive(container_id, build_archive(entries))

    def _sidecar_spec(self, name: str, image: str) -> ContainerSpec:
        service = self.project.services[name]
        spec = self.base_spec(image, name)
        cpus = (
            min(c for c in (spec.cpus, service.cpus) if c) if (spec.cpus or service.cpus) else None
        )
        memory = (
            min(m for m in (spec.memory_mb, service.memory_mb) if m)
            if (spec.memory_mb or service.memory_mb)
            else None
        )
        return replace(
            spec,
            env=dict(service.environment),
            cpus=cpus,
            memory_mb=memory,
            shm_mb=min(spec.shm_mb, memory) if spec.shm_mb and memory else spec.shm_mb,
            network="none" if service.network_none else "bridge",
            network_name=None if service.network_none else self.network,
            aliases=service.aliases,
            volumes=self._volume_mounts(service),
            process=ServiceProcess(
                entrypoint=service.entrypoint,
                command=service.command,
                user=service.user,
                workdir=service.workdir,
            ),
            healthcheck=service.healthcheck,
            cap_add=sorted(set(spec.cap_add) | set(service.cap_add)),
            mounts=(),
            deps_volume=None,
            agent_volume=None,
            gpus=0,
        )

    def _await_dependencies(self, name: str, deadline: float) -> None:
        for dependency, condition in self.project.services[name].depends_on.items():
            self._await(dependency, condition, deadline)

    def _await(self, name: str, condition: str, deadline: float) -> None:
        """Wait until service ``name`` meets ``condition`` (Compose's ``depends_on``
        conditions; ``service_healthy_if_any``: ``up --wait``'s running and, with a
        healthcheck, healthy)."""
        container_id = self.containers[name]
        has_check = self._has_healthcheck(name)
        while True:
            self._guard()
            status = self.runtime.container_status(container_id)
            if condition == "service_completed_successfully":
                if status.exists and not status.running and status.exit_code is not None:
                    if status.exit_code == 0:
                        return
                    raise EnvironmentStartError(
                        f"service {name!r} didn't complete successfully: exit {status.exit_code}"
                    )
            elif not status.running:
                if (
                    condition in ("service_healthy_if_any", "service_started")
                    and status.exists
                    and status.exit_code == 0
                    and not has_check
                ):
                    return  # a one-shot service that finished (it did start)
                raise EnvironmentStartError(
                    f"service {name!r} exited (code {status.exit_code}) before it was "
                    f"{'healthy' if has_check or condition == 'service_healthy' else 'up'}"
                )
            elif (
                condition == "service_started"
                or (condition == "service_healthy_if_any" and status.health is None)
                or status.health == "healthy"
            ):
                return
            elif status.health == "unhealthy":
                raise EnvironmentStartError(f"service {name!r} is unhealthy")
            elif status.health is None and condition == "service_healthy":
                raise EnvironmentStartError(
                    f"service {name!r} has no healthcheck (depends_on condition service_healthy)"
                )
            if time.monotonic() > deadline:
                raise EnvironmentStartTimeoutError(
                    f"service {name!r} was not {condition.removeprefix('service_')} within "
                    f"{self.start_timeout_sec:g}s"
                )
            time.sleep(_POLL_SEC)

    def _has_healthcheck(self, name: str) -> bool:
        check = self.project.services[name].healthcheck
        return check is not None and list(check.test) != ["NONE"]

    def down(self) -> None:
        """Remove every sidecar, then the network and the volumes (after the main
        container is gone). Idempotent; never raises for a missing object."""
        with self._lock:
            self._closed = True
            containers, self.containers = list(self.containers.values()), {}
            network, self.network = self.network, None
            volumes, self.volumes = list(self.volumes.values()), {}
        # Best effort, each object on its own: what an engine fault leaves is removed
        # by the reaper (by owner label) or at shutdown (``remove_owned``).
        removals: list[tuple[Callable[[str], None], str]] = [
            (self.runtime.remove, c) for c in containers
        ]
        if network is not None:
            removals.append((self.runtime.remove_network, network))
        removals += [(self.runtime.remove_volume, v) for v in volumes]
        failed: HarborExecError | None = None
        for remove, name in removals:
            try:
                remove(name)
            except HarborExecError as exc:
                failed = failed or exc
        if failed is not None:
            raise failed


__all__ = [
    "COMPOSE_FILE",
    "ComposeEnvironment",
    "ComposeProject",
    "ComposeService",
    "compose_file",
    "ensure_service_images",
    "harbor_limits",
    "harbor_variables",
    "is_compose_task",
    "load_project",
    "main_image_tag",
    "prepare_images",
    "service_image",
]
