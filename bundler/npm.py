"""One file out of a pinned npm package, checked by the registry's integrity (build time only).

An agent layer ships some programs as the prebuilt binaries of npm packages
(opencode's). ``fetch_npm_member`` asks the registry for the package version's
metadata, downloads its tarball, checks it against the ``dist.integrity`` the
registry published (sha512, Subresource Integrity form), and extracts one member.
No npm, no Node: plain HTTPS with the standard library. Which registry:
``HARBOR_EXEC_NPM_REGISTRY``, else npm's own setting (``npm_config_registry``, or
``npm config get registry`` when npm is installed).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import urllib.request
from pathlib import Path
from urllib.error import URLError
from urllib.parse import quote

from harbor_exec.bundler.errors import BundleError

REGISTRY_ENV = "HARBOR_EXEC_NPM_REGISTRY"
_TIMEOUT_SEC = 300.0
_MAX_TARBALL_BYTES = 1 << 30


def npm_registry() -> str:
    """The npm registry's base URL (see module doc); BundleError when none is set."""
    for name in (REGISTRY_ENV, "npm_config_registry", "NPM_CONFIG_REGISTRY"):
        value = os.environ.get(name, "").strip()
        if value:
            return value.rstrip("/")
    npm = shutil.which("npm")
    if npm is not None:
        try:
            done = subprocess.run(
                [npm, "config", "get", "registry"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            done = None
        value = done.stdout.strip() if done is not None and done.returncode == 0 else ""
        if value.startswith(("http://", "https://")):
            return value.rstrip("/")
    raise BundleError(
        f"no npm registry configured: set {REGISTRY_ENV} to the registry's URL "
        "(or install npm, whose configured registry is used)"
    )


def _integrity_matches(integrity: str, sha512: bytes) -> bool:
    """Whether one of ``integrity``'s sha512 entries (SRI form) is ``sha512``."""
    wanted = "sha512-" + base64.b64encode(sha512).decode()
    return wanted in integrity.split()


def fetch_npm_member(package: str, version: str, member: str, target: Path) -> str:
    """Write ``member`` of ``package@version``'s tarball to ``target`` (mode 0755);
    returns the tarball's integrity string. BundleError on any failure, a tarball
    that does not match its published sha512 first."""
    registry = npm_registry()
    name = quote(package, safe="@")
    tarball = target.with_name(target.name + ".tgz")
    try:
        url = f"{registry}/{name}/{quote(version, safe='')}"
        with urllib.request.urlopen(url, timeout=_TIMEOUT_SEC) as meta:
            dist = json.loads(meta.read(16 << 20))["dist"]
        tarball_url, integrity = str(dist["tarball"]), str(dist["integrity"])
        if "sha512-" not in integrity or not tarball_url.startswith(("https://", "http://")):
            raise ValueError("the registry gives no sha512 integrity or tarball URL")
        digest = hashlib.sha512()
        size = 0
        with (
            urllib.request.urlopen(tarball_url, timeout=_TIMEOUT_SEC) as response,
            tarball.open("wb") as out,
        ):
            while chunk := response.read(1 << 20):
                size += len(chunk)
                if size > _MAX_TARBALL_BYTES:
                    raise ValueError("the tarball is over 1 GiB")
                digest.update(chunk)
                out.write(chunk)
    except (URLError, OSError, KeyError, TypeError, ValueError) as exc:
        tarball.unlink(missing_ok=True)
        raise BundleError(
            f"{package}@{version} from {registry}: {type(exc).__name__}: {exc}"
        ) from None
    try:
        if not _integrity_matches(integrity, digest.digest()):
            raise BundleError(f"{package}@{version}: the tarball does not match its integrity")
        with tarfile.open(tarball, "r:gz") as archive:
            try:
                info = archive.getmember(member)
            except KeyError:
                raise BundleError(f"{package}@{version} has no {member}") from None
            source = archive.extractfile(info) if info.isfile() else None
            if source is None:
                raise BundleError(f"{package}@{version}: {member} is not a regular file")
            with source, target.open("wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
        target.chmod(0o755)
    finally:
        tarball.unlink(missing_ok=True)
    return integrity


__all__ = ["REGISTRY_ENV", "fetch_npm_member", "npm_registry"]
