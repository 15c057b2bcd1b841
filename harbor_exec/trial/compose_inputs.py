"""A compose task's own files, checked before Docker Compose reads them on the host.

``docker compose config`` runs on the host as the server's user, and it does more than
parse: it reads every ``env_file`` (and merges its lines into the container's
environment), follows ``extends`` and ``include`` (remote ones too, when the project's
``.env`` turns Compose's experimental switches on), and reads a build's Dockerfile. A
task from a public dataset is as untrusted as an agent, so what Compose may read is
the task's ``environment/`` and nothing else:

* the compose file and every file it names are regular files inside ``environment/``,
  each read with a size bound (``/dev/zero`` as a Dockerfile is refused unread);
* ``include`` is refused, as is a remote build context, a path spelled with a variable
  (it could name any host file once interpolated), and ``secrets``/``configs`` taken
  from the host's environment or from files outside ``environment/``;
* the project's ``.env`` is read by us (bounded) and handed to Compose as a copy without
  Compose's and Docker's own switches (``COMPOSE_*``, ``DOCKER_*``): a task configures
  nothing on the host.

Each refusal is a ``TaskConfigError`` naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import yaml

from harbor_exec.errors import TaskConfigError
from harbor_exec.tasks.task import Task

__all__ = ["MAX_INPUT_BYTES", "check_compose_inputs", "read_bounded", "sanitized_dotenv"]

#: The most of any one compose input (the compose file, an env file, a Dockerfile) read.
MAX_INPUT_BYTES: Final = 1 << 20
#: Names a project's ``.env`` may not set: they configure Compose or the Docker CLI.
_HOST_SWITCHES: Final = re.compile(r"^(COMPOSE_|DOCKER_|BUILDKIT_)", re.IGNORECASE)
_REMOTE: Final = re.compile(r"^([a-z][a-z0-9+.-]*://|git@|github\.com/)", re.IGNORECASE)
_COMPOSE: Final = "environment/docker-compose.yaml"
_DOTENV_LINE: Final = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_.-]*)\s*[=:]")


def read_bounded(path: Path, *, task: Task, field: str, file: str = _COMPOSE) -> bytes:
    """A regular file's bytes, at most ``MAX_INPUT_BYTES`` (refused by ``field`` of
    ``file`` past that, and when it is not a regular file: a device, a pipe, a directory)."""
    if not path.is_file():
        raise _refuse(task, f"{field}: {path.name} is not a regular file", file=file)
    with path.open("rb") as handle:
        data = handle.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        raise _refuse(task, f"{field}: {path.name} is over {MAX_INPUT_BYTES} bytes", file=file)
    return data


def check_compose_inputs(task: Task, compose_file: Path) -> None:
    """Refuse what would make Compose read or fetch anything outside the task's
    ``environment/`` (see the module docstring)."""
    environment = task.environment_dir.resolve()
    try:
        model = yaml.safe_load(read_bounded(compose_file, task=task, field="compose file"))
    except yaml.YAMLError as exc:
        raise _refuse(task, f"is not valid YAML: {exc}") from None
    if not isinstance(model, Mapping):
        raise _refuse(task, "is not a mapping of compose keys")
    if model.get("include"):
        raise _refuse(task, "include: not available to a task (it makes the host load other files)")
    for kind in ("secrets", "configs"):
        for name, entry in (model.get(kind) or {}).items():
            where = f"{kind}.{name}"
            if isinstance(entry, Mapping):
                if entry.get("environment") is not None:
                    raise _refuse(
                        task, f"{where}.environment: the host's environment is not a task's"
                    )
                if entry.get("file") is not None:
                    _inside(task, environment, environment, entry["file"], f"{where}.file")
    for name, service in (model.get("services") or {}).items():
        if isinstance(service, Mapping):
            _check_service(task, environment, str(name), service)


def _check_service(task: Task, environment: Path, name: str, service: Mapping[str, Any]) -> None:
    where = f"services.{name}"
    for field in ("env_file", "label_file"):
        for index, entry in enumerate(_as_list(service.get(field))):
            path = entry.get("path") if isinstance(entry, Mapping) else entry
            located = _inside(task, environment, environment, path, f"{where}.{field}[{index}]")
            read_bounded(located, task=task, field=f"{where}.{field}[{index}]")
    extends = service.get("extends")
    if isinstance(extends, Mapping) and extends.get("file") is not None:
        located = _inside(task, environment, environment, extends["file"], f"{where}.extends.file")
        read_bounded(located, task=task, field=f"{where}.extends.file")
    build = service.get("build")
    if build is None:
        return
    if not isinstance(build, Mapping):
        build = {"context": build}
    context_text = build.get("context", ".")
    if isinstance(context_text, str) and _REMOTE.match(context_text):
        raise _refuse(task, f"{where}.build.context: a remote context is not available to a task")
    context = _inside(task, environment, environment, context_text, f"{where}.build.context")
    for extra, value in (build.get("additional_contexts") or {}).items():
        if isinstance(value, str) and not value.startswith(("service:", "docker-image://")):
            _inside(task, environment, context, value, f"{where}.build.additional_contexts.{extra}")
    if build.get("ssh") or build.get("secrets"):
        raise _refuse(task, f"{where}.build: ssh and secrets come from the host, not a task")
    if build.get("dockerfile") is not None:
        field = f"{where}.build.dockerfile"
        dockerfile = _inside(task, environment, context, build["dockerfile"], field)
        read_bounded(dockerfile, task=task, field=field)


def _inside(task: Task, environment: Path, base: Path, value: object, field: str) -> Path:
    """``value`` (relative to ``base``) as a path inside ``environment``; refused when it
    leaves it, or when it is spelled with a variable (it could name any host file once
    Compose interpolates it)."""
    text = str(value)
    if "$" in text:
        raise _refuse(task, f"{field}: {text!r} is spelled with a variable; name the file")
    located = (base / text).resolve()
    if not located.is_relative_to(environment):
        raise _refuse(task, f"{field}: {text} is outside the task's environment/")
    return located


def sanitized_dotenv(task: Task) -> str | None:
    """The project's ``environment/.env`` without Compose's and Docker's switches (None
    when the task has none); a switch is refused by name."""
    path = task.environment_dir / ".env"
    if not path.exists() and not path.is_symlink():
        return None
    _inside(task, task.environment_dir.resolve(), task.environment_dir, ".env", "environment/.env")
    text = read_bounded(path, task=task, field="environment/.env").decode("utf-8", "replace")
    for line in text.splitlines():
        matched = _DOTENV_LINE.match(line)
        if matched and _HOST_SWITCHES.match(matched.group(1)):
            raise _refuse(
                task,
                f"environment/.env sets {matched.group(1)}: Compose's and Docker's own "
                "settings are the operator's, not a task's",
            )
    return text


def _as_list(value: object) -> Iterator[object]:
    if value is None:
        return iter(())
    if isinstance(value, str | Mapping):
        return iter((value,))
    if isinstance(value, list):
        return iter(value)
    return iter((value,))


def _refuse(task: Task, detail: str, *, file: str = _COMPOSE) -> TaskConfigError:
    return TaskConfigError(task.name, detail, file=file)
