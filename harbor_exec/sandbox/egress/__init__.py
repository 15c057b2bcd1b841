"""Host-side egress for ``network_mode = "allowlist"`` trials: a per-trial HTTP
forward proxy on a unix socket (``proxy``) and Harbor's host policy (``policy``)."""

from harbor_exec.sandbox.egress.container import (
    EGRESS_MOUNT,
    EGRESS_PORT,
    EGRESS_PROXY_URL,
    EGRESS_SOCKET,
    forwarder_command,
    proxy_env,
)
from harbor_exec.sandbox.egress.policy import (
    EgressMode,
    EgressPolicy,
    is_forbidden_address,
    normalize_allowed_hosts,
)
from harbor_exec.sandbox.egress.proxy import (
    EGRESS_SOCKET_NAME,
    Connector,
    DirectUpstream,
    EgressContext,
    EgressLimits,
    EgressProxy,
    EgressProxyThread,
    EgressRefused,
    EgressStats,
    GuardedBackend,
    HttpRequest,
    HttpResponse,
    Upstream,
    pipe_both_ways,
)

__all__ = [
    "EGRESS_MOUNT",
    "EGRESS_PORT",
    "EGRESS_PROXY_URL",
    "EGRESS_SOCKET",
    "EGRESS_SOCKET_NAME",
    "Connector",
    "DirectUpstream",
    "EgressContext",
    "EgressLimits",
    "EgressMode",
    "EgressPolicy",
    "EgressProxy",
    "EgressProxyThread",
    "EgressRefused",
    "EgressStats",
    "GuardedBackend",
    "HttpRequest",
    "HttpResponse",
    "Upstream",
    "forwarder_command",
    "is_forbidden_address",
    "normalize_allowed_hosts",
    "pipe_both_ways",
    "proxy_env",
]
