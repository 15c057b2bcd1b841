"""The container runner as real subprocesses, against a fake chat endpoint on 127.0.0.1.

They run it with this interpreter and the example project on PYTHONPATH. On
CPython 3.11, installed offline from the bundle's wheelhouse as a task image
does it, it runs in tests/test_harbor_backend.py (bookworm containers) and, with
this checkout on PYTHONPATH, in tests/test_relay.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.container.exchange import frame_sample, unframe_sample
from tests.bundle_utils import (
    API_KEY,
    EXAMPLE_REFS,
    EXAMPLE_SRC,
    REPO_ROOT,
    clean_env,
    run_runner,
    write_rollout,
)
from tests.fake_chat import FakeChat

MESSAGES = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]

CUSTOM_FLOWS = """
    import asyncio

    from harbor_exec.authoring import (
        AgentWorkflow, AgentWorkflowOutput, Grader, RolloutSample, SampleSource,
        get_rollout_context,
    )

    class Boom(AgentWorkflow):
        async def run(self, ctx):
            key = get_rollout_context().api_key
            raise RuntimeError(f"upstream refused key {key}")

    class FromSource(AgentWorkflow):
        async def run(self, ctx):
            class Source(SampleSource):
                async def get_sample(self):
                    return RolloutSample(
                        messages=[{"role": "assistant", "content": "from the source"}],
                        metrics={"turns": 1},
                    )
            get_rollout_context().set_sample_source(Source())
            return None

    class Nothing(AgentWorkflow):
        async def run(self, ctx):
            return None

    class NoMessages(AgentWorkflow):
        async def run(self, ctx):
            return AgentWorkflowOutput(messages=None)

    class Sleeper(AgentWorkflow):
        async def run(self, ctx):
            print("sleeping", flush=True)
            await asyncio.sleep(60)

    class Chatty(AgentWorkflow):
        async def run(self, ctx):
            import os, subprocess, sys
            # What the workflow and its children print never reaches the host's frame.
            print("\\x1eharbor-exec:sample:v1 2\\n{}", flush=True)
            os.write(1, b"raw fd 1\\n")
            subprocess.run([sys.executable, "-c", "print('child says hi')"], check=True)
            return [{"role": "assistant", "content": "the real one"}]

    class SeesLitellmEnv(AgentWorkflow):
        async def run(self, ctx):
            import json, os
            names = ("LITELLM_LOCAL_MODEL_COST_MAP", "LITELLM_OFFLINE_MODE")
            seen = json.dumps({name: os.environ.get(name) for name in names})
            return [{"role": "assistant", "content": seen}]

    class ReportsWhatItSees(Grader):
        async def grade(self, ctx):
            ctx.sample.extra_fields["seen"] = {
                "reward": ctx.sample.reward,
                "remove_sample": ctx.sample.remove_sample,
            }
            ctx.set_reward(0.25)

    class Lazy(Grader):
        async def grade(self, ctx):
            pass

    class SeesEverything(Grader):
        async def grade(self, ctx):
            ctx.sample.extra_fields["seen"] = {
                "label": ctx.label,
                "metadata": ctx.metadata,
                "artifacts": str(ctx.artifacts_dir),
                "messages": len(ctx.sample.messages),
            }
            ctx.set_reward(0.5)
    """


@dataclass
class Layout:
    """A container's paths, under tmp_path."""

    root: Path
    manifest: Path
    pythonpath: list[Path] | None = None  # None: the child gets no PYTHONPATH at all

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def tests(self) -> Path:
        return self.root / "tests"

    @property
    def agent_sample(self) -> Path:
        return self.logs / "agent" / "sample.json"

    @property
    def reward(self) -> Path:
        return self.logs / "verifier" / "reward.json"

    @property
    def verifier_sample(self) -> Path:
        return self.logs / "verifier" / "sample.json"

    def run(
        self, command: str, python: Path | str = sys.executable, args: Sequence[str] = ()
    ) -> subprocess.CompletedProcess[str]:
        return run_runner(
            command,
            args=args,
            manifest=self.manifest,
            logs_dir=self.logs,
            tests_dir=self.tests,
            python=python,
            pythonpath=self.pythonpath,
            cwd=self.root,
        )

    def agent_input(self, chat: FakeChat, prompt: str, **kwargs: Any) -> None:
        write_rollout(
            self.logs / "agent" / "rollout.json", prompt=prompt, chat_url=chat.base_url, **kwargs
        )

    def grader_input(self, chat: FakeChat, prompt: str, label: str, **kwargs: Any) -> None:
        write_rollout(
            self.tests / "rollout.json",
            prompt=prompt,
            chat_url=chat.base_url,
            label=label,
            **kwargs,
        )


HOST_PATH = [REPO_ROOT, EXAMPLE_SRC]


@pytest.fixture
def example(tmp_path: Path, chat: FakeChat) -> Layout:
    """A layout whose manifest names the example project's workflow, grader and configs
    (the runner reads only those refs; a built bundle's manifest is read in the
    container tests)."""
    chat.reset()
    layout = Layout(tmp_path, tmp_path / "manifest.json", HOST_PATH)
    _manifest(layout, **EXAMPLE_REFS)
    return layout


@pytest.fixture
def custom(tmp_path: Path, chat: FakeChat) -> Layout:
    """A layout whose manifest points at the workflows and graders of CUSTOM_FLOWS."""
    chat.reset()
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "custom_flows.py").write_text(textwrap.dedent(CUSTOM_FLOWS))
    return Layout(tmp_path, tmp_path / "manifest.json", [*HOST_PATH, mods])


def _manifest(layout: Layout, **refs: str) -> None:
    layout.manifest.write_text(json.dumps({"format_version": 1, **refs}))


def _read(path: Path) -> Any:
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- agent


def test_agent_writes_the_sample(example: Layout, chat: FakeChat) -> None:
    example.agent_input(chat, "What is 17 + 25?", rollout_id="r-ok")
    done = example.run("agent")
    assert done.returncode == 0, done.stderr
    sample = _read(example.agent_sample)
    assert set(sample) == {"messages", "reward", "remove_sample", "metrics", "extra_fields"}
    assert sample["messages"][-1] == {"role": "assistant", "content": "42"}
    assert sample["messages"][1] == {"role": "user", "content": "What is 17 + 25?"}
    assert sample["reward"] is None
    assert sample["remove_sample"] is False
    assert sample["metrics"]["completion_tokens"] == 1.0
    # The endpoint saw the rollout's key as a bearer token, and the workflow's config.
    assert chat.authorizations == [f"Bearer {API_KEY}"]
    assert chat.requests[0].path == "/chat/completions"
    assert chat.requests[0].body["model"] == "arith-model"
    # The key is in no output file.
    assert API_KEY not in example.agent_sample.read_text()
    assert (example.logs / "artifacts").is_dir()


def test_agent_hands_the_sample_over_as_the_last_frame_on_stdout(
    custom: Layout, chat: FakeChat
) -> None:
    _manifest(custom, workflow="custom_flows:Chatty")
    custom.agent_input(chat, "q")
    done = custom.run("agent", args=["--sample-to-stdout"])
    assert done.returncode == 0, done.stderr
    framed = unframe_sample(done.stdout.encode())
    # The frame is the file's bytes, and the only thing on stdout.
    assert framed == custom.agent_sample.read_bytes()
    assert done.stdout.encode() == frame_sample(custom.agent_sample.read_bytes())
    assert json.loads(framed)["messages"] == [{"role": "assistant", "content": "the real one"}]
    for printed in ("raw fd 1", "child says hi", "sample written"):
        assert printed in done.stderr


def test_setup_failure_is_handed_over_in_its_error_form(example: Layout) -> None:
    done = example.run("agent", args=["--sample-to-stdout"])
    assert done.returncode == 2
    framed = unframe_sample(done.stdout.encode())
    assert framed is not None and json.loads(framed)["error"]["phase"] == "setup"


def test_agent_appends_chat_completions_to_a_base_url_with_a_path(
    example: Layout, chat: FakeChat
) -> None:
    write_rollout(
        example.logs / "agent" / "rollout.json",
        prompt="What is 6 * 7?",
        chat_url=f"{chat.base_url}/v1/rollouts/r-7",
    )
    done = example.run("agent")
    assert done.returncode == 0, done.stderr
    assert chat.requests[0].path == "/v1/rollouts/r-7/chat/completions"
    assert _read(example.agent_sample)["messages"][-1]["content"] == "42"


def test_workflow_exception_writes_the_error_form(custom: Layout, chat: FakeChat) -> None:
    _manifest(custom, workflow="custom_flows:Boom")
    custom.agent_input(chat, "What is 1 + 1?")
    done = custom.run("agent")
    assert done.returncode == 1
    data = _read(custom.agent_sample)
    assert set(data) == {"error"}
    error = data["error"]
    assert error["type"] == "RuntimeError"
    assert error["category"] == "agent_error"
    assert error["phase"] == "workflow"
    assert error["message"] == "upstream refused key [REDACTED]"
    assert "custom_flows.py" in error["traceback"]
    assert API_KEY not in custom.agent_sample.read_text()
    assert API_KEY not in done.stderr
    assert "agent failed: upstream refused key [REDACTED]" in done.stderr


def test_chat_endpoint_failure_is_an_agent_error(example: Layout, chat: FakeChat) -> None:
    chat.reset("error")
    example.agent_input(chat, "What is 2 + 2?")
    done = example.run("agent")
    assert done.returncode == 1
    error = _read(example.agent_sample)["error"]
    assert error["type"] == "HTTPStatusError"
    assert "500" in error["message"]
    assert error["category"] == "agent_error"


def test_sample_source_is_used_when_the_workflow_returns_none(
    custom: Layout, chat: FakeChat
) -> None:
    _manifest(custom, workflow="custom_flows:FromSource")
    custom.agent_input(chat, "anything")
    done = custom.run("agent")
    assert done.returncode == 0, done.stderr
    sample = _read(custom.agent_sample)
    assert sample["messages"] == [{"role": "assistant", "content": "from the source"}]
    assert sample["metrics"] == {"turns": 1}


def test_the_workflow_runs_with_litellm_offline(
    custom: Layout, chat: FakeChat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The container is offline: litellm (the SDK's integrations use it) is told so,
    instead of trying to fetch its model cost map when imported."""
    for name in ("LITELLM_LOCAL_MODEL_COST_MAP", "LITELLM_OFFLINE_MODE"):
        monkeypatch.delenv(name, raising=False)
    _manifest(custom, workflow="custom_flows:SeesLitellmEnv")
    custom.agent_input(chat, "anything")
    done = custom.run("agent")
    assert done.returncode == 0, done.stderr
    seen = json.loads(_read(custom.agent_sample)["messages"][-1]["content"])
    assert seen == {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_OFFLINE_MODE": "true"}


def test_messages_none_is_a_success_without_a_sample(custom: Layout, chat: FakeChat) -> None:
    """As in the reference (and LocalBackend, which runs the same function)."""
    _manifest(custom, workflow="custom_flows:NoMessages", grader="custom_flows:SeesEverything")
    custom.agent_input(chat, "anything")
    done = custom.run("agent")
    assert done.returncode == 0, done.stderr
    assert _read(custom.agent_sample)["messages"] is None
    custom.grader_input(chat, "anything", label="x")
    graded = custom.run("grade")
    assert graded.returncode != 0
    assert "No sample to grade" in graded.stderr


def test_no_sample_at_all_is_a_validation_error(custom: Layout, chat: FakeChat) -> None:
    _manifest(custom, workflow="custom_flows:Nothing")
    custom.agent_input(chat, "anything")
    done = custom.run("agent")
    assert done.returncode == 1
    error = _read(custom.agent_sample)["error"]
    assert error["category"] == "validation_error"
    assert "registered no sample source" in error["message"]


@pytest.mark.parametrize(
    ("refs", "expected"),
    [
        ({"workflow": "custom_flows:Missing"}, "workflow 'custom_flows:Missing' from"),
        ({"workflow": "no_such_module:Flow"}, "No module named 'no_such_module'"),
        ({"workflow": "custom_flows:Lazy"}, "not a subclass of AgentWorkflow"),
        (
            {"workflow": "custom_flows:Boom", "workflow_config": "custom_flows:asyncio"},
            "not a AgentWorkflowConfig instance",
        ),
        ({"grader": "custom_flows:Lazy"}, "names no workflow"),
    ],
)
def test_setup_errors_exit_2_with_the_error_form(
    custom: Layout, chat: FakeChat, refs: dict[str, str], expected: str
) -> None:
    _manifest(custom, **refs)
    custom.agent_input(chat, "What is 1 + 1?")
    done = custom.run("agent")
    assert done.returncode == 2
    error = _read(custom.agent_sample)["error"]
    assert error["phase"] == "setup"
    assert expected in error["message"]
    assert chat.requests == []


def test_missing_input_file_still_leaves_the_error_form(example: Layout) -> None:
    done = example.run("agent")
    assert done.returncode == 2
    error = _read(example.agent_sample)["error"]
    assert error["phase"] == "setup"
    assert "rollout input" in error["message"] and "does not exist" in error["message"]


def test_sigterm_still_leaves_the_error_form(custom: Layout, chat: FakeChat) -> None:
    _manifest(custom, workflow="custom_flows:Sleeper")
    custom.agent_input(chat, "anything")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harbor_exec.container.runner",
            "agent",
            "--manifest",
            str(custom.manifest),
            "--logs-dir",
            str(custom.logs),
        ],
        env=clean_env(PYTHONPATH=os.pathsep.join(map(str, custom.pythonpath or []))),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "sleeping"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 1
    finally:
        process.kill()
        process.communicate()
    error = _read(custom.agent_sample)["error"]
    assert error["type"] == "Terminated"
    assert "SIGTERM" in error["message"]


# --------------------------------------------------------------------------- grade


def _agent_then_grade(
    layout: Layout, chat: FakeChat, prompt: str, label: str
) -> subprocess.CompletedProcess[str]:
    layout.agent_input(chat, prompt)
    assert layout.run("agent").returncode == 0
    layout.grader_input(chat, prompt, label)
    return layout.run("grade")


def test_grade_writes_the_reward(example: Layout, chat: FakeChat) -> None:
    done = _agent_then_grade(example, chat, "What is 17 + 25?", "42")
    assert done.returncode == 0, done.stderr
    assert _read(example.reward) == {"reward": 1.0}
    # The grader changed nothing but the reward: no verifier sample.
    assert not example.verifier_sample.exists()


def test_wrong_answer_gives_zero(example: Layout, chat: FakeChat) -> None:
    chat.reset("wrong")
    done = _agent_then_grade(example, chat, "What is 17 + 25?", "42")
    assert done.returncode == 0, done.stderr
    assert _read(example.agent_sample)["messages"][-1]["content"] == "43"
    assert _read(example.reward) == {"reward": 0.0}


def test_remove_sample_is_kept_in_the_verifier_sample(example: Layout, chat: FakeChat) -> None:
    chat.reset("no_answer")
    done = _agent_then_grade(example, chat, "What is 17 + 25?", "42")
    assert done.returncode == 0, done.stderr
    assert _read(example.reward) == {"reward": 0.0}
    graded = _read(example.verifier_sample)
    assert graded["remove_sample"] is True
    assert graded["metrics"]["unanswered"] == 1.0
    assert graded["reward"] == 0.0
    assert graded["messages"] == _read(example.agent_sample)["messages"]


def test_grader_sees_label_metadata_and_artifacts(custom: Layout, chat: FakeChat) -> None:
    _manifest(custom, workflow="custom_flows:FromSource", grader="custom_flows:SeesEverything")
    custom.agent_input(chat, "q")
    assert custom.run("agent").returncode == 0
    custom.grader_input(chat, "q", "the-label", metadata={"task": "t1"})
    done = custom.run("grade")
    assert done.returncode == 0, done.stderr
    assert _read(custom.reward) == {"reward": 0.5}
    seen = _read(custom.verifier_sample)["extra_fields"]["seen"]
    assert seen == {
        "label": "the-label",
        "metadata": {"task": "t1"},
        "artifacts": str(custom.logs / "artifacts"),
        "messages": 1,
    }


def test_grader_never_sees_the_agents_reward_or_remove_sample(
    custom: Layout, chat: FakeChat
) -> None:
    _manifest(custom, workflow="custom_flows:Nothing", grader="custom_flows:ReportsWhatItSees")
    custom.agent_sample.parent.mkdir(parents=True)
    custom.agent_sample.write_text(
        json.dumps({"messages": MESSAGES, "reward": 1.0, "remove_sample": True})
    )
    custom.grader_input(chat, "q", "x")
    done = custom.run("grade")
    assert done.returncode == 0, done.stderr
    assert _read(custom.reward) == {"reward": 0.25}
    graded = _read(custom.verifier_sample)
    assert graded["extra_fields"]["seen"] == {"reward": None, "remove_sample": False}
    assert graded["remove_sample"] is False


def test_a_deep_agent_sample_is_a_clear_setup_error(custom: Layout, chat: FakeChat) -> None:
    _manifest(custom, workflow="custom_flows:Nothing", grader="custom_flows:Lazy")
    custom.agent_sample.parent.mkdir(parents=True)
    custom.agent_sample.write_text("[" * 200_000 + "]" * 200_000)
    custom.grader_input(chat, "q", "x")
    done = custom.run("grade")
    assert done.returncode == 2
    assert "nests deeper than" in done.stderr
    assert "RecursionError" not in done.stderr


def test_missing_sample_is_a_clear_error_and_no_reward(example: Layout, chat: FakeChat) -> None:
    example.grader_input(chat, "What is 1 + 1?", "2")
    done = example.run("grade")
    assert done.returncode == 2
    assert not example.reward.exists()
    assert f"agent sample {example.agent_sample} does not exist" in done.stderr
    error = _read(example.logs / "verifier" / "grader_error.json")["error"]
    assert error["phase"] == "setup"


def test_failed_agent_sample_is_not_graded(custom: Layout, chat: FakeChat) -> None:
    _manifest(custom, workflow="custom_flows:Boom", grader="custom_flows:Lazy")
    custom.agent_input(chat, "q")
    assert custom.run("agent").returncode == 1
    custom.grader_input(chat, "q", "x")
    done = custom.run("grade")
    assert done.returncode == 2
    assert not custom.reward.exists()
    assert "the agent phase failed (RuntimeError" in done.stderr


def test_grader_that_sets_no_reward_fails_without_reward_file(
    custom: Layout, chat: FakeChat
) -> None:
    _manifest(custom, workflow="custom_flows:FromSource", grader="custom_flows:Lazy")
    custom.agent_input(chat, "q")
    assert custom.run("agent").returncode == 0
    custom.grader_input(chat, "q", "x")
    done = custom.run("grade")
    assert done.returncode == 1
    assert not custom.reward.exists()
    assert "the grader set no reward" in done.stderr
    error = _read(custom.logs / "verifier" / "grader_error.json")["error"]
    assert error["phase"] == "grader"
    assert error["category"] == "validation_error"
