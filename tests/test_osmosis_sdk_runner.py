"""SDK-authored workflows and graders in the container runner (as real subprocesses).

The runner resolves the manifest's refs to the project's osmosis-ai classes, runs
them through ``harbor_exec.compat.osmosis`` and writes the same sample, metrics and
reward that osmosis-ai's own LocalBackend produces for the same inputs (run here
in-process as the reference). The runner runs with this interpreter, the checkout and
the SDK project on PYTHONPATH; tests/test_osmosis_sdk_docker.py runs the built bundle
in a task container.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bundle_utils import API_KEY, REPO_ROOT, run_runner, write_rollout
from tests.fake_chat import FakeChat

OSMOSIS_PYTHON = sys.version_info >= (3, 12)
if not OSMOSIS_PYTHON:
    pytest.skip("osmosis-ai 0.3.8 is installed on Python >= 3.12 only", allow_module_level=True)

from osmosis_ai.rollout import LocalBackend as OsmosisLocalBackend  # noqa: E402
from osmosis_ai.rollout import RolloutContext as OsmosisRolloutContext  # noqa: E402
from osmosis_ai.rollout.types import ExecutionRequest  # noqa: E402

SDK_SRC = REPO_ROOT / "tasks_examples" / "osmosis_sdk_project" / "src"
SDK_REFS = {
    "workflow": "sdk_arith.workflow:SdkArithWorkflow",
    "workflow_config": "sdk_arith.workflow:workflow_config",
    "grader": "sdk_arith.grader:SdkArithGrader",
    "grader_config": "sdk_arith.grader:grader_config",
}
QUESTION = "What is 17 + 25?"


def _run(tmp_path: Path, command: str) -> Any:
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"format_version": 1, **SDK_REFS}))
    return run_runner(
        command,
        manifest=manifest,
        logs_dir=tmp_path / "logs",
        tests_dir=tmp_path / "tests",
        pythonpath=[REPO_ROOT, SDK_SRC],
        cwd=tmp_path,
    )


async def _reference(
    tmp_path: Path, chat: FakeChat, label: str, metadata: dict[str, Any] | None
) -> Any:
    """osmosis-ai's own LocalBackend on the same project and inputs."""
    if str(SDK_SRC) not in sys.path:
        sys.path.insert(0, str(SDK_SRC))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", str(tmp_path / "reference"))
        backend = OsmosisLocalBackend(**SDK_REFS)
    request = ExecutionRequest(
        id="r-1", prompt=[{"role": "user", "content": QUESTION}], label=label, metadata=metadata
    )
    with OsmosisRolloutContext(
        chat_completions_url=chat.base_url, api_key=API_KEY, rollout_id="r-1"
    ):
        return (await backend.execute(request)).result


@pytest.mark.parametrize(("label", "reward"), [("42", 1.0), ("41", 0.0)])
async def test_sample_and_reward_match_osmosis_local_backend(
    tmp_path: Path, chat: FakeChat, label: str, reward: float
) -> None:
    chat.reset()
    write_rollout(tmp_path / "logs/agent/rollout.json", prompt=QUESTION, chat_url=chat.base_url)
    agent = _run(tmp_path, "agent")
    assert agent.returncode == 0, agent.stderr
    write_rollout(
        tmp_path / "tests/rollout.json", prompt=QUESTION, chat_url=chat.base_url, label=label
    )
    grade = _run(tmp_path, "grade")
    assert grade.returncode == 0, grade.stderr
    sample = json.loads((tmp_path / "logs/agent/sample.json").read_text())
    assert json.loads((tmp_path / "logs/verifier/reward.json").read_text()) == {"reward": reward}
    # The grader added a metric, so the runner kept its whole sample.
    graded = json.loads((tmp_path / "logs/verifier/sample.json").read_text())

    expected = await _reference(tmp_path, chat, label, None)
    assert expected.status.value == "success" and expected.sample is not None
    assert sample["messages"] == list(expected.sample.messages)
    assert sample["messages"][-1] == {"role": "assistant", "content": "42"}
    assert graded["reward"] == expected.sample.reward == reward
    assert graded["metrics"] == expected.sample.metrics
    assert graded["metrics"]["graded_by"] == "sdk" and graded["metrics"]["turns"] == 1.0
    # The chat endpoint saw the rollout's key, through the SDK's rollout context.
    assert chat.authorizations[0] == f"Bearer {API_KEY}"
    assert chat.requests[0].body["model"] == "sdk-model"  # the SDK config reached the workflow


async def test_workflow_error_is_classified_as_osmosis_does(tmp_path: Path, chat: FakeChat) -> None:
    metadata = {"raise_value": "bad input"}
    write_rollout(
        tmp_path / "logs/agent/rollout.json",
        prompt=QUESTION,
        chat_url=chat.base_url,
        metadata=metadata,
    )
    agent = _run(tmp_path, "agent")
    assert agent.returncode == 1
    error = json.loads((tmp_path / "logs/agent/sample.json").read_text())["error"]
    expected = await _reference(tmp_path, chat, "42", metadata)
    assert (error["category"], error["message"]) == (
        expected.err_category.value,
        expected.err_message,
    )
    assert (error["category"], error["type"]) == ("validation_error", "ValueError")


async def test_sample_source_and_artifacts(tmp_path: Path, chat: FakeChat) -> None:
    """A sample from the SDK's sample source, and ``artifacts_dir`` at <logs>/artifacts."""
    chat.reset()
    write_rollout(
        tmp_path / "logs/agent/rollout.json",
        prompt=QUESTION,
        chat_url=chat.base_url,
        metadata={"use_source": True, "artifact": True},
    )
    agent = _run(tmp_path, "agent")
    assert agent.returncode == 0, agent.stderr
    sample = json.loads((tmp_path / "logs/agent/sample.json").read_text())
    assert sample["metrics"] == {"from_source": 1.0}
    assert sample["messages"][-1]["content"] == "42"
    assert (tmp_path / "logs/artifacts/answer.txt").read_text() == "42\n"
