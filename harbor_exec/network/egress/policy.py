"""Which destinations a trial's phase may reach: Harbor 0.26's network policy.

``EgressPolicy`` is one phase's policy (``public``, ``no-network`` or
``allowlist`` with ``allowed_hosts``), with Harbor's entry forms and
normalisation (``harbor.models.task.config._validate_allowed_host_names``):

* ``example.com``: that host exactly (any port; Harbor's policies apply to
  whole hosts);
* ``*.example.com``: any name below ``example.com`` (not ``example.com``
  itself), at any depth;
* ``192.0.2.1``, ``2001:db8::1``: that address literal;
* ``192.0.2.0/24``, ``2001:db8::/32``: address literals in that range.

Names match names and addresses match addresses: a name is never resolved to
decide (nothing is looked up for a refused name), and an address literal never
matches a hostname entry.

``is_forbidden_address`` is the proxy's SSRF guard: every address that is not
globally routable (loopback, private, link-local, CGNAT, multicast, reserved,
unspecified, and every IPv6 form that embeds or translates such an IPv4 address:
mapped, 6to4, NAT64; IPv4-compatible, SIIT, local-use NAT64 and site-local IPv6 at
all) is refused after resolution
unless the destination came from the operator's resolver override.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from enum import StrEnum

from harbor_exec.tasks.hosts import IPAddress, ip_literal, normalize_allowed_hosts

__all__ = [
    "EgressMode",
    "EgressPolicy",
    "is_address",
    "is_forbidden_address",
    "normalize_allowed_hosts",
    "normalize_host",
]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class EgressMode(StrEnum):
    """A phase's network mode (the values of Harbor's ``network_mode``)."""

    PUBLIC = "public"
    NO_NETWORK = "no-network"
    ALLOWLIST = "allowlist"


def normalize_host(host: str) -> str:
    """A requested host as the policy compares it: lower case, no trailing dot, no
    IPv6 brackets, an address in its compressed form."""
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    address = ip_literal(host)
    return address.compressed if address is not None else host


def is_address(text: str) -> bool:
    """Whether ``text`` is an IP address literal (no brackets, no zone)."""
    return ip_literal(text) is not None


#: IPv6 ranges refused whatever they embed: IPv4-compatible (deprecated), SIIT's
#: IPv4-translated, local-use NAT64 (RFC 8215) and the deprecated site-local range.
_REFUSED_IPV6 = tuple(
    ipaddress.IPv6Network(net)
    for net in ("::/96", "::ffff:0:0:0/96", "64:ff9b:1::/48", "fec0::/10")
)
#: The well-known NAT64 prefix (RFC 6052): it reaches the IPv4 address in its last 32 bits.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def is_forbidden_address(address: str) -> bool:
    """Whether ``address`` (an IP literal) is not a public internet address. An IPv6
    address that embeds an IPv4 one (mapped, 6to4, NAT64) is judged by that address."""
    parsed = ip_literal(address)
    if parsed is None:
        return True
    if isinstance(parsed, ipaddress.IPv6Address):
        if any(parsed in net for net in _REFUSED_IPV6):
            return True
        embedded = parsed.ipv4_mapped or parsed.sixtofour
        if parsed in _NAT64:
            embedded = ipaddress.IPv4Address(int(parsed) & 0xFFFFFFFF)
        if embedded is not None:
            return is_forbidden_address(str(embedded))
    return not parsed.is_global or parsed.is_multicast


@dataclass(frozen=True)
class EgressPolicy:
    """One phase's policy: what ``allows(host)`` admits."""

    mode: EgressMode
    allowed_hosts: tuple[str, ...] = ()
    _names: frozenset[str] = field(init=False, repr=False, compare=False)
    _suffixes: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _addresses: frozenset[IPAddress] = field(init=False, repr=False, compare=False)
    _networks: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.allowed_hosts and self.mode is not EgressMode.ALLOWLIST:
            raise ValueError("allowed_hosts is only valid when network_mode='allowlist'")
        object.__setattr__(
            self, "allowed_hosts", tuple(normalize_allowed_hosts(self.allowed_hosts))
        )
        names: set[str] = set()
        suffixes: list[str] = []
        addresses: set[IPAddress] = set()
        networks: list[IPNetwork] = []
        for entry in self.allowed_hosts:
            if entry.startswith("*."):
                suffixes.append(entry[1:])  # ".example.com"
            elif "/" in entry:
                networks.append(ipaddress.ip_network(entry))
            elif (address := ip_literal(entry)) is not None:
                addresses.add(address)
            else:
                names.add(entry)
        object.__setattr__(self, "_names", frozenset(names))
        object.__setattr__(self, "_suffixes", tuple(suffixes))
        object.__setattr__(self, "_addresses", frozenset(addresses))
        object.__setattr__(self, "_networks", tuple(networks))

    @classmethod
    def allowlist(cls, *hosts: str) -> EgressPolicy:
        return cls(EgressMode.ALLOWLIST, hosts)

    def allows(self, host: str) -> bool:
        """Whether a request for ``host`` (a name or an address literal, any port) passes."""
        if self.mode is EgressMode.PUBLIC:
            return True
        if self.mode is EgressMode.NO_NETWORK:
            return False
        host = normalize_host(host)
        address = ip_literal(host)
        if address is not None:
            return address in self._addresses or any(
                address in network for network in self._networks
            )
        if host in self._names:
            return True
        return any(host.endswith(suffix) for suffix in self._suffixes)
