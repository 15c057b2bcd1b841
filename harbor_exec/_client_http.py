"""The HTTP under ``RolloutClient``: aiohttp by default, or the caller's httpx client.

A trainer runs the client in its own process, so the client's CPU per rollout is
the trainer's cost. httpx spends most of it in httpcore's connection pool, whose
bookkeeping scans every pooled connection (a ``poll()`` on each socket) for every
request: about 1 ms per request at 32 concurrent rollouts. aiohttp's pool and C
response parser cost a fraction of that, so ``RolloutClient`` uses aiohttp unless
it was given an ``httpx.AsyncClient`` (or aiohttp is not installed).

Both implementations answer with the same small ``Answer`` and raise httpx's
exception classes (``httpx.ConnectError``, ``httpx.ReadTimeout``,
``httpx.RemoteProtocolError`` ...), which are part of the client's public
behaviour either way. Settings match a default ``httpx.AsyncClient()``: 5 s
timeouts unless a call says otherwise (each covering one wait: a free pooled
connection or connecting, or the gap between received bytes), at most 100
connections, proxies from the environment (resolved once, for the server's URL),
no redirects.
"""

from __future__ import annotations

import asyncio
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

import httpx

if TYPE_CHECKING:
    import aiohttp

__all__ = [
    "DEFAULT_TIMEOUT_SEC",
    "Answer",
    "HttpxTransport",
    "Request",
    "Transport",
    "default_transport",
]

DEFAULT_TIMEOUT_SEC: Final = 5.0  # httpx's default
_MAX_CONNECTIONS: Final = 100  # httpx's default
# Idle pooled connections are dropped before uvicorn's default keep-alive (5 s) ends
# them, so a request rarely meets a connection the server is closing.
_KEEP_ALIVE_SEC: Final = 4.0


@dataclass(frozen=True, slots=True)
class Answer:
    """A response, read in full. ``headers`` is case-insensitive."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class Request:
    """One call of ``Transport.request``, as an implementation receives it."""

    method: str
    url: str
    headers: Mapping[str, str]
    content: bytes | None
    params: Mapping[str, str] | None
    timeout: float | None


class Transport(ABC):
    """Sends the client's requests; implementations say how, in ``_send``."""

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str],
        content: bytes | None = None,
        params: Mapping[str, str] | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_SEC,  # noqa: ASYNC109 (per wait, as httpx)
    ) -> Answer:
        """One request; ``timeout`` (None: none) bounds each wait, not the whole call.
        No redirect is followed; failures raise httpx's exceptions."""
        return await self._send(Request(method, url, headers, content, params, timeout))

    @abstractmethod
    async def _send(self, request: Request) -> Answer: ...

    @abstractmethod
    async def aclose(self) -> None:
        """Release the connections (an ``HttpxTransport`` closes only a client it owns)."""


class HttpxTransport(Transport):
    """Requests through an ``httpx.AsyncClient`` (closed by ``aclose`` only when owned)."""

    def __init__(self, client: httpx.AsyncClient, *, owned: bool) -> None:
        self.client = client
        self._owned = owned

    async def _send(self, request: Request) -> Answer:
        response = await self.client.request(
            request.method,
            request.url,
            content=request.content,
            params=request.params,
            headers=request.headers,
            timeout=request.timeout,
            follow_redirects=False,
        )
        return Answer(response.status_code, response.headers, response.content)

    async def aclose(self) -> None:
        if self._owned:
            await self.client.aclose()


class AiohttpTransport(Transport):
    """Requests through one ``aiohttp.ClientSession``, made on first use (inside the
    event loop, as aiohttp requires) for a client that talks to ``base_url``."""

    def __init__(self, base_url: str) -> None:
        self._proxy = _environment_proxy(base_url)
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[float | None, aiohttp.ClientTimeout] = {}

    def _open(self) -> aiohttp.ClientSession:
        import aiohttp

        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=_MAX_CONNECTIONS, keepalive_timeout=_KEEP_ALIVE_SEC
            ),
            # Proxies were resolved once in __init__, not per request.
            trust_env=False,
            timeout=self._timeout(DEFAULT_TIMEOUT_SEC),
        )
        return self._session

    def _timeout(self, seconds: float | None) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(seconds)
        if timeout is None:
            import aiohttp

            # connect: waiting for a pooled connection plus connecting; sock_read:
            # the gap between bytes (httpx's pool, connect and read timeouts).
            timeout = self._timeouts[seconds] = aiohttp.ClientTimeout(
                total=None, connect=seconds, sock_read=seconds
            )
        return timeout

    async def _send(self, request: Request) -> Answer:
        import aiohttp

        session = self._session if self._session is not None else self._open()
        try:
            async with session.request(
                request.method,
                request.url,
                data=request.content,
                params=request.params,
                headers=request.headers,
                timeout=self._timeout(request.timeout),
                allow_redirects=False,
                proxy=self._proxy,
            ) as response:
                body = await response.read()
                return Answer(response.status, response.headers, body)
        except aiohttp.ClientError as exc:
            raise _as_httpx_error(exc) from exc

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def default_transport(base_url: str) -> AiohttpTransport | HttpxTransport:
    """aiohttp when installed (the ``server`` extra has it), else an owned httpx client."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return HttpxTransport(httpx.AsyncClient(), owned=True)
    return AiohttpTransport(base_url)


def _environment_proxy(url: str) -> str | None:
    """The proxy httpx would use for ``url`` with its default ``trust_env=True``."""
    parts = urlsplit(url)
    if parts.hostname is None or urllib.request.proxy_bypass(parts.hostname):
        return None
    proxies = urllib.request.getproxies()
    return proxies.get(parts.scheme) or proxies.get("all")


def _as_httpx_error(exc: aiohttp.ClientError) -> Exception:
    """The httpx exception a default httpx client raises for the same failure."""
    import aiohttp

    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message)
    if isinstance(exc, aiohttp.ServerTimeoutError | asyncio.TimeoutError):
        return httpx.ReadTimeout(message)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message)
    if isinstance(exc, aiohttp.InvalidURL):
        return httpx.UnsupportedProtocol(message)
    if isinstance(
        exc,
        aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | aiohttp.ClientResponseError,
    ):
        return httpx.RemoteProtocolError(message)
    if isinstance(exc, aiohttp.ClientOSError):
        return httpx.ReadError(message)
    return httpx.TransportError(message)
