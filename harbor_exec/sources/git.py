"""Tasks from git: a repository fetched at one commit into a content-addressed cache.

``GitTaskSource.checkout(url, commit, path)`` returns the task directory ``path`` of
``url`` at ``commit``, fetched once into ``<cache>/git-tasks/<key>/`` and reused after
(a cached task costs no fetch). The fetch is shallow (``--depth 1``, only that
commit, blobs only under ``path`` when the server filters), and runs nothing the
repository or this host's git configuration names: no hooks, no filters or LFS, no
submodules, no system or global config, no credential prompts, only the URL schemes
the operator's prefixes use. It is bounded in bytes (every file the fetch writes,
watched while it runs; ``RLIMIT_FSIZE`` per file) and in time, and a fetch that ends
anywhere else than ``commit`` is refused. What is published is immutable; the task
is then loaded, checked and snapshotted like any other.

Only URLs under one of the operator's ``allow`` prefixes are fetched; a commit must be
pinned (a full object id) unless ``allow_unpinned``, when the remote's ``HEAD`` is
resolved first (and the cache keyed by the commit it names).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from harbor_exec.bundler.cache import entry_lock
from harbor_exec.cache import cache_root
from harbor_exec.errors import HarborExecError

__all__ = [
    "GIT_TASKS",
    "GitTaskError",
    "GitTaskRefused",
    "GitTaskSource",
]

GIT_TASKS = "git-tasks"
#: A full object id: SHA-1 (40 hex) or SHA-256 (64 hex) repositories.
_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
#: Schemes git may use, by how a prefix starts; everything else (``ext::``, ...) is off.
_SCHEMES = {"https": "https", "http": "http", "ssh": "ssh", "git": "git", "file": "file"}
_WATCH_SEC = 0.1


class GitTaskError(HarborExecError):
    """A git task could not be fetched (the message says which step and why)."""


class GitTaskRefused(GitTaskError):
    """The operator does not allow this URL or an unpinned ref."""


def _git_env(home: Path) -> dict[str, str]:
    """An environment in which git reads no configuration but ours and never prompts."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_ASKPASS": "/bin/false",
        "SSH_ASKPASS": "/bin/false",
        "GIT_LFS_SKIP_SMUDGE": "1",
        "GIT_SSH_COMMAND": "ssh -o BatchMode=yes -o StrictHostKeyChecking=yes",
        "LC_ALL": "C",
    }


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):  # gone meanwhile: git renames as it goes
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


@dataclass
class GitTaskSource:
    """Fetches git tasks for one server (see the module doc)."""

    allow: Sequence[str] = ()
    allow_unpinned: bool = False
    cache_dir: Path = field(default_factory=lambda: cache_root() / GIT_TASKS)
    max_bytes: int = 512 * 1024 * 1024
    timeout_sec: float = 300.0

    def allows(self, url: str) -> bool:
        return any(url.startswith(prefix) for prefix in self.allow)

    def checkout(self, url: str, commit: str | None, path: str) -> tuple[Path, str]:
        """``(task directory, commit)`` of ``path`` in ``url`` at ``commit``."""
        if not self.allows(url):
            raise GitTaskRefused(f"git_url {url!r} is not under an allowed prefix")
        inner = _inner_path(path)
        if commit is None:
            if not self.allow_unpinned:
                raise GitTaskRefused(
                    f"git_url {url!r} without git_commit_id: this server runs only pinned "
                    "git tasks (a full commit id)"
                )
            commit = self._remote_head(url)
        elif not _COMMIT.fullmatch(commit):
            raise GitTaskRefused(
                f"git_commit_id {commit!r} is not a full commit id (40 or 64 hex digits)"
            )
        key = hashlib.sha256(f"{url}\0{commit}\0{inner}".encode()).hexdigest()[:32]
        entry = self.cache_dir / key
        if not (entry / "repo").is_dir():
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            with entry_lock(self.cache_dir, "git", key):
                if not (entry / "repo").is_dir():
                    self._fetch(url, commit, inner, entry)
        task_dir = entry / "repo" / inner if inner != "." else entry / "repo"
        if not task_dir.is_dir() or task_dir.is_symlink():
            raise GitTaskError(f"{url} at {commit[:12]} has no task directory {path!r}")
        return task_dir, commit

    # ----------------------------------------------------------------- git

    def _protocols(self, url: str) -> list[str]:
        scheme = urlsplit(url).scheme or ("file" if url.startswith("/") else "ssh")
        allowed = _SCHEMES.get(scheme)
        if allowed is None:
            raise GitTaskRefused(f"git_url {url!r}: scheme {scheme!r} is not fetched")
        return ["-c", "protocol.allow=never", "-c", f"protocol.{allowed}.allow=always"]

    def _git(
        self, args: list[str], *, cwd: Path, home: Path, url: str, watch: Path | None = None
    ) -> str:
        command = [
            "git",
            *self._protocols(url),
            "-c",
            "core.hooksPath=/dev/null",
            "-c",
            "core.fsmonitor=false",
            "-c",
            "submodule.recurse=false",
            "-c",
            "advice.detachedHead=false",
            *args,
        ]
        limit = self.max_bytes

        def cap_file_size() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        started = time.monotonic()
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=_git_env(home),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=cap_file_size,
        )
        too_big = threading.Event()
        finished = threading.Event()

        def watch_size() -> None:
            while not finished.wait(_WATCH_SEC):
                if watch is not None and _tree_bytes(watch) > limit:
                    too_big.set()
                    process.kill()
                    return

        watcher = threading.Thread(target=watch_size, daemon=True)
        watcher.start()
        try:
            remaining = max(1.0, self.timeout_sec - (time.monotonic() - started))
            out, err = process.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise GitTaskError(
                f"fetching {url} took longer than {self.timeout_sec:g}s (git {args[0]})"
            ) from None
        finally:
            finished.set()
            watcher.join()
        # A file past RLIMIT_FSIZE kills its writer with SIGXFSZ (git reports the signal).
        xfsz = int(signal.SIGXFSZ)
        if watch is not None and _tree_bytes(watch) > limit:  # what it wrote last, too
            too_big.set()
        if too_big.is_set() or process.returncode == -xfsz or f"signal {xfsz}".encode() in err:
            raise GitTaskError(f"fetching {url} wrote more than {limit} bytes; refused")
        if process.returncode != 0:
            tail = err.decode("utf-8", errors="replace").strip()[-800:]
            raise GitTaskError(f"git {args[0]} of {url} failed ({process.returncode}): {tail}")
        return out.decode("utf-8", errors="replace")

    def _remote_head(self, url: str) -> str:
        with tempfile.TemporaryDirectory(prefix="hx-git-") as scratch:
            out = self._git(
                ["ls-remote", url, "HEAD"], cwd=Path(scratch), home=Path(scratch), url=url
            )
        for line in out.splitlines():
            commit, _, ref = line.partition("\t")
            if ref == "HEAD" and _COMMIT.fullmatch(commit):
                return commit
        raise GitTaskError(f"{url} has no HEAD to run (git ls-remote)")

    def _fetch(self, url: str, commit: str, inner: str, entry: Path) -> None:
        stage = Path(tempfile.mkdtemp(prefix=".stage-", dir=self.cache_dir))
        try:
            repo, home = stage / "repo", stage / "home"
            repo.mkdir()
            home.mkdir()

            def git(*args: str) -> str:
                return self._git(list(args), cwd=repo, home=home, url=url, watch=stage)

            git("init", "-q")
            git("remote", "add", "origin", url)
            if inner != ".":
                git("sparse-checkout", "set", "--no-cone", f"/{inner}/")
            git(
                "fetch",
                "-q",
                "--depth",
                "1",
                "--no-tags",
                "--no-recurse-submodules",
                "--filter=blob:none",
                "origin",
                commit,
            )
            fetched = git("rev-parse", "FETCH_HEAD^{commit}").strip()
            if fetched != commit:
                raise GitTaskError(f"{url}: fetched {fetched}, not the pinned {commit}")
            git("checkout", "-q", "--detach", commit)
            shutil.rmtree(repo / ".git")
            shutil.rmtree(home)
            entry.parent.mkdir(parents=True, exist_ok=True)
            if entry.exists():
                shutil.rmtree(entry)
            os.rename(stage, entry)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise


def _inner_path(path: str) -> str:
    """``path`` inside the repository, normalised; GitTaskRefused for an escape."""
    posix = PurePosixPath(path or ".")
    if posix.is_absolute() or ".." in posix.parts or "\0" in path:
        raise GitTaskRefused(f"harbor_task {path!r} must be a relative path inside the repository")
    parts = [p for p in posix.parts if p not in ("", ".")]
    return "/".join(parts) or "."
