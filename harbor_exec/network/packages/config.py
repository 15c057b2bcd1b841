"""The package cache's settings (``--package-cache-*``, ``HarborBackend(package_cache=)``):
plain values, importable without the cache's own libraries (httpx, h11, cryptography).
The live cache is ``harbor_exec.network.packages.service``."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from harbor_exec.cache import cache_root
from harbor_exec.network.packages.hosts import check_host_pattern

__all__ = [
    "CA_DIR",
    "DEFAULT_MAX_BYTES",
    "DISK_SHARE",
    "STORE_DIR",
    "STORE_SLOTS",
    "TRUST_DIR",
    "PackageCacheConfig",
    "default_max_bytes",
    "package_cache_setting",
]

#: The bound's ceiling when none is given; below it, ``DISK_SHARE`` of the disk.
DEFAULT_MAX_BYTES: Final = 20 * 1024**3
DISK_SHARE: Final = 0.10
MIN_DEFAULT_BYTES: Final = 256 * 1024**2
#: Below the harbor-exec cache dir (``harbor_exec.cache``).
STORE_DIR: Final = "package-cache"
CA_DIR: Final = "package-cache-ca"
TRUST_DIR: Final = "package-cache-trust"
#: Processes that can hold a store of their own below one root at once (each
#: ``package-cache``, ``package-cache-2``, ...); one more runs on a temporary store.
STORE_SLOTS: Final = 8


def default_max_bytes(directory: Path) -> int:
    """The bound when the operator gives none: ``DISK_SHARE`` of the disk
    ``directory`` is on, at most ``DEFAULT_MAX_BYTES`` (and at least 256 MiB)."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        total = shutil.disk_usage(probe).total
    except OSError:
        return DEFAULT_MAX_BYTES
    return max(MIN_DEFAULT_BYTES, min(DEFAULT_MAX_BYTES, int(total * DISK_SHARE)))


@dataclass(frozen=True)
class PackageCacheConfig:
    """The operator's settings (``--package-cache-*``, docs/package-cache.md)."""

    root: Path | None = None  # None: <harbor-exec cache dir>
    #: None: ``default_max_bytes`` of the disk the store is on.
    max_bytes: int | None = None
    max_object_bytes: int | None = None  # None: a quarter of max_bytes
    #: Hosts whose HTTPS is terminated and cached besides ``hosts.PACKAGE_HOSTS``
    #: (glob patterns); every other host's HTTPS is tunnelled untouched.
    tls_hosts: tuple[str, ...] = ()
    #: Verify upstream TLS against this bundle instead of the public roots (tests).
    upstream_ca_bundle: Path | None = None
    #: Serve an index (apt lists, PyPI pages) this long after it was fetched or
    #: revalidated without asking the upstream again (0: revalidate every request;
    #: a new upstream release then shows within this window).
    index_fresh_sec: float = 0.0

    def __post_init__(self) -> None:
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError("the package cache's max_bytes must be positive")
        object.__setattr__(self, "tls_hosts", tuple(check_host_pattern(h) for h in self.tls_hosts))

    @classmethod
    def from_options(
        cls, root: Path | None, max_gb: float | None, tls_hosts: Sequence[str] = ()
    ) -> PackageCacheConfig:
        """What ``--package-cache-dir``, ``--package-cache-max-gb`` and
        ``--package-cache-host`` say."""
        max_bytes = None if max_gb is None else int(max_gb * 1024**3)
        return cls(root=root, max_bytes=max_bytes, tls_hosts=tuple(tls_hosts))

    def directory(self, name: str) -> Path:
        return (self.root or cache_root()) / name

    def bound(self) -> int:
        """``max_bytes``, or the default share of the store's disk."""
        return self.max_bytes or default_max_bytes(self.directory(STORE_DIR))


def package_cache_setting(value: PackageCacheConfig | bool | None) -> PackageCacheConfig | None:
    """What ``package_cache=`` means: on (``True``, the default) with the default
    settings, a ``PackageCacheConfig``, or off (``False``, ``None``)."""
    if value is True:
        return PackageCacheConfig()
    if value is False or value is None:
        return None
    return value
