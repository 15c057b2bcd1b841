"""A trial's egress proxy: the only way an ``allowlist`` container reaches a network.

``EgressProxy`` is an HTTP/1.1 forward proxy (``h11`` over ``asyncio``) on a unix
socket in a fresh directory the trial mounts into the container (the container
itself has network ``none``). Inside, the runtime's forwarder (``runner forward``)
pipes a loopback port to the socket, and the trial points the standard proxy
variables (``HTTP_PROXY``, ``HTTPS_PROXY``, ...) at that port.

It speaks two things, both admitted per request by the current phase's
``EgressPolicy`` (``set_phase``) before any name is resolved:

* absolute-form requests (``GET http://host/path HTTP/1.1``), forwarded with
  ``Host`` set from the URL and hop-by-hop headers dropped;
* ``CONNECT host:port`` tunnels: after ``200`` the bytes pass untouched both
  ways (TLS stays end to end).

Anything else (an origin-form request, ``https://`` absolute-form, a malformed
request) is a ``400``; a refused host a ``403``, recorded as one JSON line (time,
trial, phase, method, host, port, reason) in the trial's refusal log, which
holds at most ``EgressLimits.max_log_records`` lines (then only counts grow).

What is admitted goes to an ``Upstream``: ``DirectUpstream`` (the default)
connects through the proxy's ``Connector``, which resolves names (or takes the
operator's ``overrides``: name -> local address, how tests stay on loopback) and
refuses, after resolution, every address that is not globally routable
(loopback, private, link-local, ...): the agent must not reach the host's own
services through its proxy. A replacement ``Upstream`` (a cache) gets the same
``EgressContext`` and must connect through ``context.connector`` or
``context.pool`` so the guard still holds.

Limits (``EgressLimits``): open client connections at once, upstream
connections per trial, bytes per trial (both directions, bodies and tunnels),
idle time. A phase change cuts every open connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import re
import socket
import threading
import time
import typing
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol
from urllib.parse import urlsplit

import h11
import httpcore

from harbor_exec.container.forward import READY_PATH
from harbor_exec.errors import HarborExecError
from harbor_exec.network.egress.policy import (
    EgressMode,
    EgressPolicy,
    is_address,
    is_forbidden_address,
    normalize_host,
)
from harbor_exec.network.http11 import (
    HOP_BY_HOP,
    READ_SIZE,
    UnixServer,
    abort,
    next_event,
    send_error_answer,
)
from harbor_exec.sandbox.cgroups import Companion

__all__ = [
    "EGRESS_SOCKET_NAME",
    "Connector",
    "DirectUpstream",
    "EgressContext",
    "EgressLimits",
    "EgressProxy",
    "EgressProxyThread",
    "EgressRefused",
    "EgressStats",
    "GuardedBackend",
    "HttpRequest",
    "HttpResponse",
    "Upstream",
    "pipe_both_ways",
]

logger = logging.getLogger("harbor_exec.network.egress")

EGRESS_SOCKET_NAME: Final = "egress.sock"
_MAX_HOST_IN_LOG: Final = 255

# Not forwarded: hop-by-hop, and what the upstream request sets itself.
_DROPPED: Final = HOP_BY_HOP | {b"host", b"expect"}


@dataclass(frozen=True)
class EgressLimits:
    """Per-proxy (that is, per-trial) bounds."""

    # Client connections open at once: a hostile agent must not exhaust the host's fds.
    max_connections: int = 64
    # Upstream connections (tunnels and HTTP connections) over the whole trial.
    max_upstream_connections: int = 10_000
    # Bytes through the proxy over the whole trial, both directions.
    max_bytes: int = 8 * 2**30
    # Silence on a connection (both directions) before it is closed.
    idle_timeout_sec: float = 300.0
    connect_timeout_sec: float = 30.0
    # Lines in the refusal log; later refusals are only counted.
    max_log_records: int = 1000

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_upstream_connections, self.max_bytes) < 1 or (
            self.idle_timeout_sec <= 0 or self.connect_timeout_sec <= 0
        ):
            raise ValueError("egress limits must be positive")


@dataclass
class EgressStats:
    """What one proxy did (read from its loop, or after ``aclose``)."""

    requests: int = 0
    tunnels: int = 0
    refused: int = 0
    upstream_connections: int = 0
    upstream_errors: int = 0
    bytes: int = 0
    logged: int = 0


class EgressRefused(HarborExecError):
    """A destination the proxy must not reach; ``reason`` goes to the refusal log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _BudgetSpent(Exception):
    """The trial's byte or connection budget is spent: cut the connection."""


# --------------------------------------------------------------------------- connecting


class Connector:
    """Resolves and connects upstream, the SSRF guard included.

    ``overrides`` maps ``"name"`` or ``"name:port"`` to a ``(host, port)`` to
    connect to instead (no DNS, no guard: the operator's own choice, how tests
    reach servers on 127.0.0.1). Every other destination is resolved (address
    literals as they are) and only globally routable addresses are used, unless
    ``allow_private``.
    """

    def __init__(
        self,
        overrides: Mapping[str, tuple[str, int]] | None = None,
        *,
        dns: bool = True,
        allow_private: bool = False,
        connect_timeout_sec: float = 30.0,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        # Keys as the lookup builds them: a lower-case name, optionally ":port".
        self.overrides = {key.lower(): value for key, value in (overrides or {}).items()}
        self.dns = dns
        self.allow_private = allow_private
        self.connect_timeout_sec = connect_timeout_sec
        self._on_connect = on_connect

    async def resolve(self, host: str, port: int) -> list[tuple[str, int]]:
        """Where a connection to ``host:port`` goes; EgressRefused if nowhere allowed."""
        host = normalize_host(host)
        override = self.overrides.get(f"{host}:{port}") or self.overrides.get(host)
        if override is not None:
            return [override]
        if is_address(host):
            found = [host]
        elif not self.dns:
            raise EgressRefused("cannot resolve: not in the resolver overrides (DNS is off)")
        else:
            try:
                infos = await asyncio.wait_for(
                    asyncio.get_running_loop().getaddrinfo(
                        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
                    ),
                    self.connect_timeout_sec,
                )
            except (OSError, TimeoutError, UnicodeError) as exc:
                raise EgressRefused(f"cannot resolve: {type(exc).__name__}") from None
            found = list(dict.fromkeys(str(info[4][0]) for info in infos))
        usable = [(a, port) for a in found if self.allow_private or not is_forbidden_address(a)]
        if not usable:
            raise EgressRefused("resolves only to addresses that are not public")
        return usable

    async def open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A TCP connection to ``host:port`` (first address that answers)."""
        addresses = await self.resolve(host, port)
        if self._on_connect is not None:
            self._on_connect()
        error: OSError | None = None
        for address, address_port in addresses:
            try:
                async with asyncio.timeout(self.connect_timeout_sec):
                    return await asyncio.open_connection(address, address_port, limit=READ_SIZE)
            except (OSError, TimeoutError) as exc:
                error = exc if isinstance(exc, OSError) else OSError(str(exc))
        raise error or OSError("no address to connect to")


class _GuardedStream(httpcore.AsyncNetworkStream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        try:
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout("upstream read timed out") from None
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        try:
            self._writer.write(buffer)
            async with asyncio.timeout(timeout):
                await self._writer.drain()
        except TimeoutError:
            raise httpcore.WriteTimeout("upstream write timed out") from None
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from None

    async def aclose(self) -> None:
        abort(self._writer)

    async def start_tls(
        self,
        ssl_context: typing.Any,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        except TimeoutError:
            raise httpcore.ConnectTimeout("TLS handshake timed out") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from None
        return self

    def get_extra_info(self, info: str) -> typing.Any:
        if info == "ssl_object":
            return self._writer.get_extra_info("ssl_object")
        if info in ("client_addr", "server_addr"):
            return self._writer.get_extra_info("sockname" if info == "client_addr" else "peername")
        if info == "is_readable":
            return self._reader.at_eof()
        return None


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend over a ``Connector``: pooled HTTP obeys the guard."""

    def __init__(self, connector: Connector) -> None:
        self.connector = connector

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None,
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            reader, writer = await self.connector.open(host, port)
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from None
        return _GuardedStream(reader, writer)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        socket_options: typing.Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise EgressRefused("unix sockets are not egress")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


# --------------------------------------------------------------------------- the seam


@dataclass(frozen=True)
class HttpRequest:
    """A plain-HTTP request the policy admitted (absolute-form on the wire)."""

    method: str
    host: str  # as requested, normalised (lower case, no brackets)
    port: int
    target: bytes  # origin-form: path and query
    # End-to-end headers as the client sent them (h11 lowercases names); hop-by-hop
    # ones, Host and Expect dropped. The upstream sets Host from ``host``/``port``.
    headers: list[tuple[bytes, bytes]]
    body: AsyncIterable[bytes]  # the request body, streamed (empty when none)
    body_length: int | None  # Content-Length, or None (then chunked when a body is sent)
    has_body: bool

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = "" if self.port == 80 else f":{self.port}"
        return f"http://{host}{port}{self.target.decode('ascii')}"


@dataclass
class HttpResponse:
    """What an ``Upstream`` answers a request with; the proxy streams ``body`` out and
    awaits ``aclose`` when done (or cut)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: AsyncIterable[bytes]
    aclose: Callable[[], Awaitable[None]]
    reason: bytes = b""


@dataclass
class EgressContext:
    """Per request: who asks (trial, phase) and the guarded ways upstream."""

    trial: str
    phase: str
    connector: Connector
    pool: httpcore.AsyncConnectionPool
    limits: EgressLimits
    count: Callable[[int], None]  # add bytes to the trial's budget (raises when spent)


class Upstream(Protocol):
    """Where admitted traffic goes. ``DirectUpstream`` connects directly; a cache
    substitutes its own. Raise ``EgressRefused`` to have the proxy answer 403 and log."""

    async def http(self, request: HttpRequest, context: EgressContext) -> HttpResponse:
        """Answer one admitted plain-HTTP request."""
        ...

    async def tunnel(
        self,
        host: str,
        port: int,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        context: EgressContext,
    ) -> None:
        """Carry one admitted CONNECT tunnel; the proxy has already answered ``200``
        (and fed what the client sent early into ``client[0]``). Return when done."""
        ...


async def pipe_both_ways(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    context: EgressContext,
) -> None:
    """Copy bytes both ways until both sides are done or the connection idles for
    ``idle_timeout_sec`` (no bytes either way); counts every byte."""
    last = [asyncio.get_running_loop().time()]
    idle = context.limits.idle_timeout_sec

    async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout(idle):
                    data = await source.read(READ_SIZE)
            except TimeoutError:
                if loop.time() - last[0] >= idle:
                    raise
                continue
            if not data:
                break
            last[0] = loop.time()
            context.count(len(data))
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof() and not sink.is_closing():
            with contextlib.suppress(OSError):
                sink.write_eof()

    await asyncio.gather(copy(a[0], b[1]), copy(b[0], a[1]))


class DirectUpstream:
    """Forwards through the context's guarded pool and tunnels through its connector."""

    async def http(self, request: HttpRequest, context: EgressContext) -> HttpResponse:
        host = request.host
        headers = [(b"host", _authority(host, request.port)), *request.headers]
        if request.has_body and request.body_length is None:
            headers.append((b"transfer-encoding", b"chunked"))
        timeout = context.limits.connect_timeout_sec
        response = await context.pool.handle_async_request(
            httpcore.Request(
                request.method.encode("ascii"),
                httpcore.URL(
                    scheme=b"http",
                    host=host.encode("ascii"),
                    port=request.port,
                    target=request.target,
                ),
                headers=headers,
                content=request.body if request.has_body else None,
                extensions={
                    "timeout": {
                        "connect": timeout,
                        "read": context.limits.idle_timeout_sec,
                        "write": context.limits.idle_timeout_sec,
                        "pool": timeout,
                    }
                },
            )
        )
        stream = response.stream
        assert isinstance(stream, AsyncIterable)
        return HttpResponse(
            status=response.status,
            headers=[(k.lower(), v) for k, v in response.headers],
            body=stream,
            aclose=response.aclose,
            reason=bytes(response.extensions.get("reason_phrase", b"")),
        )

    async def tunnel(
        self,
        host: str,
        port: int,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        context: EgressContext,
    ) -> None:
        reader, writer = await context.connector.open(host, port)
        try:
            await pipe_both_ways(client, (reader, writer), context)
        finally:
            abort(writer)


def _authority(host: str, port: int) -> bytes:
    shown = f"[{host}]" if ":" in host else host
    return (shown if port == 80 else f"{shown}:{port}").encode("ascii")


# --------------------------------------------------------------------------- the proxy


class _Answer(Exception):
    """Answer the client with ``status`` and ``message`` (text), then close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_READY_PATH: Final = READY_PATH.encode("ascii")


class Announcement:
    """A container's forwarder saying it listens: ``event`` set, and the process to
    spare across phases (``companion``; None when it could not be sealed, pid 0).
    The token is known only to the container it was started in, and it announces
    before any task process runs there: the first announcement is the one kept."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.companion: Companion | None = None

    def arrived(self, pid: int) -> None:
        if self.event.is_set():
            return
        if pid > 0:
            self.companion = Companion(pid, time.clock_gettime(time.CLOCK_BOOTTIME))
        self.event.set()

    def reset(self) -> None:
        """The container starts again: its forwarder will announce itself anew."""
        self.companion = None
        self.event.clear()


class EgressProxy(UnixServer):
    """One trial's egress proxy; see the module docstring.

    ``directory`` must not exist: ``start()`` creates it (0755) with the socket
    (0666) in it; ``aclose()`` removes both. ``refused_log`` (a file in the trial
    dir) receives a JSON line per refusal, up to ``limits.max_log_records``.
    ``overrides``, ``dns`` and ``allow_private`` configure the ``Connector``;
    ``upstream`` replaces ``DirectUpstream``. The phase starts as ``no-network``
    until ``set_phase``.
    """

    WHAT = "egress proxy"
    SOCKET_WHAT = "egress"
    QUIET_ERRORS = (_BudgetSpent,)

    def __init__(
        self,
        *,
        directory: Path,
        trial: str,
        refused_log: Path | None = None,
        limits: EgressLimits = EgressLimits(),
        overrides: Mapping[str, tuple[str, int]] | None = None,
        dns: bool = True,
        allow_private: bool = False,
        upstream: Upstream | None = None,
    ) -> None:
        super().__init__(directory, EGRESS_SOCKET_NAME, limits)
        self.trial = trial
        self.refused_log = refused_log
        self.limits = limits
        self.stats = EgressStats()
        self.phase = "setup"
        self.policy = EgressPolicy(EgressMode.NO_NETWORK)
        self.connector = Connector(
            overrides,
            dns=dns,
            allow_private=allow_private,
            connect_timeout_sec=limits.connect_timeout_sec,
            on_connect=self._on_upstream_connect,
        )
        self.upstream: Upstream = upstream or DirectUpstream()
        self._pool: httpcore.AsyncConnectionPool | None = None
        #: Per container's forwarder token: what it announced, once it listens.
        self._forwarders: dict[str, Announcement] = {}

    def __repr__(self) -> str:
        return f"EgressProxy(socket={str(self.socket_path)!r}, phase={self.phase!r})"

    # ------------------------------------------------------------------ lifecycle

    async def open_resources(self) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            network_backend=GuardedBackend(self.connector),
            max_connections=self.limits.max_connections,
            keepalive_expiry=30.0,
        )

    async def close_resources(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(Exception):
                await pool.aclose()

    def expect_forwarder(self, token: str) -> Announcement:
        """What the forwarder started with ``token`` (in its container's keep-alive,
        ``harbor_exec.container.forward``) announces once it listens."""
        return self._forwarders.setdefault(token, Announcement())

    async def set_phase(self, phase: str, policy: EgressPolicy) -> None:
        """Apply ``policy`` from now on, labelled ``phase`` in the log; cuts every open
        connection (nothing the last phase opened carries over)."""
        self.phase = phase
        self.policy = policy
        await self.cut_connections()

    # ------------------------------------------------------------------ accounting

    def _on_upstream_connect(self) -> None:
        if self.stats.upstream_connections >= self.limits.max_upstream_connections:
            raise EgressRefused(
                f"this trial's {self.limits.max_upstream_connections} upstream connections "
                "are used up"
            )
        self.stats.upstream_connections += 1

    def _count(self, amount: int) -> None:
        self.stats.bytes += amount
        if self.stats.bytes > self.limits.max_bytes:
            raise _BudgetSpent

    def _record_refusal(self, method: str, host: str, port: int | None, reason: str) -> None:
        self.stats.refused += 1
        logger.info("egress %s: refused %s %s:%s (%s)", self.trial, method, host, port, reason)
        if self.refused_log is None or self.stats.logged > self.limits.max_log_records:
            return
        self.stats.logged += 1
        if self.stats.logged > self.limits.max_log_records:
            record: dict[str, object] = {
                "time": _now(),
                "trial": self.trial,
                "note": f"more than {self.limits.max_log_records} refusals; the rest are "
                "counted, not logged",
            }
        else:
            record = {
                "time": _now(),
                "trial": self.trial,
                "phase": self.phase,
                "method": method[:16],
                "host": host[:_MAX_HOST_IN_LOG],
                "port": port,
                "reason": reason,
            }
        try:
            with open(self.refused_log, "a", encoding="utf-8") as log:
                log.write(json.dumps(record) + "\n")
        except OSError as exc:
            logger.warning("egress %s: cannot write %s: %s", self.trial, self.refused_log, exc)

    def _context(self) -> EgressContext:
        assert self._pool is not None
        return EgressContext(
            trial=self.trial,
            phase=self.phase,
            connector=self.connector,
            pool=self._pool,
            limits=self.limits,
            count=self._count,
        )

    # ------------------------------------------------------------------ connections

    async def answer_malformed(self, conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
        await self._answer(conn, writer, 400, "malformed HTTP request")

    async def answer(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: h11.Request,
    ) -> bool:
        try:
            if request.method == b"GET" and request.target.startswith(_READY_PATH):
                # Not a proxy request (origin form): a forwarder saying it listens. A
                # wrong token is refused; the right one only says what is true.
                token, _, pid = request.target[len(_READY_PATH) :].decode().partition("/")
                announcement = self._forwarders.get(token)
                if announcement is None or not pid.isdigit():
                    raise _Answer(404, "harbor-exec egress proxy: no such forwarder\n")
                announcement.arrived(int(pid))
                raise _Answer(200, "ready\n")
            if request.method == b"CONNECT":
                await self._tunnel(conn, reader, writer, request)
                return False
            await self._forward(conn, reader, writer, request)
        except _Answer as answer:
            await self._answer(conn, writer, answer.status, answer.message)
            return False
        return True

    def _admit(self, method: str, host: str, port: int) -> None:
        if self.stats.bytes > self.limits.max_bytes:
            reason = f"this trial's {self.limits.max_bytes} egress bytes are used up"
        elif self.policy.allows(host):
            return
        elif self.policy.mode is EgressMode.NO_NETWORK:
            reason = f"the {self.phase} phase has no network"
        else:
            reason = f"not in the {self.phase} phase's allowed_hosts"
        self._record_refusal(method, host, port, reason)
        raise _Answer(403, f"harbor-exec egress proxy: {host}:{port} refused: {reason}\n")

    async def _tunnel(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: h11.Request,
    ) -> None:
        host, port = _split_authority(request.target)
        self._admit("CONNECT", host, port)
        context = self._context()
        self.stats.tunnels += 1
        # Resolve (and guard) before answering, so a refused address is a 403, not a
        # tunnel that closes at once.
        try:
            await self.connector.resolve(host, port)
        except EgressRefused as refused:
            self._record_refusal("CONNECT", host, port, refused.reason)
            raise _Answer(
                403, f"harbor-exec egress proxy: {host}:{port}: {refused.reason}\n"
            ) from None
        established = h11.Response(status_code=200, headers=[], reason=b"Connection established")
        writer.write(conn.send(established) or b"")
        await writer.drain()
        early, _closed = conn.trailing_data
        client_reader = _Prefixed(reader, early) if early else reader
        try:
            await self.upstream.tunnel(host, port, (client_reader, writer), context)
        except EgressRefused as refused:
            self._record_refusal("CONNECT", host, port, refused.reason)
        except OSError as exc:
            self.stats.upstream_errors += 1
            logger.info("egress %s: tunnel to %s:%d failed: %s", self.trial, host, port, exc)

    async def _forward(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: h11.Request,
    ) -> None:
        method = request.method.decode("ascii", "replace")
        host, port, target = _split_absolute(request.target)
        self._admit(method, host, port)
        self.stats.requests += 1
        length: int | None = None
        chunked = False
        headers: list[tuple[bytes, bytes]] = []
        for name, value in request.headers:
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = True
            if name not in _DROPPED:
                headers.append((name, value))
        if conn.they_are_waiting_for_100_continue:
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")

        async def body() -> AsyncIterator[bytes]:
            while True:
                event = await next_event(conn, reader, self.limits.idle_timeout_sec)
                if isinstance(event, h11.Data):
                    self._count(len(event.data))
                    yield bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return
                else:
                    raise ConnectionError("client closed mid-request")

        upstream_request = HttpRequest(
            method=method,
            host=host,
            port=port,
            target=target,
            headers=headers,
            body=body(),
            body_length=length,
            has_body=chunked or bool(length),
        )
        try:
            response = await self.upstream.http(upstream_request, self._context())
        except EgressRefused as refused:
            self._record_refusal(method, host, port, refused.reason)
            raise _Answer(
                403, f"harbor-exec egress proxy: {host}:{port}: {refused.reason}\n"
            ) from None
        except (httpcore.TimeoutException, TimeoutError):
            self.stats.upstream_errors += 1
            raise _Answer(504, f"harbor-exec egress proxy: {host}:{port} timed out\n") from None
        except (httpcore.NetworkError, httpcore.ProtocolError, OSError) as exc:
            self.stats.upstream_errors += 1
            raise _Answer(
                502, f"harbor-exec egress proxy: {host}:{port} failed: {type(exc).__name__}\n"
            ) from None
        try:
            if conn.their_state is not h11.DONE:
                # The upstream answered before reading the whole body: drop the rest.
                with contextlib.suppress(Exception):
                    async for _ in upstream_request.body:
                        pass
            out = [(k, v) for k, v in response.headers if k.lower() not in _DROPPED]
            writer.write(
                conn.send(
                    h11.Response(status_code=response.status, headers=out, reason=response.reason)
                )
                or b""
            )
            async for chunk in response.body:
                self._count(len(chunk))
                writer.write(conn.send(h11.Data(data=chunk)) or b"")
                await writer.drain()
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException):
            self.stats.upstream_errors += 1
            raise ConnectionError("upstream failed mid-answer") from None
        finally:
            await response.aclose()

    async def _answer(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, status: int, message: str
    ) -> None:
        body = message.encode("utf-8", "replace")
        await send_error_answer(conn, writer, status, body, b"text/plain; charset=utf-8")


class _Prefixed(asyncio.StreamReader):
    """A reader that first returns ``prefix`` (bytes h11 read past the CONNECT head)."""

    def __init__(self, inner: asyncio.StreamReader, prefix: bytes) -> None:
        super().__init__()
        self._inner = inner
        self._prefix = prefix

    async def read(self, n: int = -1) -> bytes:
        if self._prefix:
            data, self._prefix = self._prefix, b""
            return data
        return await self._inner.read(n)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


#: A CONNECT target: a name or an address (IPv6 in brackets), a colon and a port;
#: nothing else (no user, path, query or fragment: ``good.test:443#evil.test``).
_CONNECT_AUTHORITY = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")


def _split_authority(target: bytes) -> tuple[str, int]:
    """``host:port`` of a CONNECT (port required, nothing around them), or a 400."""
    text = target.decode("ascii", "replace")
    matched = _CONNECT_AUTHORITY.fullmatch(text)
    port = int(matched.group(2)) if matched else 0
    if matched is None or not 0 < port < 65536:
        raise _Answer(
            400, f"harbor-exec egress proxy: CONNECT needs host:port, got {text[:200]!r}\n"
        )
    return normalize_host(matched.group(1)), port


def _split_absolute(target: bytes) -> tuple[str, int, bytes]:
    """``(host, port, origin-form target)`` of an absolute-form ``http://`` request."""
    text = target.decode("ascii", "replace")
    parts = urlsplit(text)
    if parts.scheme.lower() != "http" or not parts.netloc:
        raise _Answer(
            400,
            "harbor-exec egress proxy: this is an HTTP proxy: send absolute-form "
            "http:// requests, or CONNECT host:port for anything else "
            f"(got {text[:200]!r})\n",
        )
    try:
        port = parts.port or 80
    except ValueError:
        port = 0
    if not parts.hostname or port == 0 or parts.username is not None or "@" in parts.netloc:
        raise _Answer(400, f"harbor-exec egress proxy: bad URL {text[:200]!r}\n")
    path = parts.path or "/"
    origin = path + (f"?{parts.query}" if parts.query else "")
    return normalize_host(parts.hostname), port, origin.encode("ascii", "replace")


# --------------------------------------------------------------------------- sync wrapper


@dataclass
class EgressProxyThread:
    """An ``EgressProxy`` on its own event loop in a daemon thread, for sync callers
    (a trial). ``start``, ``set_phase`` and ``close`` block until done."""

    proxy: EgressProxy
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="harbor-exec-egress", daemon=True
        )
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result(10)
        except BaseException:
            self.close()
            raise

    def set_phase(self, phase: str, policy: EgressPolicy) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.set_phase(phase, policy), self._loop).result(10)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.proxy.aclose(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
            if self._thread.is_alive():
                return
        self._loop.close()
