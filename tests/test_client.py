"""RolloutClient/RolloutHandle against our server, scripted servers, and the raw transport."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from harbor_exec._client_http import AiohttpTransport, Answer, HttpxTransport
from harbor_exec.client import (
    RolloutAdmissionTimeoutError,
    RolloutClient,
    RolloutProtocolError,
    _retry_after,
)
from harbor_exec.protocol import RolloutErrorCategory, RolloutInitResponse, RolloutStatus
from tests.server_utils import (
    CHAT_URL,
    NEVER,
    PROMPT,
    SINGLE_SLOT,
    FullBackend,
    free_port,
    gate,
    local_app,
    serve,
    wait_until_async,
)


def new_id() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    app = local_app(
        tmp_path_factory.mktemp("client"),
        workflow_config=SINGLE_SLOT,
        result_wait_timeout_sec=20.0,
        polling_lease_timeout_sec=60.0,
    )
    with serve(app, graceful_shutdown_sec=1.0) as url:
        yield url


@pytest.fixture
async def client(server_url: str) -> AsyncIterator[RolloutClient]:
    async with RolloutClient(url=server_url + "/") as rollout_client:
        yield rollout_client


# ---------------------------------------------------------------------------- the must-hold cases


async def test_graded_wrong_ungraded_and_removed(client: RolloutClient) -> None:
    result = await client.run_rollout(PROMPT, CHAT_URL, new_id(), label="4")
    assert result.status is RolloutStatus.SUCCESS
    assert result.sample is not None and result.sample.reward == 1.0
    assert result.sample.trajectory_messages == result.sample.messages

    wrong = await client.run_rollout(
        PROMPT, CHAT_URL, new_id(), label="4", metadata={"answer": "5"}
    )
    assert wrong.sample is not None and wrong.sample.reward == 0.0

    ungraded = await client.run_rollout(PROMPT, CHAT_URL, new_id(), label="4", grade=False)
    assert ungraded.status is RolloutStatus.SUCCESS
    assert ungraded.sample is not None and ungraded.sample.reward is None

    removed = await client.run_rollout(
        PROMPT, CHAT_URL, new_id(), label="4", metadata={"remove": True}
    )
    assert removed.status is RolloutStatus.SUCCESS
    assert removed.sample is not None and removed.sample.remove_sample
    assert removed.sample.reward is None


async def test_workflow_exception_and_agent_timeout(client: RolloutClient) -> None:
    failed = await client.run_rollout(PROMPT, CHAT_URL, new_id(), metadata={"raise": "boom"})
    assert (failed.status, failed.err_message, failed.err_category) == (
        RolloutStatus.FAILURE,
        "boom",
        RolloutErrorCategory.AGENT_ERROR,
    )
    late = await client.run_rollout(
        PROMPT, CHAT_URL, new_id(), label="4", metadata={"hold": NEVER}, agent_timeout_sec=0.3
    )
    assert (late.status, late.err_category, late.err_message) == (
        RolloutStatus.FAILURE,
        RolloutErrorCategory.TIMEOUT,
        "workflow exceeded its 0.3s deadline",
    )


async def test_waits_return_promptly_and_cancel_while_running_and_queued(
    client: RolloutClient,
) -> None:
    # The server's long-poll wait is 20 s: a /result-only client would sit in it.
    running = await client.run_rollout_async(
        PROMPT, CHAT_URL, new_id(), label="4", metadata={"hold": NEVER}
    )
    started = time.monotonic()
    assert await running.wait_for_running() is RolloutStatus.RUNNING
    assert time.monotonic() - started < 2.0
    queued = await client.run_rollout_async(
        PROMPT, CHAT_URL, new_id(), label="4", metadata={"hold": NEVER}
    )

    async def one_queued() -> bool:
        return bool((await client.queue_info())["queued"] == 1)

    assert await wait_until_async(one_queued)
    assert queued.status is RolloutStatus.QUEUED and not queued.done()
    assert (await client.cancel_rollout(queued.rollout_id)).dispositions == {
        queued.rollout_id: "cancelled_queued"
    }
    assert (await client.cancel_rollout(running.rollout_id)).dispositions == {
        running.rollout_id: "cancelled_running"
    }
    assert (await client.cancel_rollout(running.rollout_id)).dispositions == {
        running.rollout_id: "not_found"
    }
    for handle in (queued, running):
        result = await asyncio.wait_for(handle.wait_for_completion(), 10)
        assert result.status is RolloutStatus.CANCELLED
        assert handle.done() and handle.latest_result == result


async def test_wait_for_grading_returns_when_grading_starts(client: RolloutClient) -> None:
    name, grading = gate()
    handle = await client.run_rollout_async(
        PROMPT, CHAT_URL, new_id(), label="4", metadata={"grader_hold": name}
    )
    # Held in the grader until the test says: it returns while grading goes on.
    assert await handle.wait_for_grading() is RolloutStatus.GRADING
    assert grading.reached.is_set()
    assert await handle.wait_for_running() is RolloutStatus.GRADING  # already past it
    grading.open()
    result = await handle
    assert result.status is RolloutStatus.SUCCESS
    assert await handle.wait_for_grading() is RolloutStatus.SUCCESS


async def test_duplicate_wrong_lease_and_unknown_id(client: RolloutClient) -> None:
    rollout_id = new_id()
    handle = await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id, label="4")
    with pytest.raises(RolloutProtocolError) as duplicate:
        await client.run_rollout(PROMPT, CHAT_URL, rollout_id, label="4")
    assert duplicate.value.status_code == 409
    await handle
    forged = RolloutInitResponse(
        rollout_id=rollout_id,
        status=RolloutStatus.QUEUED,
        polling_lease_token="not-the-token",
        result_wait_timeout_sec=20,
        polling_lease_timeout_sec=60,
    )
    with pytest.raises(RolloutProtocolError) as wrong:
        await client._get_result(forged, lease_deadline=time.monotonic() + 60)
    assert wrong.value.status_code == 403
    unknown = forged.model_copy(update={"rollout_id": new_id()})
    with pytest.raises(RolloutProtocolError) as missing:
        await client._get_result(unknown, lease_deadline=time.monotonic() + 60)
    assert missing.value.status_code == 404
    with pytest.raises(ValueError, match="rollout_id"):  # refused locally, nothing sent
        await client.run_rollout(PROMPT, CHAT_URL, "a/b")


async def test_server_state_calls(client: RolloutClient) -> None:
    health = await client.health()
    assert health["lifecycle"]["accepting_rollouts"] is True
    assert (await client.queue_info())["capacity"] == 1
    assert (await client.prewarm())["total"] == 0
    assert (await client.prewarm(["t"]))["failed"] == 0
    result = await client.run_rollout(PROMPT, CHAT_URL, rid := new_id(), label="4")
    state = await client.rollout_status(rid)
    assert (state["status"], state["reward"]) == ("success", 1.0)
    assert result.sample is not None
    idle = await client.wait_idle(timeout_sec=10, poll_interval_sec=0.05)
    assert idle["process_id"] == health["process_id"]
    assert (await client.cancel_rollout(new_id())).dispositions.popitem()[1] == "not_found"


async def test_bearer_key(tmp_path: Path) -> None:
    with serve(local_app(tmp_path, api_key="k-123")) as url:
        async with RolloutClient(url=url) as anonymous:
            with pytest.raises(RolloutProtocolError) as caught:
                await anonymous.run_rollout(PROMPT, CHAT_URL, new_id(), label="4")
            assert caught.value.status_code == 401
            with pytest.raises(RolloutProtocolError):
                await anonymous.health()
        async with RolloutClient(url=url, api_key="k-123") as keyed:
            result = await keyed.run_rollout(PROMPT, CHAT_URL, new_id(), label="4")
            assert result.status is RolloutStatus.SUCCESS
            assert (await keyed.rollout_status(result.rollout_id))["status"] == "success"


async def test_full_backend_is_retried_until_admitted_or_the_deadline(tmp_path: Path) -> None:
    backend = FullBackend(tmp_path, refusals=2)
    with serve(local_app(tmp_path, backend=backend)) as url:
        async with RolloutClient(url=url, admission_timeout_sec=20) as patient:
            started = time.monotonic()
            result = await patient.run_rollout(PROMPT, CHAT_URL, new_id(), label="4")
            assert result.status is RolloutStatus.SUCCESS
            assert time.monotonic() - started >= 1.8  # two Retry-After: 1 pauses
        backend.refusals = 10**6
        async with RolloutClient(url=url, admission_timeout_sec=0.5) as hurried:
            with pytest.raises(RolloutAdmissionTimeoutError, match=r"timed out after 0\.5"):
                await hurried.run_rollout(PROMPT, CHAT_URL, new_id(), label="4")


async def test_lease_expires_when_nobody_polls(tmp_path: Path) -> None:
    app = local_app(tmp_path, result_wait_timeout_sec=0.3, polling_lease_timeout_sec=0.8)
    with serve(app) as url:
        async with RolloutClient(url=url) as rollout_client:
            handle = await rollout_client.run_rollout_async(
                PROMPT, CHAT_URL, new_id(), label="4", metadata={"hold": NEVER}
            )
            handle.cancel()  # stop polling locally; the server is not told
            with pytest.raises(asyncio.CancelledError):
                await handle

            async def lease_expired() -> bool:  # /status needs no lease and renews none
                status = await rollout_client.rollout_status(handle.rollout_id)
                return bool(status["status"] == RolloutStatus.FAILURE.value)

            assert await wait_until_async(lease_expired)
            result, _ = await rollout_client._get_result(
                handle._admission, lease_deadline=time.monotonic() + 5
            )
            assert (result.status, result.err_category, result.err_message) == (
                RolloutStatus.FAILURE,
                RolloutErrorCategory.LEASE_EXPIRED,
                "polling lease expired",
            )


# ---------------------------------------------------------------------------- scripted servers


def scripted_app(
    answer: Callable[[int], Awaitable[Response]], polls: list[float], features: bool = False
) -> FastAPI:
    """A protocol server whose /result answers come from ``answer(poll_number)``."""
    app = FastAPI()

    @app.post("/rollout")
    async def admit(request: Request) -> Response:
        body = await request.json()
        payload = {
            "rollout_id": body["rollout_id"],
            "status": "queued",
            "polling_lease_token": "token",
            "result_wait_timeout_sec": 30.0,
            "polling_lease_timeout_sec": 120.0,
        }
        headers = {"X-Harbor-Exec-Features": "status-wait"} if features else None
        return Response(json.dumps(payload), 202, headers, "application/json")

    @app.get("/rollout/{rollout_id}/result")
    async def result(rollout_id: str) -> Response:
        polls.append(time.monotonic())
        return await answer(len(polls))

    return app


def result_response(status: str, rollout_id: str = "fixed") -> Response:
    payload: dict[str, Any] = {"rollout_id": rollout_id, "status": status}
    if status == "success":
        payload["sample"] = {"messages": [], "reward": 1.0}
    return Response(json.dumps(payload), 200, None, "application/json")


@pytest.mark.parametrize("pattern", ["running", "flip-flop"])
async def test_no_busy_loop_against_a_server_that_answers_at_once(pattern: str) -> None:
    """A server that never parks a poll (answering "running", or flip-flopping
    between "unknown" and "running") is polled with a growing pause, not in a
    tight loop as the reference client does."""
    polls: list[float] = []
    started = time.monotonic()

    async def answer(number: int) -> Response:
        if time.monotonic() - started < 1.2:
            flip = pattern == "flip-flop" and number % 2 == 0
            return result_response("unknown" if flip else "running")
        return result_response("success")

    with serve(scripted_app(answer, polls)) as url:
        async with RolloutClient(url=url) as rollout_client:
            handle = await rollout_client.run_rollout_async(PROMPT, CHAT_URL, "fixed")
            # Without the features header, waits fall back to the /result polls.
            assert not handle.supports_status_wait
            assert await asyncio.wait_for(handle.wait_for_running(), 5) is RolloutStatus.RUNNING
            result = await asyncio.wait_for(handle, 15)
    assert result.status is RolloutStatus.SUCCESS
    # 50 ms doubling to 2 s: about 6 polls in 1.2 s (the reference makes hundreds).
    assert 3 <= len(polls) <= 12, len(polls)
    gaps = [b - a for a, b in itertools.pairwise(polls)]
    assert max(gaps) <= 2.6


async def test_gateway_errors_are_retried_and_others_raise() -> None:
    polls: list[float] = []

    async def flaky(number: int) -> Response:
        if number <= 2:
            return Response("bad gateway", 503)
        return result_response("success")

    with serve(scripted_app(flaky, polls)) as url:
        async with RolloutClient(url=url) as rollout_client:
            result = await asyncio.wait_for(
                rollout_client.run_rollout(PROMPT, CHAT_URL, "fixed"), 10
            )
    assert result.status is RolloutStatus.SUCCESS and len(polls) == 3
    assert polls[2] - polls[0] >= 0.7  # 0.25 s then 0.5 s

    polls.clear()

    async def gone(number: int) -> Response:
        return Response(json.dumps({"detail": "unknown rollout_id"}), 404)

    with serve(scripted_app(gone, polls)) as url:
        async with RolloutClient(url=url) as rollout_client:
            with pytest.raises(RolloutProtocolError) as caught:
                await asyncio.wait_for(rollout_client.run_rollout(PROMPT, CHAT_URL, "fixed"), 10)
    assert caught.value.status_code == 404 and len(polls) == 1


def test_retry_after_parsing() -> None:
    def parse(value: str | None) -> float:
        headers = {} if value is None else {"Retry-After": value}
        return _retry_after(Answer(429, httpx.Headers(headers), b""))

    assert [parse(v) for v in (None, "2.5", "0", "1000", "soon", "inf", "nan")] == [
        1.0,
        2.5,
        0.05,
        60.0,
        1.0,
        1.0,
        1.0,
    ]


async def test_client_options_and_owned_http_client(server_url: str) -> None:
    with pytest.raises(ValueError, match="finite"):
        RolloutClient(url=server_url, admission_timeout_sec=float("inf"))
    with pytest.raises(ValueError, match="api_key"):
        RolloutClient(url=server_url, api_key=" ")
    async with httpx.AsyncClient() as own:
        rollout_client = RolloutClient(url=server_url, http_client=own)
        assert rollout_client.http_client is own and not rollout_client.owns_http_client
        assert (await rollout_client.health())["status"] == "ok"
        # Every call goes through the given httpx client.
        result = await rollout_client.run_rollout(PROMPT, CHAT_URL, new_id(), label="4")
        assert result.status is RolloutStatus.SUCCESS
        await rollout_client.aclose()
        assert not own.is_closed  # not ours to close
    # Without one, an httpx client is still there for code that used the attribute,
    # made on first access and closed with the RolloutClient.
    rollout_client = RolloutClient(url=server_url)
    assert rollout_client.owns_http_client
    spare = rollout_client.http_client
    assert isinstance(spare, httpx.AsyncClient) and rollout_client.http_client is spare
    assert (await spare.get(f"{server_url}/health")).status_code == 200
    await rollout_client.aclose()
    assert spare.is_closed


async def test_default_http_is_aiohttp_and_reuses_one_connection() -> None:
    """Sequential rollouts share one kept-alive connection; every request is well formed."""
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            head = await read_request(reader)
            requests.append(head)
            rollout_id = head.split(b" ")[1].split(b"/")[2].decode() if b"/result" in head else ""
            if head.startswith(b"POST"):
                rollout_id = f"keep-{len(requests)}"
                body = json.dumps(
                    {
                        "rollout_id": rollout_id,
                        "status": "queued",
                        "polling_lease_token": "t",
                        "result_wait_timeout_sec": 1.0,
                        "polling_lease_timeout_sec": 30.0,
                    }
                ).encode()
                status = b"202 Accepted"
            else:
                body = json.dumps({"rollout_id": rollout_id, "status": "success"}).encode()
                status = b"200 OK"
            writer.write(b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body))
            await writer.drain()

    async with RawServer(handler) as server, RolloutClient(url=server.url, api_key="k") as client:
        assert isinstance(client._http, AiohttpTransport)
        for number in (1, 3, 5):
            result = await asyncio.wait_for(
                client.run_rollout(PROMPT, CHAT_URL, f"keep-{number}"), 10
            )
            assert result.status is RolloutStatus.SUCCESS
    assert server.connections == 1 and len(requests) == 6
    post = requests[0].lower()
    assert post.startswith(b"post /rollout http/1.1")
    assert b"authorization: bearer k" in post and b"content-type: application/json" in post
    poll = requests[1].lower()
    assert poll.startswith(b"get /rollout/keep-1/result http/1.1")
    assert b"x-osmosis-rollout-lease: t" in poll


async def test_transport_failures_raise_httpx_errors() -> None:
    """Through aiohttp, failures keep the exception classes of a default httpx client."""
    closed_port = free_port()
    async with RolloutClient(url=f"http://127.0.0.1:{closed_port}") as client:
        with pytest.raises(httpx.ConnectError):
            await client.health()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async with RawServer(garbage) as server, RolloutClient(url=server.url) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.health()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with RawServer(silent) as server:
        transport = AiohttpTransport(server.url)
        try:
            with pytest.raises(httpx.ReadTimeout):
                await transport.request("GET", f"{server.url}/health", headers={}, timeout=0.2)
        finally:
            await transport.aclose()


async def test_proxies_from_the_environment_are_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a default httpx client does (trust_env): HTTP_PROXY, unless NO_PROXY names the host."""
    seen: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        seen.append(await read_request(reader))
        body = json.dumps({"status": "ok", "via": "proxy"}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    async with RawServer(proxy) as server:
        monkeypatch.setenv("HTTP_PROXY", server.url)
        async with RolloutClient(url="http://rollouts.invalid:8000") as client:
            assert (await client.health())["via"] == "proxy"
        assert seen[0].startswith(b"GET http://rollouts.invalid:8000/health HTTP/1.1")
        monkeypatch.setenv("NO_PROXY", "rollouts.invalid")
        assert AiohttpTransport("http://rollouts.invalid:8000")._proxy is None


async def test_without_aiohttp_the_client_uses_httpx(
    server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # unimportable
    async with RolloutClient(url=server_url) as client:
        assert isinstance(client._http, HttpxTransport)
        assert client.http_client is client._http.client
        result = await client.run_rollout(PROMPT, CHAT_URL, new_id(), label="4")
        assert result.status is RolloutStatus.SUCCESS
    assert client.http_client.is_closed  # owned, so closed with the client


# ---------------------------------------------------------------------------- raw transport


class RawServer:
    """A scripted HTTP server on 127.0.0.1 speaking raw bytes, one handler per connection."""

    def __init__(
        self, handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
    ) -> None:
        self.handler = handler
        self.connections = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":")[1]))
    return head


async def test_polls_survive_dropped_connections() -> None:
    """A result poll whose connection drops is retried (0.1 s, then 0.5 s)."""
    calls = {"result": 0}

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            head = await read_request(reader)
            if head.startswith(b"POST"):
                body = json.dumps(
                    {
                        "rollout_id": "drop",
                        "status": "queued",
                        "polling_lease_token": "t",
                        "result_wait_timeout_sec": 1.0,
                        "polling_lease_timeout_sec": 30.0,
                    }
                ).encode()
                status = b"202 Accepted"
            else:
                calls["result"] += 1
                if calls["result"] <= 2:
                    return  # drop the connection without an answer
                body = json.dumps({"rollout_id": "drop", "status": "success"}).encode()
                status = b"200 OK"
            writer.write(b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body))
            await writer.drain()

    async with RawServer(handler) as server, RolloutClient(url=server.url) as rollout_client:
        result = await asyncio.wait_for(rollout_client.run_rollout(PROMPT, CHAT_URL, "drop"), 10)
    assert result.status is RolloutStatus.SUCCESS and calls["result"] == 3
