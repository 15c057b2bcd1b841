"""What harbor-exec's two h11 servers on unix sockets share: the model relay
(``harbor_exec.network.relay``) and the egress proxy (``harbor_exec.network.egress``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import h11

from harbor_exec.container.forward import abort_connections

__all__ = [
    "HOP_BY_HOP",
    "MAX_HEAD_BYTES",
    "READ_SIZE",
    "UnixListener",
    "lingering_close",
    "next_event",
]

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


async def next_event(
    conn: h11.Connection, reader: asyncio.StreamReader, idle_timeout_sec: float
) -> Any:
    """The next h11 event, reading as needed; TimeoutError after ``idle_timeout_sec``
    without a byte."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        async with asyncio.timeout(idle_timeout_sec):
            data = await reader.read(READ_SIZE)
        conn.receive_data(data)


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
