"""The images a task's own Dockerfile starts from, made present before it is built.

A build pulls a missing ``FROM`` image (or a ``COPY --from`` one) from wherever the
reference names, ``127.0.0.1:PORT/internal/probe`` included: the engine, on the host,
would call that address for the task. So every such image is looked up first with
``ContainerRuntime.ensure_present``, which pulls only from a registry the operator
allows (``HARBOR_EXEC_PULL_REGISTRIES``; default none) and never reports a registry's
answer; the build then finds them all locally.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from harbor_exec.errors import TaskConfigError
from harbor_exec.sandbox.dockerfile_syntax import base_images
from harbor_exec.sandbox.runtime import ContainerRuntime
from harbor_exec.tasks.task import Task
from harbor_exec.trial.compose_inputs import read_bounded

__all__ = ["ensure_base_images"]


def ensure_base_images(
    runtime: ContainerRuntime,
    task: Task,
    dockerfile: Path,
    build_args: Mapping[str, str] | None = None,
) -> None:
    """Make every image ``dockerfile`` builds from present (see the module docstring);
    run right before its build, never when the image is there
    (``ImageBuild.before_build``). ``TaskConfigError`` naming the file when it cannot be
    read or a reference cannot be resolved, ``EnvironmentStartError`` when an image is
    neither here nor allowed."""
    where = (
        str(dockerfile.relative_to(task.root))
        if dockerfile.is_relative_to(task.root)
        else dockerfile.name
    )
    data = read_bounded(dockerfile, task=task, field="Dockerfile", file=where)
    try:
        images = base_images(data.decode("utf-8", "replace"), dict(build_args or {}))
    except ValueError as exc:
        raise TaskConfigError(task.name, str(exc), file=where) from None
    for image in images:
        runtime.ensure_present(image)
