"""Where debootstrap fetches Debian from: a mirror named by the operator, else the first
Debian archive in this host's apt sources. Standard library only: the base images
(``images``) and the read-only runtime's first build (``runtime_volume``) both ask."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from harbor_exec.errors import HarborExecError

#: The environment variable behind ``images bootstrap --mirror`` (and a first build's).
MIRROR_ENV = "HARBOR_EXEC_DEBIAN_MIRROR"
APT_DIR = Path("/etc/apt")
# Debian's release codenames: an apt source for one of them (component main) is a
# Debian archive mirror. Aliases such as "stable" are left out on purpose: third-party
# repositories use them too ("deb https://vendor.example/apt stable main").
_DEBIAN_CODENAMES = frozenset({"buster", "bullseye", "bookworm", "trixie", "forky", "duke", "sid"})
_MIRROR_SCHEMES = ("http://", "https://", "file:/")
# A one-line entry: deb [option=value ...] uri suite [component ...]
_ONE_LINE = re.compile(r"deb\s+(?:\[[^\]]*\]\s*)?(\S+)\s+(\S+)\s*(.*)")


class BootstrapError(HarborExecError):
    """A base image or the runtime could not be made; the message says which step failed
    and why."""


@dataclass(frozen=True)
class AptSource:
    """One ``deb`` entry of the host's apt configuration."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]
    file: Path


def _one_line_sources(path: Path, text: str) -> Iterator[AptSource]:
    for raw in text.splitlines():
        match = _ONE_LINE.match(raw.split("#", 1)[0].strip())
        if match:
            uri, suite, components = match.groups()
            yield AptSource(uri, (suite,), tuple(components.split()), path)


def _deb822_sources(path: Path, text: str) -> Iterator[AptSource]:
    # Stanzas of "Field: value" lines, separated by blank lines; values may continue
    # on indented lines. See sources.list(5).
    stanzas: list[dict[str, str]] = [{}]
    key = ""
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        if not raw.strip():
            stanzas.append({})
            key = ""
        elif raw[0] in " \t" and key:
            stanzas[-1][key] += " " + raw.strip()
        elif ":" in raw:
            key, _, value = raw.partition(":")
            key = key.strip().lower()
            stanzas[-1][key] = value.strip()
    for stanza in stanzas:
        if "deb" not in stanza.get("types", "").split():
            continue
        if stanza.get("enabled", "yes").strip().lower() == "no":
            continue
        suites = tuple(stanza.get("suites", "").split())
        components = tuple(stanza.get("components", "").split())
        for uri in stanza.get("uris", "").split():
            yield AptSource(uri, suites, components, path)


def apt_sources(apt_dir: Path = APT_DIR) -> list[AptSource]:
    """The host's ``deb`` sources in apt's order: ``sources.list``, then the files of
    ``sources.list.d`` (``*.list`` one-line and ``*.sources`` deb822) by name."""
    files = [apt_dir / "sources.list"]
    parts = apt_dir / "sources.list.d"
    if parts.is_dir():
        files += sorted(p for p in parts.iterdir() if p.suffix in (".list", ".sources"))
    found: list[AptSource] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parse = _deb822_sources if path.suffix == ".sources" else _one_line_sources
        found.extend(parse(path, text))
    return found


def host_debian_mirror(apt_dir: Path = APT_DIR) -> AptSource | None:
    """The first apt source that is a Debian archive mirror: a ``deb`` entry for a
    Debian release (``bookworm``, not ``bookworm-security``) with component ``main``."""
    for source in apt_sources(apt_dir):
        if (
            source.uri.startswith(_MIRROR_SCHEMES)
            and "main" in source.components
            and any(suite in _DEBIAN_CODENAMES for suite in source.suites)
        ):
            return source
    return None


def debian_mirror(mirror: str | None = None, *, apt_dir: Path = APT_DIR) -> tuple[str, str]:
    """The mirror debootstrap uses and where it came from: ``mirror`` when given (or
    ``$HARBOR_EXEC_DEBIAN_MIRROR``), else the host's apt sources. Raises
    :class:`BootstrapError` when there is neither."""
    mirror = mirror or os.environ.get(MIRROR_ENV)
    if mirror:
        return mirror, "--mirror"
    found = host_debian_mirror(apt_dir)
    if found is None:
        raise BootstrapError(
            f"cannot debootstrap Debian: no Debian mirror in this host's apt sources "
            f"({apt_dir}/sources.list, {apt_dir}/sources.list.d/*.list or *.sources: a "
            f"'deb' entry for a Debian release with component main). Name one with "
            f"`harbor-exec images bootstrap --mirror URL` (or ${MIRROR_ENV})."
        )
    return found.uri, str(found.file)


__all__ = [
    "APT_DIR",
    "MIRROR_ENV",
    "AptSource",
    "BootstrapError",
    "apt_sources",
    "debian_mirror",
    "host_debian_mirror",
]
