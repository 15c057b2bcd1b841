"""Which hosts' HTTPS the package cache terminates (and so can store).

Only the package ecosystems' hosts: a CONNECT to any other host is tunnelled untouched
(its client sees the upstream's own certificate and its own trust decides), so a task
whose programs pin certificates, ignore every CA hook or talk to a private service
over TLS behaves as without the cache. Plain HTTP is cached for every host (no trust
is involved). The list is ``PACKAGE_HOSTS``; an operator adds to it with
``PackageCacheConfig.tls_hosts`` (``--package-cache-host``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Final

__all__ = ["PACKAGE_HOSTS", "TlsHosts", "check_host_pattern"]

#: Glob patterns (``*`` matches any run of characters, dots included), lower case.
PACKAGE_HOSTS: Final[tuple[str, ...]] = (
    # PyPI: the index, its JSON API and its file host
    "pypi.org",
    "pypi.python.org",
    "files.pythonhosted.org",
    # npm (and yarn's mirror of it)
    "registry.npmjs.org",
    "registry.yarnpkg.com",
    # Debian and Ubuntu mirrors over HTTPS
    "deb.debian.org",
    "*.deb.debian.org",
    "security.debian.org",
    "ftp.debian.org",
    "ftp.*.debian.org",
    "archive.ubuntu.com",
    "*.archive.ubuntu.com",
    "security.ubuntu.com",
    "ports.ubuntu.com",
    # the uv installer, and GitHub release downloads (where installers fetch binaries)
    "astral.sh",
    "github.com",
    "objects.githubusercontent.com",
    "release-assets.githubusercontent.com",
)


def check_host_pattern(pattern: str) -> str:
    """``pattern`` lower-cased, or ``ValueError`` naming it when it is not a host name
    glob (no scheme, port, path or spaces)."""
    cleaned = pattern.strip().lower().rstrip(".")
    if not cleaned or any(c in cleaned for c in "/:@ []") or cleaned.strip("*.") == "":
        raise ValueError(
            f"not a host name pattern: {pattern!r} (give a name such as "
            "'pypi.internal.example' or '*.mirror.example', without scheme or port)"
        )
    return cleaned


class TlsHosts:
    """``PACKAGE_HOSTS`` plus the operator's patterns: ``matches(host)``."""

    def __init__(self, extra: Iterable[str] = ()) -> None:
        self.patterns: tuple[str, ...] = (
            *PACKAGE_HOSTS,
            *(check_host_pattern(p) for p in extra),
        )

    def matches(self, host: str) -> bool:
        name = host.lower().rstrip(".")
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns)
