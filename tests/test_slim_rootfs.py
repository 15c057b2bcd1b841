"""The local debian:*-slim stand-in has the official slim image's apt and dpkg settings."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harbor_exec.sandbox.images import DEBIAN_IMAGE
from harbor_exec.sandbox.slim_rootfs import make_slim


def _tree(root: Path, files: list[str]) -> None:
    for name in files:
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)


def test_make_slim_writes_the_settings_and_drops_what_dpkg_would_exclude(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        [
            "/usr/share/doc/curl/copyright",
            "/usr/share/doc/curl/changelog.Debian.gz",
            "/usr/share/doc/curl/examples/a.c",
            "/usr/share/man/man1/curl.1.gz",
            "/usr/share/locale/de/LC_MESSAGES/apt.mo",
            "/usr/share/locale/locale.alias",
            "/usr/share/zoneinfo/UTC",
            "/usr/bin/curl",
        ],
    )
    (tmp_path / "usr/share/man/man1/link.1.gz").symlink_to("curl.1.gz")

    make_slim(tmp_path)

    kept = {
        "/" + path.relative_to(tmp_path).as_posix()
        for path in tmp_path.rglob("*")
        if path.is_file() or path.is_symlink()
    }
    assert "/usr/share/doc/curl/copyright" in kept
    assert "/usr/share/locale/locale.alias" in kept
    assert {"/usr/share/zoneinfo/UTC", "/usr/bin/curl"} <= kept
    for gone in ("/usr/share/doc/curl/changelog.Debian.gz", "/usr/share/doc/curl/examples/a.c"):
        assert gone not in kept
    assert not (tmp_path / "usr/share/doc/curl/examples").exists()
    assert not (tmp_path / "usr/share/man/man1").exists()  # the dangling link went too
    assert not (tmp_path / "usr/share/locale/de").exists()
    assert (tmp_path / "usr/share/man").is_dir()  # the excluded directory itself stays

    apt_conf = tmp_path / "etc/apt/apt.conf.d"
    assert 'Acquire::Languages "none";' in (apt_conf / "docker-no-languages").read_text()
    assert 'Acquire::GzipIndexes "true";' in (apt_conf / "docker-gzip-indexes").read_text()
    assert 'Dir::Cache::pkgcache "";' in (apt_conf / "docker-clean").read_text()
    dpkg = tmp_path / "etc/dpkg/dpkg.cfg.d"
    assert (dpkg / "docker-apt-speedup").read_text().strip() == "force-unsafe-io"
    rules = (dpkg / "docker").read_text().splitlines()
    assert "path-exclude /usr/share/doc/*" in rules
    assert "path-include /usr/share/doc/*/copyright" in rules
    policy = tmp_path / "usr/sbin/policy-rc.d"
    assert policy.stat().st_mode & 0o111 and "exit 101" in policy.read_text()


@pytest.mark.docker
def test_the_bootstrapped_debian_image_fetches_no_translations_and_keeps_docs_out(
    base_images: dict[str, str],
) -> None:
    # apt's own view of its configuration, and dpkg's exclusions applied to a package
    # already in the image: what a task's `apt-get update && apt-get install` runs with.
    probe = subprocess.run(
        [
            "docker", "run", "--rm", "--network", "none", DEBIAN_IMAGE, "sh", "-c",
            "apt-config dump Acquire::Languages Acquire::GzipIndexes;"
            " ls /usr/share/doc/apt; test -x /usr/sbin/policy-rc.d && echo policy-ok",
        ],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    # apt reads the setting as a one-entry list (what a translation fetch consults)
    assert 'Acquire::Languages:: "none";' in probe.stdout
    assert 'Acquire::GzipIndexes "true";' in probe.stdout
    assert probe.stdout.split("\n")[-3:-1] == ["copyright", "policy-ok"]
