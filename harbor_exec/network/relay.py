"""Per-rollout model relay: the only way a containerised workflow reaches the model.

A ``ModelRelay`` is an HTTP/1.1 server (``h11`` over ``asyncio``) on a unix
socket in a fresh directory that the trial mounts into the container. The
workflow gets a per-rollout token instead of the trainer's API key; the relay
checks the token, swaps in the real key and forwards the call to the upstream
chat endpoint with ``httpx``, streaming the answer back as it arrives. It
enforces size and count limits and records token usage per rollout (prompt, completion
and cached tokens, and the cost when the upstream reports one; and in the
process-wide ``RELAY_TOTALS``, which prometheus-client's default registry
exposes on ``/metrics``).

It lends only what a rollout needs (``RelayLimits`` has the numbers):

* Routes: only ``POST <prefix>/chat/completions`` is forwarded, plus the POST
  routes an operator adds (``RelayLimits.extra_routes``, relative to the prefix,
  e.g. ``/completions``). The raw request target must equal one of them byte
  for byte: no query string (chat completions takes none; a query in the
  operator's upstream URL is kept), no percent-encoding, no ``;`` parameters,
  no empty, dot or trailing segments. Nothing is decoded, so nothing can decode
  differently upstream. Anything else is a 404 naming the route, and the
  upstream never hears of it.
* Headers: only ``content-type``, ``accept`` and ``user-agent`` are forwarded;
  the relay sets ``authorization`` (the real key) and ``accept-encoding``
  (identity, so usage can be read), httpx sets ``host`` and the length.
* Refusals: every request the relay refuses (bad token, route, size, count,
  malformed) closes its connection and spends one of ``max_refused_requests``; once they
  are spent, every further request and connection of the rollout is cut.
* Idle time: a connection that sends nothing for ``idle_timeout_sec`` while the
  relay waits for a request (kept alive between calls, or a request trickling
  in) is closed; at most ``max_connections`` are open at once.

Inside the container, ``harbor_exec.container.runner`` pipes a loopback TCP port to the
socket, so the workflow sees ``http://127.0.0.1:<port>/v1`` and needs no
network at all (``network=none`` works).

The real key lives only in this object's memory and in the upstream request
headers: it is never logged, never written to disk, never in the relay's own
error answers, and scrubbed from upstream error answers that quote it.
``upstream_timeout_sec`` bounds a whole call, streaming included. Proxy
environment variables are ignored (``trust_env=False``): the upstream is
reached directly, loopback or remote.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import math
import re
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple
from urllib.parse import urlsplit

import h11
import httpx
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, generate_latest

from harbor_exec.network.http11 import (
    HOP_BY_HOP,
    UnixServer,
    next_event,
    send_error_answer,
)
from harbor_exec.network.usage import ModelUsage

__all__ = [
    "CHAT_COMPLETIONS_ROUTE",
    "FORWARDED_REQUEST_HEADERS",
    "RELAY_TOTALS",
    "SOCKET_NAME",
    "ModelRelay",
    "RelayLimits",
    "RelayTotals",
    "check_extra_route",
    "render_relay_metrics",
]

logger = logging.getLogger("harbor_exec.network.relay")

SOCKET_NAME: Final = "relay.sock"
# An SSE event larger than this is not parsed for usage (it is still forwarded).
_MAX_SSE_EVENT: Final = 1 * 2**20

# The only client headers forwarded upstream: what a chat call needs to be parsed
# (content-type) and answered as JSON or SSE (accept), and the SDK's name for the
# model server's logs (user-agent). Anything else (cookies, x-forwarded-*,
# openai-organization/-project, tracing, hop-by-hop) could steer the upstream or
# bill another account, so it is dropped. The relay adds authorization and
# accept-encoding itself; httpx adds host and content-length.
FORWARDED_REQUEST_HEADERS: Final = frozenset({b"content-type", b"accept", b"user-agent"})
_RESPONSE_DROP: Final = HOP_BY_HOP | {b"content-length"}
#: The route every relay forwards, relative to the upstream URL's path.
CHAT_COMPLETIONS_ROUTE: Final = "/chat/completions"
# What an operator's extra route may be made of: plain segments, nothing to decode.
_ROUTE_SEGMENT: Final = re.compile(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*")
_MAX_ROUTE_IN_ERROR: Final = 200


def check_extra_route(route: str) -> str:
    """``route`` if it can be an extra relay route (``/name/name``: letters, digits,
    ``-``, ``_`` and inner dots per segment), else ValueError."""
    segments = route.split("/")
    if (
        len(route) > 256
        or segments[0] != ""
        or len(segments) < 2
        or not all(_ROUTE_SEGMENT.fullmatch(s) for s in segments[1:])
    ):
        raise ValueError(
            f"relay route {route[:_MAX_ROUTE_IN_ERROR]!r} must be a path like '/completions' "
            "(relative to the model URL's path; letters, digits, '-', '_' and inner dots)"
        )
    return route


@dataclass(frozen=True)
class RelayLimits:
    """Per-relay (that is, per-rollout) bounds and the routes it forwards."""

    max_request_bytes: int = 8 * 2**20
    max_response_bytes: int = 64 * 2**20
    max_requests: int = 1000
    upstream_timeout_sec: float = 600.0
    # Open client connections at once; a hostile agent must not exhaust the host's fds.
    max_connections: int = 32
    # Requests the relay may refuse before it cuts the rollout off: a workflow that
    # works is refused rarely (a 413, the last 429s), a policy probing routes often.
    max_refused_requests: int = 32
    # Silence while waiting for a request (or the rest of one) before the connection
    # is closed; clients reopen kept-alive connections the server closed.
    idle_timeout_sec: float = 60.0
    # POST routes forwarded besides /chat/completions, relative to the upstream
    # URL's path (e.g. "/completions", "/embeddings"); see check_extra_route.
    extra_routes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for route in self.extra_routes:
            check_extra_route(route)
        if self.max_refused_requests < 1 or self.max_connections < 1 or self.idle_timeout_sec <= 0:
            raise ValueError(
                "max_refused_requests, max_connections and idle_timeout_sec must be positive"
            )


class RelayTotals:
    """Every relay's counts summed, and how many relays there are, as prometheus-client
    metrics each relay updates as it counts. ``RELAY_TOTALS`` is the process's, in
    prometheus-client's default registry (every server's ``/metrics`` appends it);
    another instance keeps its own registry (a test's)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        own = self.registry
        self._started = Counter("harbor_exec_relay_started", "Model relays started.", registry=own)
        self._active = Gauge("harbor_exec_relay_active", "Model relays open now.", registry=own)
        tokens = Counter(
            "harbor_exec_relay_tokens",
            "Tokens reported by the model, by kind.",
            ["kind"],
            registry=own,
        )
        #: ``ModelUsage``'s field -> the metric it adds to (the others are not exposed).
        self._counters: dict[str, Counter] = {
            "requests": Counter(
                "harbor_exec_relay_requests",
                "Model calls forwarded upstream by the relays.",
                registry=own,
            ),
            "rejected": Counter(
                "harbor_exec_relay_rejected",
                "Relay requests refused: bad token, wrong path or over a limit.",
                registry=own,
            ),
            "upstream_errors": Counter(
                "harbor_exec_relay_upstream_errors",
                "Relay calls answered 502: upstream failure, timeout or oversized answer.",
                registry=own,
            ),
            "prompt_tokens": tokens.labels("prompt"),
            "completion_tokens": tokens.labels("completion"),
            "cached_tokens": tokens.labels("cached"),
        }

    def count(self, what: str, amount: float = 1) -> None:
        """Add ``amount`` to ``ModelUsage``'s field ``what`` (if it is exposed)."""
        counter = self._counters.get(what)
        if counter is not None:
            counter.inc(amount)

    def relay_started(self) -> None:
        self._started.inc()
        self._active.inc()

    def relay_closed(self) -> None:
        self._active.dec()

    def _read(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    @property
    def relays_started(self) -> float:
        return self._read("harbor_exec_relay_started_total")

    @property
    def relays_active(self) -> float:
        return self._read("harbor_exec_relay_active")

    @property
    def requests(self) -> float:
        return self._read("harbor_exec_relay_requests_total")

    @property
    def rejected(self) -> float:
        return self._read("harbor_exec_relay_rejected_total")

    @property
    def upstream_errors(self) -> float:
        return self._read("harbor_exec_relay_upstream_errors_total")

    @property
    def prompt_tokens(self) -> float:
        return self._read("harbor_exec_relay_tokens_total", kind="prompt")

    @property
    def completion_tokens(self) -> float:
        return self._read("harbor_exec_relay_tokens_total", kind="completion")

    @property
    def cached_tokens(self) -> float:
        return self._read("harbor_exec_relay_tokens_total", kind="cached")


RELAY_TOTALS: Final = RelayTotals(REGISTRY)


def render_relay_metrics(totals: RelayTotals) -> str:
    """Prometheus text for ``totals``'s own registry, ending in a newline."""
    return generate_latest(totals.registry).decode()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # Loading the CA bundle takes milliseconds; do it once per process, not per relay.
    return httpx.create_ssl_context()


class _Reject(Exception):
    """Answer the client with ``status`` and a short JSON error, then close."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class _Cut(Exception):
    """Drop the client connection without an answer (the response already started)."""


def _error_body(code: str, message: str) -> bytes:
    # OpenAI's error shape, so SDK clients surface the message.
    return json.dumps({"error": {"message": message, "type": "relay_error", "code": code}}).encode()


class _Usage(NamedTuple):
    """One response's ``usage``: the token counts, and what only some upstreams add."""

    prompt: int
    completion: int
    total: int
    cached: int | None  # ``prompt_tokens_details.cached_tokens``
    cost: float | None  # ``cost`` (e.g. OpenRouter's, in USD)


def _usage_numbers(payload: Any) -> _Usage | None:
    """A response object's ``usage``, if it has one (odd values count as absent)."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None

    def count(mapping: Any, key: str) -> int | None:
        value = mapping.get(key) if isinstance(mapping, dict) else None
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        return value if ok else None

    prompt, completion = count(usage, "prompt_tokens") or 0, count(usage, "completion_tokens") or 0
    cached = count(usage.get("prompt_tokens_details"), "cached_tokens")
    cost = usage.get("cost")
    if isinstance(cost, bool) or not isinstance(cost, int | float) or not 0 <= cost < math.inf:
        cost = None
    return _Usage(
        prompt,
        completion,
        count(usage, "total_tokens") or prompt + completion,
        cached,
        None if cost is None else float(cost),
    )


class _StreamedMessage:
    """The assistant message a chat stream's deltas add up to (``choices[0]``): its
    content and reasoning concatenated, its tool calls assembled by index."""

    def __init__(self) -> None:
        self.role = "assistant"
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.seen = False

    def add(self, event: Any) -> None:
        choices = event.get("choices") if isinstance(event, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        delta = choices[0].get("delta")
        if not isinstance(delta, dict):
            return
        self.seen = True
        if isinstance(delta.get("role"), str):
            self.role = delta["role"]
        if isinstance(delta.get("content"), str):
            self.content.append(delta["content"])
        for key in ("reasoning_content", "reasoning"):
            if isinstance(delta.get(key), str):
                self.reasoning.append(delta[key])
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            index = call.get("index", len(self.tool_calls))
            slot = self.tool_calls.setdefault(
                index if isinstance(index, int) else len(self.tool_calls),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if isinstance(call.get("id"), str):
                slot["id"] = call["id"]
            function = call.get("function")
            if isinstance(function, dict):
                for key in ("name", "arguments"):
                    if isinstance(function.get(key), str):
                        slot["function"][key] += function[key]

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": "".join(self.content) or None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return message


class _SseUsage:
    """Finds ``usage`` in an SSE stream chunk by chunk, holding at most one event;
    with ``record``, also the streamed assistant message (``message``)."""

    def __init__(self, record: bool = False) -> None:
        self._line = bytearray()
        self._data = bytearray()
        self._oversized = False
        self.found: _Usage | None = None
        self.message = _StreamedMessage() if record else None

    def feed(self, chunk: bytes) -> None:
        self._line += chunk
        while True:
            end = self._line.find(b"\n")
            if end < 0:
                if len(self._line) > _MAX_SSE_EVENT:
                    self._line.clear()
                    self._oversized = True
                return
            line = bytes(self._line[:end]).rstrip(b"\r")
            del self._line[: end + 1]
            self._on_line(line)

    def _on_line(self, line: bytes) -> None:
        if not line:
            self._dispatch()
        elif line.startswith(b"data:"):
            value = line[5:]
            if self._data:
                self._data += b"\n"
            self._data += value[1:] if value.startswith(b" ") else value
            if len(self._data) > _MAX_SSE_EVENT:
                self._data.clear()
                self._oversized = True

    def _dispatch(self) -> None:
        data, oversized = bytes(self._data), self._oversized
        self._data.clear()
        self._oversized = False
        if self.message is not None and not oversized and data and data != b"[DONE]":
            with contextlib.suppress(ValueError):
                self.message.add(json.loads(data))
        # Cheap substring test first: most chunks carry no usage.
        if oversized or b'"usage"' not in data:
            return
        with contextlib.suppress(ValueError):
            found = _usage_numbers(json.loads(data))
            if found is not None:
                # Servers that send usage on every chunk send running totals: keep the last.
                self.found = found

    def close(self) -> None:
        self._on_line(bytes(self._line).rstrip(b"\r"))
        self._dispatch()


class ModelRelay(UnixServer):
    """One rollout's model relay; see the module docstring."""

    WHAT = "model relay"
    SOCKET_WHAT = "relay"

    def __init__(
        self,
        *,
        upstream_url: str,
        api_key: str | None,
        directory: Path,
        limits: RelayLimits = RelayLimits(),
        transport: httpx.AsyncBaseTransport | None = None,
        totals: RelayTotals | None = RELAY_TOTALS,
        token: str | None = None,
        record_chat: bool = False,
    ) -> None:
        """Only reads the configuration; ``start()`` creates ``directory`` and binds.

        ``record_chat``: keep the last answered chat call (``last_chat``), for an agent
        whose own record of it is untrusted (one that runs in the container).

        ``transport`` (e.g. one shared by every relay, for pooled upstream
        connections) is used but never closed by the relay; without one the
        relay owns a fresh pool. ``totals`` receives this relay's counts as
        they happen (None: only ``usage``).
        """
        parts = urlsplit(upstream_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            # No URL in the message: it may carry credentials.
            raise ValueError("upstream_url must be an absolute http(s) URL")
        self.upstream_origin = f"{parts.scheme}://{parts.netloc}"
        self.path_prefix: str = parts.path.rstrip("/")
        # The agent's query strings are refused; the operator's (e.g. Azure's
        # api-version) rides on every forwarded call.
        query = f"?{parts.query}" if parts.query else ""
        #: The exact request targets forwarded (POST only), and where each goes upstream.
        self.routes: dict[bytes, str] = {
            (self.path_prefix + route).encode(): (
                f"{self.upstream_origin}{self.path_prefix}{route}{query}"
            )
            for route in (CHAT_COMPLETIONS_ROUTE, *limits.extra_routes)
        }
        super().__init__(directory, SOCKET_NAME, limits)
        self.limits = limits
        # Given when the rollout's input file was written before the relay was made.
        self.token: str = token or secrets.token_urlsafe(32)
        # What this relay saw; read it after the rollout (or live, from the same loop).
        self.usage = ModelUsage()
        #: With ``record_chat``: the last successful chat call as the relay saw it (a
        #: streamed answer's message assembled from its deltas),
        #: ``{"messages": [...request...], "response": {...choices[0].message...},
        #: "tools": [...] | None}`` (bounded by the request and answer limits; one kept).
        self.last_chat: dict[str, Any] | None = None
        self._record_chat = record_chat
        self._api_key = api_key
        self._token_bytes = self.token.encode()
        self._transport = transport
        self._totals = totals
        # The transport, not a Client: the relay needs none of a Client's redirects,
        # cookies or auth flows, and skipping them is a good part of its overhead.
        self._owned_transport: httpx.AsyncHTTPTransport | None = None
        self._timeout = httpx.Timeout(limits.upstream_timeout_sec).as_dict()
        self._refused = 0

    def __repr__(self) -> str:
        # Never the key, nor the token.
        return f"ModelRelay(socket={str(self.socket_path)!r}, prefix={self.path_prefix!r})"

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await super().start()
        if self._totals is not None:
            self._totals.relay_started()

    async def aclose(self) -> None:
        started = not self.closed and self.listening
        await super().aclose()
        if started and self._totals is not None:
            self._totals.relay_closed()

    async def open_resources(self) -> None:
        if self._transport is None:
            self._owned_transport = httpx.AsyncHTTPTransport(verify=_ssl_context(), trust_env=False)

    async def close_resources(self) -> None:
        owned, self._owned_transport = self._owned_transport, None
        if owned is not None:
            await owned.aclose()

    # ------------------------------------------------------------------ counting

    def _count(self, what: str, amount: int = 1) -> None:
        setattr(self.usage, what, getattr(self.usage, what) + amount)
        if self._totals is not None:
            self._totals.count(what, amount)

    def _record_usage(self, numbers: _Usage) -> None:
        self._count("prompt_tokens", numbers.prompt)
        self._count("completion_tokens", numbers.completion)
        self._count("total_tokens", numbers.total)
        # None until an upstream reports them, then summed like the counts.
        for what, amount in (("cached_tokens", numbers.cached), ("cost_usd", numbers.cost)):
            if amount is None:
                continue
            setattr(self.usage, what, (getattr(self.usage, what) or 0) + amount)
            if self._totals is not None:
                self._totals.count(what, amount)

    # ------------------------------------------------------------------ connections

    def turns_away(self) -> bool:
        return self.refusals_spent

    def on_turned_away(self) -> None:
        self._count("rejected")

    @property
    def refusals_spent(self) -> bool:
        """Whether this rollout has been refused ``max_refused_requests`` times (it is cut off)."""
        return self._refused >= self.limits.max_refused_requests

    def _refuse(self) -> None:
        self._count("rejected")
        self._refused += 1
        if self._refused == self.limits.max_refused_requests:
            logger.warning(
                "model relay %s: %d requests refused; refusing the rest of this rollout",
                self.socket_path.parent.name,
                self._refused,
            )

    async def answer_malformed(self, conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
        self._refuse()
        await self._send_error(conn, writer, 400, "bad_request", "malformed HTTP request")

    async def answer(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: h11.Request,
    ) -> bool:
        if self.refusals_spent:
            # Another connection spent the budget while this one was kept alive.
            self._count("rejected")
            return False
        try:
            body = await self._admit(conn, reader, writer, request)
        except _Cut:
            return False
        except _Reject as rejected:
            self._refuse()
            await self._send_error(
                conn,
                writer,
                rejected.status,
                rejected.code,
                rejected.message,
                # h11 refuses a body on a HEAD answer (the status still says it all).
                with_body=request.method != b"HEAD",
            )
            return False
        self._count("requests")
        try:
            await self._forward(conn, writer, request, body)
        except _Cut:
            return False
        return True

    async def _admit(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: h11.Request,
    ) -> bytes:
        """Check the token, route, count and size; return the whole request body."""
        authorization = b""
        length: int | None = None
        for name, value in request.headers:
            if name == b"authorization":
                authorization = value
            elif name == b"content-length":
                length = int(value)  # h11 has validated it
        scheme, _, presented = authorization.partition(b" ")
        # compare_digest: the time taken must not reveal how much of the token matched.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(
            presented.strip(), self._token_bytes
        ):
            raise _Reject(401, "invalid_token", "missing or invalid relay token")
        if request.method != b"POST" or request.target not in self.routes:
            raise self._route_refusal(request)
        self._check_count()
        limit = self.limits.max_request_bytes
        if length is not None and length > limit:
            raise _Reject(413, "request_too_large", f"request body over {limit} bytes")
        if conn.they_are_waiting_for_100_continue:
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
        body = bytearray()
        while True:
            try:
                event = await next_event(conn, reader, self.limits.idle_timeout_sec)
            except h11.RemoteProtocolError:
                raise _Reject(400, "bad_request", "malformed request body") from None
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > limit:
                    raise _Reject(413, "request_too_large", f"request body over {limit} bytes")
            elif isinstance(event, h11.EndOfMessage):
                # Again, now that no await separates the check from the count: calls
                # on parallel connections must not overshoot the limit.
                self._check_count()
                return bytes(body)
            else:  # ConnectionClosed mid-body
                raise _Cut

    def _route_refusal(self, request: h11.Request) -> _Reject:
        asked = request.method + b" " + request.target
        allowed = ", ".join(f"POST {target.decode()}" for target in self.routes)
        return _Reject(
            404,
            "route_not_allowed",
            # The agent's own bytes, shortened; json.dumps escapes them in the answer.
            f"{asked[:_MAX_ROUTE_IN_ERROR].decode('ascii', 'replace')} is not a route this "
            f"relay forwards; it forwards only {allowed} (exactly: no query string, "
            "encoding or parameters)",
        )

    def _check_count(self) -> None:
        if self.usage.requests >= self.limits.max_requests:
            raise _Reject(
                429, "request_limit", f"this rollout's {self.limits.max_requests} calls are used up"
            )

    async def _send_error(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        status: int,
        code: str,
        message: str,
        *,
        with_body: bool = True,
    ) -> None:
        body = _error_body(code, message)
        await send_error_answer(
            conn, writer, status, body, b"application/json", with_body=with_body
        )

    # ------------------------------------------------------------------ forwarding

    def _upstream_headers(self, request: h11.Request) -> list[tuple[bytes, bytes]]:
        # h11 lowercases names; an allowlist needs no hop-by-hop or Connection parsing.
        headers = [
            (name, value) for name, value in request.headers if name in FORWARDED_REQUEST_HEADERS
        ]
        headers.append((b"accept-encoding", b"identity"))
        if self._api_key:
            headers.append((b"authorization", b"Bearer " + self._api_key.encode()))
        return headers

    async def _forward(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request, body: bytes
    ) -> None:
        transport = self._transport or self._owned_transport
        if transport is None:
            raise _Cut
        upstream = httpx.Request(
            "POST",
            # _admit let only an exact route through: the URL is the operator's.
            self.routes[request.target],
            headers=self._upstream_headers(request),
            content=body,
            extensions={"timeout": self._timeout},
        )
        try:
            async with asyncio.timeout(self.limits.upstream_timeout_sec):
                response = await transport.handle_async_request(upstream)
                try:
                    await self._relay_response(
                        conn, writer, response, body if self._record_chat else None
                    )
                finally:
                    await response.aclose()
        except (_Cut, ConnectionError):
            raise
        except _Reject as rejected:
            self._count("rejected")
            if rejected.status == 502:
                self._count("upstream_errors")
            await self._send_error(conn, writer, rejected.status, rejected.code, rejected.message)
            raise _Cut from None
        except (httpx.HTTPError, TimeoutError, OSError) as exc:
            self._count("upstream_errors")
            # The type only: httpx messages hold URLs, and the URL is the trainer's business.
            message = f"upstream model call failed: {type(exc).__name__}"
            logger.warning("model relay: %s", message)
            # A no-op once the response has started: the cut connection tells the client.
            await self._send_error(conn, writer, 502, "upstream_error", message)
            raise _Cut from None

    async def _relay_error_answer(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        response: httpx.Response,
        headers: list[tuple[bytes, bytes]],
        key: bytes,
    ) -> None:
        limit = self.limits.max_response_bytes
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > limit:
                raise _Reject(
                    502, "response_too_large", f"the model's answer is over {limit} bytes"
                )
        scrubbed = bytes(body).replace(key, b"[REDACTED]")
        headers = [(k, v.replace(key, b"[REDACTED]")) for k, v in headers]
        headers.append((b"content-length", str(len(scrubbed)).encode()))
        data = conn.send(
            h11.Response(
                status_code=response.status_code,
                headers=headers,
                reason=response.reason_phrase.encode("ascii", "replace"),
            )
        )
        data = (data or b"") + (conn.send(h11.Data(data=scrubbed)) or b"")
        writer.write(data + (conn.send(h11.EndOfMessage()) or b""))
        await writer.drain()

    async def _relay_response(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        response: httpx.Response,
        request_body: bytes | None = None,
    ) -> None:
        limit = self.limits.max_response_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _Reject(502, "response_too_large", f"the model's answer is over {limit} bytes")
        content_type = response.headers.get("content-type", "").lower()
        encoded = response.headers.get("content-encoding", "identity").lower() != "identity"
        sse = (not encoded) and content_type.startswith("text/event-stream")
        as_json = (not encoded) and "json" in content_type
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _RESPONSE_DROP]
        if response.status_code >= 400 and self._api_key:
            # Some upstreams echo the presented key in an auth error: scrub it before
            # the agent sees it. Error bodies are small, so buffering them is cheap.
            await self._relay_error_answer(conn, writer, response, headers, self._api_key.encode())
            return
        if declared is not None and declared.isdigit():
            headers.append((b"content-length", declared.encode()))
        head = conn.send(
            h11.Response(
                status_code=response.status_code,
                headers=headers,
                reason=response.reason_phrase.encode("ascii", "replace"),
            )
        )
        writer.write(head or b"")
        sse_usage = _SseUsage(record=request_body is not None) if sse else None
        json_body = bytearray() if as_json else None
        size = 0
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > limit:
                self._count("rejected")
                self._count("upstream_errors")
                logger.warning("model relay: the model's answer is over %d bytes; cut", limit)
                raise _Cut
            if sse_usage is not None:
                sse_usage.feed(chunk)
            elif json_body is not None:
                json_body += chunk
            writer.write(conn.send(h11.Data(data=chunk)) or b"")
            # Drain per chunk: SSE tokens reach the client as they arrive, and a slow
            # reader applies back-pressure instead of filling memory.
            await writer.drain()
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()
        found: _Usage | None = None
        if response.status_code >= 400:
            return
        if sse_usage is not None:
            sse_usage.close()
            found = sse_usage.found
            streamed = sse_usage.message
            if request_body is not None and streamed is not None and streamed.seen:
                self._keep_chat(request_body, {"choices": [{"message": streamed.message()}]})
        elif json_body:
            with contextlib.suppress(ValueError):
                answer = json.loads(json_body)
                found = _usage_numbers(answer)
                if request_body is not None:
                    self._keep_chat(request_body, answer)
        if found is not None:
            self._record_usage(found)

    def _keep_chat(self, request_body: bytes, answer: Any) -> None:
        """Keep the call's messages and the answer's message as ``last_chat``."""
        with contextlib.suppress(ValueError, TypeError, KeyError, IndexError, AttributeError):
            request = json.loads(request_body)
            messages = request["messages"]
            message = answer["choices"][0]["message"]
            if isinstance(messages, list) and isinstance(message, dict):
                tools = request.get("tools")
                self.last_chat = {
                    "messages": messages,
                    "response": message,
                    "tools": tools if isinstance(tools, list) else None,
                }
