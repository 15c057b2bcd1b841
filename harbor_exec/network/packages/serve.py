"""HTTP/1.1 (``h11``) between a client and the package cache: the requests of a
TLS-terminated CONNECT tunnel, one after another on one connection, each answered
by a ``CacheSession``.

Inside a tunnel the destination is the tunnel's (``CONNECT host:port``), never the
client's ``Host`` header, so what a request is stored under and where it is fetched
from are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Callable, Collection
from typing import Final, Protocol
from urllib.parse import urlsplit

import h11

from harbor_exec.network.egress.proxy import (
    DirectUpstream,
    EgressContext,
    HttpRequest,
    HttpResponse,
    Upstream,
)
from harbor_exec.network.http11 import MAX_HEAD_BYTES, READ_SIZE, next_event
from harbor_exec.network.packages.ca import LocalCA
from harbor_exec.network.packages.cache import (
    Answering,
    CacheRequest,
    CacheResponse,
    Resolver,
    connector_resolver,
    header_list,
)
from harbor_exec.network.packages.hosts import TlsHosts

__all__ = [
    "CacheUpstream",
    "PlainStream",
    "Stream",
    "TLSServerStream",
    "request_from_url",
    "serve_http",
    "serve_intercepted",
    "write_response",
]

logger = logging.getLogger(__name__)

_READ: Final = READ_SIZE
# A kept-alive connection with no request for this long is closed.
IDLE_TIMEOUT_SEC: Final = 120.0
_TLS_HANDSHAKE_SEC: Final = 30.0
_MAX_HEADER_BYTES: Final = MAX_HEAD_BYTES


class _ClientGone(Exception):
    pass


def request_from_url(
    method: str, url: str, headers: list[tuple[str, str]], body: AsyncIterator[bytes] | None
) -> CacheRequest:
    """A plain-HTTP proxy request (absolute-form target) as a ``CacheRequest``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an absolute http(s) URL: {url!r}")
    default = 443 if parts.scheme == "https" else 80
    target = parts.path or "/"
    if parts.query:
        target = f"{target}?{parts.query}"
    return CacheRequest(
        method, parts.scheme, parts.hostname, parts.port or default, target, headers, body
    )


async def write_response(
    conn: h11.Connection,
    writer: Stream,
    response: CacheResponse,
    *,
    head: bool,
    count: Callable[[int], None] | None = None,
) -> None:
    """Send ``response`` through ``conn`` (its body always drained or closed)."""
    try:
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers]
        writer.write(
            conn.send(
                h11.Response(
                    status_code=response.status,
                    headers=headers,
                    reason=response.reason.encode("latin-1"),
                )
            )
        )
        async for chunk in response.body:
            if not head and chunk:
                if count is not None:
                    count(len(chunk))
                writer.write(conn.send(h11.Data(data=chunk)))
                await writer.drain()
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
    finally:
        await response.aclose()


async def serve_http(
    stream: Stream,
    *,
    scheme: str,
    host: str,
    port: int,
    session: Answering,
    buffered: bytes = b"",
    resolve: Resolver | None = None,
    count: Callable[[int], None] | None = None,
) -> None:
    """Answer the connection's requests (for ``scheme://host:port``) until it ends;
    ``count`` is told of every body byte sent (the trial's egress budget)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEADER_BYTES)
    if buffered:
        conn.receive_data(buffered)
    while True:
        try:
            event = await next_event(conn, stream, IDLE_TIMEOUT_SEC, gone=_ClientGone)
        except (TimeoutError, h11.RemoteProtocolError, _ClientGone, OSError):
            return
        if not isinstance(event, h11.Request):
            return  # ConnectionClosed (or junk)
        method = event.method.decode("latin-1")
        target = event.target.decode("latin-1")
        if not target.startswith("/"):  # absolute-form inside a tunnel: keep the path only
            split = urlsplit(target)
            target = (split.path or "/") + (f"?{split.query}" if split.query else "")
        headers = header_list(event.headers)
        has_body = any(k.lower() in ("content-length", "transfer-encoding") for k, _ in headers)
        body = _request_body(conn, stream) if has_body else None
        request = CacheRequest(method, scheme, host, port, target, headers, body, resolve)
        try:
            response = await session.handle(request)
            await write_response(conn, stream, response, head=method.upper() == "HEAD", count=count)
        except (OSError, ConnectionError, h11.LocalProtocolError, _ClientGone) as exc:
            logger.debug("package cache connection for %s ended: %s", host, exc)
            return
        # Drain what the handler did not read of the request body.
        try:
            while conn.their_state is h11.SEND_BODY:
                if isinstance(
                    await next_event(conn, stream, IDLE_TIMEOUT_SEC, gone=_ClientGone),
                    h11.EndOfMessage,
                ):
                    break
        except (TimeoutError, h11.RemoteProtocolError, _ClientGone, OSError):
            return
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return
        try:
            conn.start_next_cycle()
        except h11.LocalProtocolError:
            return


async def _request_body(conn: h11.Connection, reader: Stream) -> AsyncIterator[bytes]:
    while True:
        event = await next_event(conn, reader, IDLE_TIMEOUT_SEC, gone=_ClientGone)
        if isinstance(event, h11.Data):
            yield bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return
        else:
            raise _ClientGone


class Stream(Protocol):
    """What ``serve_http`` talks through: a plain connection or a TLS one."""

    async def read(self, n: int) -> bytes: ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


class PlainStream:
    """An asyncio reader/writer pair as a ``Stream``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, n: int) -> bytes:
        return await self._reader.read(n)

    def write(self, data: bytes) -> None:
        self._writer.write(data)

    async def drain(self) -> None:
        await self._writer.drain()


class TLSServerStream:
    """TLS, server side, over a reader/writer pair, through ``ssl.MemoryBIO``: the
    client's first bytes may already sit in the reader's buffer when the tunnel is
    handed over (``loop.start_tls`` would never see them), here they are simply read."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        context: ssl.SSLContext,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)

    async def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            self._writer.write(data)
            await self._writer.drain()

    async def _fill(self) -> None:
        data = await self._reader.read(_READ)
        if data:
            self._incoming.write(data)
        else:
            self._incoming.write_eof()

    async def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
        await self._flush()

    async def read(self, n: int) -> bytes:
        while True:
            try:
                return self._tls.read(n)
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    def write(self, data: bytes) -> None:
        self._tls.write(data)

    async def drain(self) -> None:
        await self._flush()

    async def close(self) -> None:
        with contextlib.suppress(ssl.SSLError, OSError):
            self._tls.unwrap()
        with contextlib.suppress(OSError):
            await self._flush()


async def serve_intercepted(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    host: str,
    port: int,
    session: Answering,
    ca: LocalCA,
    resolve: Resolver | None = None,
    count: Callable[[int], None] | None = None,
) -> None:
    """A CONNECT tunnel already answered ``200``: terminate TLS as ``host`` with a
    leaf from ``ca`` (server side) and serve its HTTP/1.1 requests from the cache.
    The connection is closed at the end."""
    try:
        context = await asyncio.to_thread(ca.server_context, host)
        stream = TLSServerStream(reader, writer, context)
        try:
            async with asyncio.timeout(_TLS_HANDSHAKE_SEC):
                await stream.handshake()
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            logger.info("package cache: TLS with the client for %s failed: %r", host, exc)
            return
        await serve_http(
            stream,
            scheme="https",
            host=host,
            port=port,
            session=session,
            resolve=resolve,
            count=count,
        )
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(2):
                await stream.close()
    finally:
        writer.close()
        with contextlib.suppress(OSError, TimeoutError, asyncio.CancelledError):
            async with asyncio.timeout(2):
                await writer.wait_closed()


class CacheUpstream:
    """The egress proxy's ``Upstream`` for one trial: what its policy admitted goes
    through the package cache (plain HTTP directly; CONNECT tunnels to a package host
    (``tls_hosts``) on a port in ``intercept_ports`` are TLS-terminated with ``ca``'s
    leaf for the host), and other tunnels go to ``fallback`` untouched. Upstream
    addresses come from the trial's egress connector (overrides, SSRF guard)."""

    def __init__(
        self,
        session: Answering,
        ca: LocalCA,
        *,
        tls_hosts: TlsHosts | None = None,
        intercept_ports: Collection[int] = (443,),
        fallback: Upstream | None = None,
    ) -> None:
        self.session = session
        self.ca = ca
        self.tls_hosts = tls_hosts or TlsHosts()
        self.intercept_ports = frozenset(intercept_ports)
        self.fallback: Upstream = fallback or DirectUpstream()

    async def http(self, request: HttpRequest, context: EgressContext) -> HttpResponse:
        answer = await self.session.handle(
            CacheRequest(
                request.method,
                "http",
                request.host,
                request.port,
                request.target.decode("latin-1"),
                header_list(request.headers),
                _aiter(request.body) if request.has_body else None,
                connector_resolver(context.connector),
            )
        )
        return HttpResponse(
            status=answer.status,
            headers=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers],
            body=answer.body,
            aclose=answer.aclose,
            reason=answer.reason.encode("latin-1"),
        )

    async def tunnel(
        self,
        host: str,
        port: int,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        context: EgressContext,
    ) -> None:
        if port not in self.intercept_ports or not self.tls_hosts.matches(host):
            await self.fallback.tunnel(host, port, client, context)
            return
        await serve_intercepted(
            client[0],
            client[1],
            host=host,
            port=port,
            session=self.session,
            ca=self.ca,
            resolve=connector_resolver(context.connector),
            count=context.count,
        )


async def _aiter(body: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    async for chunk in body:
        yield chunk
