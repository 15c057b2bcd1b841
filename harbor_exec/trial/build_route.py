"""How an image build reaches the package cache (docs/package-cache.md, "Image builds").

One function, ``cache_build_options``, used by every build a trial or a prewarm makes:
a task's own image (``harbor_exec.trial.trial.ensure_task_image``) and a compose
task's service images (``harbor_exec.trial.compose``). It lives here so that both
import it without a cycle (``trial`` imports ``compose``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harbor_exec.sandbox.dockerfile_syntax import buildkit_only_syntax
from harbor_exec.sandbox.runtime import ContainerRuntime
from harbor_exec.trial.task import Task

if TYPE_CHECKING:
    from harbor_exec.trial.trial import SandboxPolicy

__all__ = ["cache_build_options", "merge_build_args"]

logger = logging.getLogger(__name__)


def cache_build_options(
    runtime: ContainerRuntime,
    task: Task,
    policy: SandboxPolicy | None,
    dockerfile: Path,
    tag: str,
) -> dict[str, Any]:
    """``ensure_image``'s ``build_args``/``network`` for building ``tag`` from
    ``dockerfile`` through the package cache, or nothing: no cache, a task that opts
    out, an image already built, or a Dockerfile only BuildKit builds."""
    if policy is None or policy.package_cache is None:
        return {}
    from harbor_exec.trial.package_cache import wanted

    if not wanted(policy.package_cache, task) or runtime.image_exists(tag):
        return {}  # a warm image needs no gateway started
    needs_buildkit = buildkit_only_syntax(dockerfile.read_text(encoding="utf-8", errors="replace"))
    if needs_buildkit is not None:
        logger.info(
            "%s builds outside the package cache: %s needs BuildKit (%s)",
            task.name,
            dockerfile,
            needs_buildkit,
        )
        return {}
    egress = policy.egress
    route = policy.package_cache.build_route(runtime, overrides=egress.overrides, dns=egress.dns)
    return route.build_options()


def merge_build_args(own: dict[str, str] | None, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` (``cache_build_options``'s) with a build's own ``--build-arg``s
    merged in: the build's own value of an argument wins over the cache's proxy
    argument of the same name (a service that sets ``HTTP_PROXY`` itself means it),
    the others are added. Without the cache, just the build's own."""
    if not options:
        return {"build_args": own or None}
    return {**options, "build_args": {**options["build_args"], **(own or {})}}
