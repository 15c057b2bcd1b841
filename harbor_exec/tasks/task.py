"""A loaded Harbor task (``Task``, its ``[[steps]]``) and ``load_task``.

Matches Harbor 0.26 (``harbor.models.task``): the same rules for what a task
directory must hold, checked on its snapshot (``harbor_exec.tasks.snapshots``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harbor_exec.errors import TaskError
from harbor_exec.tasks.config import StepConfig, TaskConfig, TaskOS, parse_task_config, strip_canary
from harbor_exec.tasks.snapshots import snapshot_task, tree_digest


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

    def in_own_terms(self, text: str) -> str:
        """``text`` (an engine's error) with the checked snapshot's paths named as the
        task's own: the user knows ``<task>/environment/Dockerfile``, not the cache."""
        if self.files is None:
            return text
        return text.replace(str(self.files), str(self.path))

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
