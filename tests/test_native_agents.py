"""Harbor's own agents as HarborBackend agents, without an engine: the names and
options refused at construction, the model route a rollout may ask for, what the
planner hands a native trial (the relay's token as its key, the real key scrubbed),
and the per-turn token ids lined up with the chat."""

from __future__ import annotations

from pathlib import Path

import pytest

from harbor_exec.agents.native.agent import NativeAgent, NativeAgentSpec
from harbor_exec.agents.native.config import AGENT_NAMES, check_model_name
from harbor_exec.authoring import RolloutContext
from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.backends.harbor.resolver import RolloutRejected
from harbor_exec.cli.helpers import parse_agent_kwargs
from harbor_exec.executors.local import LocalExecutor
from harbor_exec.executors.spec import trial_request
from harbor_exec.protocol import ExecutionRequest
from tests.bundle_utils import (  # noqa: F401  (fixtures are used by name)
    GRADER_MODULE,
    bundle_cache,
    flit_pyproject,
    write_project,
)
from tests.fake_runtime import FakeRuntime
from tests.task_factory import make_task

CHAT_URL = "http://127.0.0.1:9/v1"


def backend(tmp_path: Path, **options: object) -> HarborBackend:
    task = make_task(tmp_path / "tasks", "native-task")
    return HarborBackend(
        tasks_dir=task,
        executor=LocalExecutor(FakeRuntime()),
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        **options,  # type: ignore[arg-type]
    )


def test_a_bad_agent_name_fails_at_construction_listing_the_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as caught:
        backend(tmp_path, agent="terminus-3")
    message = str(caught.value)
    assert "'terminus-3'" in message
    for name in AGENT_NAMES:
        assert name in message
    assert "module:attr" in message


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"model_name": "anthropic/claude"}, "model_name must be an 'openai/<id>'"),
        ({"model_name": "bedrock/x"}, "model_name must be an 'openai/<id>'"),
        ({"native_agent_kwargs": {"api_base": "http://x"}}, "may not set api_base"),
        ({"native_agent_kwargs": {"llm_kwargs": {"api_key": "k"}}}, "may not set api_key"),
        ({"native_agent_kwargs": {"extra_env": {"A": "1"}}}, "may not set extra_env"),
        ({"agent_setup_timeout_sec": 0}, "agent_setup_timeout_sec must be positive"),
    ],
)
def test_native_options_are_checked_at_construction(
    tmp_path: Path, options: dict[str, object], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        backend(tmp_path, agent="terminus-2", **options)


def test_native_options_need_a_native_agent(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="for Harbor's own agents"):
        backend(tmp_path, agent="oracle", native_agent_kwargs={"max_turns": 3})


@pytest.mark.parametrize("model", ["openai/osmosis-rollout", "openai/Qwen/Qwen3-8B", "openai/m:1"])
def test_openai_routes_are_accepted(model: str) -> None:
    assert check_model_name(model) == model


@pytest.mark.parametrize(
    "model", ["osmosis-rollout", "openai/", "replicate/x", "bedrock/anthropic.c", 3, "openai/ x"]
)
def test_other_routes_are_refused(model: object) -> None:
    with pytest.raises(ValueError, match="openai/<id>"):
        check_model_name(model, field_name="metadata.harbor_model")


def plan(tmp_path: Path, metadata: dict[str, object] | None = None, **options: object) -> object:
    harbor = backend(tmp_path, agent="terminus-2", **options)
    harbor.start()
    assert harbor.planner is not None
    prompt = [{"role": "user", "content": "Write 42 to /app/answer.txt"}]
    request = ExecutionRequest(id="r-1", prompt=prompt, metadata=metadata)
    resolved = harbor.resolver.resolve(request)
    context = RolloutContext(chat_completions_url=CHAT_URL, api_key="sk-REAL", rollout_id="r-1")
    return harbor.planner.plan(request, resolved, context)


def test_harbor_model_overrides_the_model_and_only_an_openai_route(tmp_path: Path) -> None:
    planned = plan(tmp_path / "a", {"harbor_model": "openai/other-model"})
    agent = planned.trial.agent  # type: ignore[attr-defined]
    assert isinstance(agent, NativeAgentSpec)
    assert agent.model_name == "openai/other-model"
    assert agent.instruction == "Write 42 to /app/answer.txt"  # template mode: the prompt
    with pytest.raises(RolloutRejected, match=r"metadata\.harbor_model must be an 'openai/<id>'"):
        plan(tmp_path / "b", {"harbor_model": "anthropic/claude-sonnet"})


def test_a_native_trial_gets_the_token_never_the_key(tmp_path: Path) -> None:
    planned = plan(
        tmp_path,
        native_agent_kwargs={"max_turns": 5, "collect_rollout_details": True},
        agent_setup_timeout_sec=30,
    )
    secrets = planned.secrets  # type: ignore[attr-defined]
    assert secrets.model.api_key == "sk-REAL"
    assert set(secrets.scrub) == {"sk-REAL", secrets.model.token}
    request = trial_request(planned.trial, secrets, relay_socket="/tmp/hx-relay/r-x/relay.sock")  # type: ignore[attr-defined]
    agent = request.agent
    assert isinstance(agent, NativeAgent)
    assert agent.token == secrets.model.token and "sk-REAL" not in repr(agent)
    assert agent.relay_path == "/v1" and agent.relay_socket == "/tmp/hx-relay/r-x/relay.sock"
    assert agent.setup_timeout_sec == 30
    assert agent.kwargs == {"max_turns": 5, "collect_rollout_details": True}
    assert agent.files(request.spec.task) == []  # nothing of the agent's goes into the container
    assert request.mounts == ()  # the relay is dialled from the host, never mounted


def test_agent_kwargs_parse_json_values() -> None:
    parsed = parse_agent_kwargs(["max_turns=30", "collect_rollout_details=true", "parser_name=xml"])
    assert parsed == {"max_turns": 30, "collect_rollout_details": True, "parser_name": "xml"}


def test_token_turns_line_up_with_the_assistant_messages() -> None:
    from harbor_exec.agents.native.environment import token_turns

    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    details = [
        {
            "prompt_token_ids": [[1], [1, 2, 3]],
            "completion_token_ids": [[2], [4]],
            "logprobs": [[-0.1], [-0.2]],
        }
    ]
    turns = token_turns(messages, details)
    assert turns == [
        {
            "message_index": 1,
            "prompt_token_ids": [1],
            "completion_token_ids": [2],
            "logprobs": [-0.1],
        },
        {
            "message_index": 3,
            "prompt_token_ids": [1, 2, 3],
            "completion_token_ids": [4],
            "logprobs": [-0.2],
        },
    ]
    assert token_turns(messages, None) is None
    assert token_turns(messages[:2], details) is None  # they do not line up


def test_without_the_runtimes_tmux_setup_fails_fast_and_installs_nothing(tmp_path: Path) -> None:
    """FakeRuntime's container has no runtime tmux (``tmux -V`` prints nothing): setup
    stops at once with a message naming it; no apt, curl or other command ran."""
    import asyncio

    import httpx

    from harbor_exec.client import RolloutClient
    from harbor_exec.server.app import create_rollout_server
    from tests.server_utils import serve

    runtime = FakeRuntime()
    task = make_task(tmp_path / "tasks", "no-tmux")
    harbor = HarborBackend(
        tasks_dir=task,
        agent="terminus-2",
        executor=LocalExecutor(runtime),
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
    )
    app = create_rollout_server(backend=harbor, artifact_root=tmp_path / "server-artifacts")

    async def one(url: str) -> object:
        async with httpx.AsyncClient(timeout=60) as http:
            client = RolloutClient(url=url, http_client=http)
            return await client.run_rollout(
                initial_messages=[{"role": "user", "content": "Write 42"}],
                chat_completions_url=CHAT_URL,
                rollout_id="no-tmux-1",
                llm_api_key="sk-REAL",
            )

    with serve(app) as url:
        result = asyncio.run(one(url))
    assert result.status.value == "failure"  # type: ignore[attr-defined]
    assert result.err_category.value == "agent_error"  # type: ignore[attr-defined]
    message = result.err_message  # type: ignore[attr-defined]
    assert "tmux from the read-only runtime" in message and "images bootstrap" in message
    scripts = [e.script for e in runtime.execs]
    assert scripts == ["-V"]  # only the probe of the runtime's tmux


def test_serve_refuses_a_bad_agent_name_listing_the_names(tmp_path: Path) -> None:
    import typer

    from harbor_exec.cli.serve import ServeOptions, build_harbor_backend

    task = make_task(tmp_path / "tasks", "cli-task")
    options = ServeOptions(tasks_dir=task, agent="terminus2", model_name="openai/x")
    with pytest.raises(typer.BadParameter, match="use one of oracle, terminus-2"):
        build_harbor_backend(options)
    options = ServeOptions(tasks_dir=task, agent="terminus-2", model_name="gpt-4o")
    with pytest.raises(typer.BadParameter, match="model_name must be an 'openai/<id>'"):
        build_harbor_backend(options)
    with pytest.raises(typer.BadParameter, match="expected key=value"):
        parse_agent_kwargs(["max_turns"])


def test_a_workflow_config_is_refused_with_a_native_agent(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="workflow_config is a workflow's"):
        backend(tmp_path, agent="terminus-2", workflow_config="pkg.mod:config")


@pytest.mark.slow
def test_a_native_agent_with_a_grader_gets_a_grader_only_bundle(
    tmp_path: Path,
    bundle_cache: Path,  # noqa: F811  (the fixture)
) -> None:
    """Nothing of the bundle enters the agent's container; the grader's part goes to the
    verifier of a task without tests, with its dependency environment."""
    from harbor_exec.bundler import build_bundle

    project = write_project(
        tmp_path / "judge-project",
        {
            "pyproject.toml": flit_pyproject("judge"),
            "judge/__init__.py": "",
            "judge/g.py": GRADER_MODULE,
        },
    )
    bundle = build_bundle(project, workflow=None, grader="judge.g:Judge", cache_dir=bundle_cache)
    assert bundle.manifest.workflow is None and bundle.manifest.grader == "judge.g:Judge"
    task = make_task(tmp_path / "tasks", "no-tests")
    for path in (task / "tests").iterdir():
        path.unlink()
    (task / "tests").rmdir()
    harbor = HarborBackend(
        tasks_dir=task,
        agent="terminus-2",
        grader="judge.g:Judge",
        bundle=bundle,
        executor=LocalExecutor(FakeRuntime()),
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
    )
    harbor.start()
    assert harbor.planner is not None and harbor.agent_name == "terminus-2"
    request = ExecutionRequest(id="r-1", prompt=[{"role": "user", "content": "x"}])
    context = RolloutContext(chat_completions_url=CHAT_URL, api_key="sk-REAL", rollout_id="r-1")
    planned = harbor.planner.plan(request, harbor.resolver.resolve(request), context)
    assert isinstance(planned.trial.agent, NativeAgentSpec)
    assert planned.trial.bundle is None and planned.content.bundle_files == []
    assert planned.trial.verifier == "grader"
    assert planned.trial.grader_bundle is not None and planned.content.grader_files
    assert planned.trial.deps is not None
    assert planned.secrets.agent_input is None  # the agent reads no rollout.json
