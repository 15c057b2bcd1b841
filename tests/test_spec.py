"""A trial as it travels: a picklable ``TrialSpec`` plus ``TrialSecrets``, turned into
a runnable ``TrialRequest`` by ``trial_request``; and the exchange files as the trial
reads them back (``trial.outputs``)."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path

import pytest

from harbor_exec.agents.oracle import OracleAgent
from harbor_exec.agents.workflow import WorkflowAgent, WorkflowAgentSpec
from harbor_exec.container.exchange import AGENT_SAMPLE, GRADER_ERROR, RUNNER_OUTPUT
from harbor_exec.container.redaction import REDACTED
from harbor_exec.executors.spec import ModelEndpoint, TrialContent, TrialSecrets, trial_request
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.outputs import read_agent_output, read_grader_output
from harbor_exec.trial.spec import TrialSpec
from tests.task_factory import make_task

BUNDLE = [ArchiveEntry("/opt/harbor-exec/manifest.json", b"{}", 0o644)]
# The grader's part: the full manifest and the grader's module, which the agent's lacks.
GRADER_PART = [
    ArchiveEntry("/opt/harbor-exec/manifest.json", b'{"grader": "pkg.grader:G"}', 0o644),
    ArchiveEntry("/opt/harbor-exec/user/pkg/grader.py", b"SECRET = 1\n", 0o644),
]
SECRET = "sk-spec-secret-0123456789"


def spec_for(tmp_path: Path, **fields: object) -> TrialSpec:
    task = load_task(make_task(tmp_path / "tasks", "t"))
    return TrialSpec(task, tmp_path / "trials", **fields)  # type: ignore[arg-type]


def test_the_oracle_spec_runs_the_oracle_on_the_tasks_own_tests(tmp_path: Path) -> None:
    request = trial_request(spec_for(tmp_path))
    assert isinstance(request.agent, OracleAgent)
    assert request.verifier is None and request.spec.trials_dir == tmp_path / "trials"


def test_a_workflow_spec_travels_and_is_rebuilt_from_its_secrets(tmp_path: Path) -> None:
    spec = spec_for(
        tmp_path,
        agent=WorkflowAgentSpec("pkg:Flow", "abc"),
        verifier="grader",
        bundle="b-agent-1",
        grader_bundle="b-grader-1",
    )
    secrets = TrialSecrets(
        model=ModelEndpoint("http://model/v1", api_key=SECRET, token="tok"),
        scrub=[SECRET],
        agent_input=b'{"rollout_id": "r"}',
        verifier_input=b'{"label": "42"}',
    )
    travelled = pickle.loads(pickle.dumps(spec))
    assert travelled == spec
    assert SECRET not in repr(secrets)
    elsewhere = tmp_path / "node-copy"
    content = TrialContent(
        task_root=elsewhere,
        bundle_files=BUNDLE,
        grader_files=GRADER_PART,
        trials_dir=tmp_path / "n",
    )
    request = trial_request(travelled, secrets, content)
    assert isinstance(request.agent, WorkflowAgent)
    assert request.agent.info.name == "pkg:Flow"
    # The agent's container gets the agent part only; the grader part goes to the verifier.
    assert list(request.agent.bundle_files) == BUNDLE
    assert request.spec.task.root == elsewhere and request.spec.trials_dir == tmp_path / "n"
    assert list(request.secrets) == [SECRET]
    assert request.verifier is not None
    paths = [entry.path for entry in request.verifier.generated]
    assert "/tests/test.sh" in paths and "/tests/rollout.json" in paths
    # The grader's own fresh copy of the bundle (its part), never the agent's.
    assert "/opt/harbor-exec/grader/manifest.json" in paths
    assert "/opt/harbor-exec/grader/code/pkg/grader.py" in paths
    assert BUNDLE[0].path not in paths
    placed = {e.path: e.data for e in request.verifier.generated}
    assert placed["/opt/harbor-exec/grader/manifest.json"] == GRADER_PART[0].data
    # Without the grader's part there is no bundled grader to run.
    with pytest.raises(ValueError, match="grader part"):
        trial_request(travelled, secrets, replace(content, grader_files=()))


def test_the_tasks_tests_get_the_graders_input(tmp_path: Path) -> None:
    request = trial_request(spec_for(tmp_path), TrialSecrets(verifier_input=b"{}"))
    assert request.verifier is not None
    assert request.verifier.tests_dir == request.spec.task.tests_dir
    assert [e.path for e in request.verifier.generated] == ["/tests/rollout.json"]


def test_a_workflow_without_its_input_is_refused(tmp_path: Path) -> None:
    spec = spec_for(tmp_path, agent=WorkflowAgentSpec("pkg:Flow", "abc"))
    with pytest.raises(ValueError, match="rollout input"):
        trial_request(spec)


def test_exchange_files_are_read_with_secrets_redacted(tmp_path: Path) -> None:
    (tmp_path / "agent").mkdir()
    (tmp_path / "verifier").mkdir()
    sample = {"messages": [{"role": "assistant", "content": f"key {SECRET}"}]}
    (tmp_path / AGENT_SAMPLE).write_text(json.dumps(sample))
    (tmp_path / GRADER_ERROR).write_text(json.dumps({"error": {"message": f"grader {SECRET}"}}))
    agent = read_agent_output(tmp_path, [SECRET])
    assert agent.sample is not None and agent.sample.messages is not None
    assert agent.sample.messages[0]["content"] == f"key {REDACTED}"
    grader = read_grader_output(tmp_path, [SECRET])
    assert grader.error is not None and grader.error.message == f"grader {REDACTED}"
    assert grader.sample is None


def test_a_missing_sample_keeps_the_runners_tail(tmp_path: Path) -> None:
    (tmp_path / "agent").mkdir()
    (tmp_path / RUNNER_OUTPUT).write_text("".join(f"line {i}\n" for i in range(30)))
    agent = read_agent_output(tmp_path)
    assert agent.missing
    assert agent.runner_tail.splitlines() == [f"line {i}" for i in range(10, 30)]
    (tmp_path / AGENT_SAMPLE).write_text('{"messages": 3}')
    assert read_agent_output(tmp_path).invalid is not None
    (tmp_path / AGENT_SAMPLE).write_text('{"error": "not an object"}')
    error = read_agent_output(tmp_path).error
    assert error is not None and error.message == "the runner failed"
