"""Trees as uncompressed tars, for Ray's object store (no shared filesystem).

Task snapshots and wheelhouses go to a node once per content key and are
unpacked under its cache (``materialize``); a trial directory's files (logs,
artifacts) come back the same way.
"""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from pathlib import Path


def tar_dir(root: Path, *, limit: int | None = None) -> bytes:
    """``root`` as an uncompressed tar (regular files and dirs; no links), in memory."""
    buffer = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(root.rglob("*")):
            if path.is_symlink():
                continue
            rel = path.relative_to(root).as_posix()
            if path.is_dir():
                tar.add(path, arcname=rel, recursive=False)
            elif path.is_file():
                size = path.stat().st_size
                if limit is not None and total + size > limit:
                    continue  # over the bound: dropped (each part is bounded already)
                total += size
                tar.add(path, arcname=rel, recursive=False)
    return buffer.getvalue()


def untar(data: bytes, target: Path) -> None:
    """Extract ``data`` (from ``tar_dir``) into ``target``, refusing anything unsafe."""
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(target, filter="data")


def materialize(root: Path, key: str, data: bytes) -> Path:
    """``root/key`` holding ``data``'s files, written once (atomically) per node."""
    final = root / key
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=root))
    untar(data, scratch)
    try:
        scratch.rename(final)
    except OSError:  # another trial won the race: same content
        shutil.rmtree(scratch, ignore_errors=True)
    return final


__all__ = ["materialize", "tar_dir", "untar"]
