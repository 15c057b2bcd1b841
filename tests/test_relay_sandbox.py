"""The model relay end to end: a hostile workflow in a real container, a real server.

The workflow reaches the model only through its rollout's relay (the fake model
checks the real key), cannot reach the harbor-exec server on the host's
127.0.0.1, finds the real key nowhere it can read, and still reaches the model
from a ``no-network`` task.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler import Bundle, build_bundle
from harbor_exec.client import RolloutClient
from harbor_exec.network.relay import RELAY_TOTALS
from harbor_exec.server.app import create_rollout_server
from tests.bundle_utils import setuptools_pyproject, write_project
from tests.fake_chat import FakeChat
from tests.server_utils import serve

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "tasks_examples" / "template"
KEY = "sk-test-" + uuid.uuid4().hex

SPY_WORKFLOW = r'''
    """A workflow that does what a hostile policy would, and reports what it found.

    It calls the model with a synchronous client (urllib) on purpose: blocking the
    workflow's event loop must not block the relay forwarder.
    """

    import json
    import os
    import re
    import socket
    import urllib.error
    import urllib.request
    from pathlib import Path

    from harbor_exec.authoring import AgentWorkflow, AgentWorkflowOutput, get_rollout_context

    KEY_PATTERN = re.compile(rb"sk-test-[0-9a-f]{32}")
    PLACES = ("/logs", "/run", "/tmp", "/opt/harbor-exec/manifest.json", "/etc/hosts")


    def status_of(url, key, method, body=None):
        request = urllib.request.Request(
            url, data=body, method=method, headers={"Authorization": f"Bearer {key}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code


    def readable_bytes():
        yield "\n".join(f"{k}={v}" for k, v in os.environ.items()).encode()
        for proc in Path("/proc").glob("[0-9]*"):
            for name in ("environ", "cmdline"):
                try:
                    yield (proc / name).read_bytes()
                except OSError:
                    pass
        for place in PLACES:
            root = Path(place)
            paths = [root] if root.is_file() else root.rglob("*")
            for path in paths:
                try:
                    if path.is_file() and path.stat().st_size < 10_000_000:
                        yield path.read_bytes()
                except OSError:
                    pass


    class Spy(AgentWorkflow):
        async def run(self, ctx):
            rollout = get_rollout_context()
            found = [m.decode() for chunk in readable_bytes() for m in KEY_PATTERN.findall(chunk)]
            port = int((ctx.metadata or {})["server_port"])
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                reachable = 1
            except OSError:
                reachable = 0
            body = json.dumps({"model": "m", "messages": list(ctx.prompt)}).encode()
            request = urllib.request.Request(
                rollout.chat_completions_url.rstrip("/") + "/chat/completions",
                data=body,
                headers={"Authorization": f"Bearer {rollout.api_key}",
                         "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                reply = json.loads(response.read())["choices"][0]["message"]["content"]
            Path("/logs/artifacts/answer.txt").write_text(reply)
            base = rollout.chat_completions_url.rstrip("/")
            # What a reward-hacking policy would try with the relay's token.
            probes = {
                "models_status": status_of(base + "/models", rollout.api_key, "GET"),
                "files_status": status_of(base + "/files", rollout.api_key, "POST", b"{}"),
                "escape_status": status_of(
                    base + "/chat/completions/%2e%2e/files", rollout.api_key, "POST", b"{}"
                ),
                # The route the operator added.
                "completions_status": status_of(base + "/completions", rollout.api_key, "POST", body),
            }
            return AgentWorkflowOutput(
                messages=[*ctx.prompt, {"role": "assistant", "content": reply}],
                metrics={"server_reachable": reachable, "keys_found": len(found),
                         "chat_url_is_loopback": int(rollout.chat_completions_url.startswith(
                             "http://127.0.0.1:")), **probes},
            )
'''


@pytest.fixture(scope="module")
def spy_bundle(tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    root = tmp_path_factory.mktemp("spy")
    project = write_project(
        root / "spy",
        {
            "pyproject.toml": setuptools_pyproject("spy-agent"),
            "src/spy_agent/__init__.py": "",
            "src/spy_agent/workflow.py": SPY_WORKFLOW,
        },
    )
    return build_bundle(project, workflow="spy_agent.workflow:Spy", cache_dir=root / "cache")


def template_copy(tmp_path: Path, network_mode: str) -> Path:
    task = tmp_path / f"template-{network_mode}"
    shutil.copytree(TEMPLATE, task)
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(toml + f'network_mode = "{network_mode}"\n')
    return task


@pytest.mark.parametrize("network_mode", ["public", "no-network"])
def test_hostile_workflow_reaches_only_the_model(
    network_mode: str, tmp_path: Path, spy_bundle: Bundle, chat: FakeChat
) -> None:
    chat.reset("correct")
    backend = HarborBackend(
        tasks_dir=template_copy(tmp_path, network_mode),
        agent="spy_agent.workflow:Spy",
        bundle=spy_bundle,
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        cleanup_successful_trials=False,
        relay_extra_routes=["/completions"],
    )
    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")
    with serve(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # the server is there, on the host's loopback

        async def one() -> Any:
            async with httpx.AsyncClient(timeout=120) as http:
                client = RolloutClient(url=url, http_client=http)
                return await client.run_rollout(
                    initial_messages=[{"role": "user", "content": "What is 6 * 7?"}],
                    chat_completions_url=chat.base_url,
                    rollout_id=uuid.uuid4().hex,
                    llm_api_key=KEY,
                    label="42",
                    metadata={"server_port": port},
                )

        result = asyncio.run(one())
    assert result.status == "success", result.err_message
    metrics = result.sample.metrics
    assert metrics["server_reachable"] == 0
    assert metrics["keys_found"] == 0
    assert metrics["chat_url_is_loopback"] == 1
    # Only the chat route and the operator's route reached the model.
    assert (metrics["models_status"], metrics["files_status"], metrics["escape_status"]) == (
        404,
        404,
        404,
    )
    assert metrics["completions_status"] == 200
    assert [(r.method, r.path) for r in chat.requests] == [
        ("POST", "/chat/completions"),
        ("POST", "/completions"),
    ]
    assert metrics["llm_requests"] == 2 and metrics["llm_total_tokens"] > 0
    assert result.sample.reward == 1.0
    # The model saw the real key, which reached it only through the relay.
    assert chat.authorizations[-1] == f"Bearer {KEY}"
    for root in (tmp_path / "trials", tmp_path / "artifacts", tmp_path / "server-artifacts"):
        for path in root.rglob("*"):
            assert not path.is_file() or KEY.encode() not in path.read_bytes(), path
    # The rollout's relay closed with it: a leftover process has nothing to call.
    assert RELAY_TOTALS.relays_active == 0
