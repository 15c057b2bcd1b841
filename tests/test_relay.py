"""The per-rollout model relay and the runner's forwarder, with real sockets only.

A fake OpenAI-compatible model (``FakeChat``) listens on 127.0.0.1 and records
the key it is called with; the relay listens on a unix socket under tmp_path;
the runner's ``RelayForwarder`` pipes a loopback port to it, as in a container.
The first test runs the real ``python -m harbor_exec.container.runner agent`` subprocess.
Every test checks afterwards that the real key is in no file under tmp_path and
in no log record.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import stat
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from harbor_exec.container.runner import RelayForwarder
from harbor_exec.network.relay import (
    RELAY_TOTALS,
    ModelRelay,
    RelayLimits,
    RelayTotals,
    render_relay_metrics,
)
from tests.bundle_utils import PYTHON311, REPO_ROOT, clean_env
from tests.fake_chat import FakeChat
from tests.server_utils import metric, wait_until_async

pytestmark = pytest.mark.timeout(60)

REAL_KEY = "sk-real-model-key-5f1e9c0a7b"
QUESTION = "What is 17 + 25?"
CHAT_BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": QUESTION}]}
PROMPT_TOKENS = len(QUESTION.split())


@pytest.fixture(autouse=True)
def no_key_leaks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, chat: FakeChat
) -> Iterator[None]:
    chat.reset()
    caplog.set_level(logging.DEBUG)
    yield
    chat.reset()  # releases anything a test left waiting
    for record in caplog.get_records("setup") + caplog.get_records("call"):
        text = record.getMessage() + (record.exc_text or "") + str(record.exc_info or "")
        assert REAL_KEY not in text, record
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert REAL_KEY.encode() not in path.read_bytes(), path


@dataclass
class Rig:
    """Fake model <- relay (unix socket) <- forwarder (127.0.0.1:port) <- client."""

    relay: ModelRelay
    forwarder: RelayForwarder
    totals: RelayTotals
    client: httpx.AsyncClient

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.forwarder.port}{self.relay.path_prefix}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.relay.token}"}

    async def chat_call(self, body: dict[str, Any] = CHAT_BODY, **kwargs: Any) -> httpx.Response:
        headers = kwargs.pop("headers", self.auth)
        return await self.client.post(
            f"{self.base_url}/chat/completions", json=body, headers=headers, **kwargs
        )


@asynccontextmanager
async def open_rig(
    tmp_path: Path, upstream: str, limits: RelayLimits | None = None
) -> AsyncIterator[Rig]:
    totals = RelayTotals()
    relay = ModelRelay(
        upstream_url=upstream,
        api_key=REAL_KEY,
        directory=tmp_path / "relay",
        limits=limits or RelayLimits(),
        totals=totals,
    )
    async with relay:
        forwarder = RelayForwarder(str(relay.socket_path))
        await forwarder.start()
        try:
            async with httpx.AsyncClient(timeout=15) as client:
                yield Rig(relay, forwarder, totals, client)
        finally:
            await forwarder.aclose()


async def _raw_status(port: int, request: bytes) -> int:
    """Send raw bytes to the forwarder and return the answer's status code."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
    return int(line.split()[1])


# --------------------------------------------------------------------------- the runner


# Standard library only, so it also runs on the container's bare Python 3.11.
RELAYED_FLOW = """
    import asyncio
    import json
    import urllib.request

    from harbor_exec.authoring import AgentWorkflow, get_rollout_context

    def call(url, key, messages):
        request = urllib.request.Request(
            url + "/chat/completions",
            data=json.dumps({"model": "m", "messages": messages}).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=20) as response:
            return json.load(response)

    class Relayed(AgentWorkflow):
        async def run(self, ctx):
            rollout = get_rollout_context()
            # In a thread: the runner's forwarder shares this event loop.
            answer = await asyncio.to_thread(
                call, rollout.chat_completions_url, rollout.api_key, ctx.prompt
            )
            seen = {"url": rollout.chat_completions_url, "key": rollout.api_key}
            return [
                *ctx.prompt,
                answer["choices"][0]["message"],
                {"role": "user", "content": json.dumps(seen)},
            ]
    """


async def _run_agent(
    tmp_path: Path, rollout: dict[str, Any], python: str = sys.executable
) -> tuple[int, str]:
    """``python -m harbor_exec.container.runner agent`` as a subprocess; (exit code, stdout+stderr)."""
    mods = tmp_path / "mods"
    mods.mkdir(exist_ok=True)
    (mods / "relayed_flow.py").write_text(textwrap.dedent(RELAYED_FLOW))
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"format_version": 1, "workflow": "relayed_flow:Relayed"}))
    logs = tmp_path / "logs"
    (logs / "agent").mkdir(parents=True, exist_ok=True)
    (logs / "agent" / "rollout.json").write_text(json.dumps(rollout))
    command = [python, "-m", "harbor_exec.container.runner", "agent", "--manifest", str(manifest)]
    command += ["--logs-dir", str(logs), "--tests-dir", str(tmp_path / "tests")]
    process = await asyncio.create_subprocess_exec(
        *command,
        env=clean_env(PYTHONPATH=f"{REPO_ROOT}:{mods}"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), 45)
    assert process.returncode is not None
    return process.returncode, output.decode()


@pytest.mark.parametrize("python", [sys.executable, str(PYTHON311)], ids=["venv", "py311"])
async def test_runner_workflow_reaches_the_model_with_the_real_key_and_sees_only_the_token(
    tmp_path: Path, chat: FakeChat, python: str
) -> None:
    totals = RelayTotals()
    relay = ModelRelay(
        upstream_url=f"{chat.base_url}/v1",
        api_key=REAL_KEY,
        directory=tmp_path / "relay",
        totals=totals,
    )
    async with relay:
        rollout = {
            "version": 1,
            "rollout_id": "r-relay",
            "prompt": [{"role": "user", "content": QUESTION}],
            # The real URL must not matter: the relay is the way out.
            "chat_completions_url": "http://198.51.100.1:9/unused",
            "api_key": relay.token,
            "relay": {"socket": str(relay.socket_path), "path": relay.path_prefix},
        }
        code, output = await _run_agent(tmp_path, rollout, python)
    assert code == 0, output
    assert REAL_KEY not in output
    sample = json.loads((tmp_path / "logs" / "agent" / "sample.json").read_text())
    assert sample["messages"][1] == {"role": "assistant", "content": "42"}
    seen = json.loads(sample["messages"][2]["content"])
    assert seen["key"] == relay.token != REAL_KEY
    assert seen["url"].startswith("http://127.0.0.1:") and seen["url"].endswith("/v1")
    # The model got the real key, on the upstream path, exactly once.
    assert chat.authorizations == [f"Bearer {REAL_KEY}"]
    assert chat.requests[0].path == "/v1/chat/completions"
    assert (relay.usage.requests, relay.usage.prompt_tokens) == (1, PROMPT_TOKENS)
    assert (totals.requests, totals.relays_started, totals.relays_active) == (1, 1, 0)


async def test_runner_without_the_relay_socket_fails_at_setup(
    tmp_path: Path, chat: FakeChat
) -> None:
    rollout = {
        "version": 1,
        "rollout_id": "r-nosock",
        "prompt": [{"role": "user", "content": QUESTION}],
        "api_key": "token-that-goes-nowhere",
        "relay": {"socket": str(tmp_path / "missing" / "relay.sock"), "path": "/v1"},
    }
    code, output = await _run_agent(tmp_path, rollout)
    assert code == 2, output
    error = json.loads((tmp_path / "logs" / "agent" / "sample.json").read_text())["error"]
    assert error["phase"] == "setup"
    assert "relay socket" in error["message"]
    assert chat.requests == []


async def test_forwarder_stops_listening_when_closed(tmp_path: Path, chat: FakeChat) -> None:
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        port = rig.forwarder.port
        assert (await rig.chat_call()).status_code == 200
        await rig.forwarder.aclose()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)


# --------------------------------------------------------------------------- relay behaviour


async def test_json_call_swaps_the_key_and_records_usage(tmp_path: Path, chat: FakeChat) -> None:
    async with open_rig(tmp_path, f"{chat.base_url}/v1/") as rig:
        assert rig.relay.path_prefix == "/v1"
        first = await rig.chat_call()
        second = await rig.chat_call()  # the same kept-alive connection
        assert first.status_code == second.status_code == 200
        assert first.json()["choices"][0]["message"]["content"] == "42"
        assert chat.authorizations == [f"Bearer {REAL_KEY}"] * 2
        assert chat.requests[0].path == "/v1/chat/completions"
        assert chat.requests[0].body == CHAT_BODY
        usage = rig.relay.usage
        assert (usage.requests, usage.rejected) == (2, 0)
        assert (usage.prompt_tokens, usage.completion_tokens) == (2 * PROMPT_TOKENS, 2)
        assert usage.total_tokens == 2 * (PROMPT_TOKENS + 1)
        assert (rig.totals.prompt_tokens, rig.totals.completion_tokens) == (2 * PROMPT_TOKENS, 2)


async def test_no_api_key_means_no_authorization_upstream(tmp_path: Path, chat: FakeChat) -> None:
    relay = ModelRelay(upstream_url=chat.base_url, api_key=None, directory=tmp_path / "relay")
    async with relay:
        assert relay.path_prefix == ""
        transport = httpx.AsyncHTTPTransport(uds=str(relay.socket_path))
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            response = await client.post(
                "http://relay/chat/completions",
                json=CHAT_BODY,
                headers={"Authorization": f"Bearer {relay.token}"},
            )
    assert response.status_code == 200
    assert chat.authorizations == [None]


@pytest.mark.parametrize(
    "authorization", [None, "Bearer", "Bearer wrong-token", "Bearer SAME-LENGTH", "Basic TOKEN"]
)
async def test_a_missing_or_wrong_token_is_refused_before_the_model(
    tmp_path: Path, chat: FakeChat, authorization: str | None
) -> None:
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        headers = {}
        if authorization is not None:
            value = authorization.replace("SAME-LENGTH", "A" * len(rig.relay.token))
            headers["Authorization"] = value.replace("TOKEN", rig.relay.token)
        response = await rig.chat_call(headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_token"
        # A real key presented as the token is no better.
        response = await rig.chat_call(headers={"Authorization": f"Bearer {REAL_KEY}"})
        assert response.status_code == 401
        assert chat.requests == []
        assert (rig.relay.usage.rejected, rig.relay.usage.requests) == (2, 0)


@pytest.mark.parametrize(
    "target",
    [
        b"/v2/chat/completions",
        b"/chat/completions",
        b"/v1x/chat/completions",
        b"/v1/../admin",
        b"/v1/%2e%2e/admin",
        b"/v1/%2E%2E/%2e%2e/metrics",
        b"http://127.0.0.1:1/v1/chat/completions",
        b"//127.0.0.1:1/v1/chat/completions",
        b"*",
    ],
)
async def test_paths_outside_the_prefix_are_refused(
    tmp_path: Path, chat: FakeChat, target: bytes
) -> None:
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        method = b"OPTIONS" if target == b"*" else b"POST"
        request = (
            method + b" " + target + b" HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + rig.relay.token.encode() + b"\r\n"
            b"Content-Length: 2\r\n\r\n{}"
        )
        assert await _raw_status(rig.forwarder.port, request) == 404
        assert chat.requests == []
        assert rig.relay.usage.rejected == 1


# --------------------------------------------------------------------------- what the relay lends

# Every route a hostile workflow might try with the real key: the platform's file,
# fine-tuning and model APIs, vLLM's adapter loading, other inference routes, and
# the chat route dressed up (dot segments plain, encoded and double-encoded,
# parameters, empty and trailing segments, encoded separators, a query, a fragment).
OTHER_ROUTES = (
    [
        (method, path)
        for path in (
            b"/v1/files",
            b"/v1/files/file-abc123",
            b"/v1/files/file-abc123/content",
            b"/v1/fine_tunes",
            b"/v1/fine_tuning/jobs",
            b"/v1/fine_tuning/jobs/ftjob-1/cancel",
            b"/v1/models",
            b"/v1/models/m",
            b"/v1/load_lora_adapter",
            b"/v1/unload_lora_adapter",
            b"/v1/completions",
            b"/v1/embeddings",
            b"/v1/batches",
        )
        for method in (b"GET", b"DELETE", b"POST")
    ]
    + [
        (b"POST", path)
        for path in (
            b"/v1/chat/completions/../files",
            b"/v1/chat/completions/../../v1/files",
            b"/v1/chat/completions/%2e%2e/files",
            b"/v1/chat/completions/%2E%2E/files",
            b"/v1/chat/completions/%252e%252e/files",
            b"/v1/%252e%252e/v1/files",
            b"/v1/chat/completions/..;/files",
            b"/v1/..;/v1/files",
            b"/v1/chat/completions;x",
            b"/v1/chat;x/completions",
            b"/v1//chat/completions",
            b"//v1/chat/completions",
            b"/v1/chat/completions/",
            b"/v1/chat/completions//",
            b"/v1/./chat/completions",
            b"/v1/chat/./completions",
            b"/v1/chat%2fcompletions",
            b"/v1/chat%2Fcompletions",
            b"/v1/chat/completion%73",
            b"/v1/chat/completions%3b",
            b"/v1/chat/completions%00",
            b"/v1/chat/completions%252f",
            b"/v1/chat\\completions",
            b"/v1/chat%5ccompletions",
            b"/V1/chat/completions",
            b"/v1/chat/completions?",
            b"/v1/chat/completions?api-version=2024",
            b"/v1/chat/completions?x=/../files",
            b"/v1/chat/completions#frag",
            b"http://127.0.0.1:1/v1/chat/completions",
        )
    ]
    + [
        (method, b"/v1/chat/completions")
        for method in (b"GET", b"DELETE", b"PUT", b"PATCH", b"OPTIONS", b"post")
    ]
)


async def _raw_exchange(port: int, request: bytes) -> tuple[int, bytes]:
    """Send raw bytes to the forwarder; the answer's (status, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        body = await asyncio.wait_for(reader.readexactly(length), 10)
    finally:
        writer.close()
    return int(head.split()[1]), body


async def _unanswered(reader: asyncio.StreamReader) -> bytes:
    """What arrives before the relay closes the connection (a reset counts as closed:
    the relay aborts connections it will not read)."""
    try:
        return await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:
        return b""


def _request(method: bytes, target: bytes, token: str, body: bytes = b"{}") -> bytes:
    return (
        method + b" " + target + b" HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + token.encode() + b"\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


@pytest.mark.parametrize(
    ("method", "target"), OTHER_ROUTES, ids=[f"{m.decode()} {t.decode()}" for m, t in OTHER_ROUTES]
)
async def test_only_post_chat_completions_reaches_the_model(
    tmp_path: Path, chat: FakeChat, method: bytes, target: bytes
) -> None:
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        body = json.dumps(CHAT_BODY).encode()
        status, answer = await _raw_exchange(
            rig.forwarder.port, _request(method, target, rig.relay.token, body)
        )
        assert status == 404
        error = json.loads(answer)["error"]
        assert error["code"] == "route_not_allowed"
        # The answer names the route asked for and the one allowed.
        assert method.decode() in error["message"]
        assert "POST /v1/chat/completions" in error["message"]
        assert REAL_KEY not in answer.decode()
        # Nothing reached the model, so the key went nowhere.
        assert chat.requests == []
        assert (rig.relay.usage.requests, rig.relay.usage.rejected) == (0, 1)
        # And the relay still serves the one route it lends.
        assert (await rig.chat_call()).status_code == 200
        assert [r.path for r in chat.requests] == ["/v1/chat/completions"]


async def test_head_on_the_chat_route_is_refused_without_a_body(
    tmp_path: Path, chat: FakeChat
) -> None:
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        request = _request(b"HEAD", b"/v1/chat/completions", rig.relay.token)
        assert await _raw_status(rig.forwarder.port, request) == 404
        assert chat.requests == []
        assert rig.relay.usage.rejected == 1


async def test_an_operator_route_is_forwarded_and_nothing_beside_it(
    tmp_path: Path, chat: FakeChat
) -> None:
    limits = RelayLimits(extra_routes=("/completions",))
    async with open_rig(tmp_path, f"{chat.base_url}/v1", limits) as rig:
        response = await rig.client.post(
            f"{rig.base_url}/completions", json=CHAT_BODY, headers=rig.auth
        )
        assert response.status_code == 200
        assert response.json()["choices"][0]["message"]["content"] == "42"
        assert (await rig.chat_call()).status_code == 200
        assert [(r.method, r.path) for r in chat.requests] == [
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
        ]
        assert chat.authorizations == [f"Bearer {REAL_KEY}"] * 2
        assert rig.relay.usage.prompt_tokens == 2 * PROMPT_TOKENS
        chat.reset()
        port, token = rig.forwarder.port, rig.relay.token
        for method, target in [
            (b"GET", b"/v1/completions"),
            (b"POST", b"/v1/completions/"),
            (b"POST", b"/v1/completions?stream=1"),
            (b"POST", b"/v1/completions/../files"),
            (b"POST", b"/v1/embeddings"),
        ]:
            status, answer = await _raw_exchange(port, _request(method, target, token))
            assert status == 404, target
            assert "POST /v1/completions" in json.loads(answer)["error"]["message"]
        assert chat.requests == []


async def test_a_query_in_the_operators_upstream_url_rides_along(
    tmp_path: Path, chat: FakeChat
) -> None:
    async with open_rig(tmp_path, f"{chat.base_url}/openai?api-version=2024-06-01") as rig:
        assert rig.relay.path_prefix == "/openai"
        assert (await rig.chat_call()).status_code == 200
        assert chat.requests[0].path == "/openai/chat/completions?api-version=2024-06-01"
        # The workflow's own query is refused, even the same one.
        response = await rig.chat_call(params={"api-version": "2024-06-01"})
        assert response.status_code == 404
        assert len(chat.requests) == 1


@pytest.mark.parametrize(
    "route",
    [
        "completions",
        "",
        "/",
        "//completions",
        "/completions/",
        "/../files",
        "/./completions",
        "/%2e%2e",
        "/completions;x",
        "/completions?x=1",
        "/a\\b",
        "/.hidden",
        "/x" * 200,
    ],
)
def test_an_extra_route_must_be_a_plain_path(route: str) -> None:
    with pytest.raises(ValueError, match="relay route"):
        RelayLimits(extra_routes=(route,))


async def test_only_allowlisted_headers_reach_the_model(tmp_path: Path, chat: FakeChat) -> None:
    sent = {
        "Content-Type": "application/json",
        "Accept": "application/json",
        "User-Agent": "OpenAI/Python 1.40.0",
        "Cookie": "session=stolen",
        "X-Forwarded-For": "10.0.0.1",
        "X-Forwarded-Host": "admin.internal",
        "Forwarded": "for=10.0.0.1",
        "X-Real-IP": "10.0.0.1",
        "OpenAI-Organization": "org-victim",
        "OpenAI-Project": "proj-victim",
        "OpenAI-Beta": "assistants=v2",
        "Api-Key": "agent-chosen",
        "X-Api-Key": "agent-chosen",
        "Proxy-Authorization": "Basic eDp5",
        "X-Custom": "anything",
        "Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "Connection": "keep-alive, X-Custom",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Accept-Encoding": "gzip, br",
        "Host": "evil.example",
    }
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        headers = {**sent, **rig.auth}
        response = await rig.client.post(
            f"{rig.base_url}/chat/completions", json=CHAT_BODY, headers=headers
        )
        assert response.status_code == 200
    (received,) = chat.requests
    got = dict(received.headers)
    assert len(got) == len(received.headers)  # no header twice
    assert set(got) == {
        "content-type",
        "accept",
        "user-agent",
        "authorization",
        "accept-encoding",
        "host",
        "content-length",
    }
    assert got["authorization"] == f"Bearer {REAL_KEY}"
    assert got["user-agent"] == "OpenAI/Python 1.40.0"
    assert got["accept-encoding"] == "identity"
    assert got["host"] == chat.base_url.removeprefix("http://")


async def test_refusals_are_budgeted_then_the_rollout_is_cut_off(
    tmp_path: Path, chat: FakeChat
) -> None:
    async with open_rig(
        tmp_path, f"{chat.base_url}/v1", RelayLimits(max_refused_requests=3)
    ) as rig:
        relay = rig.relay
        # A connection kept alive from before the budget is spent.
        reader, writer = await asyncio.open_unix_connection(str(relay.socket_path))
        chat_request = _request(
            b"POST", b"/v1/chat/completions", relay.token, json.dumps(CHAT_BODY).encode()
        )
        writer.write(chat_request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert len(chat.requests) == 1
        chat.reset()
        for target in (b"/v1/files", b"/v1/models", b"/v1/%2e%2e/files"):
            status, _ = await _raw_exchange(
                rig.forwarder.port, _request(b"GET", target, relay.token)
            )
            assert status == 404
        assert relay.refusals_spent
        # Now even the chat route is refused: on a new connection...
        with pytest.raises(httpx.HTTPError):
            await rig.chat_call()
        fresh_reader, fresh_writer = await asyncio.open_unix_connection(str(relay.socket_path))
        fresh_writer.write(chat_request)
        assert await _unanswered(fresh_reader) == b""
        fresh_writer.close()
        # ...and on the one kept alive (after the rest of its first answer).
        writer.write(chat_request)
        assert b"HTTP/1.1" not in await _unanswered(reader)
        writer.close()
        assert chat.requests == []
        assert relay.usage.requests == 1
        assert relay.usage.rejected == 6


async def test_an_idle_connection_is_closed_but_a_slow_model_is_not_cut(
    tmp_path: Path, chat: FakeChat
) -> None:
    limits = RelayLimits(idle_timeout_sec=0.3)
    async with open_rig(tmp_path, f"{chat.base_url}/v1", limits) as rig:
        path = str(rig.relay.socket_path)
        started = time.monotonic()
        # Kept alive after an answer, then silent.
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(_request(b"POST", b"/v1/chat/completions", rig.relay.token))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 ")
        # A request trickling in: half a head, then nothing.
        slow_reader, slow_writer = await asyncio.open_unix_connection(path)
        slow_writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        # A call the model sits on for longer than the idle timeout.
        chat.reset("slow")
        call = asyncio.create_task(rig.chat_call())
        assert await asyncio.to_thread(chat.wait_for_requests, 1, 10.0)
        # Both silent connections end (EOF) on the relay's clock, well within the bound.
        await _unanswered(reader)  # the rest of the first answer, then EOF
        assert await _unanswered(slow_reader) == b""
        assert time.monotonic() - started < 9
        writer.close()
        slow_writer.close()
        # The slow call outlived the idle timeout, yet its answer still arrives.
        chat.release_slow()
        response = await asyncio.wait_for(call, 10)
        assert response.status_code == 200
        assert rig.relay.usage.requests == 2


async def test_a_request_over_the_size_limit_gets_413(tmp_path: Path, chat: FakeChat) -> None:
    limits = RelayLimits(max_request_bytes=1024)
    big = {**CHAT_BODY, "pad": "y" * 2048}
    async with open_rig(tmp_path, f"{chat.base_url}/v1", limits) as rig:
        response = await rig.chat_call(big)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"

        # Chunked, so the relay only finds out while reading the body.
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(8):
                yield b"z" * 512

        response = await rig.client.post(
            f"{rig.base_url}/chat/completions", content=chunks(), headers=rig.auth
        )
        assert response.status_code == 413
        # Under the limit still passes.
        assert (await rig.chat_call()).status_code == 200
        assert len(chat.requests) == 1
        assert rig.relay.usage.rejected == 2


async def test_the_request_count_limit_answers_429(tmp_path: Path, chat: FakeChat) -> None:
    async with open_rig(tmp_path, f"{chat.base_url}/v1", RelayLimits(max_requests=3)) as rig:
        statuses = [(await rig.chat_call()).status_code for _ in range(5)]
        assert statuses == [200, 200, 200, 429, 429]
        assert len(chat.requests) == 3
        assert (rig.relay.usage.requests, rig.relay.usage.rejected) == (3, 2)
        assert rig.totals.requests == 3


async def test_parallel_calls_do_not_overshoot_the_request_limit(
    tmp_path: Path, chat: FakeChat
) -> None:
    limits = RelayLimits(max_requests=4)
    async with open_rig(tmp_path, f"{chat.base_url}/v1", limits) as rig:
        responses = await asyncio.gather(*(rig.chat_call() for _ in range(12)))
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200] * 4 + [429] * 8
        assert len(chat.requests) == 4


async def test_expect_100_continue_is_answered(tmp_path: Path, chat: FakeChat) -> None:
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        body = json.dumps(CHAT_BODY).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", rig.forwarder.port)
        try:
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                b"Authorization: Bearer " + rig.relay.token.encode() + b"\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
            )
            await writer.drain()
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert interim.startswith(b"HTTP/1.1 100 ")
            writer.write(body)
            final = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert final.startswith(b"HTTP/1.1 200 ")
        finally:
            writer.close()
        assert chat.authorizations == [f"Bearer {REAL_KEY}"]


async def test_a_declared_oversized_response_is_refused(tmp_path: Path, chat: FakeChat) -> None:
    chat.padding = 64 * 1024
    async with open_rig(
        tmp_path, f"{chat.base_url}/v1", RelayLimits(max_response_bytes=16384)
    ) as rig:
        response = await rig.chat_call()
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "response_too_large"
        assert rig.relay.usage.upstream_errors == 1


async def test_a_streamed_oversized_response_is_cut(tmp_path: Path, chat: FakeChat) -> None:
    chat.padding = 256 * 1024
    limit = 16384
    async with open_rig(
        tmp_path, f"{chat.base_url}/v1", RelayLimits(max_response_bytes=limit)
    ) as rig:
        received = 0
        with pytest.raises(httpx.HTTPError):  # the chunked body never completes
            async with rig.client.stream(
                "POST",
                f"{rig.base_url}/chat/completions",
                json={**CHAT_BODY, "stream": True},
                headers=rig.auth,
            ) as response:
                assert response.status_code == 200
                async for chunk in response.aiter_raw():
                    received += len(chunk)
        # Cut at the first upstream read that would cross the limit (may be the first).
        assert received <= limit
        assert rig.relay.usage.upstream_errors == 1
        assert rig.relay.usage.prompt_tokens == 0


async def test_sse_arrives_incrementally_and_the_final_usage_is_recorded(
    tmp_path: Path, chat: FakeChat
) -> None:
    gate = threading.Event()
    chat.stream_gate = gate
    body = {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}}
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        async with rig.client.stream(
            "POST", f"{rig.base_url}/chat/completions", json=body, headers=rig.auth
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert response.headers["transfer-encoding"] == "chunked"
            lines = response.aiter_lines()
            # The model holds the rest of the stream until the gate opens.
            first = await asyncio.wait_for(anext(lines), 10)
            assert not gate.is_set()
            assert (
                json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["content"] == "42"
            )
            assert rig.relay.usage.completion_tokens == 0
            gate.set()
            rest = [line async for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        final = json.loads(rest[-2].removeprefix("data: "))
        assert final["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1}
        usage = rig.relay.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (PROMPT_TOKENS, 1)
        assert usage.total_tokens == PROMPT_TOKENS + 1
        assert chat.authorizations == [f"Bearer {REAL_KEY}"]


async def test_cached_tokens_and_the_upstreams_cost_are_recorded_from_json(
    tmp_path: Path, chat: FakeChat
) -> None:
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        assert (await rig.chat_call()).status_code == 200
        # An upstream that reports neither: both stay None (nothing is priced here).
        assert rig.relay.usage.cached_tokens is None and rig.relay.usage.cost_usd is None
        assert "cached_tokens" not in rig.relay.usage.usage_metrics()
        chat.usage_extra = {"prompt_tokens_details": {"cached_tokens": 3}, "cost": 0.0125}
        assert (await rig.chat_call()).status_code == 200
        assert (await rig.chat_call()).status_code == 200
        usage = rig.relay.usage
        assert usage.cached_tokens == 6
        assert usage.cost_usd == pytest.approx(0.025)
        assert usage.usage_metrics() == {
            "input_tokens": 3 * PROMPT_TOKENS,
            "cached_tokens": 6,
            "output_tokens": 3,
            "cost_usd": pytest.approx(0.025),
        }
        assert rig.totals.cached_tokens == 6
        # Odd values count as absent, never as a number.
        chat.usage_extra = {"prompt_tokens_details": {"cached_tokens": -4}, "cost": "free"}
        assert (await rig.chat_call()).status_code == 200
        assert (usage.cached_tokens, usage.prompt_tokens) == (6, 4 * PROMPT_TOKENS)
        assert usage.cost_usd == pytest.approx(0.025)
    text = render_relay_metrics(rig.totals)
    assert metric(text, "harbor_exec_relay_tokens_total", kind="cached") == 6


async def test_cached_tokens_are_recorded_from_a_streamed_answer(
    tmp_path: Path, chat: FakeChat
) -> None:
    chat.usage_extra = {"prompt_tokens_details": {"cached_tokens": 2}}
    body = {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}}
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        async with rig.client.stream(
            "POST", f"{rig.base_url}/chat/completions", json=body, headers=rig.auth
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            lines = [line async for line in response.aiter_lines() if line]
        final = json.loads(lines[-2].removeprefix("data: "))
        assert final["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
        usage = rig.relay.usage
        assert (usage.prompt_tokens, usage.cached_tokens, usage.cost_usd) == (
            PROMPT_TOKENS,
            2,
            None,
        )
        assert usage.usage_metrics() == {
            "input_tokens": PROMPT_TOKENS,
            "cached_tokens": 2,
            "output_tokens": 1,
        }


def test_the_agents_own_counts_are_cross_checked_with_the_relays() -> None:
    from harbor_exec.network.usage import ModelUsage

    usage = ModelUsage(requests=2, prompt_tokens=20, completion_tokens=4, cached_tokens=8)
    agreeing = {"input_tokens": 20, "cached_tokens": 8, "output_tokens": 4, "cost_usd": 0.3}
    assert usage.disagreement(agreeing) is None  # a cost only the agent knows: no verdict
    assert usage.disagreement(None) is None
    assert usage.disagreement({"input_tokens": None}) is None
    assert usage.disagreement({**agreeing, "output_tokens": 9}) == {
        "output_tokens": {"relay": 4, "agent": 9}
    }
    # The agent's 0 cached tokens and a relay that saw none reported agree.
    assert ModelUsage(prompt_tokens=5).disagreement({"input_tokens": 5, "cached_tokens": 0}) is None
    priced = ModelUsage(prompt_tokens=5, cost_usd=0.5)
    assert priced.disagreement({"cost_usd": 0.7}) == {"cost_usd": {"relay": 0.5, "agent": 0.7}}


async def test_upstream_failure_is_a_502_without_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    async with open_rig(tmp_path, f"http://127.0.0.1:{closed_port}/v1") as rig:
        response = await rig.chat_call()
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_error"
        assert REAL_KEY not in response.text
        assert rig.relay.usage.upstream_errors == 1
    assert any("upstream model call failed" in r.getMessage() for r in caplog.records)


async def test_an_upstream_error_quoting_the_key_is_scrubbed(
    tmp_path: Path, chat: FakeChat
) -> None:
    chat.reset("unauthorized")
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        response = await rig.chat_call()
        assert response.status_code == 401  # the model's own status passes through
        assert response.json()["error"]["message"] == "Incorrect API key: Bearer [REDACTED]"
        assert REAL_KEY not in response.text
        assert chat.authorizations == [f"Bearer {REAL_KEY}"]
        assert rig.relay.usage.prompt_tokens == 0
        # The connection stays usable.
        chat.mode = "correct"
        assert (await rig.chat_call()).status_code == 200


async def test_aclose_cuts_calls_in_flight_and_removes_the_socket(
    tmp_path: Path, chat: FakeChat
) -> None:
    chat.reset("slow")
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        relay = rig.relay
        call = asyncio.create_task(rig.chat_call())
        reached = await asyncio.to_thread(chat.wait_for_requests, 1, 10.0)
        assert reached, "the call never reached the model"
        started = time.monotonic()
        await relay.aclose()
        with pytest.raises(httpx.HTTPError):
            await asyncio.wait_for(call, 5)
        assert time.monotonic() - started < 3
        assert not relay.socket_path.exists()
        assert not relay.directory.exists()
        with pytest.raises(OSError):
            await asyncio.open_unix_connection(str(relay.socket_path))
        # Through the forwarder, a new call finds nothing behind it either.
        with pytest.raises(httpx.HTTPError):
            await rig.chat_call()
        assert rig.totals.relays_active == 0


async def test_socket_is_open_to_any_container_user(tmp_path: Path, chat: FakeChat) -> None:
    relay = ModelRelay(upstream_url=chat.base_url, api_key=REAL_KEY, directory=tmp_path / "relay")
    await relay.start()
    try:
        assert relay.socket_path == tmp_path / "relay" / "relay.sock"
        assert stat.S_ISSOCK(relay.socket_path.stat().st_mode)
        assert stat.S_IMODE(relay.directory.stat().st_mode) == 0o755
        assert stat.S_IMODE(relay.socket_path.stat().st_mode) == 0o666
        assert REAL_KEY not in repr(relay) and relay.token not in repr(relay)
    finally:
        await relay.aclose()
    # A relay's directory is always fresh, and one it did not make it never removes.
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep").write_text("someone else's")
    other = ModelRelay(upstream_url=chat.base_url, api_key=None, directory=taken)
    with pytest.raises(FileExistsError):
        await other.start()
    await other.aclose()
    assert (taken / "keep").read_text() == "someone else's"


async def test_relays_start_and_close_one_after_another(tmp_path: Path, chat: FakeChat) -> None:
    # What start() costs per rollout is measured by bench/bench_relay.py.
    for index in range(20):
        relay = ModelRelay(
            upstream_url=chat.base_url, api_key=REAL_KEY, directory=tmp_path / f"r{index}"
        )
        await relay.start()
        assert stat.S_ISSOCK(relay.socket_path.stat().st_mode)
        await relay.aclose()
        assert not relay.directory.exists()


async def test_too_many_connections_are_dropped(tmp_path: Path, chat: FakeChat) -> None:
    async with open_rig(tmp_path, f"{chat.base_url}/v1", RelayLimits(max_connections=2)) as rig:
        path = str(rig.relay.socket_path)
        held = [await asyncio.open_unix_connection(path) for _ in range(2)]

        async def both_registered() -> bool:
            return rig.relay.open_connections == 2

        assert await wait_until_async(both_registered)
        reader, writer = await asyncio.open_unix_connection(path)
        assert await asyncio.wait_for(reader.read(100), 5) == b""
        writer.close()
        for _, held_writer in held:
            held_writer.close()
        assert rig.relay.usage.rejected == 1


async def test_totals_render_as_prometheus_text(tmp_path: Path, chat: FakeChat) -> None:
    async with open_rig(tmp_path, f"{chat.base_url}/v1") as rig:
        assert (await rig.chat_call()).status_code == 200
        assert (await rig.chat_call(headers={})).status_code == 401
    text = render_relay_metrics(rig.totals)
    assert text.endswith("\n")
    assert "# TYPE harbor_exec_relay_requests_total counter" in text.splitlines()
    assert metric(text, "harbor_exec_relay_started_total") == 1
    assert metric(text, "harbor_exec_relay_requests_total") == 1
    assert metric(text, "harbor_exec_relay_rejected_total") == 1
    assert metric(text, "harbor_exec_relay_upstream_errors_total") == 0
    assert metric(text, "harbor_exec_relay_active") == 0
    assert metric(text, "harbor_exec_relay_tokens_total", kind="prompt") == PROMPT_TOKENS
    assert metric(text, "harbor_exec_relay_tokens_total", kind="completion") == 1


def test_process_totals_are_in_the_default_registry() -> None:
    """RELAY_TOTALS is process-wide, so it is exposed by prometheus-client's default
    registry (which every server's /metrics appends), as the relays count."""
    before = REGISTRY.get_sample_value("harbor_exec_relay_rejected_total")
    RELAY_TOTALS.count("rejected")
    assert REGISTRY.get_sample_value("harbor_exec_relay_rejected_total") == (before or 0) + 1


async def test_a_socket_path_too_long_for_unix_sockets_is_refused(tmp_path: Path) -> None:
    relay = ModelRelay(
        upstream_url="http://127.0.0.1:9/v1", api_key=REAL_KEY, directory=tmp_path / ("d" * 120)
    )
    with pytest.raises(ValueError, match="longer than"):
        await relay.start()
    assert not relay.directory.exists()


# --------------------------------------------------------------------------- configuration


async def test_a_rollouts_extra_routes_reach_its_relay(tmp_path: Path, chat: FakeChat) -> None:
    """What an operator allows travels in the rollout's ModelEndpoint (sealed to a
    Ray node along with the key) to the relay LocalExecutor opens for it."""
    from harbor_exec.executors.local import LocalExecutor
    from harbor_exec.executors.spec import ModelEndpoint

    executor = LocalExecutor()
    endpoint = ModelEndpoint(
        f"{chat.base_url}/v1", api_key=REAL_KEY, token="tok-1", extra_routes=("/completions",)
    )
    try:
        relay = executor._relay(endpoint)
        assert relay.limits.extra_routes == ("/completions",)
        assert set(relay.routes) == {b"/v1/chat/completions", b"/v1/completions"}
        async with relay:
            transport = httpx.AsyncHTTPTransport(uds=str(relay.socket_path))
            async with httpx.AsyncClient(transport=transport, timeout=10) as client:
                response = await client.post(
                    "http://relay/v1/completions",
                    json=CHAT_BODY,
                    headers={"Authorization": "Bearer tok-1"},
                )
        assert response.status_code == 200
        assert chat.requests[0].path == "/v1/completions"
        assert executor._relay(ModelEndpoint("http://m/v1", None, "t")).limits == RelayLimits()
    finally:
        await executor.aclose()


def test_serve_checks_relay_routes_and_hands_them_to_the_backend(tmp_path: Path) -> None:
    import typer

    from harbor_exec.backends.harbor.backend import HarborBackend
    from harbor_exec.cli.serve import ServeOptions, build_backend

    backend = HarborBackend(tasks_dir=tmp_path, relay_extra_routes=["/completions"])
    assert backend.relay_extra_routes == ("/completions",)
    with pytest.raises(ValueError, match="relay route"):
        HarborBackend(tasks_dir=tmp_path, relay_extra_routes=["/v1/../files"])
    bad = ServeOptions(tasks_dir=tmp_path, relay_extra_routes=["/completions?x"])
    with pytest.raises(typer.BadParameter, match="relay route"):
        build_backend(bad)
    local = ServeOptions(workflow="m:W", relay_extra_routes=["/completions"])
    with pytest.raises(typer.BadParameter, match="needs --tasks-dir"):
        build_backend(local)
