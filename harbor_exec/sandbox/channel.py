"""The host's end of a container's command channel (``harbor_exec.container.commands``).

Each container the runtime creates with a channel gets a directory of its own (a
unix socket listening in it, mounted read-only into the container) and a token on
its command server's command line. The server connects when the container starts
and says hello; the channel takes **one** hello per start, only before the first
command after that start, and only with the token: by then nothing of the task has
run, so the process that said it is ours. Every other connection is closed unheard
(the agent's, a second server's). A channel whose server is gone (killed, stopped
answering, a malformed frame) is closed for good until the container starts again:
the runtime runs its commands through the engine's exec instead, and a command that
was running when it went reports no exit code (the agent ended its own command).

Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import IO, Final

from harbor_exec.container import commands
from harbor_exec.container.commands import (
    ADDED_VARIABLES,
    GET_NOT_FOUND,
    KIND_CANCEL,
    KIND_ERR,
    KIND_EXIT,
    KIND_GET,
    KIND_HELLO,
    KIND_OUT,
    KIND_PUT,
    KIND_RUN,
    KIND_STDIN,
    encode_frame,
    read_frame,
)
from harbor_exec.container.exchange import RUNTIME_PYTHON
from harbor_exec.sandbox.archives import cut_marker
from harbor_exec.sandbox.cgroups import Companion, parent_pid
from harbor_exec.sandbox.runtime import Mount

logger = logging.getLogger("harbor_exec.sandbox")

__all__ = [
    "CHANNEL_MOUNT",
    "CHANNEL_ROOT",
    "MISSING",
    "ChannelReply",
    "CommandChannel",
    "Missing",
    "OutputTail",
]

#: Where the channels' directories live on the host: short (a socket path has 107
#: bytes), and shared at the same path with the host when harbor-exec runs in a
#: container (the engine resolves bind mounts on the host).
CHANNEL_ROOT: Final = Path("/tmp") / "hx-egress"
#: Where a container sees its channel's directory (read-only).
CHANNEL_MOUNT: Final = "/run/harbor-exec/commands"
_SOCKET: Final = "c.sock"
#: How long the first command waits for the server's hello after the start (its
#: Python starts in tens of milliseconds; a container that never says hello runs its
#: commands through the engine).
HELLO_WAIT_SEC: Final = 10.0
_STDIN_CHUNK: Final = 256 * 1024
_PEERCRED: Final = struct.Struct("3i")  # pid, uid, gid
_MAX_HELLO: Final = 507  # a hello's payload: a token and a pid


def _chunks(data: bytes | IO[bytes]) -> Iterator[bytes]:
    """``data`` (bytes, or a file read as it goes) in stdin frames' sizes."""
    if isinstance(data, bytes):
        for start in range(0, len(data), _STDIN_CHUNK):
            yield data[start : start + _STDIN_CHUNK]
        return
    while chunk := data.read(_STDIN_CHUNK):
        yield chunk


def _limits(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/limits").read_text()
    except OSError:
        return None


@cache
def _server_source() -> str:
    return Path(commands.__file__).read_text(encoding="utf-8")


class OutputTail:
    """The last ``cap`` bytes of a stream, with a marker when more came."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.total = 0
        self._kept = bytearray()

    def add(self, data: bytes) -> None:
        self.total += len(data)
        self._kept += data
        if len(self._kept) > 2 * self.cap:
            del self._kept[: len(self._kept) - self.cap]

    def value(self) -> bytes:
        if self.total <= self.cap:
            return bytes(self._kept)
        return cut_marker(self.total - self.cap, self.cap) + bytes(self._kept[-self.cap :])


@dataclass
class ChannelReply:
    """One command's outcome over the channel, its output bounded as the engine's
    (``exit_code`` None: the channel went while it ran). For a get, ``archive`` keeps
    the whole output up to ``archive_cap`` bytes (past it: ``overflowed``, and the
    server is told to stop)."""

    stdout: OutputTail
    stderr: OutputTail
    exit_code: int | None = None
    done: threading.Event = field(default_factory=threading.Event)
    archive: bytearray | None = None
    archive_cap: int = 0
    overflowed: bool = False


class Missing:
    """A get's answer for a path that does not exist (the engine's 404)."""


MISSING: Final = Missing()


class CommandChannel:
    """One container's channel: see the module docstring. ``close()`` removes it all."""

    def __init__(self, container_name: str) -> None:
        CHANNEL_ROOT.mkdir(mode=0o711, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix="c-", dir=CHANNEL_ROOT))
        self.directory.chmod(0o755)
        self.name = container_name
        self.token = secrets.token_hex(16)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = self.directory / _SOCKET
        self._listener.bind(str(path))
        path.chmod(0o666)  # the server's uid is the container's root: any uid on the host
        self._listener.listen(8)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._conn: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._accepting = False  # between a start and that start's first command
        self._closed = False
        self._replies: dict[int, ChannelReply] = {}
        self._next_id = 1
        self.companion: Companion | None = None
        self._peer_pid = 0
        self._limits: str | None = None  # the server's resource limits at its hello
        threading.Thread(
            target=self._accept_forever, name=f"channel-{self.name}", daemon=True
        ).start()

    # ------------------------------------------------------------------ container side

    def mount(self) -> Mount:
        return Mount(str(self.directory), CHANNEL_MOUNT, read_only=True)

    def launcher(self, configured: Collection[str]) -> list[str]:
        """The container's first command: it forks the server, then runs ``--then``.
        ``configured``: the names the container's own environment sets (image and
        spec), so that the server tells them from what its start added."""
        argv = [RUNTIME_PYTHON, "-I", "-S", "-c", _server_source()]
        argv += ["--socket", f"{CHANNEL_MOUNT}/{_SOCKET}", "--token", self.token]
        for name in ADDED_VARIABLES:
            if name in configured:
                argv += ["--keep", name]
        return [*argv, "--then"]

    # ------------------------------------------------------------------ lifecycle

    def started(self) -> None:
        """The container (re)started: its server says hello anew, before any command."""
        with self._lock:
            self._drop_connection()
            self._accepting = not self._closed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._accepting = False
            self._drop_connection()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        with contextlib.suppress(OSError):
            self._listener.close()
        with contextlib.suppress(OSError):
            (self.directory / _SOCKET).unlink()
        with contextlib.suppress(OSError):
            self.directory.rmdir()

    def _drop_connection(self) -> None:
        """The server is gone (or replaced by a start): every waiting command ends
        without an exit code. Called with the lock held."""
        conn, self._conn = self._conn, None
        self.companion = None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        replies, self._replies = self._replies, {}
        for reply in replies.values():
            reply.done.set()
        self._ready.notify_all()

    def _accept_forever(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                listening = self._accepting and self._conn is None
            if not listening:
                # Outside the window only the agent can knock: closed unread, on this
                # thread (a flood of connections costs the host no thread, no read).
                conn.close()
                continue
            # Inside it nothing of the task has run yet: the server is all that connects.
            self._greet(conn)

    def _greet(self, conn: socket.socket) -> None:
        conn.settimeout(2.0)
        try:
            frame = read_frame(conn, _MAX_HELLO)
            if frame is None or frame[0] != KIND_HELLO:
                raise OSError("not a hello")
            hello = json.loads(frame[2])
            token, pid = str(hello.get("token", "")), int(hello.get("pid", 0))
        except (OSError, ValueError, AttributeError, TypeError):
            conn.close()
            return
        with self._lock:
            fresh = self._accepting and self._conn is None
            if not (fresh and pid > 0 and secrets.compare_digest(token, self.token)):
                conn.close()
                return
            conn.settimeout(None)
            self._conn = conn
            # The server's pid as this host sees it (the kernel's word, not the hello's).
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            self._peer_pid = _PEERCRED.unpack(creds)[0]
            self._limits = _limits(self._peer_pid)
            self.companion = Companion(
                pid, time.clock_gettime(time.CLOCK_BOOTTIME), uid=0, parent="init"
            )
            self._ready.notify_all()
        threading.Thread(target=self._read_forever, args=(conn,), daemon=True).start()

    def _read_forever(self, conn: socket.socket) -> None:
        try:
            while frame := read_frame(conn):
                self._dispatch(*frame)
        except (OSError, ValueError):
            pass
        self._lose(conn)

    def _lose(self, conn: socket.socket) -> None:
        """``conn``'s server is gone: the channel is closed until the container starts
        again (nothing else is heard before)."""
        with self._lock:
            if self._conn is conn:
                logger.info("container %s: its command server is gone", self.name)
                self._drop_connection()
                self._accepting = False

    def _dispatch(self, kind: int, request: int, payload: bytes) -> None:
        cancel = False
        with self._lock:
            reply = self._replies.get(request)
            if reply is None:
                return
            if kind == KIND_OUT and reply.archive is not None:
                if reply.overflowed:
                    return
                if len(reply.archive) + len(payload) > reply.archive_cap:
                    reply.overflowed = cancel = True
                    reply.archive.clear()
                else:
                    reply.archive += payload
            elif kind == KIND_OUT:
                reply.stdout.add(payload)
            elif kind == KIND_ERR:
                reply.stderr.add(payload)
            elif kind == KIND_EXIT:
                reply.exit_code = int(json.loads(payload)["exit_code"])
                del self._replies[request]
                reply.done.set()
        if cancel:
            self._send([encode_frame(KIND_CANCEL, request)])

    # ------------------------------------------------------------------ commands

    def submit(
        self,
        argv: list[str],
        *,
        user: str,
        workdir: str | None,
        env: Mapping[str, str] | None,
        stdin: bytes | None,
        output_cap: int,
    ) -> ChannelReply | None:
        """Start ``argv`` through the server: its reply to wait on, or None when the
        channel cannot (the caller runs it through the engine)."""
        spec = {
            "argv": argv,
            "user": user,
            "workdir": workdir,
            "env": dict(env or {}),
            "stdin": stdin is not None,
        }
        opened = self._open(
            KIND_RUN, spec, ChannelReply(OutputTail(output_cap), OutputTail(output_cap))
        )
        if opened is None:
            return None
        request, reply = opened
        if stdin is not None:
            frames = [encode_frame(KIND_STDIN, request, chunk) for chunk in _chunks(stdin)]
            self._send([*frames, encode_frame(KIND_STDIN, request, b"")])
        return reply

    def put(self, data: bytes | IO[bytes], timeout_sec: float) -> bool:
        """Unpack the tar archive ``data`` at ``/`` through the server (as the engine's
        archive API unpacks one): True once it did. False when the channel cannot or the
        server failed: the caller puts it through the engine, which unpacks all of it
        again over whatever part the server wrote (a server that does not answer within
        ``timeout_sec`` is dropped first, so nothing writes beside the engine)."""
        opened = self._open(KIND_PUT, {}, ChannelReply(OutputTail(4096), OutputTail(4096)))
        if opened is None:
            return False
        request, reply = opened
        for chunk in _chunks(data):  # a frame at a time: the server holds only a few
            self._send([encode_frame(KIND_STDIN, request, chunk)])
        self._send([encode_frame(KIND_STDIN, request, b"")])
        return self._finished(reply, timeout_sec) == 0

    def get(self, path: str, cap: int, timeout_sec: float) -> bytes | Missing | None:
        """``path``'s tree as a tar archive packed by the server, whole (the engine's
        archive API gives the same entries); ``MISSING`` when there is no such path.
        None when the channel cannot, or the archive would pass ``cap`` bytes (the
        caller reads it through the engine, as a stream it may stop)."""
        reply = ChannelReply(OutputTail(4096), OutputTail(4096), archive=bytearray())
        reply.archive_cap = cap
        opened = self._open(KIND_GET, {"path": path}, reply)
        if opened is None:
            return None
        code = self._finished(reply, timeout_sec)
        if code == GET_NOT_FOUND:
            return MISSING
        if code != 0 or reply.overflowed or reply.archive is None:
            return None
        return bytes(reply.archive)

    def _finished(self, reply: ChannelReply, timeout_sec: float) -> int | None:
        """The exit code of a put or get; None when the channel went or the server did
        not answer in time (then it is dropped: it will write nothing more)."""
        if not reply.done.wait(timeout_sec):
            with self._lock:
                conn = self._conn
            if conn is not None:
                self._lose(conn)
            return None
        return reply.exit_code

    def _send(self, frames: list[bytes]) -> None:
        with self._lock:
            conn = self._conn
        if conn is None:
            return  # its reply ends (or ended) without an exit code
        try:
            with self._send_lock:
                for frame in frames:
                    conn.sendall(frame)
        except OSError:
            # It may have started: never run twice; it ends as the channel went.
            self._lose(conn)

    def _open(
        self, kind: int, spec: Mapping[str, object], reply: ChannelReply
    ) -> tuple[int, ChannelReply] | None:
        """Send request ``kind`` (``spec``, the first frame): its id and ``reply``, or
        None when the channel cannot."""
        with self._lock:
            if self._conn is None and self._accepting:
                # The first command after a start waits for the hello (only then).
                self._ready.wait_for(
                    lambda: self._conn is not None or not self._accepting, HELLO_WAIT_SEC
                )
            waited = self._accepting and self._conn is None
            self._accepting = False  # from now on the task's processes run
            conn = self._conn
            if conn is None:
                if waited:
                    logger.warning(
                        "container %s: its command server said no hello within %gs; its "
                        "commands run through the engine",
                        self.name,
                        HELLO_WAIT_SEC,
                    )
                return None
            request, self._next_id = self._next_id, self._next_id + 1
            self._replies[request] = reply
        self._send([encode_frame(kind, request, json.dumps(spec).encode())])
        return request, reply

    @property
    def alive(self) -> bool:
        with self._lock:
            return self._conn is not None

    def check_intact(self) -> None:
        """Close the channel for good (its server ends with its stream) when the server's
        resource limits are no longer those it said hello with: a root agent may lower
        them (``prlimit`` needs only the same uid) so that the server's later work fails,
        the verifier's included. The engine runs the container's commands from then on.
        Read from the host's ``/proc`` (nothing to check where it cannot see the pid)."""
        with self._lock:
            conn, pid, limits = self._conn, self._peer_pid, self._limits
        if conn is None or pid <= 0 or limits is None or _limits(pid) == limits:
            return
        logger.warning("container %s: its command server's limits were changed", self.name)
        self._lose(conn)

    def init_pid(self) -> int | None:
        """The container's init as this host sees it (the server's parent), while the
        server is connected: no engine call needed to find it. None otherwise."""
        with self._lock:
            if self._conn is None or self._peer_pid <= 0:
                return None
            pid = self._peer_pid
        parent = parent_pid(pid)
        return parent if parent is not None and parent > 1 else None

    def __repr__(self) -> str:
        return f"CommandChannel({self.name!r}, alive={self.alive})"
