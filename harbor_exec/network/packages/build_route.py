"""How an image build reaches the package cache (docs/package-cache.md, "Image builds").

One function, ``cache_build_options``, used by every build a trial or a prewarm makes:
a task's own image (``harbor_exec.trial.trial.ensure_task_image``) and a compose
task's service images (``harbor_exec.trial.compose``). It lives here so that both
import it without a cycle (``trial`` imports ``compose``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harbor_exec.network.egress.plan import EgressSettings
from harbor_exec.network.packages.build_trust import TRUST_CONTEXT_DIR, trust_conflict
from harbor_exec.network.packages.service import PackageCacheService
from harbor_exec.network.packages.session import CachedTask, wanted
from harbor_exec.sandbox.dockerfile_syntax import buildkit_only_syntax
from harbor_exec.sandbox.runtime import ContainerRuntime

__all__ = ["BuildCache", "build_cache", "cache_build_options", "merge_build_args"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildCache:
    """The live package cache an image build goes through, and the egress settings its
    gateway dials with: what a build takes beside the task, never inside a policy."""

    service: PackageCacheService
    egress: EgressSettings = field(default_factory=EgressSettings)


def build_cache(
    service: PackageCacheService | None, egress: EgressSettings | None = None
) -> BuildCache | None:
    """``BuildCache`` of ``service`` (None: builds go straight to the network)."""
    if service is None:
        return None
    return BuildCache(service, egress or EgressSettings())


def cache_build_options(
    runtime: ContainerRuntime,
    task: CachedTask,
    cache: BuildCache | None,
    dockerfile: Path,
    tag: str,
    context_dir: Path | None = None,
    build_args: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``ensure_image``'s ``build_args``/``network``/``context_files`` for building
    ``tag`` from ``dockerfile`` (in ``context_dir``, default its directory; with the
    build's own ``build_args``) through the package cache, or nothing: no cache, a task
    that opts out, an image already built, a Dockerfile only BuildKit builds, or a build
    that cannot trust the cache through build arguments (``build_trust.trust_conflict``:
    its Dockerfile or its own arguments set a CA variable)."""
    if cache is None:
        return {}
    if not wanted(cache.service, task) or runtime.image_exists(tag):
        return {}  # a warm image needs no gateway started
    context_dir = context_dir or dockerfile.parent
    text = read_dockerfile(dockerfile)
    reason: str | None = None
    if text is None:
        reason = f"is not a regular file of at most {MAX_DOCKERFILE_BYTES} bytes"
    elif (syntax := buildkit_only_syntax(text)) is not None:
        reason = f"needs BuildKit ({syntax})"
    elif (conflict := trust_conflict(text, build_args)) is not None:
        reason = f"sets a CA variable itself ({conflict})"
    elif (context_dir / TRUST_CONTEXT_DIR).exists():
        reason = f"its context has a {TRUST_CONTEXT_DIR} of its own"
    elif not dockerfile.resolve().is_relative_to(context_dir.resolve()):
        reason = "the Dockerfile is outside its build context"
    if reason is not None or text is None:
        logger.info("%s builds outside the package cache: %s %s", task.name, dockerfile, reason)
        return {}
    egress = cache.egress
    route = cache.service.build_route(runtime, overrides=egress.overrides, dns=egress.dns)
    name = dockerfile.resolve().relative_to(context_dir.resolve()).as_posix()
    return route.build_options(name, text)


#: A Dockerfile longer than this is not rewritten for the cache (read in the server).
MAX_DOCKERFILE_BYTES = 1024 * 1024


def read_dockerfile(dockerfile: Path) -> str | None:
    """The Dockerfile's text, read with a bound (a task's file may be a device or huge:
    it is read in the server's process); None when it is not a regular file or too long."""
    if not dockerfile.is_file():
        return None
    with dockerfile.open("rb") as handle:
        data = handle.read(MAX_DOCKERFILE_BYTES + 1)
    if len(data) > MAX_DOCKERFILE_BYTES:
        return None
    return data.decode("utf-8", errors="replace")


def merge_build_args(own: dict[str, str] | None, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` (``cache_build_options``'s) with a build's own ``--build-arg``s
    merged in: the build's own value of an argument wins over the cache's proxy
    argument of the same name (a service that sets ``HTTP_PROXY`` itself means it),
    the others are added. Without the cache, just the build's own."""
    if not options:
        return {"build_args": own or None}
    return {**options, "build_args": {**options["build_args"], **(own or {})}}
