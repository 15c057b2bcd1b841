"""terminus-2 (Harbor's own class, unchanged) as a HarborBackend agent: real Docker
trials behind the real HTTP server, a scripted model on 127.0.0.1, our client.

The task image (debian:bookworm-slim) has no tmux: terminus-2 drives the container
with the read-only runtime's. The model sees only the rollout's relay token; the
upstream gets the real key, which no file under the trial directory holds."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before litellm is imported
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.client import RolloutClient
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.server.app import create_rollout_server
from tests.bundle_utils import (  # noqa: F401  (fixtures are used by name)
    bundle_cache,
    flit_pyproject,
    write_project,
)
from tests.fake_chat import ScriptedChat, terminus_reply
from tests.server_utils import serve, wait_until
from tests.task_factory import make_task

KEY = "sk-real-" + uuid.uuid4().hex
INSTRUCTION = "Write the number 42 into /app/answer.txt."
# The verifier also says whether the image has a tmux of its own (it must not).
TEST_SH = """
if command -v tmux >/dev/null 2>&1; then echo present > /logs/verifier/tmux.txt; else echo none > /logs/verifier/tmux.txt; fi
if [ "$(cat /app/answer.txt 2>/dev/null)" = 42 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
#: A reply terminus-2 cannot parse (kept in the chat as the model wrote it), then the
#: keystrokes that solve the task, then ``task_complete`` twice (asked to confirm).
SCRIPT = [
    "not json at all",
    terminus_reply(keystrokes=["env > /logs/agent/pane-env.txt; echo 42 > /app/answer.txt\n"]),
    terminus_reply(task_complete=True),
    terminus_reply(task_complete=True),
]
TURNS = len(SCRIPT)
CACHED = 7  # prompt tokens the scripted model says it had cached, per answer
NETWORKS = {
    "public": "",
    "no-network": '[environment]\nnetwork_mode = "no-network"\n',
}
#: (network, client): the osmosis-ai 0.3.8 client once, on the public task.
CASES = [("public", "ours"), ("no-network", "ours"), ("public", "osmosis")]

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]


def rollout(url: str, chat: ScriptedChat, prompt: str, kind: str = "ours", **kwargs: Any) -> Any:
    async def run() -> Any:
        async with httpx.AsyncClient(timeout=120) as http:
            if kind == "osmosis":
                from osmosis_ai.rollout.client import RolloutClient as OsmosisClient

                client: Any = OsmosisClient(url=url, http_client=http)
            else:
                client = RolloutClient(url=url, http_client=http)
            return await client.run_rollout(
                initial_messages=[{"role": "user", "content": prompt}],
                chat_completions_url=chat.base_url,
                rollout_id=uuid.uuid4().hex,
                llm_api_key=KEY,
                **kwargs,
            )

    return asyncio.run(run())


def terminus_app(tmp_path: Path, task: Path, **options: Any) -> Any:
    """The rollout server over ``HarborBackend(agent="terminus-2")`` for ``task``; its
    trials in ``tmp_path / "trials"``, kept unless ``options`` say otherwise."""
    options.setdefault("cleanup_successful_trials", False)
    backend = HarborBackend(
        tasks_dir=task,
        agent="terminus-2",
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        **options,
    )
    return create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")


def files_holding(root: Path, needle: str) -> list[str]:
    return [
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and needle.encode() in p.read_bytes()
    ]


@pytest.mark.parametrize(("network", "kind"), CASES)
def test_terminus_2_solves_a_task_through_the_relay(
    network: str, kind: str, tmp_path: Path, docker_runtime: DockerRuntime
) -> None:
    toml = NETWORKS[network] + "[agent]\ntimeout_sec = 60.0\n[verifier]\ntimeout_sec = 30.0\n"
    task = make_task(
        tmp_path / "tasks", "answer-42", test=TEST_SH, instruction=INSTRUCTION, toml=toml
    )
    app = terminus_app(
        tmp_path,
        task,
        native_agent_kwargs={"collect_rollout_details": True, "max_turns": 10},
        agent_setup_timeout_sec=60,
    )
    with ScriptedChat(SCRIPT, token_ids=True, cached_tokens=CACHED) as chat, serve(app) as url:
        result = rollout(url, chat, INSTRUCTION, kind)
    assert result.status.value == "success", result.err_message
    sample = result.sample
    assert sample is not None and sample.reward == 1.0

    # The exact chat: the last request's history, then the last answer; every request
    # was the chat so far; the unparsable reply is there as the model wrote it.
    assert len(chat.requests) == TURNS
    last = chat.requests[-1].body["messages"]
    assert sample.messages == [*last, {"role": "assistant", "content": chat.answers[-1]}]
    assert sample.messages[0]["role"] == "user" and INSTRUCTION in sample.messages[0]["content"]
    assert [m["content"] for m in sample.messages if m["role"] == "assistant"] == chat.answers
    assert sample.messages[1] == {"role": "assistant", "content": "not json at all"}
    assert "parsing errors" in sample.messages[2]["content"]
    for turn, request in enumerate(chat.requests):
        assert request.body["messages"] == sample.messages[: 2 * turn + 1]
        assert request.body["model"] == "osmosis-rollout"
        assert request.path == "/v1/chat/completions"
        assert request.authorization == f"Bearer {KEY}"  # the relay's, to the upstream only

    # Token ids and logprobs, per turn, aligned with the assistant messages.
    turns = sample.extra_fields["token_turns"] if sample.extra_fields else None
    assert turns is not None and len(turns) == TURNS
    for turn, entry in enumerate(turns):
        prompt_ids, completion_ids, logprobs = chat.ids_of(turn)
        assert sample.messages[entry["message_index"]]["role"] == "assistant"
        assert entry["message_index"] == 2 * turn + 1
        assert entry["prompt_token_ids"] == prompt_ids
        assert entry["completion_token_ids"] == completion_ids
        assert entry["logprobs"] == pytest.approx(logprobs)

    # Usage from the relay's own accounting.
    assert sample.metrics["llm_requests"] == TURNS
    assert sample.metrics["llm_prompt_tokens"] == TURNS * ScriptedChat.PROMPT_TOKENS
    assert sample.metrics["llm_completion_tokens"] == TURNS * ScriptedChat.COMPLETION_TOKENS
    # ... under osmosis-ai's names (no cost: the upstream reported none, nothing is priced).
    assert {k: v for k, v in sample.metrics.items() if not k.startswith("llm_")} == {
        "input_tokens": TURNS * ScriptedChat.PROMPT_TOKENS,
        "cached_tokens": TURNS * CACHED,
        "output_tokens": TURNS * ScriptedChat.COMPLETION_TOKENS,
    }
    agent_usage = sample.extra_fields["agent_usage"] if sample.extra_fields else {}
    assert agent_usage["input_tokens"] == sample.metrics["llm_prompt_tokens"]  # cross-checked
    assert agent_usage["cached_tokens"] == sample.metrics["cached_tokens"]
    assert "usage_mismatch" not in sample.extra_fields

    (trial_dir,) = (tmp_path / "trials").iterdir()
    # The image had no tmux: the runtime's drove it.
    assert (trial_dir / "verifier" / "tmux.txt").read_text().strip() == "none"
    trajectory = json.loads((trial_dir / "agent" / "trajectory.json").read_text())
    assert trajectory["agent"]["name"] == "terminus-2"
    assert trajectory["agent"]["extra"]["llm_kwargs"]["api_key"] == "[REDACTED]"
    result_json = json.loads((trial_dir / "result.json").read_text())
    assert result_json["agent_info"]["name"] == "terminus-2"
    assert result_json["agent_result"]["n_input_tokens"] == TURNS * ScriptedChat.PROMPT_TOKENS
    assert result_json["agent_result"]["n_cache_tokens"] == TURNS * CACHED
    # The agent's shell (the image's bash in tmux) saw neither key nor relay.
    pane_env = (trial_dir / "agent" / "pane-env.txt").read_text()
    assert (
        KEY not in pane_env and "OPENAI" not in pane_env and "harbor-exec-runtime" not in pane_env
    )
    assert result_json["verifier_result"]["rewards"] == {"reward": 1.0}
    # The real key is on no file the trial left (nor is the relay token).
    assert files_holding(trial_dir, KEY) == []
    assert files_holding(tmp_path / "server-artifacts", KEY) == []
    assert files_holding(tmp_path / "artifacts", KEY) == []
    (kept,) = (tmp_path / "artifacts").glob("*/atif-trajectory.json")  # beside the artifacts
    assert json.loads(kept.read_text()) == trajectory


def test_a_model_that_never_completes_ends_at_the_agent_timeout_and_is_verified(
    tmp_path: Path, docker_runtime: DockerRuntime
) -> None:
    task = make_task(tmp_path / "tasks", "never-done", test=TEST_SH, instruction=INSTRUCTION)
    app = terminus_app(tmp_path, task)
    forever = [terminus_reply(keystrokes=["echo 41 > /app/answer.txt\n"], duration=1.0)]
    with ScriptedChat(forever) as chat, serve(app) as url:
        result = rollout(url, chat, INSTRUCTION, agent_timeout_sec=6)
    # Verified at the timeout: its zero stands (a failed rollout would be dropped).
    assert result.status.value == "success", result.err_message
    assert result.sample is not None and result.sample.reward == 0.0
    assert result.sample.extra_fields["agent_error"]["category"] == "timeout"
    (trial_dir,) = (tmp_path / "trials").iterdir()
    result_json = json.loads((trial_dir / "result.json").read_text())
    assert result_json["exception_info"]["exception_type"] == "AgentTimeoutError"
    assert result_json["verifier_result"]["rewards"] == {"reward": 0.0}  # verified anyway
    assert len(chat.requests) >= 2
    assert files_holding(trial_dir, KEY) == []


def test_terminus_2_as_a_non_root_agent_user(tmp_path: Path, docker_runtime: DockerRuntime) -> None:
    """The tmux server and the pane's shell run as the task's agent user."""
    toml = '[agent]\ntimeout_sec = 60.0\nuser = "nobody"\n[verifier]\ntimeout_sec = 30.0\n'
    dockerfile = "FROM debian:bookworm-slim\nRUN mkdir -p /app && chmod 777 /app\nWORKDIR /app\n"
    test = TEST_SH + 'echo "$(stat -c %U /app/answer.txt)" > /logs/verifier/owner.txt\n'
    task = make_task(
        tmp_path / "tasks",
        "as-nobody",
        test=test,
        instruction=INSTRUCTION,
        toml=toml,
        dockerfile=dockerfile,
    )
    app = terminus_app(tmp_path, task)
    with ScriptedChat(SCRIPT) as chat, serve(app) as url:
        result = rollout(url, chat, INSTRUCTION)
    assert result.status.value == "success", result.err_message
    assert result.sample.reward == 1.0
    (trial_dir,) = (tmp_path / "trials").iterdir()
    assert (trial_dir / "verifier" / "owner.txt").read_text().strip() == "nobody"
    assert files_holding(trial_dir, KEY) == []


@pytest.mark.quiet_engine  # a wall-clock bound on engine work
def test_cancelling_a_running_terminus_2_rollout_frees_its_container(
    tmp_path: Path, docker_runtime: DockerRuntime
) -> None:
    task = make_task(tmp_path / "tasks", "cancel-me", test=TEST_SH, instruction=INSTRUCTION)
    app = terminus_app(tmp_path, task, cleanup_successful_trials=True)
    # The model's first command waits 30 s on the host (terminus sleeps its duration).
    slow = [terminus_reply(keystrokes=["sleep 100\n"], duration=30.0)]

    async def scenario(url: str, chat: ScriptedChat) -> tuple[Any, Any, float]:
        async with httpx.AsyncClient(timeout=60) as http:
            client = RolloutClient(url=url, http_client=http)
            running = await client.run_rollout_async(
                [{"role": "user", "content": INSTRUCTION}],
                chat.base_url,
                rollout_id="cancel-1",
                llm_api_key=KEY,
            )
            asked = await asyncio.to_thread(chat.asked.wait, 30)  # the model was asked once
            assert asked, "terminus-2 never called the model"
            began = time.monotonic()
            cancel = await client.cancel_rollout("cancel-1")
            result = await running
            return cancel, result, time.monotonic() - began

    def containers() -> list[Any]:
        return [
            c
            for c in docker_runtime.our_containers()
            if (c.get("Labels") or {}).get("harbor-exec.rollout") == "cancel-1"
        ]

    with ScriptedChat(slow) as chat, serve(app) as url:
        cancel, result, seconds = asyncio.run(scenario(url, chat))
        began = time.monotonic()
        assert wait_until(lambda: not containers(), timeout=5, interval=0.1)
        removed_in = time.monotonic() - began
    assert cancel.dispositions == {"cancel-1": "cancelled_running"}
    assert result.status == "cancelled"
    assert seconds < 5  # the agent's loop stopped, though it was sleeping on the host
    assert removed_in < 2


#: The key in two halves: the model's command joins them, so the key itself is never in
#: the chat, the pane or a file, and a match can only be a leak.
_KEY_A, _KEY_B = KEY[:16], KEY[16:]
KEY_SCAN = (
    f"A={_KEY_A}; B={_KEY_B}; "
    'grep -rlsF "$A$B" / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev'
    " > /logs/agent/key-files.txt; "
    'cat /proc/[0-9]*/environ | grep -caF "$A$B" > /logs/agent/key-environ.txt; '
    "cat /proc/[0-9]*/environ | grep -caF PATH= > /logs/agent/environ-control.txt; "
    "echo 42 > /app/answer.txt\n"
)
JUDGE = """
    from harbor_exec.authoring import Grader

    class Judge(Grader):
        \"\"\"1.0 when an assistant turn wrote the label into the answer file.\"\"\"

        async def grade(self, ctx):
            said = [m.get("content") or "" for m in ctx.sample.messages if m["role"] == "assistant"]
            ctx.sample.metrics["graded_turns"] = float(len(said))
            wrote = any(f"echo {ctx.label} > /app/answer.txt" in s for s in said)
            ctx.set_reward(1.0 if wrote else 0.0)
    """


def test_terminus_2_with_a_bundled_grader_and_no_key_anywhere_in_the_container(
    tmp_path: Path,
    docker_runtime: DockerRuntime,
    bundle_cache: Path,  # noqa: F811  (the fixture)
) -> None:
    """A native agent with a grader-only bundle: the grader grades the exact chat (the
    task has no tests). Meanwhile the model, as root, looks for the real key in every
    file of its container and in every process's environment (tmux's included)."""
    from harbor_exec.bundler import build_bundle

    project = write_project(
        tmp_path / "judge-project",
        {
            "pyproject.toml": flit_pyproject("judge"),
            "judge/__init__.py": "",
            "judge/judge.py": JUDGE,
        },
    )
    bundle = build_bundle(
        project, workflow=None, grader="judge.judge:Judge", cache_dir=bundle_cache
    )
    assert bundle.manifest.workflow is None
    task = make_task(tmp_path / "tasks", "graded", instruction=INSTRUCTION)
    for path in (task / "tests").iterdir():
        path.unlink()
    (task / "tests").rmdir()
    app = terminus_app(tmp_path, task, grader="judge.judge:Judge", bundle=bundle)
    script = [terminus_reply(keystrokes=[KEY_SCAN], duration=3.0)] + [
        terminus_reply(task_complete=True)
    ] * 2
    with ScriptedChat(script) as chat, serve(app) as url:
        result = rollout(url, chat, INSTRUCTION, label="42")
    assert result.status.value == "success", result.err_message
    assert result.sample is not None and result.sample.reward == 1.0
    assert result.sample.metrics["graded_turns"] == 3.0  # the grader saw the whole chat
    (trial_dir,) = (tmp_path / "trials").iterdir()
    agent_dir = trial_dir / "agent"
    assert (agent_dir / "key-files.txt").read_text() == ""
    assert (agent_dir / "key-environ.txt").read_text().strip() == "0"
    assert int((agent_dir / "environ-control.txt").read_text()) > 0  # environs were readable
    assert files_holding(trial_dir, KEY) == []


def test_a_model_that_refuses_is_the_trials_exception_and_the_trial_is_verified(
    tmp_path: Path, docker_runtime: DockerRuntime
) -> None:
    """Harbor's rule: what the agent raised (here its model's 401, which quotes the key
    it got, as careless servers do) is the trial's exception, counted as an error, never
    a plain 0 with ``exception_info: null``; the trial is still verified, and the key
    is nowhere in what the trial keeps."""
    from tests.fake_chat import FakeChat

    task = make_task(tmp_path / "tasks", "refused", test=TEST_SH, instruction=INSTRUCTION)
    app = terminus_app(tmp_path, task)
    with FakeChat() as chat, serve(app) as url:
        chat.reset("unauthorized")
        result = rollout(url, chat, INSTRUCTION, agent_timeout_sec=60)  # type: ignore[arg-type]
    (trial_dir,) = (tmp_path / "trials").iterdir()
    result_json = json.loads((trial_dir / "result.json").read_text())
    info = result_json["exception_info"]
    assert info is not None and "Authentication" in info["exception_type"], info
    assert result_json["verifier_result"]["rewards"] == {"reward": 0.0}  # verified anyway
    assert result.status.value == "success" and result.sample.reward == 0.0
    assert result.sample.extra_fields["agent_error"]["exception_type"] == info["exception_type"]
    assert files_holding(trial_dir, KEY) == []
