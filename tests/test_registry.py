"""Harbor's JSON registry (``harbor_exec.sources.registry``) and ``validate -d
name@version --registry-path``: a local repository over ``file://`` stands in for the
registry's git remotes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harbor_exec.sources.registry import (
    RegistryError,
    fetch_dataset,
    find_dataset,
    read_registry,
    resolve_version,
)
from tests.test_git_tasks import git, task_repo
from tests.test_validate_resume import CLI, env


def registry_file(root: Path, repo: Path, commit: str | None, version: str = "1.0") -> Path:
    rows = [
        {
            "name": "hello-set",
            "version": version,
            "description": "one task",
            "tasks": [
                {
                    "name": "hello",
                    "git_url": f"file://{repo}",
                    "git_commit_id": commit,
                    "path": "tasks/hello",
                }
            ],
            "metrics": [{"type": "mean"}],
        }
    ]
    path = root / "registry.json"
    path.write_text(json.dumps(rows))
    return path


def test_versions_resolve_as_harbor_resolves_them() -> None:
    assert resolve_version(["1.0", "head", "2.0"]) == "head"
    assert resolve_version(["1.9", "1.10", "0.5"]) == "1.10"
    assert resolve_version(["beta", "alpha"]) == "beta"


def test_a_bad_registry_or_reference_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"name": "x", "version": "1", "tasks": [{"git_url": "u"}]}]))
    with pytest.raises(RegistryError, match=r"bad.json: dataset \[0\]\.tasks\.0\.name"):
        read_registry(path=bad)
    with pytest.raises(RegistryError, match="not JSON"):
        (tmp_path / "t.json").write_text("{")
        read_registry(path=tmp_path / "t.json")
    repo, commit = task_repo(tmp_path)
    datasets = read_registry(path=registry_file(tmp_path, repo, commit))
    with pytest.raises(
        RegistryError, match=r"no dataset 'nope' in the registry \(it has: hello-set\)"
    ):
        find_dataset(datasets, "nope@1.0")
    with pytest.raises(RegistryError, match=r"has no version '9' \(it has: 1.0\)"):
        find_dataset(datasets, "hello-set@9")
    assert find_dataset(datasets, "hello-set").version == "1.0"


def test_an_unpinned_registry_task_is_refused_before_any_fetch(tmp_path: Path) -> None:
    repo, _ = task_repo(tmp_path)
    dataset = find_dataset(read_registry(path=registry_file(tmp_path, repo, "main")), "hello-set")
    with pytest.raises(RegistryError, match="task 'hello' is not pinned to a full commit id"):
        fetch_dataset(dataset, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_a_pinned_dataset_is_fetched_once_by_commit(tmp_path: Path) -> None:
    repo, commit = task_repo(tmp_path)
    dataset = find_dataset(read_registry(path=registry_file(tmp_path, repo, commit)), "hello-set")
    fetched = fetch_dataset(dataset, cache_dir=tmp_path / "cache")
    assert [(f.task.name, f.commit) for f in fetched] == [("hello", commit)]
    assert (fetched[0].directory / "task.toml").is_file()
    # The branch moves on; the pinned dataset still runs the same files, from the cache.
    (repo / "tasks" / "hello" / "instruction.md").write_text("changed\n")
    git(repo, "commit", "-qam", "two")
    again = fetch_dataset(dataset, cache_dir=tmp_path / "cache")
    assert again[0].directory == fetched[0].directory
    assert "changed" not in (again[0].directory / "instruction.md").read_text()


@pytest.mark.docker
@pytest.mark.usefixtures("base_images")
def test_validate_runs_a_registry_dataset_with_harbors_job_layout(tmp_path: Path) -> None:
    repo, commit = task_repo(tmp_path)
    registry = registry_file(tmp_path, repo, commit)
    jobs = tmp_path / "jobs"
    done = subprocess.run(
        [
            *CLI,
            "validate",
            "-d",
            "hello-set@1.0",
            "--registry-path",
            str(registry),
            "--jobs-dir",
            str(jobs),
            "--job-name",
            "r",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    config = json.loads((jobs / "r" / "config.json").read_text())
    assert config["datasets"] == [
        {"name": "hello-set", "version": "1.0", "registry": {"path": str(registry)}}
    ]
    results = [json.loads(p.read_text()) for p in (jobs / "r").glob("*/result.json")]
    assert len(results) == 1
    assert results[0]["task_id"] == {
        "git_url": f"file://{repo}",
        "git_commit_id": commit,
        "path": "tasks/hello",
    }
    assert results[0]["verifier_result"]["rewards"]["reward"] == 1.0
    # Neither a PATH with -d nor -d without a registry runs anything.
    both = subprocess.run(
        [*CLI, "validate", str(tmp_path), "-d", "hello-set"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert both.returncode == 2 and "give a task or dataset PATH, or -d" in both.stdout
    alone = subprocess.run(
        [*CLI, "validate", "-d", "hello-set"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
    )
    assert alone.returncode == 2 and "exactly one of --registry-path" in alone.stdout
