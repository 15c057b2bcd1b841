"""The Harbor task model: ``task.toml`` as pydantic, task loading and dataset discovery.

Matches Harbor 0.26 (``harbor.models.task``): every ``task.toml`` field with its
default, deprecated keys converted, canary lines stripped from the instruction,
and the same rules for which directories count as tasks. Errors name the task,
the file and the field. Symlinks that leave the task directory are refused.

A loaded task is a *snapshot*: its files are checked (no symlink leaves the task,
checked on the file actually opened) and copied, content-addressed, into the
cache directory; builds and uploads read the snapshot, never the task directory,
so a file changed or a symlink added after loading cannot reach a container.
``task_fingerprint`` tells a caller when a task directory changed and must be
loaded (and checked) again.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import stat
import tempfile
import tomllib
import unicodedata
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from harbor_exec.cache import SNAPSHOTS, cache_root
from harbor_exec.errors import DatasetError, TaskConfigError, TaskError, UnsafeTaskPathError
from harbor_exec.network.egress.policy import normalize_allowed_hosts

ORG_NAME_PATTERN = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]*/[a-zA-Z0-9][a-zA-Z0-9._-]*$")
_CANARY_LINE = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
_ENV_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")


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
    timeout_sec: float = 30.0
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

    build_timeout_sec: float = 600.0
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
    timeout_sec: float = 60.0
    user: str | int | None = None


class VerifierConfig(_PhaseNetwork):
    """``[verifier]``."""

    timeout_sec: float = 600.0
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

    timeout_sec: float | None = None
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
    try:
        return TaskConfig.model_validate(data)
    except ValidationError as exc:
        by_field: dict[str, list[str]] = {}
        for err in exc.errors(include_url=False):
            path = _step_field_path(err["loc"], data) or _field_path(err["loc"])
            by_field.setdefault(path, []).append(err["msg"])
        problems = "; ".join(f"{path}: {' or '.join(msgs)}" for path, msgs in by_field.items())
        raise TaskConfigError(task, problems, file="task.toml") from None


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


def task_fingerprint(task_dir: Path) -> str:
    """A cheap digest of every entry's metadata (no content read): changes whenever a
    file is written, added, removed, renamed or replaced by a symlink."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(task_dir):
        dirnames.sort()
        for name in sorted([*dirnames, *filenames]):
            path = os.path.join(dirpath, name)
            try:
                info = os.lstat(path)
                link = os.readlink(path) if stat.S_ISLNK(info.st_mode) else ""
            except OSError:
                continue
            digest.update(
                f"{path}\0{info.st_mode}\0{info.st_size}\0{info.st_mtime_ns}\0"
                f"{info.st_ino}\0{link}\n".encode()
            )
    return digest.hexdigest()


def _open_inside(path: Path, root: Path, *, task: str, rel: str) -> int:
    """Open ``path`` for reading; refuse it unless the file actually opened is under ``root``.

    Checking the opened file (not the name) closes the gap in which a checked path
    could be swapped for a symlink before it is read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise UnsafeTaskPathError(
            task, f"cannot be read safely ({exc.strerror})", file=rel
        ) from None
    real = Path(os.readlink(f"/proc/self/fd/{fd}"))
    if not real.is_relative_to(root):
        os.close(fd)
        raise UnsafeTaskPathError(
            task,
            f"resolves outside the task directory (to {real}); copy the file into the task",
            file=rel,
        )
    return fd


def _copy_tree_checked(source: Path, target: Path, root: Path, *, task: str) -> None:
    """Copy ``source`` (inside ``root``) to ``target``, following symlinks that stay
    inside ``root`` and refusing any that leave it. Only files and directories."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in sorted(os.scandir(source), key=lambda e: e.name):
        path = Path(entry.path)
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(root):
            raise UnsafeTaskPathError(
                task,
                f"symlink points outside the task directory (to {os.readlink(path)}); "
                "copy the file into the task instead",
                file=rel,
            )
        if real.is_dir():
            if entry.is_symlink() and (real == root or path.is_relative_to(real)):
                raise UnsafeTaskPathError(task, "symlink loops back into its parent", file=rel)
            _copy_tree_checked(real, target / entry.name, root, task=task)
        elif real.is_file():
            fd = _open_inside(real, root, task=task, rel=rel)
            with os.fdopen(fd, "rb") as handle, open(target / entry.name, "wb") as out:
                shutil.copyfileobj(handle, out, 1 << 20)
                mode = os.fstat(handle.fileno()).st_mode
            (target / entry.name).chmod(0o755 if mode & 0o111 else 0o644)


def snapshot_task(task_dir: Path, *, task: str, store: Path | None = None) -> Path:
    """Check and copy ``task_dir`` into ``store`` (default: ``<cache>/snapshots``),
    named by its content hash; returns the snapshot's directory."""
    store = store or cache_root() / SNAPSHOTS
    store.mkdir(parents=True, exist_ok=True)
    root = task_dir.resolve()
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=store))
    try:
        _copy_tree_checked(root, staging / "task", root, task=task)
        final = store / tree_digest(staging / "task")
        if not final.exists():
            try:
                (staging / "task").rename(final)
            except OSError:  # another process made the same snapshot meanwhile
                if not final.is_dir():
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


@dataclass(frozen=True)
class TaskStep:
    """One step of a multi-step task: its ``[[steps]]`` table and instruction."""

    config: StepConfig
    instruction: str

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(frozen=True)
class Task:
    """A loaded, validated Harbor task.

    A multi-step task has ``steps``; ``for_step`` gives the view of one step (its
    instruction, solution, tests, timeouts, users and artifacts), which the trial
    runs as it runs a single-step task (``harbor_exec.trial.steps``).

    ``path`` is where it was loaded from (what results report); ``files`` is its
    checked snapshot, which every build and upload reads.
    """

    path: Path
    name: str
    config: TaskConfig
    instruction: str
    # (environment digest, task checksum, tests digest), hashed once at load.
    digests: tuple[str, str, str] = ("", "", "")
    files: Path | None = None
    # Host variables its ${VAR} templates may read (None: any; request-named tasks: a few).
    env_allow: frozenset[str] | None = None
    # Harbor's ``task_id`` when it is not ``{"path": ...}``: a git task's
    # ``{git_url, git_commit_id, path}``.
    origin: dict[str, str] | None = None
    #: ``[[steps]]`` in order (empty: a single-step task).
    steps: tuple[TaskStep, ...] = ()
    #: The step this view runs (``for_step``); None: the task itself.
    step: TaskStep | None = None

    @property
    def root(self) -> Path:
        return self.files or self.path

    @property
    def is_multi_step(self) -> bool:
        return bool(self.steps)

    def for_step(self, step: TaskStep) -> Task:
        """The view of ``step``: what the trial's agent and verifier read for it."""
        return replace(self, step=step, instruction=step.instruction)

    def step_dir(self, name: str) -> Path:
        return self.root / "steps" / name

    @property
    def step_tests_dir(self) -> Path | None:
        """The step's own ``tests/``, placed over the task's ``tests/`` (as Harbor does)."""
        return None if self.step is None else self.step_dir(self.step.name) / "tests"

    @property
    def step_workdir(self) -> Path | None:
        """``steps/<name>/workdir/``: copied into the container's workdir before the step."""
        return None if self.step is None else self.step_dir(self.step.name) / "workdir"

    @property
    def agent_timeout_sec(self) -> float | None:
        """The step's ``[steps.agent].timeout_sec``, else the task's."""
        step_timeout = self.step.config.agent.timeout_sec if self.step is not None else None
        return self.config.agent.timeout_sec if step_timeout is None else step_timeout

    @property
    def verifier_timeout_sec(self) -> float:
        """The step's ``[steps.verifier].timeout_sec`` (Harbor 0.26 reads the step's,
        whose default is 600 s, never the task's), else the task's."""
        if self.step is not None:
            return self.step.config.verifier.timeout_sec
        return self.config.verifier.timeout_sec

    @property
    def agent_user(self) -> str | int | None:
        step_user = self.step.config.agent.user if self.step is not None else None
        return self.config.agent.user if step_user is None else step_user

    @property
    def verifier_user(self) -> str | int | None:
        step_user = self.step.config.verifier.user if self.step is not None else None
        return self.config.verifier.user if step_user is None else step_user

    @property
    def verifier_env(self) -> dict[str, str]:
        """``[verifier].env`` with the step's ``[steps.verifier].env`` over it."""
        step_env = self.step.config.verifier.env if self.step is not None else {}
        return {**self.config.verifier.env, **step_env}

    @property
    def artifacts(self) -> list[str | dict[str, Any]]:
        """The task's declared artifacts, then the step's."""
        step_artifacts = self.step.config.artifacts if self.step is not None else []
        return [*self.config.artifacts, *step_artifacts]

    @property
    def environment_dir(self) -> Path:
        return self.root / "environment"

    @property
    def dockerfile(self) -> Path | None:
        candidate = self.environment_dir / "Dockerfile"
        return candidate if candidate.is_file() else None

    @property
    def tests_dir(self) -> Path:
        return self.root / "tests"

    @property
    def solution_dir(self) -> Path:
        """A step's ``steps/<name>/solution/`` when it has one, else ``solution/``."""
        if self.step is not None:
            own = self.step_dir(self.step.name) / "solution"
            if own.is_dir():
                return own
        return self.root / "solution"

    @property
    def verifier_dockerfile(self) -> Path | None:
        """``tests/Dockerfile``: a separate verifier's image, built with ``tests/`` as context."""
        candidate = self.tests_dir / "Dockerfile"
        return candidate if candidate.is_file() else None

    def tests_digest(self) -> str:
        return self.digests[2]

    @property
    def test_script(self) -> Path:
        if self.step_tests_dir is not None and (self.step_tests_dir / "test.sh").is_file():
            return self.step_tests_dir / "test.sh"
        return self.tests_dir / "test.sh"

    @property
    def has_tests(self) -> bool:
        if self.steps and self.step is None:
            return all(self.for_step(step).has_tests for step in self.steps)
        return self.test_script.is_file()

    @property
    def solve_script(self) -> Path:
        return self.solution_dir / "solve.sh"

    def environment_digest(self) -> str:
        """Content hash of ``environment/`` plus ``docker_image``: the image cache key."""
        return self.digests[0]

    def checksum(self) -> str:
        """Content hash of the whole task directory (Harbor's ``task_checksum``)."""
        return self.digests[1]


def tree_digest(root: Path, *, extra: str = "") -> str:
    """sha256 over every file under ``root``: relative path, executable bit and content."""
    digest = hashlib.sha256(f"{extra}\n".encode())
    if root.is_dir():
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = file.relative_to(root).as_posix()
            executable = os.access(file, os.X_OK)
            digest.update(f"{rel}\0{int(executable)}\0{file.stat().st_size}\0".encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def load_task(
    path: Path | str,
    *,
    require_tests: bool = True,
    env_allow: frozenset[str] | None = None,
    snapshots: Path | None = None,
) -> Task:
    """Load the task at ``path``; raise a ``TaskError`` naming the file and field at fault.

    ``require_tests=False`` accepts a task without ``tests/test.sh`` (Harbor's
    ``disable_verification``), for rollouts graded by a bundled grader instead.
    The task is checked and snapshotted (see the module doc) into ``snapshots``.
    """
    source_dir = Path(path)
    label = source_dir.name or str(source_dir)
    if not source_dir.is_dir():
        raise TaskError(label, f"no such task directory: {source_dir}")
    if not (source_dir / "task.toml").is_file():
        raise TaskError(label, "missing (every Harbor task has one)", file="task.toml")
    task_dir = snapshot_task(source_dir, task=label, store=snapshots)
    config_path = task_dir / "task.toml"
    config = parse_task_config(config_path.read_text(encoding="utf-8"), task=label)
    name = config.task.name if config.task is not None else source_dir.resolve().name
    if config.environment.os is not TaskOS.LINUX:
        raise TaskError(name, "[environment].os: only 'linux' tasks can run here", file="task.toml")
    env_dir = task_dir / "environment"
    if not config.environment.docker_image and not env_dir.is_dir():
        raise TaskError(
            name, "missing environment/ directory and no [environment].docker_image is set"
        )
    if (
        not config.environment.docker_image
        and env_dir.is_dir()
        and not (env_dir / "Dockerfile").is_file()
        and not (env_dir / "docker-compose.yaml").is_file()
    ):
        raise TaskError(
            name,
            "environment/ has neither a Dockerfile nor a docker-compose.yaml",
            file="environment/Dockerfile",
        )
    steps = _load_steps(task_dir, config, name=name, require_tests=require_tests)
    instruction_path = task_dir / "instruction.md"
    if steps:
        instruction = ""  # each step has its own (Harbor: Task.instruction is "")
    elif not instruction_path.is_file():
        raise TaskError(name, "missing (the agent's instruction)", file="instruction.md")
    elif require_tests and not (task_dir / "tests" / "test.sh").is_file():
        raise TaskError(name, "missing (the verifier's entry point)", file="tests/test.sh")
    else:
        instruction = strip_canary(instruction_path.read_text(encoding="utf-8"))
    digests = (
        tree_digest(env_dir, extra=f"docker_image={config.environment.docker_image}"),
        task_dir.name,  # the snapshot is named by tree_digest(task_dir)
        tree_digest(task_dir / "tests"),
    )
    return Task(
        source_dir.resolve(), name, config, instruction, digests, task_dir, env_allow, steps=steps
    )


def _load_steps(
    task_dir: Path, config: TaskConfig, *, name: str, require_tests: bool
) -> tuple[TaskStep, ...]:
    """Each ``[[steps]]`` entry with its instruction, checked as Harbor 0.26 checks them:
    ``steps/<name>/instruction.md``, and a test script (the step's ``tests/test.sh`` or
    the task's shared ``tests/test.sh``) unless verification is off."""
    steps: list[TaskStep] = []
    for index, step in enumerate(config.steps or [], start=1):
        where = f"[[steps]] #{index} ({step.name!r}) in task.toml"
        step_dir = task_dir / "steps" / step.name
        rel = f"steps/{step.name}"
        if not step_dir.is_dir():
            raise TaskError(name, f"missing: the directory of {where}", file=rel)
        instruction = step_dir / "instruction.md"
        if not instruction.is_file():
            raise TaskError(
                name, f"missing: the instruction of {where}", file=f"{rel}/instruction.md"
            )
        if (
            require_tests
            and not (step_dir / "tests" / "test.sh").is_file()
            and not (task_dir / "tests" / "test.sh").is_file()
        ):
            raise TaskError(
                name,
                f"missing: {where} has no test script ({rel}/tests/test.sh, or a shared "
                "tests/test.sh)",
                file=f"{rel}/tests/test.sh",
            )
        text = strip_canary(instruction.read_text(encoding="utf-8"))
        steps.append(TaskStep(step, text))
    return tuple(steps)


@dataclass(frozen=True)
class Discovery:
    """What a dataset path holds: its valid tasks, and task dirs that failed to load."""

    tasks: list[Task]
    broken: list[TaskError]


def discover_tasks(path: Path | str) -> Discovery:
    """A valid task dir is one task; otherwise its valid subdirectories, sorted by name.

    Unlike Harbor, subdirectories that have a ``task.toml`` but fail to load are
    reported in ``broken`` instead of silently ignored.
    """
    root = Path(path)
    if not root.is_dir():
        raise DatasetError(f"{root}: not a directory")
    try:
        return Discovery(tasks=[load_task(root)], broken=[])
    except TaskError as exc:
        if (root / "task.toml").is_file():
            return Discovery(tasks=[], broken=[exc])
    tasks: list[Task] = []
    broken: list[TaskError] = []
    for child in sorted(root.iterdir(), key=lambda p: p.name):
        if not child.is_dir() or not (child / "task.toml").is_file():
            continue
        try:
            tasks.append(load_task(child))
        except TaskError as exc:
            broken.append(exc)
    if not tasks and not broken:
        raise DatasetError(f"{root}: holds no Harbor task (no subdirectory has a task.toml)")
    return Discovery(tasks=tasks, broken=broken)


def task_dir_for_id(tasks_dir: Path, task_id: str) -> Path:
    """``tasks_dir/<task_id>``, refusing ids that are empty, absolute or escape ``tasks_dir``."""
    if not task_id or "\0" in task_id or task_id.startswith(("/", "\\")):
        raise DatasetError(f"harbor_task_id {task_id!r} is not a task directory name")
    candidate = (tasks_dir / task_id).resolve()
    if not candidate.is_relative_to(tasks_dir.resolve()) or candidate == tasks_dir.resolve():
        raise DatasetError(f"harbor_task_id {task_id!r} escapes the tasks directory")
    return candidate
