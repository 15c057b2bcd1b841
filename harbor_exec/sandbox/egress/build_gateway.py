"""Image builds through the package cache: a build gateway container.

A build step cannot reach a host unix socket, and nothing of ours may be reached on a
host or bridge address, so builds through the cache take the route a trial container's
egress does, with one container in between: the gateway, a small container of ours
with network ``none``, the build proxy's socket directory mounted read-only (as a
trial container gets its egress proxy's) and the read-only runtime's forwarder
(``harbor_exec.container.forward``) on ``127.0.0.1:EGRESS_PORT`` in its network
namespace. The build's RUN steps join that namespace (``ImageBuild.network`` =
``container:<gateway>``, a legacy-builder feature: BuildKit has no such mode, see
``harbor_exec.sandbox.dockerfile_syntax`` for the Dockerfiles that keep BuildKit and
build outside the cache), so a step has loopback and the proxy, nothing else: every
byte of a cached build goes step -> 127.0.0.1 -> forwarder -> unix socket -> host
proxy. Builds get the predefined proxy build arguments (``HTTP_PROXY``, ``HTTPS_PROXY``,
``NO_PROXY`` and their lower-case spellings); the builder does not persist predefined
arguments in the image, so nothing of the proxy lands in it.

The host-side proxy behind the socket admits public destinations only (the egress
SSRF guard refuses private and host addresses, except the operator's explicit
overrides) and hands plain HTTP to the cache; HTTPS ``CONNECT`` tunnels are passed
through untouched (a build cannot be made to trust the cache's CA without its
Dockerfile taking part), so in builds only what is fetched over plain HTTP is cached:
Debian and Ubuntu apt mirrors (``deb.debian.org``, ``archive.ubuntu.com``, ...), which
is where builds spend.

One gateway per process (``PackageCacheService.build_route``), started with the first
build through the cache and removed when the service closes; concurrent cached builds
share its loopback. It is labelled and owned like every container of ours, so the
reaper removes it if the process dies.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from harbor_exec.errors import HarborExecError
from harbor_exec.sandbox.egress.container import (
    EGRESS_MOUNT,
    EGRESS_PORT,
    EGRESS_PROXY_URL,
    proxy_env,
    start_forwarder,
)
from harbor_exec.sandbox.egress.policy import EgressMode, EgressPolicy
from harbor_exec.sandbox.egress.proxy import (
    EgressLimits,
    EgressProxy,
    EgressProxyThread,
    Upstream,
)
from harbor_exec.sandbox.runtime import LABEL_KIND, ContainerRuntime, ContainerSpec, Mount

__all__ = ["BUILD_GATEWAY_IMAGE", "BuildGateway", "BuildRoute", "build_proxy_args"]

logger = logging.getLogger(__name__)

#: A base image every engine of ours has (``harbor-exec images bootstrap``); only its
#: filesystem hosts the runtime's interpreter, nothing of it runs.
BUILD_GATEWAY_IMAGE: Final = "debian:bookworm-slim"
KIND: Final = "build-gateway"
#: For the whole process's builds, not one trial's: bytes and connections unbounded
#: in practice (the cache's own bound holds what is stored).
GATEWAY_LIMITS: Final = EgressLimits(
    max_connections=256, max_upstream_connections=2**62, max_bytes=2**62
)


def build_proxy_args(url: str = EGRESS_PROXY_URL) -> dict[str, str]:
    """The predefined proxy build arguments for the gateway's forwarder at ``url``
    (``ALL_PROXY`` is not one of Docker's predefined arguments and is left out)."""
    env = proxy_env(url)
    return {name: value for name, value in env.items() if "all_proxy" not in name.lower()}


@dataclass(frozen=True)
class BuildRoute:
    """How one build reaches the cache: ``ImageBuild``'s ``build_args`` and ``network``."""

    build_args: dict[str, str]
    network: str

    def build_options(self) -> dict[str, Any]:
        return {"build_args": dict(self.build_args), "network": self.network}


class BuildGateway:
    """The host-side build proxy (upstream: the cache) and its gateway container."""

    def __init__(
        self,
        runtime: ContainerRuntime,
        upstream: Upstream,
        *,
        overrides: Mapping[str, tuple[str, int]] | None = None,
        dns: bool = True,
        image: str = BUILD_GATEWAY_IMAGE,
    ) -> None:
        self.runtime = runtime
        self._scratch = Path(tempfile.mkdtemp(prefix="hx-build-gateway-"))
        self._thread: EgressProxyThread | None = EgressProxyThread(
            EgressProxy(
                directory=self._scratch / "egress",
                trial="image-build",
                limits=GATEWAY_LIMITS,
                overrides=overrides,
                dns=dns,
                upstream=upstream,
            )
        )
        self.container_id: str | None = None
        try:
            self._thread.start()
            self._thread.set_phase("build", EgressPolicy(EgressMode.PUBLIC))
            container_id = self._start_container(image)
        except BaseException:
            self.close()
            raise
        self.route = BuildRoute(build_proxy_args(), f"container:{container_id}")

    def _start_container(self, image: str) -> str:
        spec = ContainerSpec(
            image=image,
            name=f"hx-build-gateway-{uuid.uuid4().hex[:12]}",
            labels={LABEL_KIND: KIND},
            cpus=1.0,
            memory_mb=256,
            pids_limit=64,
            network="none",
            mounts=[Mount(str(self._scratch / "egress"), EGRESS_MOUNT, read_only=True)],
        )
        container_id = self.container_id = self.runtime.create(spec)
        self.runtime.start(container_id)
        start_forwarder(self.runtime, container_id, "the build gateway's forwarder")
        logger.info("build gateway %s, proxy on its 127.0.0.1:%d", container_id[:12], EGRESS_PORT)
        return container_id

    def running(self) -> bool:
        """Whether the gateway container is still up (checked before each build)."""
        if self.container_id is None:
            return False
        try:
            return self.runtime.container_status(self.container_id).running
        except HarborExecError:
            return False

    def close(self) -> None:
        """Remove the container, stop the proxy, remove its directory (idempotent)."""
        container, self.container_id = self.container_id, None
        if container is not None:
            try:
                self.runtime.remove(container)
            except HarborExecError as exc:  # the reaper removes it later
                logger.warning("build gateway %s not removed: %s", container[:12], exc)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.close()
        shutil.rmtree(self._scratch, ignore_errors=True)
