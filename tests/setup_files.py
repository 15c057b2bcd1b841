"""Files that ``scripts/setup.sh`` provides for the tests (fetched from the package
registries there, never by a test).

A test that needs one skips on a developer's machine without it and fails under CI
(``CI=true``): a skipped test there would hide a broken setup step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: ``ensure_test_packages`` in scripts/setup.sh: Debian bookworm's curl and the libraries
#: python:3.11-slim-bookworm lacks (``debian/*.deb``), nodejs's beyond those
#: (``debian-node/*.deb``), uv's wheel (``pypi/uv-*.whl``), npm's tarball (``npm/``).
TEST_PACKAGES = ROOT / ".cache" / "test-packages"
TEST_PACKAGE_PATTERNS = (
    "debian/curl_*.deb",
    "debian/*.deb",
    "debian-node/nodejs_*.deb",
    "debian-node/*.deb",
    "pypi/uv-*.whl",
    "npm/npm-*.tgz",
)


def require_setup_files(directory: Path, *patterns: str) -> dict[str, list[Path]]:
    """The files under ``directory`` matching each glob ``pattern`` (each must match
    one at least); fails under CI, skips elsewhere, naming what is missing."""
    found = {pattern: sorted(directory.glob(pattern)) for pattern in patterns}
    missing = [pattern for pattern, paths in found.items() if not paths]
    if missing:
        message = (
            f"missing {', '.join(str(directory / m) for m in missing)}: "
            "run ./scripts/setup.sh (it fetches them)"
        )
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return found
