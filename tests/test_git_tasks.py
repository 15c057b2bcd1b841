"""Git tasks (``harbor_exec.sources.git``): a local repository over ``file://`` stands in
for a git server. Pinned by commit, fetched once, nothing of the repository's or the
host's git configuration run; refused URLs and unpinned refs get the roots' message."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.backends.harbor.resolver import RolloutRejected, TaskResolver
from harbor_exec.protocol import ExecutionRequest
from harbor_exec.server.app import create_rollout_server
from harbor_exec.sources.git import GitTaskError, GitTaskRefused, GitTaskSource
from tests.server_utils import serve, task_rollout

ROOT = Path(__file__).resolve().parents[1]
HELLO = ROOT / "tasks_examples" / "dataset" / "hello-shell"
ROOTS_MESSAGE = "is not under a served task root"


def git(repo: Path, *args: str) -> str:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(repo.parent),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
    }
    done = subprocess.run(
        ["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def task_repo(root: Path) -> tuple[Path, str]:
    """A repository holding hello-shell under ``tasks/hello`` and something else beside
    it; returns (repo, the commit)."""
    repo = root / "repo"
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    shutil.copytree(HELLO, repo / "tasks" / "hello")
    (repo / "other").mkdir()
    (repo / "other" / "big.bin").write_bytes(b"x" * 10_000)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "one")
    return repo, git(repo, "rev-parse", "HEAD")


def source(tmp_path: Path, repo: Path, **options: object) -> GitTaskSource:
    return GitTaskSource(
        allow=(f"file://{repo}",),
        cache_dir=tmp_path / "git-cache",
        **options,  # type: ignore[arg-type]
    )


def test_a_pinned_task_is_fetched_once_and_a_moved_branch_changes_nothing(tmp_path: Path) -> None:
    repo, first = task_repo(tmp_path)
    (repo / "tasks" / "hello" / "instruction.md").write_text("changed on main\n")
    git(repo, "commit", "-qam", "two")
    git_source = source(tmp_path, repo)
    task_dir, commit = git_source.checkout(f"file://{repo}", first, "tasks/hello")
    assert commit == first
    assert "Hello, world!" in (task_dir / "instruction.md").read_text()  # the pinned commit's
    assert not (task_dir.parent.parent / ".git").exists()  # no git metadata is kept
    # Cached: with the repository gone, the same task still resolves, with no fetch.
    shutil.rmtree(repo)
    again, _ = git_source.checkout(f"file://{repo}", first, "./tasks/hello/")
    assert again == task_dir


def test_unpinned_refs_only_when_allowed_and_then_the_remote_head(tmp_path: Path) -> None:
    repo, first = task_repo(tmp_path)
    with pytest.raises(GitTaskRefused, match="only pinned"):
        source(tmp_path, repo).checkout(f"file://{repo}", None, "tasks/hello")
    with pytest.raises(GitTaskRefused, match="not a full commit id"):
        source(tmp_path, repo).checkout(f"file://{repo}", first[:12], "tasks/hello")
    _, commit = source(tmp_path, repo, allow_unpinned=True).checkout(
        f"file://{repo}", None, "tasks/hello"
    )
    assert commit == first


@pytest.mark.parametrize("path", ["../etc", "/etc", "tasks/../../x"])
def test_paths_that_leave_the_repository_are_refused(tmp_path: Path, path: str) -> None:
    repo, first = task_repo(tmp_path)
    with pytest.raises(GitTaskRefused, match="relative path inside the repository"):
        source(tmp_path, repo).checkout(f"file://{repo}", first, path)


@pytest.mark.parametrize(
    ("files", "budget"), [(1, 1_000_000), (40, 4_500_000)], ids=["one-big-file", "in-all"]
)
def test_a_fetch_over_its_byte_budget_is_refused_and_leaves_nothing(
    tmp_path: Path, files: int, budget: int
) -> None:
    """Over the budget in one file (RLIMIT_FSIZE: the 3 MB pack) or in all of them
    (the pack and the 3 MB checked out: no file is over it)."""
    repo, _ = task_repo(tmp_path)
    for i in range(files):
        (repo / "tasks" / "hello" / f"blob{i}.bin").write_bytes(os.urandom(3_000_000 // files))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "big")
    commit = git(repo, "rev-parse", "HEAD")
    git_source = source(tmp_path, repo, max_bytes=budget)
    with pytest.raises(GitTaskError, match=f"more than {budget} bytes"):
        git_source.checkout(f"file://{repo}", commit, "tasks/hello")
    assert [p.name for p in git_source.cache_dir.iterdir() if p.name != "locks"] == []


def test_neither_the_hosts_git_config_nor_the_repository_runs_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A smudge filter and hooks in the host's global config, and the repository's
    ``.gitattributes`` asking for that filter: the fetch runs none of them."""
    repo, _ = task_repo(tmp_path)
    marker = tmp_path / "ran"
    (repo / "tasks" / "hello" / ".gitattributes").write_text("* filter=evil\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "attributes")
    commit = git(repo, "rev-parse", "HEAD")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for hook in ("post-checkout", "reference-transaction", "fsmonitor-watchman"):
        (hooks / hook).write_text(f"#!/bin/sh\ntouch {marker}\n")
        (hooks / hook).chmod(0o755)
    config = tmp_path / "global.gitconfig"
    config.write_text(
        f'[filter "evil"]\n\tsmudge = "sh -c \'touch {marker}; cat\'"\n\trequired = true\n'
        f"[core]\n\thooksPath = {hooks}\n"
    )
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    task_dir, _ = source(tmp_path, repo).checkout(f"file://{repo}", commit, "tasks/hello")
    assert (task_dir / "instruction.md").is_file()
    assert not marker.exists()


def test_the_resolver_refuses_a_disallowed_url_and_an_unpinned_ref_as_it_refuses_a_path(
    tmp_path: Path,
) -> None:
    repo, commit = task_repo(tmp_path)
    served = tmp_path / "served"
    served.mkdir()
    resolver = TaskResolver(
        served, task_mode="dataset", git=source(tmp_path, repo), written_roots=[tmp_path / "w"]
    )
    cases = [
        {"harbor_task": "/etc"},
        {"harbor_task": "tasks/hello", "git_url": "file:///elsewhere", "git_commit_id": commit},
        {"harbor_task": "tasks/hello", "git_url": f"file://{repo}"},
    ]
    messages = []
    for metadata in cases:
        with pytest.raises(RolloutRejected) as caught:
            resolver.resolve(ExecutionRequest(id="r", prompt=[], metadata=metadata))
        messages.append(str(caught.value).replace(repr(metadata["harbor_task"]), "<ref>"))
    assert len(set(messages)) == 1 and ROOTS_MESSAGE in messages[0]
    resolved = resolver.resolve(
        ExecutionRequest(
            id="r",
            prompt=[],
            metadata={
                "harbor_task": "tasks/hello",
                "git_url": f"file://{repo}",
                "git_commit_id": commit,
            },
        )
    )
    assert resolved.task.origin == {
        "git_url": f"file://{repo}",
        "git_commit_id": commit,
        "path": "tasks/hello",
    }
    assert resolved.task.name == "hello"


@pytest.mark.docker
@pytest.mark.usefixtures("base_images")
def test_a_git_task_runs_end_to_end_and_its_result_names_it(tmp_path: Path) -> None:
    repo, commit = task_repo(tmp_path)
    served = tmp_path / "served"
    served.mkdir()
    backend = HarborBackend(
        tasks_dir=served,
        task_mode="dataset",
        agent="oracle",
        task_git_allow=[f"file://{repo}"],
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        cleanup_successful_trials=False,
    )
    metadata = {"harbor_task": "tasks/hello", "git_url": f"file://{repo}", "git_commit_id": commit}

    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")
    with serve(app) as url:
        result = task_rollout(url, metadata, timeout_sec=120)
    assert result.status.value == "success", result.err_message
    assert result.sample.reward == 1.0
    (trial_dir,) = (tmp_path / "trials").iterdir()
    recorded = json.loads((trial_dir / "result.json").read_text())
    assert recorded["task_id"] == {
        "git_url": f"file://{repo}",
        "git_commit_id": commit,
        "path": "tasks/hello",
    }
    assert recorded["task_name"] == "hello"


def test_serve_passes_the_git_options_to_the_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harbor_exec.backends.harbor.backend import HarborBackend
    from harbor_exec.cli.serve import ServeOptions, build_harbor_backend

    # No engine in the fast suite: record that serve starts the backend before it binds.
    started: list[HarborBackend] = []
    monkeypatch.setattr(HarborBackend, "start", lambda self: started.append(self))

    served = tmp_path / "served"
    served.mkdir()
    options = ServeOptions(
        tasks_dir=served,
        task_mode="dataset",
        agent="oracle",
        task_git_allow=["https://github.com/org/"],
        task_git_allow_unpinned=True,
    )
    backend = build_harbor_backend(options)
    assert started == [backend]
    assert backend.resolver.git.allow == ("https://github.com/org/",)
    assert backend.resolver.git.allow_unpinned is True
