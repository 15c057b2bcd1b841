"""A trial's network plan (Harbor 0.26's per-phase policies) and its egress proxy.

Harbor resolves one policy per phase (``harbor.trial.network_policy``): the agent's
is ``[agent].network_mode``/``allowed_hosts`` when set, else ``[environment]``'s;
the verifier's is ``[verifier]``'s when set, else the environment its container
was made from (``[verifier].environment`` in separate mode, else ``[environment]``).

A container whose phases are all ``public`` gets the bridge network, one whose
phases are all ``no-network`` gets none, and any other gets network ``none`` plus
the trial's egress proxy (``harbor_exec.network.egress``): its socket mounted at
``EGRESS_MOUNT``, the proxy variables in the container's environment, and, as
each phase starts, the phase's policy on the proxy and a fresh forwarder in the
container. Refusals go to ``egress-refused.jsonl`` in the trial dir.

Differences from Harbor, which enforces policies with an in-namespace transparent
proxy (an egress sidecar this kernel cannot run): here only programs that honour
the proxy variables (or speak CONNECT to the forwarder) reach anything, a
``public`` phase of a proxied container is public through the proxy (never the
host's private or loopback addresses), and UDP (DNS included) reaches nothing.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, Protocol

from harbor_exec.errors import EnvironmentStartError
from harbor_exec.network.egress.container import (
    EGRESS_MOUNT,
    forwarder_with_container,
    proxy_env,
    start_forwarder,
)
from harbor_exec.network.egress.policy import EgressMode, EgressPolicy
from harbor_exec.network.egress.proxy import (
    Announcement,
    EgressLimits,
    EgressProxy,
    EgressProxyThread,
    Upstream,
)
from harbor_exec.sandbox.runtime import ContainerRuntime, Mount, NetworkKind

__all__ = ["REFUSED_LOG", "EgressSettings", "NetworkPlan", "TrialEgress", "network_plan"]

logger = logging.getLogger(__name__)

#: Where trials' egress proxies keep their sockets.
EGRESS_ROOT: Final = Path("/tmp") / "hx-egress"
#: How long a forwarder started with its container may take to announce itself.
FORWARDER_ANNOUNCE_SEC: Final = 10.0
#: The trial dir's record of what its proxy refused (JSON lines).
REFUSED_LOG = "egress-refused.jsonl"
ContainerKind = Literal["trial", "verifier"]


class PhaseNetwork(Protocol):
    """A phase's (or an environment's) network settings, as the task format reads them
    (``[environment]``, ``[agent]``, ``[verifier]``): the network sits below the task
    format, so it names only what it reads."""

    @property
    def network_mode(self) -> object: ...

    @property
    def allowed_hosts(self) -> list[str] | None: ...


class VerifierNetwork(PhaseNetwork, Protocol):
    @property
    def environment(self) -> PhaseNetwork | None: ...


class TaskNetwork(Protocol):
    """What ``network_plan`` reads of a task's config (``TaskConfig``)."""

    @property
    def environment(self) -> PhaseNetwork: ...

    @property
    def agent(self) -> PhaseNetwork: ...

    @property
    def verifier(self) -> VerifierNetwork: ...


@dataclass(frozen=True)
class EgressSettings:
    """The operator's egress settings (``SandboxPolicy.egress``).

    ``overrides``: name (or ``name:port``) -> ``(host, port)`` the proxy connects
    to instead, without DNS or the private-address guard (a local mirror; how tests
    reach servers on 127.0.0.1). ``dns=False``: names not in ``overrides`` are
    refused. ``upstream``: where admitted traffic goes (one object for every trial,
    e.g. a cache; it gets each request's trial and phase); None: directly."""

    overrides: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    dns: bool = True
    limits: EgressLimits = field(default_factory=EgressLimits)
    upstream: Upstream | None = None


def _policy(mode: object, hosts: list[str] | None) -> EgressPolicy:
    return EgressPolicy(EgressMode(str(mode)), tuple(hosts or ()))


def _baseline(env: PhaseNetwork) -> EgressPolicy:
    return _policy(env.network_mode, env.allowed_hosts)


@dataclass(frozen=True)
class NetworkPlan:
    """Each phase's policy, and which of them run in which container."""

    agent: EgressPolicy
    verifier: EgressPolicy
    separate_verifier: bool

    def phases(self, kind: ContainerKind) -> list[EgressPolicy]:
        if kind == "verifier" or self.separate_verifier:
            return [self.agent] if kind == "trial" else [self.verifier]
        return [self.agent, self.verifier]

    def network(self, kind: ContainerKind) -> NetworkKind:
        modes = {policy.mode for policy in self.phases(kind)}
        return "bridge" if modes == {EgressMode.PUBLIC} else "none"

    def proxied(self, kind: ContainerKind) -> bool:
        modes = {policy.mode for policy in self.phases(kind)}
        return modes not in ({EgressMode.PUBLIC}, {EgressMode.NO_NETWORK})


def network_plan(config: TaskNetwork, *, separate_verifier: bool) -> NetworkPlan:
    """Harbor 0.26's ``resolve_trial_network_plan`` (without run-specific extra hosts)."""
    baseline = _baseline(config.environment)
    agent = config.agent
    verifier = config.verifier
    verifier_base = baseline
    if separate_verifier:
        verifier_base = _baseline(verifier.environment or config.environment)
    return NetworkPlan(
        agent=(
            _policy(agent.network_mode, agent.allowed_hosts)
            if agent.network_mode is not None
            else baseline
        ),
        verifier=(
            _policy(verifier.network_mode, verifier.allowed_hosts)
            if verifier.network_mode is not None
            else verifier_base
        ),
        separate_verifier=separate_verifier,
    )


class TrialEgress:
    """One trial's proxy, started on first use (``mount``) and closed by ``close``."""

    def __init__(self, trial: str, trial_dir: Path, settings: EgressSettings) -> None:
        self.trial = trial
        self.refused_log = trial_dir / REFUSED_LOG
        self.settings = settings
        self._scratch: Path | None = None
        self._thread: EgressProxyThread | None = None

    @property
    def proxy(self) -> EgressProxy | None:
        return None if self._thread is None else self._thread.proxy

    def mount(self) -> Mount:
        """The proxy's directory, to mount read-only at ``EGRESS_MOUNT``."""
        if self._thread is None:
            # Short and fresh: a unix socket path has 107 bytes; the trial dir may be long.
            # One root (as the relay's): a service in a container shares it with the host
            # at the same path, since the engine resolves bind mounts on the host.
            EGRESS_ROOT.mkdir(mode=0o711, exist_ok=True)
            self._scratch = Path(tempfile.mkdtemp(prefix="e-", dir=EGRESS_ROOT))
            proxy = EgressProxy(
                directory=self._scratch / "e",
                trial=self.trial,
                refused_log=self.refused_log,
                limits=self.settings.limits,
                overrides=self.settings.overrides,
                dns=self.settings.dns,
                upstream=self.settings.upstream,
            )
            thread = EgressProxyThread(proxy)
            try:
                thread.start()
            except Exception as exc:
                shutil.rmtree(self._scratch, ignore_errors=True)
                raise EnvironmentStartError(f"the egress proxy did not start: {exc}") from None
            self._thread = thread
        assert self.proxy is not None
        return Mount(str(self.proxy.directory), EGRESS_MOUNT, read_only=True)

    @staticmethod
    def env() -> dict[str, str]:
        return proxy_env()

    def forwarder_with_container(self) -> tuple[list[str], Announcement]:
        """A container's ``before_keep_alive`` that starts its forwarder with it, and
        what it will announce (``enter``'s ``announced``)."""
        assert self.proxy is not None, "mount() first"
        token = secrets.token_hex(16)
        return forwarder_with_container(token), self.proxy.expect_forwarder(token)

    def enter(
        self,
        phase: str,
        policy: EgressPolicy,
        runtime: ContainerRuntime,
        container_id: str,
        serving: Announcement | None = None,
    ) -> None:
        """Apply ``policy`` (cutting what the last phase opened) and have a forwarder
        in the container, as the runtime's own uid (an agent that is not root cannot
        end it; one that ends it only cuts itself off): ``serving``, the one started
        with the container (its first phase, or spared as exactly itself by the kill
        after the last one), once it announced itself (no exec); else one started now
        (every other process of the container was killed after its last phase, so a
        port in use is a forwarder its restart started)."""
        assert self._thread is not None, "mount() first"
        self._thread.set_phase(phase, policy)
        what = f"the egress forwarder for the {phase} phase"
        if serving is None:
            start_forwarder(runtime, container_id, what, in_use_ok=True)
        elif not serving.event.wait(FORWARDER_ANNOUNCE_SEC):
            # Not heard from the one started with the container: one is started now (a
            # port it holds already is that one's), spared by nothing.
            logger.warning(
                "%s: not announced within %gs of the container's start; starting one",
                what,
                FORWARDER_ANNOUNCE_SEC,
            )
            try:
                start_forwarder(runtime, container_id, what, in_use_ok=True)
            except EnvironmentStartError as exc:
                raise EnvironmentStartError(
                    f"{exc} (nor did the one started with the container announce itself "
                    f"within {FORWARDER_ANNOUNCE_SEC:g}s; when harbor-exec runs in a "
                    f"container, mount {EGRESS_ROOT} and the package cache's trust dir at "
                    "the same paths from the host: docs/server.md)"
                ) from None

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
