"""Which directories of a dataset path are Harbor tasks (Harbor 0.26's rules; tasks
that fail to load are reported, not skipped), and a request's task id as a directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harbor_exec.errors import DatasetError, TaskError
from harbor_exec.tasks.task import Task, load_task


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
