"""Files in and out of containers as tar streams, under budgets.

``build_archive`` packs what a trial places (``put_archive`` at ``/``);
``extract_archive`` unpacks what it reads back (``get_archive``), treating the
content as hostile: bounded by ``OutputLimits``, never outside its destination.
"""

from __future__ import annotations

import io
import os
import tarfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any


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
    #: ``(uid, gid)`` the engine gives the path (None: root's); the engine applies
    #: the header's owner itself, so no program in the container takes part.
    owner: tuple[int, int] | None = None


def build_archive(entries: Iterable[ArchiveEntry]) -> bytes:
    """A tar archive of ``entries`` (owned by root unless an entry names its owner),
    for ``put_archive`` at ``/``."""
    buffer = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for entry in entries:
            info = tarfile.TarInfo(PurePosixPath(entry.path).relative_to("/").as_posix())
            info.mtime = int(now)
            info.mode = entry.mode
            if entry.owner is not None:
                info.uid, info.gid = entry.owner
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


def write_archive(
    target: IO[bytes], entries: Iterable[ArchiveEntry], sources: Iterable[tuple[Path, str]] = ()
) -> None:
    """Like ``build_archive``, into ``target`` (a file), plus each ``(host_path,
    container_path)`` of ``sources`` (a file, or a directory and its tree) streamed
    from disk: an archive of hundreds of megabytes never sits in memory. Links and
    other special files in a tree are left out."""
    now = int(time.time())

    def add(tar: tarfile.TarFile, path: Path, name: str) -> None:
        info = tarfile.TarInfo(name)
        info.mtime = now
        if path.is_symlink():
            return
        if path.is_dir():
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        elif path.is_file():
            stat = path.stat()
            info.size, info.mode = stat.st_size, 0o755 if stat.st_mode & 0o111 else 0o644
            with path.open("rb") as source:
                tar.addfile(info, source)

    with tarfile.open(fileobj=target, mode="w") as tar:
        for entry in entries:
            info = tarfile.TarInfo(PurePosixPath(entry.path).relative_to("/").as_posix())
            info.mtime, info.mode = now, entry.mode
            if entry.data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
        for host_path, container_path in sources:
            base = PurePosixPath(container_path).relative_to("/")
            add(tar, host_path, base.as_posix())
            if host_path.is_dir() and not host_path.is_symlink():
                for path in sorted(host_path.rglob("*")):
                    add(tar, path, (base / path.relative_to(host_path).as_posix()).as_posix())


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
    marker line saying how much was cut. ``max_total_bytes`` bounds the file bytes
    *read* (a huge file spends it even though only its tail is kept); past it, or
    past ``max_files``, ``max_dirs`` or ``max_entries`` (every member: files,
    directories, links, devices), the archive is dropped unread and the report says
    which limit stopped it. Entries deeper than ``max_depth``, with a name over
    ``max_name_bytes`` or a path over ``max_path_bytes`` (relative to the destination,
    well under the host's PATH_MAX even below a deep trial directory) are skipped.
    """

    max_file_bytes: int = 4 * 2**20
    max_total_bytes: int = 256 * 2**20
    max_files: int = 10_000
    max_dirs: int = 10_000
    max_entries: int = 20_000
    max_depth: int = 32
    max_name_bytes: int = 255
    max_path_bytes: int = 1024


#: The verifier's own output (reward files, test logs): read first, on its own small
#: budget, so that nothing the agent wrote can stand between it and the reward.
VERIFIER_OUTPUT_LIMITS = OutputLimits(
    max_file_bytes=4 * 2**20,
    max_total_bytes=32 * 2**20,
    max_files=1_000,
    max_dirs=200,
    max_entries=2_000,
    max_depth=16,
)

#: How many skipped or truncated names a report keeps (each cut to ``_NAME_SHOWN``).
REPORTED_NAMES = 100
_NAME_SHOWN = 200


@dataclass
class ExtractReport:
    """What ``extract_archive`` wrote and what it left out; pass it to the next
    ``extract_archive`` to charge several archives to one budget."""

    files: int = 0
    dirs: int = 0
    entries: int = 0
    bytes_read: int = 0  # file content consumed from the archives
    bytes_written: int = 0
    truncated: list[str] = field(default_factory=list)  # files cut to their tail
    skipped: list[str] = field(default_factory=list)  # "name: why" (links, long paths...)
    skipped_count: int = 0  # all skipped entries; ``skipped`` keeps the first few
    exceeded: str | None = None  # the limit that stopped the copy ("files", "bytes"...)

    @property
    def incomplete(self) -> bool:
        """A total limit stopped the copy: the rest of the archive was not read."""
        return self.exceeded is not None

    def skip(self, name: str, why: str) -> None:
        self.skipped_count += 1
        if len(self.skipped) < REPORTED_NAMES:
            shown = name if len(name) <= _NAME_SHOWN else f"{name[:_NAME_SHOWN]}..."
            self.skipped.append(f"{shown}: {why}")

    def summary(self) -> dict[str, object]:
        """A plain, bounded account for a trial's notes."""
        return {
            "files": self.files,
            "dirs": self.dirs,
            "entries": self.entries,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "exceeded": self.exceeded,
            "truncated": self.truncated[:REPORTED_NAMES],
            "skipped_count": self.skipped_count,
            "skipped": self.skipped,
        }


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


def budget_marker(read: int, size: int, kept: int) -> bytes:
    return (
        f"[harbor-exec: the copy-back budget ran out after {read} of {size} bytes; "
        f"the last {kept} bytes read follow]\n"
    ).encode()


def _read_tail(source: io.BufferedReader | Any, cap: int, budget: int | None) -> tuple[int, bytes]:
    """Read ``source`` (at most ``budget`` bytes) keeping its last ``cap`` bytes;
    returns (bytes read, the tail). Memory stays under 2 x ``cap``."""
    kept = bytearray()
    total = 0
    while budget is None or total < budget:
        block = source.read(1 << 20 if budget is None else min(1 << 20, budget - total))
        if not block:
            break
        total += len(block)
        kept += block
        if len(kept) > 2 * cap:
            del kept[: len(kept) - cap]
    return total, bytes(kept[-cap:]) if total > cap else bytes(kept)


def _copy_capped(source: io.BufferedReader | Any, target: Path, cap: int) -> tuple[int, bool]:
    """Copy ``source`` to ``target`` keeping at most ``cap`` bytes (the tail);
    returns (bytes read, truncated)."""
    total, tail = _read_tail(source, cap, None)
    if total > cap:
        target.write_bytes(cut_marker(total - cap, cap) + tail)
        return total, True
    target.write_bytes(tail)
    return total, False


def _make_dirs(path: Path, root: Path, report: ExtractReport, limits: OutputLimits) -> bool:
    """``mkdir -p`` that charges every directory it creates to ``max_dirs``; False
    (and ``report.exceeded``) when that budget is spent."""
    missing: list[Path] = []
    while path != root and not path.is_dir():
        missing.append(path)
        path = path.parent
    if report.dirs + len(missing) > limits.max_dirs:
        report.exceeded = "dirs"
        return False
    for directory in reversed(missing):
        directory.mkdir(exist_ok=True)
        report.dirs += 1
    return True


def _unwritable(parts: tuple[str, ...], name: str, limits: OutputLimits) -> str | None:
    """Why an entry cannot be written on the host, or None."""
    if any(part in ("..", "", ".") for part in parts):
        return "escapes the destination"
    if len(parts) > limits.max_depth:
        return f"deeper than {limits.max_depth} levels"
    if len(os.fsencode(name)) > limits.max_path_bytes:
        return f"path longer than {limits.max_path_bytes} bytes"
    if any(len(os.fsencode(part)) > limits.max_name_bytes for part in parts):
        return f"name longer than {limits.max_name_bytes} bytes"
    return None


def extract_archive(
    data: bytes | Iterable[bytes],
    dest: Path,
    *,
    strip: int = 1,
    limits: OutputLimits | None = None,
    report: ExtractReport | None = None,
    routes: Mapping[str, Path] | None = None,
) -> ExtractReport:
    """Extract a tar (bytes, or the chunk stream of ``get_archive``) into ``dest``,
    dropping ``strip`` leading path parts.

    With ``routes``, the next path part picks the destination instead (``{"agent":
    dir_a, "artifacts": dir_b}``; ``dest`` is unused) and other members are passed
    over, their bytes still charged. The engine sends a tree in name order, so the
    first member named after every route ends the copy: a sibling the reader does not
    want (``/logs/verifier``, read on its own) is never streamed.

    What a container wrote is untrusted: only regular files and directories are
    written (symlinks, hardlinks and devices are skipped), nothing lands outside
    ``dest``, modes lose setuid/setgid, and ``limits`` bound every file, the depth,
    the names and the totals (counted on from ``report``, when given). An entry the
    host cannot write is skipped and recorded, never raised. The archive is read as
    a stream, so memory stays bounded whatever its size, and a spent budget closes
    the stream at once (the engine stops producing it).
    """
    limits = limits or OutputLimits()
    report = report if report is not None else ExtractReport()
    chunks: Iterable[bytes] = [data] if isinstance(data, bytes) else data
    try:
        if not report.incomplete:
            wanted: dict[str | None, Path] = {None: dest}
            if routes:
                wanted = {route: directory for route, directory in routes.items()}
            roots: dict[str | None, Path] = {}
            for route, directory in wanted.items():
                directory.mkdir(parents=True, exist_ok=True)
                roots[route] = directory.resolve()
            _extract_members(chunks, roots, strip, limits, report)
    except (tarfile.TarError, EOFError) as exc:
        # A stream cut short or garbled (by a budget or by the container): keep what
        # was written, say why the rest is missing.
        report.skip("<archive>", f"unreadable tar: {exc}")
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    return report


def _extract_members(
    chunks: Iterable[bytes],
    roots: Mapping[str | None, Path],
    strip: int,
    limits: OutputLimits,
    report: ExtractReport,
) -> None:
    last_route = max((r for r in roots if r is not None), default=None)
    with tarfile.open(fileobj=_ChunkReader(chunks), mode="r|") as tar:
        for member in tar:
            report.entries += 1
            if report.entries > limits.max_entries:
                report.exceeded = "entries"
                return
            parts = tuple(PurePosixPath(member.name).parts[strip:])
            root = roots.get(None)
            if last_route is not None and parts:
                head, parts = parts[0], parts[1:]
                if head not in roots:
                    if head > last_route:
                        return  # name order: nothing for any route follows
                    report.bytes_read += member.size if member.isfile() else 0
                    if report.bytes_read > limits.max_total_bytes:
                        report.exceeded = "bytes"
                        return
                    continue  # read through, not written
                root = roots[head]
            if not parts or root is None:
                continue
            name = "/".join(parts)
            why = _unwritable(parts, name, limits)
            if why is not None:
                report.skip(name, why)
                continue
            target = root.joinpath(*parts)
            try:
                if not _inside(target, root):
                    report.skip(name, "escapes the destination")
                    continue
                if member.isdir():
                    if not _make_dirs(target, root, report, limits):
                        return
                    continue
                if not member.isfile():
                    report.skip(name, "not a regular file or directory")
                    continue
                if report.files >= limits.max_files:
                    report.exceeded = "files"
                    return
                if report.bytes_read >= limits.max_total_bytes:
                    report.exceeded = "bytes"
                    return
                if not _make_dirs(target.parent, root, report, limits):
                    return
                if target.is_symlink() or target.is_dir():
                    report.skip(name, "a directory or link is in the way")
                    continue
                source = tar.extractfile(member)
                if source is None:
                    continue
                budget = limits.max_total_bytes - report.bytes_read
                if member.size > budget:
                    _copy_over_budget(source, target, member.size, budget, limits.max_file_bytes)
                    truncated = True
                    read = budget
                else:
                    read, truncated = _copy_capped(source, target, limits.max_file_bytes)
                target.chmod(member.mode & 0o777)
                report.bytes_read += read
                report.files += 1
                report.bytes_written += target.stat().st_size
                if truncated and len(report.truncated) < REPORTED_NAMES:
                    report.truncated.append(name)
                if member.size > budget:
                    report.exceeded = "bytes"
                    return
            except OSError as exc:  # e.g. a name the host's filesystem refuses
                report.skip(name, f"cannot be written here: {exc.strerror or exc}")


def _copy_over_budget(
    source: io.BufferedReader | Any, target: Path, size: int, budget: int, cap: int
) -> None:
    """The file that spends the last of the budget: the tail of what was read of it
    (at most ``cap`` bytes), after a marker saying the budget ran out."""
    read, tail = _read_tail(source, cap, budget)
    target.write_bytes(budget_marker(read, size, len(tail)) + tail)


def _inside(path: Path, root: Path) -> bool:
    # The parent is resolved (it exists or will be made by us); the leaf itself may
    # not exist yet and is checked for symlinks before writing.
    try:
        return path.parent.resolve().is_relative_to(root)
    except OSError:
        return False
