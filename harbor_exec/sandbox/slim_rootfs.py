"""What makes a debootstrap root filesystem the official ``debian:*-slim`` image.

Docker's official Debian images are debootstrap trees that debuerreotype then adjusts
for containers: its "minimizing config" (services never start during installs, dpkg
skips ``fsync``, apt cleans its archives after every run, keeps its indexes compressed,
fetches no translations) and, for ``-slim``, dpkg ``path-exclude`` rules for
documentation, man pages and locales, with those files removed. Tasks written against
the official images run ``apt-get update && apt-get install`` with these settings, so a
local stand-in has them too (without them every ``apt-get update`` also fetches and
parses the 6 MB ``Translation-en`` index, and dpkg syncs every file it writes).
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

# File name -> content, under etc/apt/apt.conf.d/ of the root filesystem.
_APT_CONF = {
    "docker-autoremove-suggests": 'Apt::AutoRemove::SuggestsImportant "false";\n',
    "docker-clean": (
        'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb '
        '/var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\n'
        'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb '
        '/var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\n'
        'Dir::Cache::pkgcache "";\n'
        'Dir::Cache::srcpkgcache "";\n'
    ),
    "docker-gzip-indexes": 'Acquire::GzipIndexes "true";\n',
    "docker-no-languages": 'Acquire::Languages "none";\n',
}
# An init script that a package install tries to start: "not allowed" (exit 101).
_POLICY_RC_D = "#!/bin/sh\n# Services do not start inside image builds and containers.\nexit 101\n"
# The slim variant's exclusions; a pattern ending in "/*" covers its directory's tree.
SLIM_EXCLUDES = (
    "/usr/share/doc/*",
    "/usr/share/info/*",
    "/usr/share/linda/*",
    "/usr/share/lintian/overrides/*",
    "/usr/share/locale/*",
    "/usr/share/man/*",
    "/usr/share/doc/kde/HTML/*/*",
    "/usr/share/gnome/help/*/*",
    "/usr/share/omf/*/*-*.emf",
)
SLIM_INCLUDES = (
    "/usr/share/doc/*/copyright",
    "/usr/share/doc/kde/HTML/C/*",
    "/usr/share/gnome/help/*/C/*",
    "/usr/share/locale/all_languages",
    "/usr/share/locale/currency/*",
    "/usr/share/locale/l10n/*",
    "/usr/share/locale/languages",
    "/usr/share/locale/locale.alias",
    "/usr/share/omf/*/*-C.emf",
)


def make_slim(root: Path) -> None:
    """Give the root filesystem at ``root`` the official slim image's settings and drop
    the files its dpkg rules exclude (as dpkg itself would have, had they been set)."""
    _write(root / "usr/sbin/policy-rc.d", _POLICY_RC_D, mode=0o755)
    _write(root / "etc/dpkg/dpkg.cfg.d/docker-apt-speedup", "force-unsafe-io\n")
    for name, content in _APT_CONF.items():
        _write(root / "etc/apt/apt.conf.d" / name, content)
    rules = [f"path-exclude {pattern}" for pattern in SLIM_EXCLUDES]
    rules += [f"path-include {pattern}" for pattern in SLIM_INCLUDES]
    _write(root / "etc/dpkg/dpkg.cfg.d/docker", "\n".join(rules) + "\n")
    for pattern in SLIM_EXCLUDES:
        _remove_excluded(root, pattern)


def _write(path: Path, content: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    path.chmod(mode)


def _included(path: str) -> bool:
    # dpkg's patterns are shell globs on the whole path, "*" crossing "/" (fnmatch's too).
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in SLIM_INCLUDES)


def _remove_excluded(root: Path, pattern: str) -> None:
    top = root / pattern.lstrip("/").split("*", 1)[0].rstrip("/")
    if not top.is_dir() or top.is_symlink():
        return
    for directory, _subdirs, files in os.walk(top):
        for name in files:
            entry = Path(directory) / name
            inside = "/" + entry.relative_to(root).as_posix()
            if entry.is_symlink() or not fnmatch.fnmatchcase(inside, pattern):
                continue
            if not _included(inside):
                entry.unlink()
    _prune_empty(top)


def _prune_empty(top: Path) -> None:
    """Remove dangling links and directories left empty, bottom up, keeping ``top``."""
    for directory, subdirs, files in os.walk(top, topdown=False):
        here = Path(directory)
        for name in files + subdirs:
            entry = here / name
            if entry.is_symlink() and not entry.exists():
                entry.unlink()
        if here != top and not any(here.iterdir()):
            here.rmdir()
