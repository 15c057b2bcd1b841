"""A trial through the server's package cache (docs/package-cache.md).

When the operator turns the cache on (``SandboxPolicy.package_cache``) and the task
does not opt out, every container of the trial that has any network reaches it
through the trial's egress proxy (``harbor_exec.network.egress.plan``) whose upstream is the
cache: a ``public`` container keeps its bridge network (a program that ignores the
proxy variables still reaches the internet, uncached) and gets the proxy socket, the
proxy variables and the forwarder per phase as an allowlisted one does; both also get
the public trust directory and the trust variables. ``package-cache.json`` in the
trial dir records what the trial got from where.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Protocol

from harbor_exec.network.egress.proxy import Connector
from harbor_exec.network.packages.cache import connector_resolver
from harbor_exec.network.packages.serve import CacheUpstream
from harbor_exec.network.packages.service import PackageCacheService, TrialCache
from harbor_exec.network.packages.trust import (
    CA_PEM,
    TRUST_MOUNT,
    task_opts_out,
    trust_env,
)
from harbor_exec.sandbox.runtime import Mount

__all__ = ["RESULT_FILE", "CachedTask", "TrialPackageCache", "wanted"]

logger = logging.getLogger(__name__)

RESULT_FILE: Final = "package-cache.json"


class _EnvironmentEnv(Protocol):
    @property
    def env(self) -> Mapping[str, str]: ...


class _TaskOptions(Protocol):
    @property
    def metadata(self) -> Mapping[str, Any]: ...

    @property
    def environment(self) -> _EnvironmentEnv: ...


class CachedTask(Protocol):
    """What the cache reads of a task (``harbor_exec``'s ``Task``): its name, its
    environment's digest and whether it opts out. The network sits below the task
    format, so it names only what it reads."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> _TaskOptions: ...

    def environment_digest(self) -> str: ...


def wanted(service: PackageCacheService | None, task: CachedTask) -> bool:
    """Whether ``task``'s trial goes through the cache: the server has one and the task
    does not opt out (a container without network gets nothing either way)."""
    if service is None:
        return False
    return not task_opts_out(task.config.metadata, task.config.environment.env)


class TrialPackageCache:
    """One trial's session with the cache and what its containers need for it."""

    def __init__(self, service: PackageCacheService, task: CachedTask) -> None:
        self.service = service
        # Per task and environment (a rollout's own prompt does not change the key; a
        # rebuilt environment may change what its tests fetch).
        key = f"{task.name}\n{task.environment_digest()}"
        self.session: TrialCache = service.trial_session(key)
        self.upstream: CacheUpstream = service.upstream(self.session)

    def begin(self, overrides: Mapping[str, tuple[str, int]], *, dns: bool) -> None:
        """The trial starts: see ``TrialCache.begin``; upstream addresses as the
        trial's egress proxy finds them (``overrides``, ``dns``, the SSRF guard)."""
        try:
            self.session.begin(connector_resolver(Connector(overrides, dns=dns)))
        except Exception as exc:  # only a speed-up: the trial revalidates on request then
            logger.warning("package cache: the trial's start was not marked: %r", exc)

    def trust_mounts(self) -> list[Mount]:
        """The public trust directory, and the CA's certificate in the system store
        (one file beside the image's own, under OpenSSL's hashed name)."""
        return [
            Mount(str(self.service.trust_dir), TRUST_MOUNT, read_only=True),
            Mount(
                str(self.service.trust_dir / CA_PEM),
                self.service.system_trust_target,
                read_only=True,
            ),
        ]

    @staticmethod
    def env() -> dict[str, str]:
        return trust_env()

    def write(self, trial_dir: Path) -> None:
        """``package-cache.json``, and what the trial asked is remembered for its task."""
        try:
            self.session.finish()
        except Exception as exc:  # as in begin: its next trials revalidate on request
            logger.warning("package cache: what the trial asked was not remembered: %r", exc)
        try:
            self.session.write(trial_dir / RESULT_FILE)
        except OSError as exc:
            logger.warning("package cache: %s not written: %s", RESULT_FILE, exc)
