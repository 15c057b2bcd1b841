"""An SDK project built on osmosis-ai's OpenAI Agents integration, side by side.

``tests/projects/osmosis_agents_project`` (an ``OsmosisAgent`` with an ``add`` tool,
``OsmosisRolloutModel``, ``OsmosisMemorySession`` as the sample source; a grader that
walks the session's items) runs under osmosis-ai's LocalBackend behind osmosis-ai's
server and under harbor-exec's LocalBackend behind ours; the real osmosis-ai
RolloutClient drives both with the same inputs against one scripted model on
127.0.0.1 (a tool call, then the answer, streamed as the integration asks), and the
results must agree: status, error message and category, and the whole sample
(the session's items, trajectory messages included, label, reward, metrics).
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fake_chat import ScriptedChat
from tests.osmosis_side_by_side import comparable, run_osmosis_rollout
from tests.server_utils import serve

if sys.version_info < (3, 12):
    pytest.skip("osmosis-ai 0.3.8 is installed on Python >= 3.12 only", allow_module_level=True)

# The dev extra's openai-agents: missing is a broken install, an error here, never a skip.
import agents  # noqa: F401
from osmosis_ai.rollout import LocalBackend as OsmosisLocalBackend
from osmosis_ai.rollout.server.app import (
    create_rollout_server as create_osmosis_server,
)

from harbor_exec.backends.local import LocalBackend
from harbor_exec.server import create_rollout_server

PROJECT = Path(__file__).resolve().parent / "projects" / "osmosis_agents_project"
sys.path.insert(0, str(PROJECT / "src"))

PROMPT = [{"role": "user", "content": "What is 2+2?"}]
AGENTS_REFS: dict[str, Any] = {
    "workflow": "agents_arith.workflow:AgentsArithWorkflow",
    "workflow_config": "agents_arith.workflow:workflow_config",
    "grader": "agents_arith.grader:AgentsArithGrader",
    "grader_config": "agents_arith.grader:grader_config",
}


def add_call(a: float, b: float, *, call_id: str = "call_add_1") -> dict[str, Any]:
    """The model's first turn: call the project's ``add`` tool."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})},
            }
        ],
    }


# (label, metadata, grade)
CASES: dict[str, tuple[str | None, dict[str, Any] | None, bool]] = {
    "right": ("4", None, True),
    "wrong": ("5", None, True),
    "ungraded": ("4", None, False),
    "max_turns": ("4", {"max_turns": 1}, True),
    "no_session": ("4", {"no_session": True}, True),
    "workflow_raises": ("4", {"raise": "the agent broke"}, True),
}
EXPECTED: dict[str, tuple[str, str | None, float | None]] = {
    "right": ("success", None, 1.0),
    "wrong": ("success", None, 0.0),
    "ungraded": ("success", None, None),
    "max_turns": ("failure", "agent_error", None),
    "no_session": ("failure", "agent_error", None),
    "workflow_raises": ("failure", "agent_error", None),
}


@pytest.fixture(scope="module")
def chat() -> Iterator[ScriptedChat]:
    # per_conversation: each rollout gets the tool call first, then the answer.
    with ScriptedChat([add_call(2, 2), "4"], per_conversation=True) as scripted:
        yield scripted


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    reference_root = tmp_path_factory.mktemp("osmosis-root")
    ours_root = tmp_path_factory.mktemp("harbor-root")
    monkeypatch = pytest.MonkeyPatch()
    # The integration's litellm, imported with the workflow: no network at import.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("LITELLM_OFFLINE_MODE", "true")
    # osmosis-ai's LocalBackend reads its artifact root when constructed.
    monkeypatch.setenv("_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", str(reference_root))
    reference = create_osmosis_server(
        backend=OsmosisLocalBackend(**AGENTS_REFS), configure_logging=False
    )
    ours = create_rollout_server(
        backend=LocalBackend(**AGENTS_REFS, artifact_root=ours_root), artifact_root=ours_root
    )
    try:
        with serve(reference) as reference_url, serve(ours) as ours_url:
            yield {"reference": reference_url, "ours": ours_url}
    finally:
        monkeypatch.undo()


async def _run(url: str, chat_url: str, case: str, rollout_id: str) -> Any:
    label, metadata, grade = CASES[case]
    return await run_osmosis_rollout(
        url,
        chat_url,
        rollout_id,
        PROMPT,
        llm_api_key="sk-agents-side-by-side",
        label=label,
        metadata=metadata,
        grade=grade,
    )


@pytest.mark.parametrize("case", list(CASES))
async def test_same_results_as_osmosis_local_backend(
    case: str, servers: dict[str, str], chat: ScriptedChat
) -> None:
    rollout_id = uuid.uuid4().hex
    reference = await _run(servers["reference"], chat.base_url, case, rollout_id)
    ours = await _run(servers["ours"], chat.base_url, case, rollout_id)
    assert comparable(ours) == comparable(reference)
    # And what they agree on is what the project does.
    status, category, reward = EXPECTED[case]
    assert (ours.status.value, ours.err_category.value if ours.err_category else None) == (
        status,
        category,
    ), ours.err_message
    assert (ours.sample.reward if ours.sample else None) == reward
    if case in ("right", "wrong"):
        assert ours.sample is not None
        items = ours.sample.messages
        kinds = [item.get("type") or item.get("role") for item in items]
        assert kinds == ["user", "function_call", "function_call_output", "message"]
        assert items[1]["call_id"] == "call_add_1" and items[2]["output"] == "4.0"
        assert items[3]["content"][0]["text"] == "4"
        assert ours.sample.metrics["tool_calls"] == 1.0
    if case == "max_turns":
        assert "Max turns (1) exceeded" in (ours.err_message or "")
    if case == "no_session":
        assert "without an active OsmosisMemorySession" in (ours.err_message or "")
    if case == "workflow_raises":
        assert ours.err_message == "the agent broke"


async def test_the_model_saw_the_integrations_requests(
    servers: dict[str, str], chat: ScriptedChat
) -> None:
    """The integration streamed through litellm with the rollout's key, and its second
    request carried the tool's result, in both backends."""
    for server in ("reference", "ours"):
        before = len(chat.requests)
        result = await _run(servers[server], chat.base_url, "right", uuid.uuid4().hex)
        assert result.status.value == "success", result.err_message
        requests = chat.requests[before:]
        assert len(requests) == 2, server
        assert all(r.body.get("stream") is True for r in requests)
        assert all(r.authorization == "Bearer sk-agents-side-by-side" for r in requests)
        assert requests[1].body["messages"][-1] == {
            "role": "tool",
            "tool_call_id": "call_add_1",
            "content": "4.0",
        }
