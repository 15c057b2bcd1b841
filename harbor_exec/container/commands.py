"""The command server: a trial container's commands over one stream the host holds.

Started with the container, as root, before anything of the task runs: it is the
container's first process (``--then`` names the init it becomes after forking the
server), so no engine exec is needed to start it. The server connects to the host's
unix socket (``--socket``, a directory of the trial's mounted read-only), says hello
with its token and pid, then runs each command the host sends: argv, ``uid:gid``
(with the groups and ``HOME`` ``docker exec`` gives that user, read from the
container's own account files as runc reads them), working directory,
environment, stdin; its stdout and stderr go back in frames, then its exit code.

The host accepts one hello per container start, before the first command: a server
the agent starts later, or a connection of its own, is never heard
(``harbor_exec.sandbox.channel``). The server makes itself non-dumpable first, so no
process of the container (root included) can open its memory or ptrace it; the agent
can still kill it, and then the host runs the container's commands through the
engine again. Output a command writes is data inside the server's frames: nothing a
process in the container writes can make a frame of its own.

Files go in and out the same way (``KIND_PUT``: a tar archive unpacked at ``/`` as the
engine's archive API unpacks one; ``KIND_GET``: a path's tree packed as a tar archive),
done by the server itself, never by a program of the image: the host sends them only
when nothing of the agent runs any more (between phases, after the kill) or before it
ran. The modules they need are imported before the hello (nothing later is loaded
from where the agent could have written), and no owner name is looked up (the image's
name service could load its libraries into this root process).

Frames, both ways: a 4-byte big-endian length (of what follows), a kind byte, a
4-byte request id, the payload. Standard library only: it runs on the read-only
runtime's Python, never the image's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import posixpath
import queue
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import IO, Any, Final

__all__ = [
    "ADDED_VARIABLES",
    "EXEC_START_FAILED",
    "FRAME_HEAD",
    "GET_NOT_FOUND",
    "KIND_CANCEL",
    "KIND_ERR",
    "KIND_EXIT",
    "KIND_GET",
    "KIND_HELLO",
    "KIND_OUT",
    "KIND_PUT",
    "KIND_RUN",
    "KIND_STDIN",
    "MAX_FRAME",
    "encode_frame",
    "main",
    "read_exact",
    "read_frame",
]

#: length (of kind + id + payload), kind, request id.
FRAME_HEAD: Final = struct.Struct(">IBI")
#: The largest frame either side sends (a chunk of output or stdin, or a request).
MAX_FRAME: Final = 1 << 20
KIND_HELLO: Final = 0  # server -> host: {"token", "pid"}
KIND_OUT: Final = 1  # server -> host: stdout bytes
KIND_ERR: Final = 2  # server -> host: stderr bytes
KIND_EXIT: Final = 3  # server -> host: {"exit_code"}
KIND_RUN: Final = 10  # host -> server: {"argv", "user", "workdir", "env", "stdin"}
KIND_STDIN: Final = 11  # host -> server: stdin bytes; empty: end of input
KIND_PUT: Final = 12  # host -> server: {}; the archive follows as KIND_STDIN frames
KIND_GET: Final = 13  # host -> server: {"path"}; the archive comes back as KIND_OUT
KIND_CANCEL: Final = 14  # host -> server: stop sending the request's archive
#: A get's exit code when its path does not exist (the engine's 404).
GET_NOT_FOUND: Final = 2
#: What ``docker exec`` answers a command that could not start (on stdout, exit 126).
EXEC_START_FAILED: Final = 126
_CHUNK: Final = 64 * 1024
#: A put's chunks (256 KiB each from the host) held at most before the unpacking.
_PUT_CHUNKS_HELD: Final = 16
_OUTPUT_GRACE_SEC: Final = 2.0
#: Set in this process's environment by others than the container's config: runc
#: (``HOME``, the root user's) and Python (``LC_CTYPE``, its C locale coercion).
ADDED_VARIABLES: Final = ("HOME", "LC_CTYPE")


def encode_frame(kind: int, request: int, payload: bytes = b"") -> bytes:
    return FRAME_HEAD.pack(len(payload) + 5, kind, request) + payload


def read_exact(sock: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or None at the end of the stream."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def read_frame(sock: socket.socket, max_payload: int = MAX_FRAME) -> tuple[int, int, bytes] | None:
    """The next frame's ``(kind, request, payload)``; None at the end of the stream or
    for a frame whose payload would pass ``max_payload`` (the stream is then over)."""
    head = read_exact(sock, FRAME_HEAD.size)
    if head is None:
        return None
    length, kind, request = FRAME_HEAD.unpack(head)
    if not 5 <= length <= max_payload + 5:
        return None
    payload = read_exact(sock, length - 5)
    return None if payload is None else (kind, request, payload)


class _Server:
    def __init__(self, sock: socket.socket, base_env: dict[str, str]) -> None:
        self.sock = sock
        self.base_env = base_env
        self.send_lock = threading.Lock()
        #: Where each request's input chunks go (a command's stdin, a put's archive).
        self.stdins: dict[int, queue.SimpleQueue[bytes] | queue.Queue[bytes]] = {}
        self.cancelled: set[int] = set()

    def send(self, kind: int, request: int, payload: bytes = b"") -> None:
        with self.send_lock:
            self.sock.sendall(encode_frame(kind, request, payload))

    def serve(self) -> None:
        while frame := read_frame(self.sock):
            kind, request, payload = frame
            if kind == KIND_RUN:
                # Started here, before the next frame is read: its stdin is in place
                # for the frames that follow.
                self.start(request, json.loads(payload))
            elif kind == KIND_STDIN:
                stdin = self.stdins.get(request)
                if stdin is not None:
                    stdin.put(payload)
                    if not payload:
                        self.stdins.pop(request, None)
            elif kind == KIND_PUT:
                # Bounded: a big archive waits in the socket, not in this container's
                # memory (the host sends it only between phases: nothing else is asked).
                chunks: queue.Queue[bytes] = queue.Queue(maxsize=_PUT_CHUNKS_HELD)
                self.stdins[request] = chunks
                self._builtin(request, _unpack_whole, _ChunkReader(chunks))
            elif kind == KIND_GET:
                path = str(json.loads(payload)["path"])
                self._builtin(request, self._pack, request, path)
            elif kind == KIND_CANCEL:
                self.cancelled.add(request)

    def _builtin(self, request: int, work: Any, *args: Any) -> None:
        """Run ``work(*args)`` (an archive in or out) on a thread of its own; its exit
        code (an error: 1, its message on stderr) ends the request."""

        def run() -> None:
            try:
                code = int(work(*args))
            except Exception as exc:  # the host falls back to the engine
                self.send(KIND_ERR, request, repr(exc).encode()[:4096])
                code = 1
            self.stdins.pop(request, None)
            self.cancelled.discard(request)
            self.exited(request, code)

        threading.Thread(target=run, daemon=True).start()

    def _pack(self, request: int, path: str) -> int:
        """``path``'s tree as the engine's archive API packs it (its base name at the
        top, links as links, nothing followed), sent as output frames."""
        try:
            os.lstat(path)
        except OSError:
            return GET_NOT_FOUND
        out = _FrameWriter(self, request)
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            for full, name in _walk(path, posixpath.basename(path.rstrip("/")) or "."):
                if request in self.cancelled:
                    return 1
                _add(tar, full, name)
        out.flush()
        return 0

    def start(self, request: int, spec: dict[str, Any]) -> None:
        try:
            process = self._start(request, spec)
        except Exception as exc:  # never a silent request: the host waits on its exit
            self._start_failed(request, f"the command server failed: {exc!r}")
            process = None
        if process is None:
            self.exited(request, EXEC_START_FAILED)
            return
        if process.stdin is not None:
            stdin: queue.SimpleQueue[bytes] = queue.SimpleQueue()
            self.stdins[request] = stdin
            threading.Thread(target=_feed, args=(process.stdin, stdin), daemon=True).start()
        threading.Thread(target=self.finish, args=(request, process), daemon=True).start()

    def exited(self, request: int, code: int) -> None:
        self.send(KIND_EXIT, request, json.dumps({"exit_code": code}).encode())

    def finish(self, request: int, process: subprocess.Popen[bytes]) -> None:
        readers = [
            threading.Thread(target=self._pump, args=(pipe, kind, request), daemon=True)
            for pipe, kind in ((process.stdout, KIND_OUT), (process.stderr, KIND_ERR))
        ]
        for reader in readers:
            reader.start()
        code = process.wait()
        # As ``docker exec``: a process the command left behind holding its output
        # delays the end by at most this grace, then the command has ended.
        deadline = time.monotonic() + _OUTPUT_GRACE_SEC
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        self.stdins.pop(request, None)
        self.exited(request, code if code >= 0 else 128 - code)

    def _start_failed(self, request: int, what: str) -> None:
        message = f"OCI runtime exec failed: exec failed: unable to start container process: {what}"
        self.send(KIND_OUT, request, (message + ": unknown\r\n").encode())

    def _start(self, request: int, spec: dict[str, Any]) -> subprocess.Popen[bytes] | None:
        argv = [str(a) for a in spec["argv"]]
        uid_text, colon, gid_text = str(spec.get("user") or "0:0").partition(":")
        uid = int(uid_text)
        name, home, primary = _passwd_entry(uid)
        # runc: "uid:gid" gets that group alone; "uid" the account's group and every
        # group that lists the account.
        gid = int(gid_text) if colon else primary
        groups = [gid] if colon else _groups_of(name, gid)
        env = dict(self.base_env)
        env.update({str(k): str(v) for k, v in (spec.get("env") or {}).items()})
        env.setdefault("HOME", home)
        workdir = spec.get("workdir") or None
        if workdir is not None and not os.path.isdir(workdir):
            self._start_failed(
                request,
                f'chdir to cwd ("{workdir}") set in config.json failed: no such file or directory',
            )
            return None
        try:
            return subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if spec.get("stdin") else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                user=uid,
                group=gid,
                extra_groups=groups,
                close_fds=True,
            )
        except FileNotFoundError:
            what = f'exec: "{argv[0]}": executable file not found in $PATH'
            if "/" in argv[0]:
                what = f'exec: "{argv[0]}": stat {argv[0]}: no such file or directory'
            self._start_failed(request, what)
            return None
        except PermissionError:
            self._start_failed(request, f'exec: "{argv[0]}": permission denied')
            return None

    def _pump(self, pipe: IO[bytes] | None, kind: int, request: int) -> None:
        assert pipe is not None
        with pipe:
            while chunk := os.read(pipe.fileno(), _CHUNK):
                self.send(kind, request, chunk)


class _ChunkReader:
    """A file over the host's chunks (an empty one: the end)."""

    def __init__(self, chunks: queue.Queue[bytes]) -> None:
        self.chunks = chunks
        self.current = b""
        self.offset = 0
        self.ended = False

    def read(self, size: int = -1) -> bytes:
        parts: list[bytes] = []
        while size != 0:
            if self.offset >= len(self.current):
                if self.ended:
                    break
                self.current, self.offset = self.chunks.get(), 0
                if not self.current:
                    self.ended = True
                    break
            left = len(self.current) - self.offset
            take = left if size < 0 else min(size, left)
            parts.append(self.current[self.offset : self.offset + take])
            self.offset += take
            if size > 0:
                size -= take
        return b"".join(parts)

    def drain(self) -> None:
        """Take (and drop) what is left, to the end."""
        while not self.ended:
            self.ended = not self.chunks.get()


class _FrameWriter:
    """A file whose writes go to the host as output frames."""

    def __init__(self, server: _Server, request: int) -> None:
        self.server = server
        self.request = request
        self.buffer = bytearray()

    def write(self, data: bytes) -> int:
        if self.request in self.server.cancelled:
            raise OSError("cancelled by the host")
        self.buffer += data
        while len(self.buffer) >= _CHUNK:
            self.server.send(KIND_OUT, self.request, bytes(self.buffer[:_CHUNK]))
            del self.buffer[:_CHUNK]
        return len(data)

    def flush(self) -> None:
        if self.buffer:
            self.server.send(KIND_OUT, self.request, bytes(self.buffer))
            self.buffer.clear()


def _walk(path: str, name: str) -> Iterator[tuple[str, str]]:
    """``(path, archive name)`` of ``path`` and, for a directory (never through a
    link), of everything under it, parents first."""
    yield path, name
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        return
    with os.scandir(path) as entries:
        children = sorted(entry.name for entry in entries)
    for child in children:
        try:
            yield from _walk(posixpath.join(path, child), f"{name}/{child}")
        except FileNotFoundError:
            continue


def _add(tar: tarfile.TarFile, path: str, name: str) -> None:
    """One entry, its owner by number only; sockets and devices are left out."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    info = tarfile.TarInfo(name)
    info.mode, info.uid, info.gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
    info.mtime = int(st.st_mtime)
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(st.st_mode):
        info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
    elif stat.S_ISFIFO(st.st_mode):
        info.type = tarfile.FIFOTYPE
    elif stat.S_ISREG(st.st_mode):
        # Opened without following a link put there since (and never blocking).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as source:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return
            info.size = os.fstat(fd).st_size
            tar.addfile(info, source)
        return
    else:
        return
    tar.addfile(info)


def _unpack_whole(stream: _ChunkReader) -> int:
    """``_unpack``, then the rest of the stream taken (what a failed unpack, or the tar's
    end padding, left): the reading loop never waits on a full queue."""
    try:
        return _unpack(stream)
    finally:
        stream.drain()


def _unpack(stream: _ChunkReader) -> int:
    """Unpack a tar archive at ``/`` as the engine's archive API does: an existing path
    is replaced unless both it and the entry are directories (then merged); a missing
    parent is made (0755); owner (by number), mode and times from the header; links are
    written as links, never followed at the leaf."""
    directories: list[tuple[str, tarfile.TarInfo]] = []
    with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
        for member in tar:
            path = posixpath.normpath("/" + member.name)
            if path == "/":
                continue
            with contextlib.suppress(FileNotFoundError):
                existing = os.lstat(path)
                if not (stat.S_ISDIR(existing.st_mode) and member.isdir()):
                    if stat.S_ISDIR(existing.st_mode):
                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
            os.makedirs(posixpath.dirname(path), 0o755, exist_ok=True)
            if member.isdir():
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o700)
                directories.append((path, member))
            elif member.isfile():
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                source = tar.extractfile(member)
                assert source is not None
                with os.fdopen(os.open(path, flags, 0o600), "wb") as target:
                    shutil.copyfileobj(source, target)
            elif member.issym():
                os.symlink(member.linkname, path)
            elif member.islnk():
                os.link(posixpath.normpath("/" + member.linkname), path, follow_symlinks=False)
            else:
                continue  # devices and fifos: never in what the host sends
            os.lchown(path, member.uid, member.gid)
            if not member.issym():
                os.chmod(path, stat.S_IMODE(member.mode))
                if not member.isdir():
                    os.utime(path, (member.mtime, member.mtime))
    for path, member in reversed(directories):  # children first changed their parents
        os.utime(path, (member.mtime, member.mtime))
    return 0


def _feed(pipe: IO[bytes], chunks: queue.SimpleQueue[bytes]) -> None:
    """Write the host's stdin chunks to a command, in order; an empty one closes it. A
    command that stops reading loses the rest, as a pipe's writer sees it."""
    try:
        while chunk := chunks.get():
            pipe.write(chunk)
            pipe.flush()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


def _passwd_entry(uid: int) -> tuple[str | None, str, int]:
    """The user name, home and group of ``uid`` in the container's ``/etc/passwd``
    (runc's lookup for ``docker exec``): ``(None, "/", 0)`` when it has none."""
    try:
        with open("/etc/passwd", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                fields = line.rstrip("\n").split(":")
                if len(fields) >= 6 and fields[2].strip().isdigit() and int(fields[2]) == uid:
                    gid = int(fields[3]) if fields[3].strip().isdigit() else 0
                    return fields[0], fields[5] or "/", gid
    except OSError:
        pass
    return None, "/", 0


def _groups_of(name: str | None, gid: int) -> list[int]:
    """The supplementary groups ``docker exec`` gives user ``name``: every group of the
    container's ``/etc/group`` that lists it, and its primary group."""
    groups = [gid]
    if name is None:
        return groups
    try:
        with open("/etc/group", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                fields = line.rstrip("\n").split(":")
                if len(fields) >= 4 and fields[2].strip().isdigit():
                    members = fields[3].split(",")
                    if name in members and int(fields[2]) not in groups:
                        groups.append(int(fields[2]))
    except OSError:
        pass
    return groups


def _not_dumpable() -> None:
    """``PR_SET_DUMPABLE`` 0: no process of the container may open the server's
    memory or ptrace it (root without ``CAP_SYS_PTRACE`` included)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if int(libc.prctl(4, 0, 0, 0, 0)) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_DUMPABLE")


def serve(socket_path: str, token: str, keep: Sequence[str]) -> None:
    """Connect, say hello, serve until the host hangs up (then exit)."""
    _not_dumpable()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path)
    hello = json.dumps({"token": token, "pid": os.getpid()}).encode()
    sock.sendall(encode_frame(KIND_HELLO, 0, hello))
    # What a command gets is the container's environment: not what runc gave this
    # process as its root user (HOME) nor what Python set for itself (LC_CTYPE, PEP 538).
    base = {k: v for k, v in os.environ.items() if k in keep or k not in ADDED_VARIABLES}
    _Server(sock, base).serve()


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    # Everything after --then is the init's argv, "--" and all: never argparse's to read.
    then: list[str] = []
    if "--then" in arguments:
        at = arguments.index("--then")
        arguments, then = arguments[:at], arguments[at + 1 :]
    parser = argparse.ArgumentParser(prog="commands", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="the host's unix socket")
    parser.add_argument("--token", required=True, help="said in the hello")
    parser.add_argument(
        "--keep",
        action="append",
        default=[],
        choices=ADDED_VARIABLES,
        help="a variable the container's own environment sets (kept as it is)",
    )
    args = parser.parse_args(arguments)
    child = os.fork()
    if child == 0:
        # Whatever ends it, the host runs the container's commands through the engine.
        with contextlib.suppress(BaseException):
            serve(args.socket, args.token, args.keep)
        os._exit(0)
    if then:
        os.execv(then[0], then)
    return 0


if __name__ == "__main__":
    sys.exit(main())
