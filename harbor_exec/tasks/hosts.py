"""Harbor 0.26's ``allowed_hosts`` entry forms and normalisation
(``harbor.models.task.config._validate_allowed_host_names``).

Part of the task format (``task.toml`` is checked with it at load) and read by the
egress allowlist (``harbor_exec.network.egress.policy``), which sits above it.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_LABEL: Final = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_INVALID: Final = (
    "allowed_hosts entries must be hostnames, IP addresses, or IP CIDR ranges, "
    "not URLs, ports, or paths"
)


def ip_literal(text: str) -> IPAddress | None:
    """``text`` as an IP address when it is one (no brackets, no zone), else None."""
    if "%" in text:
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _normalize_entry(entry: str) -> str:
    host = entry.strip().lower().rstrip(".")
    if not host:
        raise ValueError("allowed_hosts entries must be non-empty hostnames")
    if "/" in host:
        try:
            return ipaddress.ip_network(host, strict=True).compressed
        except ValueError:
            raise ValueError(f"{_INVALID}: {entry!r}") from None
    if ":" in host:
        address = ip_literal(host)
        if address is None or address.version != 6:
            raise ValueError(f"{_INVALID}: {entry!r}")
        return address.compressed
    if "[" in host or "]" in host:
        raise ValueError(f"{_INVALID}: {entry!r}")
    name = host
    if host.startswith("*."):
        name = host[2:]
        if not name:
            raise ValueError("allowed_hosts wildcard entries must include a hostname suffix")
        if ip_literal(name) is not None:
            raise ValueError(
                "allowed_hosts wildcard entries must target hostnames, not IP address "
                f"literals: {entry!r}"
            )
    elif "*" in host:
        raise ValueError(
            f"allowed_hosts wildcard entries must use a leading '*.' prefix: {entry!r}"
        )
    if not all(_LABEL.match(label) for label in name.split(".")):
        raise ValueError(
            "allowed_hosts entries must be IP addresses, IP CIDR ranges, or valid hostnames "
            "or leading wildcard host patterns containing only letters, digits, hyphens, "
            f"and dots: {entry!r}"
        )
    return host


def normalize_allowed_hosts(hosts: list[str] | tuple[str, ...]) -> list[str]:
    """Harbor's validation and normalisation of ``allowed_hosts`` (ValueError naming
    the entry at fault)."""
    return [_normalize_entry(host) for host in hosts]
