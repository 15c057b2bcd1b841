"""opencode (Harbor's own class, unchanged) as a HarborBackend agent: real Docker trials
behind the real HTTP server, a scripted model on 127.0.0.1 (streaming, as opencode
asks), our client.

opencode runs inside the container from its prebuilt read-only layer (its Bun binary
on the runtime's glibc loader; the task image has neither Node nor Python; nothing is
installed or fetched at trial time) and reaches the model through the runtime's
in-container forwarder, on a ``no-network`` task, with its own provider on
``@ai-sdk/openai-compatible``. Every command the model runs sees the rollout's relay
token as the key; the real key (also in this process's environment, where Harbor
would find it) is in no file of the container, no process's environment, and no file
the trial left. The sample's chat is the one the relay saw."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before litellm is imported
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.agents.native.layer import AgentLayer, ensure_agent_layer
from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler.agent_wheels import prepare_agent_layer
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.server.app import create_rollout_server
from tests.fake_chat import ScriptedChat, env_value_sent_back
from tests.server_utils import serve
from tests.task_factory import make_task
from tests.test_native_agents_docker import KEY, files_holding, rollout

INSTRUCTION = "Write the number 42 into /app/answer.txt."
TEST_SH = """
for p in python3 node; do
  if command -v $p >/dev/null 2>&1; then echo present; else echo none; fi > /logs/verifier/$p.txt
done
if [ "$(cat /app/answer.txt 2>/dev/null)" = 42 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
TOML = (
    '[environment]\nnetwork_mode = "no-network"\n'
    "[agent]\ntimeout_sec = 120.0\n[verifier]\ntimeout_sec = 30.0\n"
)
#: The key in two halves: the model's command joins them, so the key itself is never in
#: the chat or a file, and a match can only be a leak.
_KEY_A, _KEY_B = KEY[:16], KEY[16:]
COMMAND = (
    f"env; A={_KEY_A}; B={_KEY_B}; "
    'grep -rlsF "$A$B" / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev'
    " > /logs/agent/key-files.txt; "
    'cat /proc/[0-9]*/environ | grep -caF "$A$B" > /logs/agent/key-environ.txt; '
    "cat /proc/[0-9]*/environ | grep -caF PATH= > /logs/agent/environ-control.txt; "
    "echo 42 > /app/answer.txt"
)


def bash_call(command: str, *, call_id: str) -> dict[str, Any]:
    """An assistant message calling opencode's ``bash`` tool."""
    arguments = {"command": command, "description": "Write the answer"}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "bash", "arguments": json.dumps(arguments)},
            }
        ],
    }


#: The model runs the command (``env`` and the key scan; its output comes back to it),
#: then ends the turn with plain text (opencode stops when no tool is called).
SCRIPT: list[Any] = [bash_call(COMMAND, call_id="call_1"), "The answer is written."]
#: On the musl image (busybox's grep cannot skip /proc): env and the answer only.
MUSL_SCRIPT: list[Any] = [
    bash_call("env; echo 42 > /app/answer.txt", call_id="call_1"),
    "The answer is written.",
]

MUSL_LOADER = Path("/usr/lib/x86_64-linux-musl/libc.so")  # Debian's musl package
STATIC_BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static
STATIC_BASH = Path("/bin/bash-static")  # Debian's bash-static
_APPLETS = ("sh", "env", "cat", "grep", "mkdir", "tee", "ls", "rm", "echo", "test", "[")
#: No glibc at all: musl's loader, a static busybox and a static bash (Harbor's agents
#: run their commands with bash), and neither Node nor Python.
MUSL_DOCKERFILE = (
    "FROM scratch\nCOPY ld-musl /lib/ld-musl-x86_64.so.1\nCOPY busybox /bin/busybox\n"
    + "".join(f"COPY busybox /bin/{applet}\n" for applet in _APPLETS)
    + "COPY bash /bin/bash\n"
    + 'RUN ["/bin/busybox", "mkdir", "-p", "/tmp", "/app"]\n'
    + 'RUN ["/bin/busybox", "chmod", "1777", "/tmp"]\nWORKDIR /app\n'
)
GLIBC_DOCKERFILE = "FROM debian:bookworm-slim\nRUN mkdir -p /app\nWORKDIR /app\n"

# engine_lane: its own tasks and agent layer; its one time bound (30 s) is wide.
pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]


@pytest.fixture(scope="session")
def opencode_layer(docker_runtime: DockerRuntime, base_images: dict[str, str]) -> AgentLayer:
    """opencode's layer, prepared (its binary from the npm registry, host side) and
    installed into its volume once for the session (once per machine)."""
    started = time.monotonic()
    layer = prepare_agent_layer("opencode")
    prepared = time.monotonic()
    _volume, built = ensure_agent_layer(docker_runtime, layer, "debian:bookworm-slim")
    print(
        f"opencode layer: prepare {prepared - started:.1f}s, "
        f"volume {time.monotonic() - prepared:.1f}s (built now: {built})"
    )
    return layer


@pytest.mark.parametrize("image", ["glibc", "musl"])
def test_opencode_solves_a_no_network_task_through_the_in_container_forwarder(
    tmp_path: Path,
    docker_runtime: DockerRuntime,
    opencode_layer: AgentLayer,
    monkeypatch: pytest.MonkeyPatch,
    image: str,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    musl = image == "musl"
    task = make_task(
        tmp_path / "tasks",
        "answer-42",
        test=TEST_SH,
        instruction=INSTRUCTION,
        toml=TOML,
        dockerfile=MUSL_DOCKERFILE if musl else GLIBC_DOCKERFILE,
    )
    if musl:
        for path in (MUSL_LOADER, STATIC_BUSYBOX, STATIC_BASH):
            assert path.is_file(), f"{path} is missing: run scripts/setup.sh"
        environment = task / "environment"
        shutil.copyfile(MUSL_LOADER, environment / "ld-musl")
        shutil.copy(STATIC_BUSYBOX, environment / "busybox")  # executable
        shutil.copy(STATIC_BASH, environment / "bash")
    script = MUSL_SCRIPT if musl else SCRIPT
    backend = HarborBackend(
        tasks_dir=task,
        agent="opencode",
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        agent_setup_timeout_sec=60,
        cleanup_successful_trials=False,
    )
    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")
    started = time.monotonic()
    with ScriptedChat(script) as chat, serve(app) as url:
        result = rollout(url, chat, INSTRUCTION)
    seconds = time.monotonic() - started
    assert result.status.value == "success", result.err_message
    sample = result.sample
    assert sample is not None and sample.reward == 1.0

    # Two streamed calls (no title call), both through the relay with the real key, on
    # chat completions with opencode's own tools.
    assert len(chat.requests) == 2, [r.body.get("messages", [{}])[0] for r in chat.requests]
    for request in chat.requests:
        assert request.path == "/v1/chat/completions"
        assert request.authorization == f"Bearer {KEY}"
        assert request.body["model"] == "osmosis-rollout"
        assert request.body["stream"] is True
        assert "bash" in [t["function"]["name"] for t in request.body["tools"]]
    assert INSTRUCTION in json.dumps(chat.requests[0].body["messages"])
    # What `env` showed the model: the token as the key, the forwarder as the endpoint.
    messages = chat.requests[1].body["messages"]
    observed = json.dumps(messages)
    assert KEY not in observed
    token = env_value_sent_back(messages, "OPENAI_API_KEY")
    assert token and token != KEY
    base = env_value_sent_back(messages, "OPENAI_BASE_URL")
    assert base is not None and base.startswith("http://127.0.0.1:") and base.endswith("/v1")
    assert env_value_sent_back(messages, "OPENCODE_DISABLE_AUTOUPDATE") == "true"

    # The sample's chat is the relay's: the last call's messages, then the streamed
    # answer assembled (the token redacted like every secret the trial knows).
    last = json.loads(json.dumps(messages).replace(token, "[REDACTED]"))
    assert sample.messages[: len(last)] == last
    assert len(sample.messages) == len(last) + 1
    assert sample.messages[-1] == {"role": "assistant", "content": "The answer is written."}
    extra = sample.extra_fields or {}
    assert extra["chat_source"] == "relay"
    assert "bash" in [t["function"]["name"] for t in extra["tools"]]
    # Usage from the relay's own accounting (streamed usage chunks).
    assert sample.metrics["llm_requests"] == 2
    assert sample.metrics["llm_prompt_tokens"] == 2 * ScriptedChat.PROMPT_TOKENS
    assert sample.metrics["llm_completion_tokens"] == 2 * ScriptedChat.COMPLETION_TOKENS

    (trial_dir,) = (tmp_path / "trials").iterdir()
    verifier = trial_dir / "verifier"
    assert (verifier / "python3.txt").read_text().strip() == "none"
    assert (verifier / "node.txt").read_text().strip() == "none"
    agent_dir = trial_dir / "agent"
    if not musl:
        # The model, as root, found the key in no file and no process environment of
        # its container (while opencode and the forwarder ran); environments were readable.
        assert (agent_dir / "key-files.txt").read_text() == ""
        assert (agent_dir / "key-environ.txt").read_text().strip() == "0"
        assert int((agent_dir / "environ-control.txt").read_text()) > 0
    result_json = json.loads((trial_dir / "result.json").read_text())
    assert result_json["agent_info"]["name"] == "opencode"
    assert result_json["verifier_result"]["rewards"] == {"reward": 1.0}
    # opencode's own output came back; Harbor's ATIF conversion of it is kept, untrusted.
    assert (agent_dir / "opencode.txt").is_file()
    trajectory = json.loads((agent_dir / "trajectory.json").read_text())
    assert trajectory["agent"]["name"] == "opencode"
    assert trajectory["agent"]["extra"]["harbor_exec"]["trusted"] is False
    assert files_holding(trial_dir, KEY) == []
    assert files_holding(trial_dir, token) == []
    assert files_holding(tmp_path / "server-artifacts", KEY) == []
    assert files_holding(tmp_path / "artifacts", KEY) == []
    print(f"opencode rollout ({image}): {seconds:.1f}s")


def test_harbor_exec_run_evaluates_a_dataset_with_opencode(
    tmp_path: Path, opencode_layer: AgentLayer
) -> None:
    """``harbor-exec run --agent opencode``: the real CLI in a subprocess prepares (finds)
    the layer, each trial's relay gets the key from the named variable."""
    from tests.test_run_native_docker import KEY as RUN_KEY
    from tests.test_run_native_docker import KEY_ENV, files_holding, run_cli

    dataset = tmp_path / "answers"
    for name in ("answer-a", "answer-b"):
        make_task(
            dataset,
            name,
            test=TEST_SH,
            instruction=INSTRUCTION,
            toml=TOML,
            dockerfile=GLIBC_DOCKERFILE,
        )
    script = [bash_call("echo 42 > /app/answer.txt", call_id="c1"), "Done."]
    with ScriptedChat(script, per_conversation=True) as chat:
        args = [str(dataset), "--agent", "opencode", "--model-name", "openai/scripted"]
        args += ["--api-base", chat.base_url, "--api-key-env", KEY_ENV, "-n", "2"]
        args += ["--jobs-dir", str(tmp_path / "jobs"), "--job-name", "j"]
        done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "opencode__scripted__answers" in done.stdout and "mean 1.000" in done.stdout
    assert len(chat.requests) == 4  # two calls per trial, no title call
    assert {r.authorization for r in chat.requests} == {f"Bearer {RUN_KEY}"}
    assert {r.body["model"] for r in chat.requests} == {"scripted"}
    job = json.loads((tmp_path / "jobs" / "j" / "result.json").read_text())
    evals = job["stats"]["evals"]["opencode__scripted__answers"]
    assert evals["n_trials"] == 2 and evals["n_errors"] == 0
    assert job["stats"]["n_input_tokens"] == 4 * ScriptedChat.PROMPT_TOKENS
    assert files_holding(tmp_path / "jobs", RUN_KEY) == []


def test_without_its_layer_opencode_fails_setup_fast_naming_it(
    tmp_path: Path, docker_runtime: DockerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend started where the layer could not be had: no npm, curl or nvm is
    tried at trial time; setup fails at once naming the layer and the prewarm command."""
    import harbor_exec.bundler.agent_wheels as agent_wheels
    from harbor_exec.agents.native.layer import AgentLayerError

    def offline(name: str) -> AgentLayer:
        raise AgentLayerError("the npm registry is unreachable")

    monkeypatch.setattr(agent_wheels, "prepare_agent_layer", offline)
    task = make_task(
        tmp_path / "tasks", "no-layer", test=TEST_SH, instruction=INSTRUCTION, toml=TOML
    )
    backend = HarborBackend(
        tasks_dir=task,
        agent="opencode",
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        cleanup_successful_trials=False,
    )
    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")
    with ScriptedChat(SCRIPT) as chat, serve(app) as url:
        started = time.monotonic()
        result = rollout(url, chat, INSTRUCTION)
        seconds = time.monotonic() - started
    assert result.status.value == "failure"
    assert "/opt/harbor-exec-agent" in (result.err_message or "")
    assert "harbor-exec prewarm --agent opencode" in (result.err_message or "")
    assert chat.requests == []
    assert seconds < 30
