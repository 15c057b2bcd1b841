"""SDK-authored projects in LocalBackend: side by side with osmosis-ai's own.

The same project (``tasks_examples/osmosis_sdk_project``: a workflow and grader that
subclass osmosis-ai 0.3.8's classes and call the chat endpoint) runs under osmosis-ai's
LocalBackend behind osmosis-ai's server, and under harbor-exec's LocalBackend behind
our server, and under osmosis-ai's own LocalBackend object served by our server
(``harbor_exec.backends.osmosis``); the real osmosis-ai RolloutClient drives all three
with the same inputs against one fake chat endpoint on 127.0.0.1, and every result must
agree: status, error message and category, and the sample (messages, label, reward,
metrics, removal).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fake_chat import FakeChat
from tests.osmosis_side_by_side import comparable, run_osmosis_rollout
from tests.server_utils import serve, wait_until

OSMOSIS_PYTHON = sys.version_info >= (3, 12)
if not OSMOSIS_PYTHON:
    pytest.skip("osmosis-ai 0.3.8 is installed on Python >= 3.12 only", allow_module_level=True)

from osmosis_ai.rollout import AgentWorkflow as OsmosisAgentWorkflow  # noqa: E402
from osmosis_ai.rollout import LocalBackend as OsmosisLocalBackend  # noqa: E402
from osmosis_ai.rollout import RolloutStatus as OsmosisRolloutStatus  # noqa: E402
from osmosis_ai.rollout import get_rollout_context as osmosis_rollout_context  # noqa: E402
from osmosis_ai.rollout.server.app import (  # noqa: E402
    create_rollout_server as create_osmosis_server,
)

from harbor_exec.backends.local import LocalBackend  # noqa: E402
from harbor_exec.server import create_rollout_server  # noqa: E402

SDK_PROJECT_SRC = Path(__file__).resolve().parents[1] / "tasks_examples/osmosis_sdk_project/src"
sys.path.insert(0, str(SDK_PROJECT_SRC))

from harbor_exec.authoring import resolve_import_path  # noqa: E402

PROMPT = [{"role": "user", "content": "What is 2+2?"}]
SDK_REFS: dict[str, Any] = {
    "workflow": "sdk_arith.workflow:SdkArithWorkflow",
    "workflow_config": "sdk_arith.workflow:workflow_config",
    "grader": "sdk_arith.grader:SdkArithGrader",
    "grader_config": "sdk_arith.grader:grader_config",
}

# (label, metadata, grade): every path through workflow and grader the SDK defines.
CASES: dict[str, tuple[str | None, dict[str, Any] | None, bool]] = {
    "right": ("4", None, True),
    "wrong": ("5", None, True),
    "ungraded": ("4", None, False),
    "sample_source": ("4", {"use_source": True}, True),
    "no_sample": ("4", {"no_sample": True}, True),
    "workflow_raises": ("4", {"raise": "the agent broke"}, True),
    "workflow_raises_value": ("4", {"raise_value": "bad input"}, True),
    "grader_raises": ("4", {"grader_raise": "grader broke"}, True),
    "no_reward": ("4", {"no_reward": True}, True),
    "removed": ("4", {"remove": True}, True),
    "artifact": ("4", {"artifact": True}, True),
}


@pytest.fixture(scope="module")
def chat() -> Iterator[FakeChat]:
    with FakeChat() as fake:
        yield fake


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Both servers, each with its own artifact root."""
    reference_root = tmp_path_factory.mktemp("osmosis-root")
    ours_root = tmp_path_factory.mktemp("harbor-root")
    served_root = tmp_path_factory.mktemp("served-root")
    monkeypatch = pytest.MonkeyPatch()
    # osmosis-ai's LocalBackend reads its artifact root when constructed.
    monkeypatch.setenv("_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", str(reference_root))
    reference = create_osmosis_server(
        backend=OsmosisLocalBackend(**SDK_REFS), configure_logging=False
    )
    monkeypatch.setenv("_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", str(served_root))
    # osmosis-ai's own backend object behind our server; no artifact_root given, so
    # the trajectory goes next to the backend's artifacts, as osmosis-ai's server does.
    served = create_rollout_server(backend=OsmosisLocalBackend(**SDK_REFS), configure_logging=False)
    ours = create_rollout_server(
        backend=LocalBackend(**SDK_REFS, artifact_root=ours_root), artifact_root=ours_root
    )
    try:
        with (
            serve(reference) as reference_url,
            serve(ours) as ours_url,
            serve(served) as served_url,
        ):
            yield {
                "reference": reference_url,
                "ours": ours_url,
                "served": served_url,
                "reference_root": str(reference_root),
                "ours_root": str(ours_root),
                "served_root": str(served_root),
            }
    finally:
        monkeypatch.undo()


async def _run(url: str, chat_url: str, case: str, rollout_id: str) -> Any:
    label, metadata, grade = CASES[case]
    return await run_osmosis_rollout(
        url,
        chat_url,
        rollout_id,
        PROMPT,
        llm_api_key="sk-side-by-side",
        label=label,
        metadata=metadata,
        grade=grade,
    )


def _comparable(result: Any) -> dict[str, Any]:
    return comparable(result, exclude={"trajectory_messages"})


@pytest.mark.parametrize("case", list(CASES))
async def test_same_results_as_osmosis_local_backend(
    case: str, servers: dict[str, str], chat: FakeChat
) -> None:
    rollout_id = uuid.uuid4().hex
    reference = await _run(servers["reference"], chat.base_url, case, rollout_id)
    ours = await _run(servers["ours"], chat.base_url, case, rollout_id)
    served = await _run(servers["served"], chat.base_url, case, rollout_id)
    assert _comparable(ours) == _comparable(reference)
    assert _comparable(served) == _comparable(reference)
    # And what they agree on is what the project does.
    expected_status, expected_category, expected_reward = {
        "right": ("success", None, 1.0),
        "wrong": ("success", None, 0.0),
        "ungraded": ("success", None, None),
        "sample_source": ("success", None, 1.0),
        "no_sample": ("failure", "validation_error", None),
        "workflow_raises": ("failure", "agent_error", None),
        "workflow_raises_value": ("failure", "validation_error", None),
        "grader_raises": ("failure", "agent_error", None),
        "no_reward": ("failure", "validation_error", None),
        "removed": ("success", None, None),
        "artifact": ("success", None, 1.0),
    }[case]
    got = _comparable(ours)
    assert (got["status"], got["err_category"]) == (expected_status, expected_category)
    assert (ours.sample.reward if ours.sample else None) == expected_reward
    if case in ("right", "artifact"):
        assert ours.sample is not None
        assert ours.sample.messages[-1] == {"role": "assistant", "content": "4"}
        assert ours.sample.metrics["turns"] == 1.0
        assert ours.sample.metrics["graded_by"] == "sdk"
    if case == "sample_source":
        assert ours.sample is not None and ours.sample.metrics["from_source"] == 1.0
    if case == "workflow_raises":
        assert ours.err_message == "the agent broke"
    if case == "artifact":
        for root in (servers["reference_root"], servers["ours_root"], servers["served_root"]):
            answer = Path(root) / rollout_id / "artifacts" / "answer.txt"
            assert answer.read_text() == "4\n"
    if case == "right":
        # Our server wrote the trajectory of osmosis-ai's backend into its own root.
        trajectory = Path(servers["served_root"]) / rollout_id / "trajectory.json"
        assert wait_until(trajectory.is_file)  # written shortly after the result


class _StatusReportingWorkflow(OsmosisAgentWorkflow[Any]):
    """Reports ``grading`` through the SDK's ambient context, then answers."""

    async def run(self, ctx: Any) -> list[dict[str, Any]]:
        rollout = osmosis_rollout_context()
        assert rollout is not None
        await rollout.set_status(OsmosisRolloutStatus.GRADING)
        return [*ctx.prompt, {"role": "assistant", "content": rollout.api_key or ""}]


async def test_sdk_context_carries_key_and_reports_status(tmp_path: Path) -> None:
    """The SDK context the workflow sees has the rollout's URL, key and id, and its
    status changes reach harbor-exec's rollout context (so the server's)."""
    from harbor_exec.authoring import RolloutContext
    from harbor_exec.protocol import ExecutionRequest

    seen: list[str] = []
    backend = LocalBackend(workflow=_StatusReportingWorkflow, artifact_root=tmp_path)
    context = RolloutContext(
        chat_completions_url="http://127.0.0.1:9/v1",
        api_key="sk-ctx",
        rollout_id="ctx",
        on_status=lambda status: seen.append(status.value),
    )
    with context:
        outcome = await backend.execute(ExecutionRequest(id="ctx", prompt=PROMPT, grade=False))
    assert outcome.result.status.value == "success"
    assert outcome.result.sample is not None
    assert outcome.result.sample.messages[-1]["content"] == "sk-ctx"
    assert seen == ["running", "grading"]


def test_sdk_classes_are_accepted_directly(tmp_path: Path) -> None:
    classes = {name: resolve_import_path(ref) for name, ref in SDK_REFS.items()}
    backend = LocalBackend(**classes, artifact_root=tmp_path)
    workflow_config = classes["workflow_config"]
    assert backend.workflow_cls.__name__ == "SdkArithWorkflow"
    assert backend.workflow_cls.sdk_class is classes["workflow"]  # type: ignore[attr-defined]
    assert backend.workflow_config is workflow_config
    with pytest.raises(TypeError, match="AgentWorkflow subclass"):
        LocalBackend(workflow=object, artifact_root=tmp_path)
    with pytest.raises(TypeError, match="GraderConfig"):
        LocalBackend(workflow=classes["workflow"], grader_config=workflow_config)


async def test_direct_execute_without_a_server(tmp_path: Path, chat: FakeChat) -> None:
    """execute() called directly (no server context) still runs an SDK workflow."""
    from harbor_exec.authoring import RolloutContext
    from harbor_exec.protocol import ExecutionRequest

    backend = LocalBackend(**SDK_REFS, artifact_root=tmp_path)
    with RolloutContext(chat_completions_url=chat.base_url, rollout_id="direct"):
        outcome = await backend.execute(ExecutionRequest(id="direct", prompt=PROMPT, label="4"))
    assert outcome.result.status.value == "success"
    assert outcome.result.sample is not None and outcome.result.sample.reward == 1.0
