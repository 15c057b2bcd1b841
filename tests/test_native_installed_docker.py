"""mini-swe-agent (Harbor's own class, unchanged) as a HarborBackend agent: real Docker
trials behind the real HTTP server, a scripted model on 127.0.0.1, our client.

mini-swe-agent runs inside the container from its prebuilt read-only layer (the
task image has no Python; nothing is installed at trial time) and reaches the model
through the runtime's in-container forwarder, on a ``no-network`` task. Every
command the model runs sees the rollout's relay token as the key, never the real
one (which this test also puts in the host's own environment, where Harbor would
find it); the sample's chat is the one the relay saw."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before litellm is imported
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")

import json
import time
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.agents.native.layer import AgentLayer, AgentLayerError, ensure_agent_layer
from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler.agent_wheels import prepare_agent_layer
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.server.app import create_rollout_server
from tests.fake_chat import ScriptedChat, env_value_sent_back, tool_call_reply
from tests.server_utils import serve
from tests.task_factory import make_task
from tests.test_native_agents_docker import KEY, files_holding, rollout

INSTRUCTION = "Write the number 42 into /app/answer.txt."
TEST_SH = """
if command -v python3 >/dev/null 2>&1; then echo present > /logs/verifier/python.txt; else echo none > /logs/verifier/python.txt; fi
if [ "$(cat /app/answer.txt 2>/dev/null)" = 42 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
NO_NETWORK = '[environment]\nnetwork_mode = "no-network"\n'
TOML = NO_NETWORK + "[agent]\ntimeout_sec = 120.0\n[verifier]\ntimeout_sec = 30.0\n"
#: The model runs ``env`` (its output comes back to it), writes the answer, then
#: submits with mini's completion command.
SCRIPT = [
    tool_call_reply("env; echo 42 > /app/answer.txt", call_id="call_1"),
    tool_call_reply("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", call_id="call_2"),
]

# engine_lane("b"): its own tasks and agent layer; its one time bound (30 s) is wide.
pytestmark = [
    pytest.mark.docker,
    pytest.mark.engine_lane("b"),
    pytest.mark.usefixtures("base_images"),
]


@pytest.fixture(scope="session")
def mini_layer(docker_runtime: DockerRuntime, base_images: dict[str, str]) -> AgentLayer:
    """mini-swe-agent's layer, prepared (wheels from the index, host side) and installed
    into its volume once for the session (once per machine: both are content-named)."""
    layer = prepare_agent_layer("mini-swe-agent")
    ensure_agent_layer(docker_runtime, layer, "debian:bookworm-slim")
    return layer


def mini_app(tmp_path: Path, task: Path, **options: Any) -> Any:
    options.setdefault("cleanup_successful_trials", False)
    backend = HarborBackend(
        tasks_dir=task,
        agent="mini-swe-agent",
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        agent_setup_timeout_sec=60,
        **options,
    )
    return create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")


def test_mini_swe_agent_solves_a_no_network_task_through_the_in_container_forwarder(
    tmp_path: Path,
    docker_runtime: DockerRuntime,
    mini_layer: AgentLayer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The real key in this process's environment too: Harbor resolves an agent's key
    # from there when nothing else gives one; the token must win.
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    task = make_task(
        tmp_path / "tasks",
        "answer-42",
        test=TEST_SH,
        instruction=INSTRUCTION,
        toml=TOML,
        dockerfile="FROM debian:bookworm-slim\nRUN mkdir -p /app\nWORKDIR /app\n",
    )
    app = mini_app(tmp_path, task)
    started = time.monotonic()
    with ScriptedChat(SCRIPT) as chat, serve(app) as url:
        result = rollout(url, chat, INSTRUCTION)
    seconds = time.monotonic() - started
    assert result.status.value == "success", result.err_message
    sample = result.sample
    assert sample is not None and sample.reward == 1.0

    # Two calls, both through the relay to the upstream with the real key; mini's own
    # tool-call format, the completion command ended it.
    assert len(chat.requests) == 2
    for request in chat.requests:
        assert request.path == "/v1/chat/completions"
        assert request.authorization == f"Bearer {KEY}"
        assert request.body["model"] == "osmosis-rollout"
        assert [t["function"]["name"] for t in request.body["tools"]] == ["bash"]
    # What `env` showed the model came back to it in the second call: the token as
    # the key, the loopback forwarder as the endpoint, never the real key.
    observed = json.dumps(chat.requests[1].body["messages"])
    assert KEY not in observed
    token = env_value_sent_back(chat.requests[1].body["messages"], "OPENAI_API_KEY")
    assert token and token != KEY
    base = env_value_sent_back(chat.requests[1].body["messages"], "OPENAI_BASE_URL")
    assert base is not None and base.startswith("http://127.0.0.1:") and base.endswith("/v1")

    # The sample's chat is the relay's: the last call's messages, then the answer (the
    # token, dead with its relay, redacted like every secret the trial knows).
    last = json.loads(json.dumps(chat.requests[-1].body["messages"]).replace(token, "[REDACTED]"))
    assert sample.messages[: len(last)] == last
    assert len(sample.messages) == len(last) + 1
    final = sample.messages[-1]
    assert final["role"] == "assistant"
    assert json.loads(final["tool_calls"][0]["function"]["arguments"]) == {
        "command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
    }
    assert sample.messages[0]["role"] == "system" and INSTRUCTION in sample.messages[1]["content"]
    extra = sample.extra_fields or {}
    assert extra["chat_source"] == "relay"
    assert [t["function"]["name"] for t in extra["tools"]] == ["bash"]
    # Usage from the relay's own accounting.
    assert sample.metrics["llm_requests"] == 2
    assert sample.metrics["llm_prompt_tokens"] == 2 * ScriptedChat.PROMPT_TOKENS
    assert sample.metrics["llm_completion_tokens"] == 2 * ScriptedChat.COMPLETION_TOKENS

    (trial_dir,) = (tmp_path / "trials").iterdir()
    assert (trial_dir / "verifier" / "python.txt").read_text().strip() == "none"
    result_json = json.loads((trial_dir / "result.json").read_text())
    assert result_json["agent_info"]["name"] == "mini-swe-agent"
    assert result_json["verifier_result"]["rewards"] == {"reward": 1.0}
    # mini's own files came back; its ATIF trajectory (Harbor's conversion) is kept,
    # marked untrusted, beside the artifacts too.
    assert (trial_dir / "agent" / "mini-swe-agent.trajectory.json").is_file()
    trajectory = json.loads((trial_dir / "agent" / "trajectory.json").read_text())
    assert trajectory["schema_version"].startswith("ATIF")
    assert trajectory["agent"]["name"] == "mini-swe-agent"
    assert trajectory["agent"]["extra"]["harbor_exec"]["trusted"] is False
    (kept,) = (tmp_path / "artifacts").glob("*/atif-trajectory.json")
    assert json.loads(kept.read_text()) == trajectory
    # The real key is on no file the trial left, nor the token (scrubbed).
    assert files_holding(trial_dir, KEY) == []
    assert files_holding(trial_dir, token) == []
    assert files_holding(tmp_path / "server-artifacts", KEY) == []
    assert files_holding(tmp_path / "artifacts", KEY) == []
    print(f"mini-swe-agent rollout: {seconds:.1f}s")


def test_a_missing_agent_layer_fails_setup_fast_naming_it(
    tmp_path: Path, docker_runtime: DockerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend started where the layer could not be had (no cache, no index): no
    install is tried at trial time, setup fails at once naming it."""
    import harbor_exec.bundler.agent_wheels as agent_wheels

    def offline(name: str) -> AgentLayer:
        raise AgentLayerError("the package index is unreachable")

    monkeypatch.setattr(agent_wheels, "prepare_agent_layer", offline)
    task = make_task(
        tmp_path / "tasks", "no-layer", test=TEST_SH, instruction=INSTRUCTION, toml=TOML
    )
    app = mini_app(tmp_path, task)
    with ScriptedChat(SCRIPT) as chat, serve(app) as url:
        started = time.monotonic()
        result = rollout(url, chat, INSTRUCTION)
        seconds = time.monotonic() - started
    assert result.status.value == "failure"
    assert "/opt/harbor-exec-agent" in (result.err_message or "")
    assert "harbor-exec prewarm --agent mini-swe-agent" in (result.err_message or "")
    assert chat.requests == []  # the model was never asked
    (trial_dir,) = (tmp_path / "trials").iterdir()
    result_json = json.loads((trial_dir / "result.json").read_text())
    assert result_json["exception_info"]["exception_type"] == "AgentSetupError"
    assert seconds < 30
