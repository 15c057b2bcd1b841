"""What harbor-exec's two h11 servers on unix sockets share: the model relay
(``harbor_exec.executors.relay``) and the egress proxy (``harbor_exec.sandbox.egress``)."""

from __future__ import annotations

import asyncio
from typing import Any, Final

import h11

__all__ = ["HOP_BY_HOP", "MAX_HEAD_BYTES", "READ_SIZE", "lingering_close", "next_event"]

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
