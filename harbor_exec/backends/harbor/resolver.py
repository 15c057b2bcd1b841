"""Which task a rollout runs: the only place that knows template vs dataset mode.

* template mode: ``tasks_dir`` is one task; the request's prompt becomes its
  instruction;
* dataset mode: ``metadata.harbor_task_id`` names ``tasks_dir/<id>``, or
  ``metadata.harbor_task`` a task path under a served root (``tasks_dir`` or an
  operator's ``task_roots``, never a directory we write into), or with
  ``metadata.git_url`` (and ``git_commit_id``) the path ``harbor_task`` inside that
  repository at that commit, from URL prefixes the operator allows
  (``harbor_exec.sources.git``), or a Harbor package ``org/name[@ref]`` through the
  operator's package source (``harbor_exec.sources.packages``; digest checked). Every
  refusal of a ``harbor_task`` is the same message, whether or not the path exists,
  whatever the URL, and for a package when no package source is configured.

Tasks are loaded (checked and snapshotted) once and again whenever their
directory changes; ``${VAR}`` templates in a request-named task read only the
operator's ``env_allow`` variables.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from harbor_exec.errors import DatasetError, HarborExecError, TaskError
from harbor_exec.protocol import ExecutionRequest
from harbor_exec.sources.git import GitTaskError, GitTaskRefused, GitTaskSource
from harbor_exec.sources.packages import PackageError, PackageSource, fetch_task, is_package_ref
from harbor_exec.tasks.discovery import discover_tasks, task_dir_for_id
from harbor_exec.tasks.snapshots import task_fingerprint
from harbor_exec.tasks.task import Task, load_task

TaskMode = Literal["template", "dataset"]


class RolloutRejected(HarborExecError, ValueError):
    """A request that cannot run; becomes a ``validation_error`` naming the field."""


@dataclass(frozen=True)
class ResolvedTask:
    task_id: str
    task: Task


class TaskResolver:
    """Request -> task snapshot (see the module doc)."""

    def __init__(
        self,
        tasks_dir: Path,
        *,
        task_mode: TaskMode = "template",
        task_roots: Sequence[Path] = (),
        written_roots: Sequence[Path] = (),
        env_allow: Sequence[str] = (),
        require_tests: bool = True,
        git: GitTaskSource | None = None,
        packages: PackageSource | None = None,
    ) -> None:
        if task_mode not in ("template", "dataset"):
            raise ValueError(f"task_mode must be 'template' or 'dataset'; got {task_mode!r}")
        self.tasks_dir = tasks_dir.resolve()
        self.task_mode: TaskMode = task_mode
        _check_mode_fits(self.tasks_dir, task_mode)
        self.task_roots = [self.tasks_dir, *(Path(r).resolve() for r in task_roots)]
        self.written_roots = [Path(r).resolve() for r in written_roots]
        self.env_allow = frozenset(env_allow)
        self.require_tests = require_tests
        self.git = git or GitTaskSource()
        self.packages = packages
        self._loaded: dict[tuple[Path, bool], tuple[str, Task]] = {}
        self._lock = threading.Lock()

    def resolve(self, request: ExecutionRequest) -> ResolvedTask:
        """The task ``request`` names; ``RolloutRejected`` when it names none we serve."""
        try:
            return self._resolve(request)
        except TaskError as exc:
            raise RolloutRejected(str(exc)) from None

    def _resolve(self, request: ExecutionRequest) -> ResolvedTask:
        metadata = request.metadata or {}
        if self.task_mode == "template":
            task = self.load(self.tasks_dir)
            instruction = _instruction_from_prompt(request.prompt)
            return ResolvedTask(self.tasks_dir.name, replace(task, instruction=instruction))
        ref = metadata.get("harbor_task")
        if ref is not None and metadata.get("git_url") is not None:
            return self._git_task(ref, metadata)
        if is_package_ref(ref):
            return self._package_task(str(ref))
        if ref is not None:
            if not isinstance(ref, str) or not ref.startswith((".", "/", "~")):
                raise RolloutRejected(
                    f"metadata.harbor_task {ref!r}: a local task path (starting with '/', "
                    "'.' or '~'), a Harbor package org/name[@ref], or a path with "
                    "metadata.git_url"
                )
            return ResolvedTask(ref, self.load(self._served_path(ref), from_request=True))
        task_id = metadata.get("harbor_task_id")
        if task_id is None:
            raise RolloutRejected(
                "dataset mode needs metadata.harbor_task_id (a task directory under the "
                "tasks dir) or metadata.harbor_task (a local task path)"
            )
        if not isinstance(task_id, str):
            raise RolloutRejected(f"metadata.harbor_task_id must be a string; got {task_id!r}")
        try:
            path = task_dir_for_id(self.tasks_dir, task_id)
        except DatasetError as exc:
            raise RolloutRejected(f"metadata.{exc}") from None
        if not path.is_dir():
            raise RolloutRejected(
                f"metadata.harbor_task_id {task_id!r}: no such task in {self.tasks_dir}"
            )
        return ResolvedTask(task_id, self.load(path))

    def _git_task(self, ref: object, metadata: dict[str, Any]) -> ResolvedTask:
        url, commit = metadata.get("git_url"), metadata.get("git_commit_id")
        if not isinstance(ref, str):
            raise RolloutRejected(f"metadata.harbor_task must be a string; got {ref!r}")
        if not isinstance(url, str) or not (commit is None or isinstance(commit, str)):
            raise RolloutRejected("metadata.git_url and metadata.git_commit_id must be strings")
        try:
            path, pinned = self.git.checkout(url, commit, ref)
        except GitTaskRefused:
            raise _not_served(ref) from None
        except GitTaskError as exc:
            raise RolloutRejected(f"metadata.harbor_task {ref!r}: {exc}") from None
        task = self.load(path, from_request=True)
        origin = {"git_url": url, "git_commit_id": pinned, "path": ref}
        return ResolvedTask(f"{url}@{pinned[:12]}:{ref}", replace(task, origin=origin))

    def _package_task(self, ref: str) -> ResolvedTask:
        if self.packages is None:
            raise _not_served(ref)
        try:
            fetched = fetch_task(self.packages, ref)
        except PackageError as exc:
            raise RolloutRejected(f"metadata.harbor_task {ref!r}: {exc}") from None
        task = self.load(fetched.directory, from_request=True)
        task_id = f"{fetched.ref.full_name}@{fetched.digest}"
        return ResolvedTask(task_id, replace(task, origin=fetched.task_id))

    def load(self, path: Path, *, from_request: bool = False) -> Task:
        """The task at ``path``, loaded again (checked and snapshotted) whenever its
        directory changed since the last load."""
        fingerprint = task_fingerprint(path)
        key = (path, from_request)
        with self._lock:
            cached = self._loaded.get(key)
        if cached is not None and cached[0] == fingerprint:
            return cached[1]
        task = load_task(
            path,
            require_tests=self.require_tests,
            env_allow=self.env_allow if from_request else None,
        )
        with self._lock:
            self._loaded[key] = (fingerprint, task)
        return task

    def _served_path(self, ref: str) -> Path:
        refusal = _not_served(ref)
        if "\0" in ref:
            raise refusal
        path = Path(ref).expanduser()
        path = (self.tasks_dir / path if not path.is_absolute() else path).resolve()
        if any(path.is_relative_to(root) for root in self.written_roots):
            raise refusal
        if not any(path.is_relative_to(root) for root in self.task_roots) or not path.is_dir():
            raise refusal
        return path

    def candidates(self, task_ids: list[str] | None) -> list[tuple[str, Path]]:
        """``(task id, directory)`` of the tasks to prewarm (None: every task served)."""
        if self.task_mode == "template":
            return [(self.tasks_dir.name, self.tasks_dir)]
        if task_ids is None:
            found = discover_tasks(self.tasks_dir)
            candidates = [(t.path.name, t.path) for t in found.tasks]
            candidates += [(e.task, self.tasks_dir / e.task) for e in found.broken]
            return candidates
        return [(task_id, task_dir_for_id(self.tasks_dir, task_id)) for task_id in task_ids]


def _check_mode_fits(tasks_dir: Path, task_mode: TaskMode) -> None:
    """Refuse, at start, a tasks dir the mode cannot serve (every rollout would fail):
    a dataset served as one template task, or one task served as a dataset."""
    is_task = (tasks_dir / "task.toml").is_file()
    if task_mode == "dataset" and is_task:
        raise ValueError(
            f"{tasks_dir} is one task (it has task.toml), not a dataset of tasks: serve it "
            "with --task-mode template (task_mode='template'), or give its parent directory"
        )
    if task_mode == "template" and not is_task and tasks_dir.is_dir():
        tasks = sorted(p.name for p in tasks_dir.iterdir() if (p / "task.toml").is_file())
        if tasks:
            shown = ", ".join(tasks[:3]) + (", ..." if len(tasks) > 3 else "")
            raise ValueError(
                f"{tasks_dir} is a dataset ({len(tasks)} task(s): {shown}), not one task: "
                "serve it with --task-mode dataset (task_mode='dataset'), where "
                "metadata.harbor_task_id picks each rollout's task"
            )


def _not_served(ref: object) -> RolloutRejected:
    """The one refusal of a ``harbor_task`` (a path, a git task or a package) this
    server does not serve."""
    return RolloutRejected(f"harbor_task {ref!r} is not under a served task root")


def _instruction_from_prompt(prompt: Sequence[dict[str, Any]]) -> str:
    texts = [m.get("content") for m in prompt if m.get("role") == "user"]
    if texts and all(isinstance(t, str) for t in texts):
        return "\n\n".join(str(t) for t in texts)
    return json.dumps(list(prompt), indent=2)


__all__ = ["ResolvedTask", "RolloutRejected", "TaskMode", "TaskResolver"]
