"""What a trial container needs to use the package cache: proxy variables and trust in
the cache's CA, through each tool's standard hook, and nothing else in the container.

The trust directory (host side ``<cache>/package-cache-trust/``, mounted read-only at
``TRUST_MOUNT``) holds only public material:

* ``ca-bundle.pem``: the cache's CA certificate followed by the host's public roots
  (certifi's), so a program that reaches a host directly (``NO_PROXY``, or one that
  ignores proxy variables) still verifies it;
* ``apt.conf``: ``Acquire::https::CAInfo`` for apt, read through ``APT_CONFIG`` (apt
  reads that file first and still reads ``/etc/apt/apt.conf.d``: nothing in the
  image is changed). apt takes its proxies from ``http_proxy``/``https_proxy``;
* ``ca.pem``: the CA's certificate alone, also mounted (read-only, one file) into the
  system trust directory as OpenSSL's hashed name (``/etc/ssl/certs/<hash>.0``,
  ``system_trust_target``), so a program that reads only the system store (OpenSSL's
  default verify paths, Go) trusts the cache too; the image's own certificates stay.

The CA's key lives elsewhere (``ca.LocalCA``) and is never in this directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from cryptography import x509

from harbor_exec.network.packages.ca import LocalCA

__all__ = [
    "BUNDLE",
    "CA_PEM",
    "SYSTEM_CERTS_DIR",
    "TASK_OPT_OUT_KEY",
    "TRUST_MOUNT",
    "subject_hash",
    "system_trust_target",
    "task_opts_out",
    "trust_env",
    "write_trust_dir",
]

#: Where the trust directory is mounted (read-only) in trial containers.
TRUST_MOUNT: Final = "/run/harbor-exec-trust"
BUNDLE: Final = "ca-bundle.pem"
APT_CONF: Final = "apt.conf"
CA_PEM: Final = "ca.pem"
#: OpenSSL's default verify directory on Debian, Ubuntu and Alpine (``CApath``).
SYSTEM_CERTS_DIR: Final = "/etc/ssl/certs"
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
    for name, data in ((BUNDLE, bundle), (APT_CONF, apt), (CA_PEM, ca.cert_pem)):
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            # What an engine leaves when it bind-mounted a file that was not there yet
            # (a service in a container whose cache dir the host did not share).
            shutil.rmtree(path)
        if not path.exists() or path.read_bytes() != data:
            tmp = directory / f".{name}.{os.getpid()}"
            tmp.write_bytes(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
    return directory


def _der(tag: int, body: bytes) -> bytes:
    size = len(body)
    if size < 0x80:
        return bytes([tag, size]) + body
    length = size.to_bytes((size.bit_length() + 7) // 8, "big")
    return bytes([tag, 0x80 | len(length)]) + length + body


def _oid(dotted: str) -> bytes:
    parts = [int(p) for p in dotted.split(".")]
    body = bytearray([40 * parts[0] + parts[1]])
    for part in parts[2:]:
        chunk = [part & 0x7F]
        part >>= 7
        while part:
            chunk.append(0x80 | (part & 0x7F))
            part >>= 7
        body += bytes(reversed(chunk))
    return _der(0x06, bytes(body))


def subject_hash(cert: x509.Certificate) -> str:
    """OpenSSL's ``X509_NAME_hash`` of ``cert``'s subject (``openssl x509 -hash``):
    the first four bytes, little-endian, of the SHA-1 of the name's canonical form
    (each value as a UTF8String, trimmed, inner spaces collapsed, ASCII lower-cased;
    the RDN sets without the outer SEQUENCE). The name of its file in a CApath."""
    canon = b""
    for rdn in cert.subject.rdns:
        entries = []
        for attribute in rdn:
            value = attribute.value if isinstance(attribute.value, str) else ""
            text = " ".join(value.split()).encode()
            lowered = bytes(b + 32 if 65 <= b <= 90 else b for b in text)
            entries.append(_der(0x30, _oid(attribute.oid.dotted_string) + _der(0x0C, lowered)))
        canon += _der(0x31, b"".join(sorted(entries)))
    digest = hashlib.sha1(canon, usedforsecurity=False).digest()
    return f"{int.from_bytes(digest[:4], 'little'):08x}"


def system_trust_target(ca: LocalCA) -> str:
    """Where ``ca.pem`` is mounted in a container: the system store's hashed name."""
    return f"{SYSTEM_CERTS_DIR}/{subject_hash(ca.cert)}.0"


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
