"""Setup-provided files: a test that needs one fails under CI, skips elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.setup_files import require_setup_files


def test_present_files_are_returned(tmp_path: Path) -> None:
    (tmp_path / "debian").mkdir()
    (tmp_path / "debian" / "curl_1_amd64.deb").write_bytes(b"x")
    found = require_setup_files(tmp_path, "debian/*.deb")
    assert found == {"debian/*.deb": [tmp_path / "debian" / "curl_1_amd64.deb"]}


def test_missing_files_fail_under_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"pypi/uv-\*\.whl.*scripts/setup\.sh"):
        require_setup_files(tmp_path, "pypi/uv-*.whl")


def test_missing_files_skip_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"scripts/setup\.sh"):
        require_setup_files(tmp_path, "pypi/uv-*.whl")
