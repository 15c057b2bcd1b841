"""A task's *snapshot*: its files checked (no symlink leaves the task, checked on the
file actually opened) and copied, content-addressed, into the cache directory.

Builds and uploads read the snapshot, never the task directory, so a file changed or a
symlink added after loading cannot reach a container. ``task_fingerprint`` tells a
caller when a task directory changed and must be loaded (and checked) again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

from harbor_exec.cache import SNAPSHOTS, cache_root
from harbor_exec.errors import UnsafeTaskPathError


def task_fingerprint(task_dir: Path) -> str:
    """A cheap digest of every entry's metadata (no content read): changes whenever a
    file is written, added, removed, renamed or replaced by a symlink."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(task_dir):
        dirnames.sort()
        for name in sorted([*dirnames, *filenames]):
            path = os.path.join(dirpath, name)
            try:
                info = os.lstat(path)
                link = os.readlink(path) if stat.S_ISLNK(info.st_mode) else ""
            except OSError:
                continue
            digest.update(
                f"{path}\0{info.st_mode}\0{info.st_size}\0{info.st_mtime_ns}\0"
                f"{info.st_ino}\0{link}\n".encode()
            )
    return digest.hexdigest()


def _open_inside(path: Path, root: Path, *, task: str, rel: str) -> int:
    """Open ``path`` for reading; refuse it unless the file actually opened is under ``root``.

    Checking the opened file (not the name) closes the gap in which a checked path
    could be swapped for a symlink before it is read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise UnsafeTaskPathError(
            task, f"cannot be read safely ({exc.strerror})", file=rel
        ) from None
    real = Path(os.readlink(f"/proc/self/fd/{fd}"))
    if not real.is_relative_to(root):
        os.close(fd)
        raise UnsafeTaskPathError(
            task,
            f"resolves outside the task directory (to {real}); copy the file into the task",
            file=rel,
        )
    return fd


def _copy_tree_checked(source: Path, target: Path, root: Path, *, task: str) -> None:
    """Copy ``source`` (inside ``root``) to ``target``, following symlinks that stay
    inside ``root`` and refusing any that leave it. Only files and directories."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in sorted(os.scandir(source), key=lambda e: e.name):
        path = Path(entry.path)
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(root):
            raise UnsafeTaskPathError(
                task,
                f"symlink points outside the task directory (to {os.readlink(path)}); "
                "copy the file into the task instead",
                file=rel,
            )
        if real.is_dir():
            if entry.is_symlink() and (real == root or path.is_relative_to(real)):
                raise UnsafeTaskPathError(task, "symlink loops back into its parent", file=rel)
            _copy_tree_checked(real, target / entry.name, root, task=task)
        elif real.is_file():
            fd = _open_inside(real, root, task=task, rel=rel)
            with os.fdopen(fd, "rb") as handle, open(target / entry.name, "wb") as out:
                shutil.copyfileobj(handle, out, 1 << 20)
                mode = os.fstat(handle.fileno()).st_mode
            (target / entry.name).chmod(0o755 if mode & 0o111 else 0o644)


def snapshot_task(task_dir: Path, *, task: str, store: Path | None = None) -> Path:
    """Check and copy ``task_dir`` into ``store`` (default: ``<cache>/snapshots``),
    named by its content hash; returns the snapshot's directory."""
    store = store or cache_root() / SNAPSHOTS
    store.mkdir(parents=True, exist_ok=True)
    root = task_dir.resolve()
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=store))
    try:
        _copy_tree_checked(root, staging / "task", root, task=task)
        final = store / tree_digest(staging / "task")
        if not final.exists():
            try:
                (staging / "task").rename(final)
            except OSError:  # another process made the same snapshot meanwhile
                if not final.is_dir():
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def tree_digest(root: Path, *, extra: str = "") -> str:
    """sha256 over every file under ``root``: relative path, executable bit and content."""
    digest = hashlib.sha256(f"{extra}\n".encode())
    if root.is_dir():
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = file.relative_to(root).as_posix()
            executable = os.access(file, os.X_OK)
            digest.update(f"{rel}\0{int(executable)}\0{file.stat().st_size}\0".encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()
