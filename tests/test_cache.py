"""One cache setting: $HARBOR_EXEC_CACHE_DIR is the root of every host-side cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from harbor_exec.bundler.cache import default_cache_dir
from harbor_exec.cache import BUILD_LOGS, BUNDLES, SNAPSHOTS, cache_root
from harbor_exec.tasks.snapshots import snapshot_task


def test_root_is_the_setting_else_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HARBOR_EXEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "harbor-exec"
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "harbor-exec" / "bundles"

    monkeypatch.setenv("HARBOR_EXEC_CACHE_DIR", "~/elsewhere")
    assert cache_root() == tmp_path / "home" / "elsewhere"
    assert (BUNDLES, SNAPSHOTS, BUILD_LOGS) == ("bundles", "snapshots", "build-logs")


def test_bundles_and_snapshots_share_one_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    monkeypatch.setenv("HARBOR_EXEC_CACHE_DIR", str(root))
    assert default_cache_dir() == root / "bundles"

    task = tmp_path / "task"
    (task / "tests").mkdir(parents=True)
    (task / "instruction.md").write_text("say hi\n")
    (task / "tests" / "test.sh").write_text("#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n")
    snapshot = snapshot_task(task, task="hello")
    assert snapshot.parent == root / "snapshots"
    assert (snapshot / "instruction.md").read_text() == "say hi\n"
    assert sorted(p.name for p in root.iterdir()) == ["snapshots"]
