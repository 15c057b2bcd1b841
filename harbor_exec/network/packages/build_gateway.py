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
arguments in the image, so nothing of the proxy lands in it. Only Dockerfiles the
legacy builder parses come here; BuildKit-only ones (``dockerfile_syntax``) and those
``build_trust.trust_conflict`` names build outside the cache
(``harbor_exec.network.packages.build_route``).

The host-side proxy behind the socket admits public destinations only (the egress
SSRF guard refuses private and host addresses, except the operator's explicit
overrides) and hands plain HTTP to the cache. With ``trust_files`` (the package
cache's: ``PackageCacheService.build_route``) its upstream also terminates HTTPS
``CONNECT`` to port 443 with the cache's CA, as a trial's does, and the route carries
what makes a build trust that CA for its steps only: the public trust files for the
context and the rewritten Dockerfile (``build_trust``), the trust variables as build
arguments. Without (a gateway with no cache behind it, the bench's baseline) HTTPS
is tunnelled untouched.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from harbor_exec.errors import HarborExecError
from harbor_exec.network.egress.container import (
    EGRESS_MOUNT,
    EGRESS_PORT,
    EGRESS_PROXY_URL,
    proxy_env,
    start_forwarder,
)
from harbor_exec.network.egress.policy import EgressMode, EgressPolicy
from harbor_exec.network.egress.proxy import (
    EgressLimits,
    EgressProxy,
    EgressProxyThread,
    Upstream,
)
from harbor_exec.network.packages.build_trust import rewrite_dockerfile
from harbor_exec.network.packages.trust import trust_env
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
    """How one build reaches the cache: ``ImageBuild``'s ``build_args``, ``network`` and,
    when the proxy terminates TLS (``trust_files``: context path -> the public trust
    files, ``build_trust.trust_context_files``), its ``context_files``."""

    build_args: dict[str, str]
    network: str
    trust_files: Mapping[str, bytes] = field(default_factory=dict)

    def build_options(
        self, dockerfile: str = "Dockerfile", text: str | None = None
    ) -> dict[str, Any]:
        """The options for building the Dockerfile ``text`` (at ``dockerfile`` in the
        context; needed when the route terminates TLS: it is sent rewritten)."""
        options: dict[str, Any] = {"build_args": dict(self.build_args), "network": self.network}
        if not self.trust_files:
            return options
        if text is None:
            raise ValueError("this build route terminates TLS: pass the Dockerfile to rewrite")
        options["build_args"].update(trust_env())
        options["context_files"] = {
            **self.trust_files,
            dockerfile: rewrite_dockerfile(text).encode("utf-8"),
        }
        return options


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
        trust_files: Mapping[str, bytes] | None = None,
    ) -> None:
        """``trust_files``: set when ``upstream`` terminates TLS with a CA of ours (the
        builds then get them and a rewritten Dockerfile, ``BuildRoute``)."""
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
        self.route = BuildRoute(
            build_proxy_args(), f"container:{container_id}", dict(trust_files or {})
        )

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
