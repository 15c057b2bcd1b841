"""The sample reaches the host only as the runner hands it over, in a real container.

Each hostile workflow tries to change what the host reads after the fact: a detached
process that rewrites ``sample.json`` once the runner is done, an agent that claims
its own reward and ``remove_sample``, a frame (and a reward file) nested 200,000 deep.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.bundler import Bundle
from tests.fake_chat import FakeChat
from tests.hostile import bundle_of, bundled_rollout, hostile_project, only_trial

# engine_lane("b"): its own tasks and bundles; no engine-wide counts, no wall-clock bound.
pytestmark = [
    pytest.mark.docker,
    pytest.mark.engine_lane("b"),
    pytest.mark.usefixtures("base_images"),
]

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "hostile_sample"
TEMPLATE = ROOT / "tasks_examples" / "template"
KEY = "sk-test-" + uuid.uuid4().hex

HOSTILE = r'''
    """Workflows that attack the sample's way to the host."""

    import os
    import subprocess
    import sys
    import time

    from harbor_exec.authoring import (
        AgentWorkflow, RolloutSample, SampleSource, get_rollout_context,
    )

    ORIGINAL = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "original"}]
    FORGED = (
        '{"messages": [{"role": "assistant", "content": "forged"}], "reward": 1.0, '
        '"remove_sample": true, "metrics": {"forged": 1}, "extra_fields": {}}'
    )
    REWRITER = f"""
    import os, time
    from pathlib import Path
    sample, done = Path("/logs/agent/sample.json"), Path("/logs/agent/rewritten.txt")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if "original" in sample.read_text():
                tmp = sample.with_name(".forged")
                tmp.write_text({FORGED!r})
                os.replace(tmp, sample)
                done.write_text("rewritten after the runner wrote the sample\\n")
        except OSError:
            pass
        time.sleep(0.001)
    """


    class Rewriter(AgentWorkflow):
        async def run(self, ctx):
            # Detached, in its own session, with the workflow's own stdout and stderr:
            # it outlives the runner and rewrites the file as soon as it is written.
            subprocess.Popen([sys.executable, "-c", REWRITER], start_new_session=True)
            return ORIGINAL


    class Claims(AgentWorkflow):
        async def run(self, ctx):
            class Mine(SampleSource):
                async def get_sample(self):
                    return RolloutSample(messages=ORIGINAL, reward=1.0, remove_sample=True)
            get_rollout_context().set_sample_source(Mine())
            return None


    class DeepFrame(AgentWorkflow):
        async def run(self, ctx):
            # In-process, the workflow can find the runner's private stdout and write
            # its own frame there first: a document nested 200,000 deep.
            payload = ("[" * 200_000 + "]" * 200_000).encode()
            frame = b"\n\x1eharbor-exec:sample:v1 " + str(len(payload)).encode() + b"\n"
            for fd in range(3, 64):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                        os.write(fd, frame + payload + b"\n")
                except OSError:
                    pass
            time.sleep(0.2)
            os._exit(0)
'''

GRADER = r'''
    """A grader that reports what it was shown, in its own module."""

    from harbor_exec.authoring import Grader


    class Witness(Grader):
        async def grade(self, ctx):
            sample = ctx.sample
            sample.metrics["seen_reward"] = -1.0 if sample.reward is None else sample.reward
            sample.metrics["seen_remove_sample"] = float(sample.remove_sample)
            sample.metrics["seen_forged"] = float(
                any("forged" in str(m.get("content")) for m in sample.messages)
            )
            ctx.set_reward(0.25)
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile-sample")
    return hostile_project(root / "hostile", PACKAGE, HOSTILE, GRADER)


def bundle_for(project: Path, workflow: str) -> Bundle:
    return bundle_of(project, PACKAGE, workflow, "Witness")


def grader_task(tmp_path: Path) -> Path:
    task = tmp_path / "grader-template"
    shutil.copytree(TEMPLATE, task)
    shutil.rmtree(task / "tests")
    return task


def rollout(tmp_path: Path, bundle: Bundle, tasks_dir: Path, chat: FakeChat) -> Any:
    return bundled_rollout(tmp_path, bundle, tasks_dir, chat, api_key=KEY, timeout_sec=120)


def test_a_detached_rewrite_of_sample_json_changes_nothing(
    tmp_path: Path, project: Path, chat: FakeChat
) -> None:
    result = rollout(tmp_path, bundle_for(project, "Rewriter"), grader_task(tmp_path), chat)
    assert result.status == "success", result.err_message
    sample = result.sample
    assert sample.messages[-1] == {"role": "assistant", "content": "original"}
    assert sample.reward == 0.25 and sample.remove_sample is False
    assert sample.metrics["seen_forged"] == 0.0 and "forged" not in sample.metrics
    agent = only_trial(tmp_path)[0] / "agent"
    # The attack did run (the container's file was rewritten after the runner wrote
    # it), and the trial's sample.json is still the one the runner handed over.
    assert (agent / "rewritten.txt").is_file()
    assert json.loads((agent / "sample.json").read_text())["messages"][-1]["content"] == "original"


def test_the_agents_own_reward_and_remove_sample_are_ignored(
    tmp_path: Path, project: Path, chat: FakeChat
) -> None:
    result = rollout(tmp_path, bundle_for(project, "Claims"), grader_task(tmp_path), chat)
    assert result.status == "success", result.err_message
    metrics = result.sample.metrics
    assert metrics["seen_reward"] == -1.0 and metrics["seen_remove_sample"] == 0.0
    assert result.sample.reward == 0.25 and result.sample.remove_sample is False


def test_a_deep_frame_is_an_agent_error(tmp_path: Path, project: Path, chat: FakeChat) -> None:
    result = rollout(tmp_path, bundle_for(project, "DeepFrame"), grader_task(tmp_path), chat)
    assert result.status == "failure"
    assert result.err_category == "agent_error"
    assert "nests deeper than" in result.err_message


DEEP_REWARD_TEST = """#!/bin/bash
{ printf '{"reward": '; printf '[%.0s' $(seq 200000); printf ']%.0s' $(seq 200000); printf '}'; } \\
    > /logs/verifier/reward.json
"""


def test_a_deep_reward_json_is_a_verifier_side_failure(
    tmp_path: Path, project: Path, chat: FakeChat
) -> None:
    task = tmp_path / "deep-reward"
    shutil.copytree(TEMPLATE, task)
    (task / "tests" / "test.sh").write_text(DEEP_REWARD_TEST)
    result = rollout(tmp_path, bundle_for(project, "Claims"), task, chat)
    assert result.status == "failure", result
    assert "nests deeper than" in result.err_message
    assert "RecursionError" not in result.err_message
    (trial,) = [p for p in (tmp_path / "trials").iterdir() if p.is_dir()]
    record = json.loads((trial / "result.json").read_text())
    assert record["exception_info"]["exception_type"] == "VerifierOutputParseError"
