"""A policy that knows it answered wrongly cannot erase its zero by failing its own side.

Each workflow answers "41" (the label is "42", so the honest grader gives 0.0), then
sabotages the rollout: it floods the copy-back budget (``AgentOutputLimitError``), or it
hands its answer over itself (a frame on the runner's stdout, as the runner writes it)
and ends the container (``AgentEndedContainerError``, or none when the trial's own
restart between phases came first). A trainer drops failed rollouts, so a failure would erase the zero: the
rollout must be a success carrying the grader's 0.0, naming the agent's error. Both
grader verifier modes (separate, the default, and shared).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.fake_chat import FakeChat
from tests.hostile import bundle_of, bundled_rollout, hostile_project, only_trial

# engine_lane("b"): its own tasks and bundles; no engine-wide counts, no wall-clock bound.
pytestmark = [
    pytest.mark.docker,
    pytest.mark.engine_lane("b"),
    pytest.mark.usefixtures("base_images"),
]

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "zero_stands"
TEMPLATE = ROOT / "tasks_examples" / "template"

WORKFLOWS = r'''
    """Workflows that answer wrongly, then try to have the rollout dropped."""

    import json
    import os
    import signal
    import time

    from harbor_exec.authoring import AgentWorkflow

    WRONG = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "41"}]


    class Flood(AgentWorkflow):
        async def run(self, ctx):
            chunk = bytes(1 << 20)
            with open("/logs/artifacts/flood.bin", "wb") as out:
                for _ in range(300):  # past the copy-back's 256 MiB
                    out.write(chunk)
            return WRONG


    class EndContainer(AgentWorkflow):
        async def run(self, ctx):
            # Hand the wrong answer over itself, as the runner would (a frame on the
            # runner's stdout pipe), then end the container: the rollout must not fail.
            payload = json.dumps({"messages": WRONG}).encode()
            frame = b"\n\x1eharbor-exec:sample:v1 " + str(len(payload)).encode() + b"\n"
            for fd in range(1, 64):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                        os.write(fd, frame + payload + b"\n")
                        break
                except OSError:
                    pass
            time.sleep(0.5)  # the frame on its way out of the pipe before the kill
            os.kill(1, signal.SIGTERM)  # the init handles TERM (KILL from inside is ignored)
            time.sleep(30)  # the container ends under it
            return WRONG
'''

GRADER = r'''
    """The honest grader: 1.0 for the label, else 0.0."""

    from harbor_exec.authoring import Grader


    class ExactMatch(Grader):
        async def grade(self, ctx):
            answer = ctx.sample.messages[-1]["content"] if ctx.sample.messages else ""
            ctx.set_reward(1.0 if answer == ctx.label else 0.0)
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zero-stands")
    return hostile_project(root / "project", PACKAGE, WORKFLOWS, GRADER)


@pytest.mark.parametrize("mode", ["separate", "shared"])
@pytest.mark.parametrize(
    ("workflow", "errors"),
    [
        ("Flood", {"AgentOutputLimitError"}),
        # None when the trial's own between-phase restart came first (as in
        # tests/test_sandbox_users.py): the container ended either way.
        ("EndContainer", {"AgentEndedContainerError", None}),
    ],
)
def test_a_sabotaged_wrong_answer_keeps_the_graders_zero(
    tmp_path: Path,
    project: Path,
    chat: FakeChat,
    workflow: str,
    errors: set[str | None],
    mode: str,
) -> None:
    task = tmp_path / "grader-template"
    shutil.copytree(TEMPLATE, task)
    shutil.rmtree(task / "tests")  # the bundled grader verifies
    bundle = bundle_of(project, PACKAGE, workflow, "ExactMatch")
    result = bundled_rollout(tmp_path, bundle, task, chat, grader_verifier_mode=mode)
    assert result.status == "success", (result.err_category, result.err_message)
    assert result.sample is not None and result.sample.reward == 0.0
    _trial, recorded = only_trial(tmp_path)
    exception = recorded["exception_info"]
    exc_type = exception["exception_type"] if exception else None
    assert exc_type in errors, exception
    if exc_type is not None:  # the agent's error is named beside the reward
        agent_error = result.sample.extra_fields["agent_error"]
        assert agent_error["exception_type"] == exc_type
        assert agent_error["category"] == "agent_error"
    assert [m["content"] for m in result.sample.messages][-1] == "41"
