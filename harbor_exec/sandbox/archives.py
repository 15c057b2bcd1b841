"""Files in and out of containers as tar streams, under budgets.

``build_archive`` packs what a trial places (``put_archive`` at ``/``);
``extract_archive`` unpacks what it reads back (``get_archive``), treating the
content as hostile: bounded by ``OutputLimits``, never outside its destination.
"""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any


@dataclass(frozen=True)
class ArchiveEntry:
    """One file or directory to place in a container."""

    path: str  # absolute container path
    data: bytes | None = None  # None: a directory
    mode: int = 0o644
    # A directory that replaces whatever is at ``path`` (a tree, a symlink, a file):
    # the engine's extraction removes an existing path whose type differs from the
    # archive's entry, so a file entry first and then the directory empties it.
    fresh: bool = False


def build_archive(entries: Iterable[ArchiveEntry]) -> bytes:
    """A tar archive (owned by root) of ``entries``, for ``put_archive`` at ``/``."""
    buffer = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for entry in entries:
            info = tarfile.TarInfo(PurePosixPath(entry.path).relative_to("/").as_posix())
            info.mtime = int(now)
            info.mode = entry.mode
            if entry.fresh:
                placeholder = tarfile.TarInfo(info.name)
                placeholder.mtime = int(now)
                tar.addfile(placeholder, io.BytesIO(b""))
            if entry.data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
    return buffer.getvalue()


def tree_entries(
    host_dir: Path, container_dir: str, *, executable: Iterable[str] = ()
) -> list[ArchiveEntry]:
    """Entries for every file under ``host_dir``, placed under ``container_dir``.

    Symlinks are followed (task loading already refused ones that escape); the
    files named in ``executable`` (relative paths) get mode 0755, as Harbor's
    ``chmod +x`` would give them.
    """
    forced = set(executable)
    entries = [ArchiveEntry(container_dir, None, 0o755)]
    for path in sorted(host_dir.rglob("*")):
        rel = path.relative_to(host_dir).as_posix()
        target = f"{container_dir}/{rel}"
        if path.is_dir():
            entries.append(ArchiveEntry(target, None, 0o755))
        elif path.is_file():
            mode = 0o755 if rel in forced or path.stat().st_mode & 0o111 else 0o644
            entries.append(ArchiveEntry(target, path.read_bytes(), mode))
    return entries


@dataclass(frozen=True)
class OutputLimits:
    """Bounds on what is copied back from a container (its content is hostile).

    A file over ``max_file_bytes`` keeps its last ``max_file_bytes`` bytes after a
    marker line saying how much was cut; past ``max_total_bytes`` or ``max_files``
    nothing more is written.
    """

    max_file_bytes: int = 4 * 2**20
    max_total_bytes: int = 256 * 2**20
    max_files: int = 10_000


@dataclass
class ExtractReport:
    """What ``extract_archive`` wrote and what it left out."""

    files: int = 0
    bytes_written: int = 0
    truncated: list[str] = field(default_factory=list)  # files cut to their tail
    skipped: list[str] = field(default_factory=list)  # links, devices, escaping paths
    incomplete: bool = False  # a total limit stopped the copy


class _ChunkReader(io.RawIOBase):
    """A read-only file over an iterator of chunks (no chunk kept once consumed)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks: Iterator[bytes] = iter(chunks)
        self._buffer = b""

    def readable(self) -> bool:
        return True

    def readinto(self, target: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._buffer:
            try:
                self._buffer = next(self._chunks)
            except StopIteration:
                return 0
        size = min(len(target), len(self._buffer))
        target[:size] = self._buffer[:size]
        self._buffer = self._buffer[size:]
        return size


def cut_marker(cut: int, kept: int) -> bytes:
    return f"[harbor-exec: {cut} bytes cut here; the last {kept} bytes follow]\n".encode()


def _copy_capped(source: io.BufferedReader | Any, target: Path, cap: int) -> tuple[int, bool]:
    """Copy ``source`` to ``target`` keeping at most ``cap`` bytes (the tail);
    returns (bytes read, truncated). Memory stays under 2 x ``cap``."""
    kept = bytearray()
    total = 0
    while True:
        block = source.read(1 << 20)
        if not block:
            break
        total += len(block)
        kept += block
        if len(kept) > 2 * cap:
            del kept[: len(kept) - cap]
    if total > cap:
        target.write_bytes(cut_marker(total - cap, cap) + bytes(kept[-cap:]))
        return total, True
    target.write_bytes(bytes(kept))
    return total, False


def extract_archive(
    data: bytes | Iterable[bytes],
    dest: Path,
    *,
    strip: int = 1,
    limits: OutputLimits | None = None,
) -> ExtractReport:
    """Extract a tar (bytes, or the chunk stream of ``get_archive``) into ``dest``,
    dropping ``strip`` leading path parts.

    What a container wrote is untrusted: only regular files and directories are
    written (symlinks, hardlinks and devices are skipped), nothing lands outside
    ``dest``, modes lose setuid/setgid, and ``limits`` bound every file and the total.
    The archive is read as a stream, so memory stays bounded whatever its size.
    """
    limits = limits or OutputLimits()
    report = ExtractReport()
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    chunks: Iterable[bytes] = [data] if isinstance(data, bytes) else data
    with tarfile.open(fileobj=_ChunkReader(chunks), mode="r|") as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts[strip:]
            if not parts:
                continue
            name = "/".join(parts)
            target = root.joinpath(*parts)
            if any(part in ("..", "") for part in parts) or not _inside(target, root):
                report.skipped.append(name)
                continue
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            if not member.isfile():
                report.skipped.append(name)
                continue
            if report.files >= limits.max_files or report.bytes_written >= limits.max_total_bytes:
                report.incomplete = True
                break
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink() or target.is_dir():
                report.skipped.append(name)
                continue
            source = tar.extractfile(member)
            if source is None:
                continue
            cap = min(limits.max_file_bytes, limits.max_total_bytes - report.bytes_written)
            _total, truncated = _copy_capped(source, target, max(cap, 0))
            target.chmod(member.mode & 0o777)
            report.files += 1
            report.bytes_written += target.stat().st_size
            if truncated:
                report.truncated.append(name)
    return report


def _inside(path: Path, root: Path) -> bool:
    # The parent is resolved (it exists or will be made by us); the leaf itself may
    # not exist yet and is checked for symlinks before writing.
    try:
        return path.parent.resolve().is_relative_to(root)
    except OSError:
        return False
