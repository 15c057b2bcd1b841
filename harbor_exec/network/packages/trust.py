"""What a trial container needs to use the package cache: proxy variables and trust in
the cache's CA, through each tool's standard hook, and nothing else in the container.

The trust directory (host side ``<cache>/package-cache-trust/``, mounted read-only at
``TRUST_MOUNT``) holds only public material:

* ``ca-bundle.pem``: the cache's CA certificate followed by the host's public roots
  (certifi's), so a program that reaches a host directly (``NO_PROXY``, or one that
  ignores proxy variables) still verifies it;
* ``apt.conf``: ``Acquire::https::CAInfo`` for apt, read through ``APT_CONFIG`` (apt
  reads that file first and still reads ``/etc/apt/apt.conf.d``: nothing in the
  image is changed). apt takes its proxies from ``http_proxy``/``https_proxy``.

The CA's key lives elsewhere (``ca.LocalCA``) and is never in this directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from harbor_exec.network.packages.ca import LocalCA

__all__ = [
    "BUNDLE",
    "TASK_OPT_OUT_KEY",
    "TRUST_MOUNT",
    "task_opts_out",
    "trust_env",
    "write_trust_dir",
]

#: Where the trust directory is mounted (read-only) in trial containers.
TRUST_MOUNT: Final = "/run/harbor-exec-trust"
BUNDLE: Final = "ca-bundle.pem"
APT_CONF: Final = "apt.conf"
#: ``[metadata]`` key of a task that must not go through the cache (``false``).
TASK_OPT_OUT_KEY: Final = "harbor_exec_package_cache"


def _public_roots() -> bytes:
    try:
        import certifi
    except ImportError:  # pragma: no cover - httpx depends on certifi
        return b""
    return Path(certifi.where()).read_bytes()


def write_trust_dir(ca: LocalCA, directory: Path) -> Path:
    """Write (or refresh) the trust directory for ``ca``; returns ``directory``.

    Refuses a directory that holds the CA's key (it is mounted into containers)."""
    directory = directory.resolve()
    if directory == ca.directory.resolve() or ca.directory.resolve().is_relative_to(directory):
        raise ValueError(
            f"the package cache's trust directory {directory} would expose the CA key "
            f"in {ca.directory}: choose a separate directory"
        )
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o755)
    bundle = ca.cert_pem.rstrip(b"\n") + b"\n" + _public_roots()
    apt = f'Acquire::https::CAInfo "{TRUST_MOUNT}/{BUNDLE}";\n'.encode()
    for name, data in ((BUNDLE, bundle), (APT_CONF, apt)):
        path = directory / name
        if not path.exists() or path.read_bytes() != data:
            tmp = directory / f".{name}.{os.getpid()}"
            tmp.write_bytes(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
    return directory


def trust_env() -> dict[str, str]:
    """The variables that make a container's tools trust the cache's CA (the proxy
    variables come with the egress proxy: ``harbor_exec.network.egress.container.proxy_env``)."""
    bundle = f"{TRUST_MOUNT}/{BUNDLE}"
    return {
        # OpenSSL (Python's ssl, curl with OpenSSL, uv, git with OpenSSL, Go on Linux)
        "SSL_CERT_FILE": bundle,
        "REQUESTS_CA_BUNDLE": bundle,
        "CURL_CA_BUNDLE": bundle,
        "PIP_CERT": bundle,
        "NODE_EXTRA_CA_CERTS": bundle,
        "GIT_SSL_CAINFO": bundle,
        "CARGO_HTTP_CAINFO": bundle,
        "APT_CONFIG": f"{TRUST_MOUNT}/{APT_CONF}",
    }


def task_opts_out(metadata: Mapping[str, Any], env: Mapping[str, str] = {}) -> bool:
    """Whether a task opts out: ``[metadata] harbor_exec_package_cache = false`` in its
    ``task.toml``, or ``HARBOR_EXEC_PACKAGE_CACHE=0`` in its environment's env."""
    value = metadata.get(TASK_OPT_OUT_KEY)
    if value is False or (isinstance(value, str) and value.lower() in ("false", "0", "off", "no")):
        return True
    flag = env.get("HARBOR_EXEC_PACKAGE_CACHE", "")
    return flag.lower() in ("false", "0", "off", "no")
