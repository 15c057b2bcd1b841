"""Base-image bootstrap: the Debian mirror comes from the host's apt sources or --mirror."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harbor_exec.sandbox.apt_mirror import (
    MIRROR_ENV,
    BootstrapError,
    apt_sources,
    debian_mirror,
    host_debian_mirror,
)

VENDOR_LIST = """\
# Google's repository: suite "stable", which is not a Debian release.
deb [arch=amd64 signed-by=/usr/share/keyrings/google.gpg] https://dl.google.com/linux/chrome/deb/ stable main
"""

DEB822 = """\
Types: deb deb-src
# a comment between fields
URIs: https://mirror.example.org/debian
Suites: trixie trixie-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: https://mirror.example.org/debian-security
Suites: trixie-security
Components: main
"""


def _apt(tmp_path: Path, files: dict[str, str]) -> Path:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (apt / name).write_text(text)
    return apt


def test_deb822_sources_give_the_debian_archive_not_security_or_vendors(tmp_path: Path) -> None:
    apt = _apt(
        tmp_path,
        {
            "sources.list.d/00-chrome.list": VENDOR_LIST,
            "sources.list.d/debian.sources": DEB822,
            "sources.list.d/off.sources.disabled": "Types: deb\nURIs: http://x.invalid/\n",
        },
    )
    uris = [source.uri for source in apt_sources(apt)]
    assert uris == [
        "https://dl.google.com/linux/chrome/deb/",
        "https://mirror.example.org/debian",
        "https://mirror.example.org/debian-security",
    ]
    found = host_debian_mirror(apt)
    assert found is not None
    assert found.uri == "https://mirror.example.org/debian"
    assert found.suites == ("trixie", "trixie-updates")
    assert found.file == apt / "sources.list.d" / "debian.sources"
    assert debian_mirror(apt_dir=apt) == (
        "https://mirror.example.org/debian",
        str(apt / "sources.list.d" / "debian.sources"),
    )


def test_one_line_sources_list_comes_first_and_disabled_stanzas_do_not_count(
    tmp_path: Path,
) -> None:
    apt = _apt(
        tmp_path,
        {
            "sources.list": (
                "# deb http://commented.example/debian bookworm main\n"
                "deb-src http://src.example/debian bookworm main\n"
                "deb\thttp://local.example/debian  bookworm main non-free-firmware # trailing\n"
            ),
            "sources.list.d/debian.sources": "Enabled: no\n" + DEB822,
        },
    )
    found = host_debian_mirror(apt)
    assert found is not None
    assert (found.uri, found.suites, found.components) == (
        "http://local.example/debian",
        ("bookworm",),
        ("main", "non-free-firmware"),
    )
    (apt / "sources.list").unlink()
    # The first stanza is disabled; the second is the security archive: no mirror.
    assert host_debian_mirror(apt) is None


def test_no_debian_mirror_is_a_clear_error_and_an_explicit_one_wins(tmp_path: Path) -> None:
    ubuntu = "deb http://archive.ubuntu.com/ubuntu noble main restricted\n"
    apt = _apt(tmp_path, {"sources.list": ubuntu, "sources.list.d/00-chrome.list": VENDOR_LIST})
    with pytest.raises(BootstrapError) as caught:
        debian_mirror(apt_dir=apt)
    message = str(caught.value)
    assert "no Debian mirror in this host's apt sources" in message
    assert "--mirror URL" in message and MIRROR_ENV in message
    assert "http" not in message  # names no mirror of its own

    assert debian_mirror("http://given.example/debian", apt_dir=apt) == (
        "http://given.example/debian",
        "--mirror",
    )
    assert host_debian_mirror(tmp_path / "no-apt-here") is None


def test_bootstrap_command_takes_a_mirror_option_and_its_env_var() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "harbor_exec.cli", "images", "bootstrap", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert "--mirror" in done.stdout and MIRROR_ENV in done.stdout
