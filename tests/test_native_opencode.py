"""opencode's pieces without Docker: its name, its layer's launchers, its configuration,
the npm download checked by the registry's integrity (a real HTTP server on
127.0.0.1 serving a real tarball), and the relay's record of a streamed chat (a real
relay before a scripted model that streams)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.agents.native.agent import NativeAgent
from harbor_exec.agents.native.config import (
    IN_CONTAINER_AGENT_NAMES,
    NATIVE_AGENT_NAMES,
    check_agent_name,
)
from harbor_exec.agents.native.environment import (
    OPENCODE_PROVIDER,
    in_container_env,
    opencode_options,
)
from harbor_exec.agents.native.layer import (
    AGENT_LIBEXEC,
    AGENT_PACKAGES,
    OPENCODE_VERSION,
    launchers,
)
from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler.errors import BundleError
from harbor_exec.bundler.npm import REGISTRY_ENV, fetch_npm_member
from harbor_exec.container.exchange import RUNTIME_LIB, RUNTIME_LOADER
from harbor_exec.network.relay import ModelRelay
from tests.fake_chat import ScriptedChat, tool_call_reply
from tests.task_factory import make_task


def test_opencode_is_a_native_in_container_agent(tmp_path: Path) -> None:
    assert "opencode" in NATIVE_AGENT_NAMES and "opencode" in IN_CONTAINER_AGENT_NAMES
    with pytest.raises(ValueError, match="opencode"):
        check_agent_name("open-code")
    backend = HarborBackend(tasks_dir=make_task(tmp_path / "tasks", "t"), agent="opencode")
    assert backend.native is not None and backend.native.name == "opencode"


def test_the_layers_opencode_runs_on_the_runtimes_loader_and_stdbuf_is_a_shim() -> None:
    package = AGENT_PACKAGES["opencode"]
    assert package.binaries["opencode"].version == OPENCODE_VERSION
    assert package.binaries["opencode"].package == "opencode-linux-x64-baseline"  # no AVX2
    texts = launchers(package)
    assert set(texts) == {"opencode", "stdbuf"} == set(package.program_names)
    assert (
        f'exec {RUNTIME_LOADER} --library-path {RUNTIME_LIB} {AGENT_LIBEXEC}/opencode "$@"'
        in texts["opencode"].splitlines()
    )
    # Harbor pipes opencode through `stdbuf -oL tee FILE`: the shim runs `tee FILE`.
    body = texts["stdbuf"].split("\n", 1)[1]
    for options in (["-oL"], ["-o", "L"], ["--output=L", "-eL"]):
        done = subprocess.run(
            ["sh", "-c", body, "stdbuf", *options, "echo", "hello"],
            capture_output=True,
            check=True,
            timeout=10,
        )
        assert done.stdout == b"hello\n"


def _agent(**kwargs: Any) -> NativeAgent:
    return NativeAgent(
        name="opencode", model_name="openai/my-model", instruction="x", token="tok", **kwargs
    )


def test_opencode_gets_the_relay_as_a_provider_of_its_own_and_stays_offline() -> None:
    user = {"opencode_config": {"provider": {"other": {"npm": "x"}}, "compaction": {"x": 1}}}
    model, options = opencode_options(_agent(kwargs=user), 4321)
    assert model == f"{OPENCODE_PROVIDER}/my-model"
    config = options["opencode_config"]
    assert config["provider"]["other"] == {"npm": "x"}  # the user's own kept
    assert config["provider"][OPENCODE_PROVIDER] == {
        "npm": "@ai-sdk/openai-compatible",
        "name": "harbor-exec relay",
        "options": {"baseURL": "http://127.0.0.1:4321/v1", "apiKey": "{env:OPENAI_API_KEY}"},
        "models": {"my-model": {}},
    }
    assert config["compaction"] == {"x": 1, "auto": False, "prune": False}
    assert config["agent"]["title"]["disable"] is True  # no second conversation
    assert config["autoupdate"] is False and config["share"] == "disabled"
    assert user["opencode_config"]["provider"] == {"other": {"npm": "x"}}  # not mutated
    env = in_container_env(_agent(), 4321)
    assert env["OPENAI_API_KEY"] == "tok"
    assert env["OPENCODE_DISABLE_AUTOUPDATE"] == env["OPENCODE_DISABLE_MODELS_FETCH"] == "true"
    mini = NativeAgent(name="mini-swe-agent", model_name="openai/m", instruction="x", token="t")
    assert "OPENCODE_DISABLE_AUTOUPDATE" not in in_container_env(mini, 1)


def _tarball(member: str, content: bytes) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as archive:
        info = tarfile.TarInfo(member)
        info.size = len(content)
        info.mode = 0o644
        archive.addfile(info, io.BytesIO(content))
    return raw.getvalue()


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A registry on 127.0.0.1 serving ``pkg@1.0.0``; ``state["integrity"]`` is what it
    publishes (the tarball's own sha512 unless a test changes it)."""
    tarball = _tarball("package/bin/tool", b"\x7fELF binary")
    state: dict[str, Any] = {
        "tarball": tarball,
        "integrity": "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode(),
    }

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            port = server.server_address[1]
            if self.path == "/pkg/1.0.0":
                dist = {
                    "tarball": f"http://127.0.0.1:{port}/pkg/-/pkg-1.0.0.tgz",
                    "integrity": state["integrity"],
                }
                data = json.dumps({"name": "pkg", "version": "1.0.0", "dist": dist}).encode()
            elif self.path == "/pkg/-/pkg-1.0.0.tgz":
                data = state["tarball"]
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv(REGISTRY_ENV, f"http://127.0.0.1:{server.server_address[1]}/")
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_an_npm_binary_is_extracted_when_it_matches_its_integrity(
    tmp_path: Path, registry: dict[str, Any]
) -> None:
    target = tmp_path / "tool"
    integrity = fetch_npm_member("pkg", "1.0.0", "package/bin/tool", target)
    assert integrity == registry["integrity"]
    assert target.read_bytes() == b"\x7fELF binary"
    assert target.stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tool"]  # no tarball left
    with pytest.raises(BundleError, match="has no package/bin/other"):
        fetch_npm_member("pkg", "1.0.0", "package/bin/other", tmp_path / "other")
    with pytest.raises(BundleError, match=r"pkg@2\.0\.0"):
        fetch_npm_member("pkg", "2.0.0", "package/bin/tool", tmp_path / "two")


def test_an_npm_tarball_that_does_not_match_its_integrity_is_refused(
    tmp_path: Path, registry: dict[str, Any]
) -> None:
    registry["integrity"] = "sha512-" + base64.b64encode(hashlib.sha512(b"x").digest()).decode()
    with pytest.raises(BundleError, match="does not match its integrity"):
        fetch_npm_member("pkg", "1.0.0", "package/bin/tool", tmp_path / "tool")
    assert list(tmp_path.iterdir()) == []


async def test_the_relay_keeps_a_streamed_chat_call_assembled(tmp_path: Path) -> None:
    replies = [tool_call_reply("ls", call_id="c1"), "All done."]
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    with ScriptedChat(replies) as chat:
        relay = ModelRelay(
            upstream_url=chat.base_url,
            api_key="sk-real",
            directory=tmp_path / "relay",
            record_chat=True,
        )
        async with relay:
            transport = httpx.AsyncHTTPTransport(uds=str(relay.socket_path))
            async with httpx.AsyncClient(transport=transport, timeout=10) as client:
                history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
                for turn in range(2):
                    body = {"model": "m", "messages": history, "tools": tools, "stream": True}
                    response = await client.post(
                        "http://relay/v1/chat/completions",
                        json=body,
                        headers={"Authorization": f"Bearer {relay.token}"},
                    )
                    assert response.status_code == 200
                    assert response.headers["content-type"].startswith("text/event-stream")
                    assert response.text.endswith("data: [DONE]\n\n")
                    record = relay.last_chat
                    assert record is not None and record["messages"] == history
                    assert record["tools"] == tools
                    if turn == 0:
                        call = replies[0]["tool_calls"][0]
                        assert record["response"] == {
                            "role": "assistant",
                            "content": "Running a command.",
                            "tool_calls": [call],
                        }
                    history = [*history, record["response"], {"role": "tool", "content": "x"}]
        assert relay.last_chat is not None
        assert relay.last_chat["response"] == {"role": "assistant", "content": "All done."}
        # Usage from the streams' usage chunks.
        assert relay.usage.requests == 2
        assert relay.usage.prompt_tokens == 2 * ScriptedChat.PROMPT_TOKENS
        assert relay.usage.completion_tokens == 2 * ScriptedChat.COMPLETION_TOKENS
        assert all(r.authorization == "Bearer sk-real" for r in chat.requests)
