"""The one server core of the host's network services, on h11 over asyncio.

``UnixServer`` is what the model relay (``harbor_exec.network.relay``) and the egress
proxy (``harbor_exec.network.egress.proxy``) are built on: its socket in a fresh
directory (``UnixListener``), a start-once/close-once lifecycle, the bound on open
connections and the turning away of the rest, one connection loop's end (lingering
close, quiet ends, a logged bug that never takes the server down). The package cache's
server (``harbor_exec.network.packages.serve``) answers inside the proxy's tunnels, on
the same reading (``next_event``) and answers (``send_error_answer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Final, Protocol, Self

import h11

from harbor_exec.container.forward import abort_connections

__all__ = [
    "HOP_BY_HOP",
    "MAX_HEAD_BYTES",
    "READ_SIZE",
    "ConnectionLimits",
    "Readable",
    "UnixListener",
    "UnixServer",
    "abort",
    "lingering_close",
    "next_event",
    "send_error_answer",
]

logger = logging.getLogger(__name__)

READ_SIZE: Final = 64 * 1024
#: Request line plus headers.
MAX_HEAD_BYTES: Final = 64 * 1024
#: Headers that describe one connection, never forwarded.
HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# How long a finished connection may take to deliver its last bytes and close.
_LINGER_SEC: Final = 2.0
#: sun_path holds 108 bytes, the terminating NUL included.
_MAX_SOCKET_PATH: Final = 107

ConnectionHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class UnixListener:
    """One server's socket in a directory of its own: made fresh (0755, it must not
    exist) with the socket 0666, so that any uid in a container may connect whatever
    the umask; on ``stop`` the socket goes first (no new connect reaches the
    listener), then every open connection, then the directory with what is in it."""

    def __init__(self, socket_path: Path, *, what: str) -> None:
        self.what = what
        self.socket_path = socket_path
        self.directory = socket_path.parent
        self.connections: set[asyncio.Task[None]] = set()
        self.writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None
        self._made_directory = False

    @property
    def listening(self) -> bool:
        return self._server is not None

    async def listen(self, on_connection: ConnectionHandler) -> None:
        """Make the directory and listen (on failure, call ``stop`` and ``remove_directory``)."""
        if len(os.fsencode(self.socket_path)) > _MAX_SOCKET_PATH:
            raise ValueError(
                f"{self.what} socket path {self.socket_path} is longer than "
                f"{_MAX_SOCKET_PATH} bytes; use a shorter directory"
            )
        self.directory.mkdir(mode=0o755)
        self._made_directory = True
        os.chmod(self.directory, 0o755)
        self._server = await asyncio.start_unix_server(
            on_connection, path=self.socket_path, limit=READ_SIZE
        )
        os.chmod(self.socket_path, 0o666)

    async def stop(self) -> None:
        """Stop accepting and cut every open connection (the directory stays)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        await abort_connections(self.writers, self.connections)
        if server is not None:
            # Bounded: a connection accepted in this very moment closes itself on its first step.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await server.wait_closed()

    def remove_directory(self) -> None:
        """Ours alone (``listen`` made it fresh): anything else in it goes with the socket."""
        if self._made_directory:
            self._made_directory = False
            shutil.rmtree(self.directory, ignore_errors=True)


class Readable(Protocol):
    """What ``next_event`` reads from: an asyncio stream, or a TLS stream over one."""

    async def read(self, n: int) -> bytes: ...


async def next_event(
    conn: h11.Connection,
    reader: Readable,
    idle_timeout_sec: float,
    *,
    gone: type[Exception] | None = None,
) -> Any:
    """The next h11 event, reading as needed; TimeoutError after ``idle_timeout_sec``
    without a byte. ``gone``: raised when the client closes in the middle of a request
    body (else h11 says it, as a ``RemoteProtocolError``, on the next event)."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        async with asyncio.timeout(idle_timeout_sec):
            data = await reader.read(READ_SIZE)
        conn.receive_data(data)
        if gone is not None and not data and conn.their_state is h11.SEND_BODY:
            raise gone


def abort(writer: asyncio.StreamWriter) -> None:
    """Drop the connection at once. A transport asyncio already tore down has nothing
    left to drop (3.12's ``abort`` then fails on the loop it let go)."""
    with contextlib.suppress(AttributeError, RuntimeError):
        writer.transport.abort()


async def lingering_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Flush, half-close, and drain what the client still sends, for a bounded time.

    Closing a socket with unread input resets the connection, and a reset can
    destroy an answer (a 413, a 403, the start of a cut stream) before the client
    reads it.
    """
    async with asyncio.timeout(_LINGER_SEC):
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        while await reader.read(READ_SIZE):
            pass
        writer.close()
        await writer.wait_closed()


async def send_error_answer(
    conn: h11.Connection,
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: bytes,
    *,
    with_body: bool = True,
) -> None:
    """Answer the current request with ``status`` and ``body`` and say the connection
    closes (the rest of a refused request is never read, so it cannot be reused).
    Nothing when an answer has already started or no request line came (h11 cannot
    answer before one: the caller just closes)."""
    if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return
    if conn.our_state is h11.IDLE and conn.their_state is h11.IDLE:
        return
    headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    with contextlib.suppress(h11.LocalProtocolError):
        data = conn.send(h11.Response(status_code=status, headers=headers)) or b""
        if with_body:
            data += conn.send(h11.Data(data=body)) or b""
        data += conn.send(h11.EndOfMessage()) or b""
        writer.write(data)
        await writer.drain()


class ConnectionLimits(Protocol):
    """What the core reads of a server's limits (``RelayLimits``, ``EgressLimits``)."""

    @property
    def max_connections(self) -> int: ...

    @property
    def idle_timeout_sec(self) -> float: ...


class UnixServer:
    """One HTTP/1.1 server on a unix socket in a directory of its own, started once and
    closed once, with at most ``max_connections`` open at a time.

    A subclass answers each request in ``answer`` (and a malformed one in
    ``answer_malformed``) and may open what it needs beside the
    socket (``open_resources``, ``close_resources``), turn a connection away before it
    is served (``turns_away``, ``on_turned_away``) and end a connection quietly on its
    own exceptions (``QUIET_ERRORS``). Every connection is cut on ``aclose``.
    """

    #: Names the server in the errors and the log ("model relay", "egress proxy").
    WHAT: ClassVar[str] = "server"
    #: Names its socket in the errors ("relay", "egress").
    SOCKET_WHAT: ClassVar[str] = "server"
    #: Exceptions that end a connection without a log line, beyond the client's own
    #: (gone, silent, or closed mid-message).
    QUIET_ERRORS: ClassVar[tuple[type[BaseException], ...]] = ()

    def __init__(self, directory: Path, socket_name: str, limits: ConnectionLimits) -> None:
        self.directory = Path(directory)
        self.socket_path = self.directory / socket_name
        self.max_connections = limits.max_connections
        self.idle_timeout_sec = limits.idle_timeout_sec
        self._listener = UnixListener(self.socket_path, what=self.SOCKET_WHAT)
        self._connections = self._listener.connections
        self._writers = self._listener.writers
        self._closed = False
        self._quiet_errors: tuple[type[BaseException], ...] = (
            ConnectionError,
            asyncio.IncompleteReadError,
            TimeoutError,
            *self.QUIET_ERRORS,
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the subclass's resources, create the directory (0755; it must not
        exist), bind the socket (0666) and listen."""
        if self._listener.listening or self._closed:
            name = type(self).__name__
            raise RuntimeError(f"{'an' if name[0] in 'AEIOU' else 'a'} {name} starts once")
        try:
            await self.open_resources()
            await self._listener.listen(self._on_connection)
        except BaseException:
            await self._teardown()
            raise

    async def aclose(self) -> None:
        """Stop accepting, cut open connections, close the subclass's resources,
        remove the socket and the directory."""
        if self._closed:
            return
        self._closed = True
        await self._teardown()

    async def _teardown(self) -> None:
        await self._listener.stop()
        await self.close_resources()
        self._listener.remove_directory()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def listening(self) -> bool:
        return self._listener.listening

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def open_connections(self) -> int:
        """Connections being served now."""
        return len(self._connections)

    async def open_resources(self) -> None:
        """What the server needs beside its socket (an upstream pool), before it listens."""

    async def close_resources(self) -> None:
        """Close what ``open_resources`` opened (also after a failed start)."""

    async def cut_connections(self) -> None:
        """Cut every open connection (the server keeps listening)."""
        await abort_connections(self._writers, self._connections)

    # ------------------------------------------------------------------ connections

    def turns_away(self) -> bool:
        """Whether a new connection is cut unserved, besides the bound and a closed server."""
        return False

    def on_turned_away(self) -> None:
        """A connection was cut unserved (to count it)."""

    async def answer(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: h11.Request,
    ) -> bool:
        """Answer ``request``; whether the connection may carry the next one (when both
        sides also finished this one)."""
        raise NotImplementedError

    async def answer_malformed(self, conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
        """Answer what h11 could not parse (the connection then closes)."""
        raise NotImplementedError

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer one connection's requests in turn; return to close it gracefully."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        while True:
            try:
                event = await next_event(conn, reader, self.idle_timeout_sec)
            except h11.RemoteProtocolError:
                await self.answer_malformed(conn, writer)
                return
            if not isinstance(event, h11.Request):  # ConnectionClosed
                return
            if not await self.answer(conn, reader, writer, event):
                return
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if (
            self._closed
            or task is None
            or len(self._connections) >= self.max_connections
            or self.turns_away()
        ):
            self.on_turned_away()
            abort(writer)
            return
        self._connections.add(task)
        self._writers.add(writer)
        try:
            await self.serve(reader, writer)
            await lingering_close(reader, writer)
        except self._quiet_errors:
            pass
        except asyncio.CancelledError:
            # Only aclose() cancels; ending normally keeps asyncio's stream callback
            # (3.12.0/3.12.1) from logging the cancellation as an error.
            pass
        except Exception:
            # A bug in one connection must not take the server down; the message names
            # no secret.
            logger.exception("%s connection failed", self.WHAT)
        finally:
            self._writers.discard(writer)
            self._connections.discard(task)
            abort(writer)
