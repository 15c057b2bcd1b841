"""``task.toml`` as pydantic: every Harbor 0.26 field with its default, deprecated keys
converted, errors that name the task, the file and the field; the instruction's canary
lines and ``${VAR}`` templates as Harbor reads them."""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import tomllib
import typing
import unicodedata
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from harbor_exec.errors import TaskConfigError
from harbor_exec.tasks.hosts import normalize_allowed_hosts

logger = logging.getLogger("harbor_exec.tasks")

ORG_NAME_PATTERN = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]*/[a-zA-Z0-9][a-zA-Z0-9._-]*$")
_CANARY_LINE = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
_ENV_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")


#: A timeout: seconds, more than none (Harbor would run a non-positive one and time out).
PositiveSeconds = Annotated[float, Field(gt=0)]


class NetworkMode(StrEnum):
    PUBLIC = "public"
    NO_NETWORK = "no-network"
    ALLOWLIST = "allowlist"


class TaskOS(StrEnum):
    LINUX = "linux"
    WINDOWS = "windows"


class _Model(BaseModel):
    # Harbor's models ignore unknown keys; so do we, so that we accept what it accepts.
    model_config = ConfigDict(extra="ignore")


class Author(_Model):
    name: str
    email: str | None = None


class PackageInfo(_Model):
    """``[task]``: package identity, ``org/name``."""

    name: str
    version: str | None = Field(default=None, min_length=1)
    description: str = ""
    authors: list[Author] = Field(default_factory=list)
    keywords: list[str] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _org_name(cls, value: str) -> str:
        if not ORG_NAME_PATTERN.match(value) or ".." in value:
            raise ValueError(f"must be 'org/name' (letters, digits, '.', '_', '-'); got {value!r}")
        return value


def _check_allowlist(mode: NetworkMode | None, hosts: list[str] | None) -> None:
    if hosts and mode is not NetworkMode.ALLOWLIST:
        raise ValueError("allowed_hosts is only valid when network_mode='allowlist'")
    normalize_allowed_hosts(hosts or [])  # Harbor's entry forms, or its message


class _PhaseNetwork(_Model):
    network_mode: NetworkMode | None = None
    allowed_hosts: list[str] | None = None

    @model_validator(mode="after")
    def _allowlist_only(self) -> _PhaseNetwork:
        _check_allowlist(self.network_mode, self.allowed_hosts)
        return self


class HealthcheckConfig(_Model):
    command: str
    interval_sec: float = 5.0
    timeout_sec: PositiveSeconds = 30.0
    start_period_sec: float = 0.0
    start_interval_sec: float = 5.0
    retries: int = 3


def _size_to_mb(size: str) -> int:
    text = size.strip().upper()
    units = {"G": 1024.0, "M": 1.0, "K": 1 / 1024}
    if not text or text[-1] not in units:
        raise ValueError(f"invalid size {size!r}; expected a value like '1G' or '512M'")
    return int(float(text[:-1]) * units[text[-1]])


class EnvironmentConfig(_Model):
    """``[environment]``."""

    build_timeout_sec: PositiveSeconds = 600.0
    docker_image: str | None = None
    os: TaskOS = TaskOS.LINUX
    cpus: int | float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None  # recorded, not enforced (as in Harbor's docker environment)
    gpus: int | None = None
    gpu_types: list[str] | None = None
    tpu: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    skills_dir: str | None = None
    healthcheck: HealthcheckConfig | None = None
    workdir: str | None = None
    network_mode: NetworkMode = NetworkMode.PUBLIC
    allowed_hosts: list[str] | None = None
    allow_internet: bool | None = Field(default=None, exclude=True)  # deprecated

    @field_validator("os", mode="before")
    @classmethod
    def _lower_os(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("cpus")
    @classmethod
    def _finite_cpus(cls, value: int | float | None) -> int | float | None:
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"cpus must be a finite number; got {value}")
            if value.is_integer():
                return int(value)
        return value

    @model_validator(mode="before")
    @classmethod
    def _deprecated_sizes(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in (("memory", "memory_mb"), ("storage", "storage_mb")):
            if old in data:
                value = data.pop(old)
                if isinstance(value, str):
                    try:
                        converted = _size_to_mb(value)
                    except ValueError as exc:
                        raise ValueError(f"{old} (deprecated, use {new}): {exc}") from None
                    if new in data and data[new] != converted:
                        raise ValueError(
                            f"conflicting {old!r} ({value!r} = {converted} MB) and {new!r} "
                            f"({data[new]!r})"
                        )
                    data.setdefault(new, converted)
        return data

    @model_validator(mode="after")
    def _allowlist_only(self) -> EnvironmentConfig:
        _check_allowlist(self.network_mode, self.allowed_hosts)
        return self


class CollectConfig(_Model):
    command: str
    service: str = "main"
    timeout_sec: PositiveSeconds = 60.0
    user: str | int | None = None


class VerifierConfig(_PhaseNetwork):
    """``[verifier]``."""

    timeout_sec: PositiveSeconds = 600.0
    env: dict[str, str] = Field(default_factory=dict)
    user: str | int | None = None
    environment_mode: str | None = None
    environment: EnvironmentConfig | None = None
    collect: list[CollectConfig] = Field(default_factory=list)

    @field_validator("environment_mode")
    @classmethod
    def _mode(cls, value: str | None) -> str | None:
        if value not in (None, "shared", "separate"):
            raise ValueError(f"must be 'shared' or 'separate'; got {value!r}")
        return value


class AgentConfig(_PhaseNetwork):
    """``[agent]``. There is no agent timeout unless one is set (Harbor >= 0.13)."""

    timeout_sec: PositiveSeconds | None = None
    user: str | int | None = None


class SolutionConfig(_Model):
    env: dict[str, str] = Field(default_factory=dict)


_STEP_NAME_INVALID = re.compile(r'[<>:"/\\|?*\x00-\x1f\x7f]')
_WINDOWS_DEVICE = re.compile(r"^(CON|PRN|AUX|NUL|CONIN\$|CONOUT\$|(?:COM|LPT)[1-9¹²³])$", re.I)


class StepConfig(_Model):
    """One ``[[steps]]`` table (Harbor 0.26 ``StepConfig``)."""

    name: str
    agent: AgentConfig = Field(default_factory=AgentConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    #: A float gates on the ``reward`` key; a mapping on each key it names.
    min_reward: float | dict[str, float] | None = None
    healthcheck: HealthcheckConfig | None = None
    artifacts: list[str | dict[str, Any]] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _portable_name(cls, value: str) -> str:
        # Harbor's validate_step_name: one portable directory name on every host OS.
        if (
            not value.strip()
            or value in {".", ".."}
            or value.endswith((".", " "))
            or _STEP_NAME_INVALID.search(value)
            or _WINDOWS_DEVICE.fullmatch(value.partition(".")[0].rstrip(" "))
        ):
            raise ValueError(
                f"invalid step name {value!r}: it must be a non-empty, portable directory "
                "name (no path separators, control or reserved characters, device names, "
                "trailing dots or spaces)"
            )
        if len(value.encode("utf-8")) > 255:
            raise ValueError("step names must be at most 255 UTF-8 bytes")
        return value


class TaskConfig(_Model):
    """``task.toml`` (Harbor 0.26, ``schema_version = "1.4"``)."""

    schema_version: str = "1.4"
    task: PackageInfo | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    solution: SolutionConfig = Field(default_factory=SolutionConfig)
    source: str | None = None
    #: How the trial's reward derives from its steps' (None: ``mean``, for multi-step tasks).
    multi_step_reward_strategy: Literal["mean", "final"] | None = None
    steps: list[StepConfig] | None = None
    artifacts: list[str | dict[str, Any]] = Field(default_factory=list)

    @field_validator("steps")
    @classmethod
    def _unique_step_names(cls, steps: list[StepConfig] | None) -> list[StepConfig] | None:
        seen: set[str] = set()
        for step in steps or []:
            key = unicodedata.normalize("NFC", step.name).casefold()
            if key in seen:
                raise ValueError(
                    "step names must be unique, including case and Unicode normalization "
                    f"variants: {step.name!r}"
                )
            seen.add(key)
        return steps

    @model_validator(mode="before")
    @classmethod
    def _version_rename(cls, data: Any) -> Any:
        if isinstance(data, dict) and "version" in data:
            data = dict(data)
            data.setdefault("schema_version", data.pop("version"))
        return data

    @model_validator(mode="after")
    def _allow_internet(self) -> TaskConfig:
        env = self.environment
        explicit = "network_mode" in env.model_fields_set or env.allowed_hosts is not None
        if env.allow_internet is not None and not explicit:
            env.network_mode = NetworkMode.PUBLIC if env.allow_internet else NetworkMode.NO_NETWORK
        env.allow_internet = None
        return self


_TYPE_TAGS = {"int", "float", "str", "bool", "none", "list", "dict"}
_TOP_LEVEL_KEYS = {"schema_version", "source", "multi_step_reward_strategy", "steps", "artifacts"}


def _field_path(loc: tuple[int | str, ...]) -> str:
    """``("environment", "cpus")`` -> ``[environment].cpus``."""
    # Drop the union-member tags pydantic adds ("int", "float", "function-after[...]").
    parts = [str(p) for p in loc if not (str(p) in _TYPE_TAGS or "[" in str(p))]
    if not parts:
        return "(top level)"
    if parts[0] not in TaskConfig.model_fields or parts[0] in _TOP_LEVEL_KEYS:
        return ".".join(parts)
    return f"[{parts[0]}]" + "".join(f".{p}" for p in parts[1:])


def _step_field_path(loc: tuple[int | str, ...], data: Any) -> str | None:
    """``("steps", 1, "min_reward")`` -> ``[[steps]] #2 ('check').min_reward``."""
    if len(loc) < 2 or loc[0] != "steps" or not isinstance(loc[1], int):
        return None
    steps = data.get("steps") if isinstance(data, dict) else None
    entry = steps[loc[1]] if isinstance(steps, list) and loc[1] < len(steps) else None
    name = entry.get("name") if isinstance(entry, dict) else None
    label = f"[[steps]] #{loc[1] + 1}" + (f" ({name!r})" if isinstance(name, str) else "")
    rest = _field_path(loc[2:])
    return label if rest == "(top level)" else f"{label}.{rest.replace('[', '').replace(']', '')}"


def parse_task_config(text: str, *, task: str) -> TaskConfig:
    """Parse ``task.toml`` text; a ``TaskConfigError`` names the field at fault."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TaskConfigError(task, f"not valid TOML: {exc}", file="task.toml") from None
    for path, suggestion in unknown_keys(TaskConfig, data):
        hint = f" (did you mean {suggestion}?)" if suggestion else ""
        logger.warning(
            "task %s/task.toml: unknown key %s%s; ignored, as Harbor ignores it", task, path, hint
        )
    try:
        return TaskConfig.model_validate(data)
    except ValidationError as exc:
        by_field: dict[str, list[str]] = {}
        for err in exc.errors(include_url=False):
            path = _step_field_path(err["loc"], data) or _field_path(err["loc"])
            by_field.setdefault(path, []).append(err["msg"])
        problems = "; ".join(f"{path}: {' or '.join(msgs)}" for path, msgs in by_field.items())
        raise TaskConfigError(task, problems, file="task.toml") from None


#: Keys a model converts before validation (Harbor's deprecated spellings).
_CONVERTED_KEYS: dict[type[BaseModel], frozenset[str]] = {
    TaskConfig: frozenset({"version"}),
    EnvironmentConfig: frozenset({"memory", "storage"}),
}


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (itself, optional, or a list of it), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = model_in(arg)
        if found is not None:
            return found
    return None


def unknown_keys(model: type[BaseModel], data: Any, where: str = "") -> list[tuple[str, str]]:
    """``(key path, closest known key or "")`` of every key of ``data`` (a TOML table,
    ``where`` its name) that ``model`` does not read: Harbor ignores them, so a
    misspelling would be silent."""
    if not isinstance(data, dict):
        return []
    known = set(model.model_fields) | _CONVERTED_KEYS.get(model, frozenset())
    found: list[tuple[str, str]] = []
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
            found.append((f"[{where}].{key}" if where else key, close[0] if close else ""))
            continue
        field = model.model_fields.get(key)
        sub = model_in(field.annotation) if field is not None else None
        if sub is None:
            continue
        table = f"{where}.{key}" if where else key
        if isinstance(value, list):
            for index, entry in enumerate(value):
                found += unknown_keys(sub, entry, f"{table} #{index + 1}")
        else:
            found += unknown_keys(sub, value, table)
    return found


def strip_canary(text: str) -> str:
    """Drop leading canary comment lines and the blank lines after them (as Harbor does)."""
    lines = text.split("\n")
    index = 0
    while index < len(lines) and _CANARY_LINE.match(lines[index].strip()):
        index += 1
    while index < len(lines) and lines[index].strip() == "":
        index += 1
    return "\n".join(lines[index:])


def resolve_env(
    env: dict[str, str], *, task: str, field: str, allowed: frozenset[str] | None = None
) -> dict[str, str]:
    """Resolve ``${VAR}`` / ``${VAR:-default}`` values from the host environment.

    ``allowed`` (for tasks named by a request) limits which host variables may be
    read; any other name resolves as if unset, so a request cannot read the
    server's secrets nor learn which variables exist.
    """
    resolved: dict[str, str] = {}
    for key, value in env.items():
        match = _ENV_TEMPLATE.fullmatch(value)
        if match is None:
            resolved[key] = value
            continue
        name, default = match.group(1), match.group(2)
        if name in os.environ and (allowed is None or name in allowed):
            resolved[key] = os.environ[name]
        elif default is not None:
            resolved[key] = default
        elif allowed is not None:
            raise TaskConfigError(
                task,
                f"{field}.{key}: environment variable {name!r} is not one the operator "
                "allows for request tasks (serve --task-env-allow NAME) and has no default",
                file="task.toml",
            )
        else:
            raise TaskConfigError(
                task,
                f"{field}.{key}: environment variable {name!r} is not set on the host "
                "and has no default (write ${" + name + ":-default})",
                file="task.toml",
            )
    return resolved
