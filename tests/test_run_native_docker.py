"""``harbor-exec run`` with terminus-2 (Harbor's own class, unchanged) over a 2-task
dataset: the real CLI in a subprocess, real Docker trials, a scripted model on
127.0.0.1 behind each trial's own relay, the key given through an environment
variable. Checks Harbor's job layout (job and trial ``result.json``, ``agent_info``,
``agent_result`` from the relay, stats), that the key is on no file of the job, and
that running the job again resumes it (nothing runs twice) unless the agent changed."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from tests import cli_utils
from tests.fake_chat import ScriptedChat, terminus_reply
from tests.task_factory import make_task

KEY = "sk-real-" + uuid.uuid4().hex
KEY_ENV = "HX_TEST_RUN_KEY"
INSTRUCTION = "Write the number 42 into /app/answer.txt."
TEST_SH = (
    'if [ "$(cat /app/answer.txt 2>/dev/null)" = 42 ]; then echo 1 > /logs/verifier/reward.txt; '
    "else echo 0 > /logs/verifier/reward.txt; fi\n"
)
#: Keystrokes that write the answer, then task_complete twice (terminus asks to confirm).
SCRIPT = [
    terminus_reply(keystrokes=["echo 42 > /app/answer.txt\n"]),
    terminus_reply(task_complete=True),
    terminus_reply(task_complete=True),
]
TURNS = len(SCRIPT)
CACHED = 3
TOML = "[agent]\ntimeout_sec = 60.0\n[verifier]\ntimeout_sec = 30.0\n"

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return cli_utils.run_cli("run", *args, cwd=cwd, env={KEY_ENV: KEY}, timeout=300)


def files_holding(root: Path, needle: str) -> list[str]:
    return [
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and needle.encode() in p.read_bytes()
    ]


def test_run_evaluates_a_dataset_with_terminus_2_in_harbors_job_layout(tmp_path: Path) -> None:
    dataset = tmp_path / "answers"
    for name in ("answer-a", "answer-b"):
        make_task(dataset, name, test=TEST_SH, instruction=INSTRUCTION, toml=TOML)
    jobs = tmp_path / "jobs"
    with ScriptedChat(SCRIPT, cached_tokens=CACHED, per_conversation=True) as chat:
        args = [str(dataset), "--agent", "terminus-2", "--model-name", "openai/scripted"]
        args += ["--api-base", chat.base_url, "--api-key-env", KEY_ENV, "-n", "2"]
        args += ["--agent-kwarg", "max_turns=6", "--jobs-dir", str(jobs), "--job-name", "j"]
        first = run_cli(*args, cwd=tmp_path)
        assert first.returncode == 0, first.stdout + first.stderr
        assert len(chat.requests) == 2 * TURNS
        # The upstream got the real key from each trial's relay; the agent never had it.
        assert {r.authorization for r in chat.requests} == {f"Bearer {KEY}"}
        assert {r.body["model"] for r in chat.requests} == {"scripted"}

        # Again: the job resumes, both trials are kept, the model is not asked again.
        again = run_cli(*args, cwd=tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "kept 2 finished trial(s)" in again.stdout
        assert len(chat.requests) == 2 * TURNS
        # Another model is another job: refused, saying what changed.
        other = [a if a != "openai/scripted" else "openai/other" for a in args]
        changed = run_cli(*other, cwd=tmp_path)
        assert changed.returncode == 2
        assert "the agent changed" in changed.stdout and "openai/other" in changed.stdout
    assert "terminus-2__scripted__answers" in first.stdout and "mean 1.000" in first.stdout

    job_dir = jobs / "j"
    config = json.loads((job_dir / "config.json").read_text())
    assert config["agents"] == [
        {
            "name": "terminus-2",
            "model_name": "openai/scripted",
            "kwargs": {"max_turns": 6},
            "model_api_key_name": KEY_ENV,
        }
    ]
    job = json.loads((job_dir / "result.json").read_text())
    assert job["n_total_trials"] == 2
    stats = job["stats"]
    evals = stats["evals"]["terminus-2__scripted__answers"]  # Harbor's key: agent, model, dataset
    assert evals["n_trials"] == 2 and evals["n_errors"] == 0
    assert evals["metrics"] == [{"mean": 1.0}]
    assert evals["pass_at_k"] == {}  # k=1 only: Harbor reports pass@k from k=2
    assert stats["n_input_tokens"] == 2 * TURNS * ScriptedChat.PROMPT_TOKENS
    assert stats["n_cache_tokens"] == 2 * TURNS * CACHED
    assert stats["n_output_tokens"] == 2 * TURNS * ScriptedChat.COMPLETION_TOKENS
    assert stats["cost_usd"] is None  # the upstream reported no cost: nothing is priced

    trial_dirs = sorted(p for p in job_dir.iterdir() if p.is_dir())
    assert [p.name.split("__")[0] for p in trial_dirs] == ["answer-a", "answer-b"]
    for trial_dir in trial_dirs:
        result = json.loads((trial_dir / "result.json").read_text())
        assert result["exception_info"] is None
        assert result["verifier_result"]["rewards"] == {"reward": 1.0}
        assert result["source"] == "answers"
        info = result["agent_info"]
        assert info["name"] == "terminus-2" and info["version"].startswith("harbor-")
        assert info["model_info"] == {"name": "scripted", "provider": "openai"}
        usage = result["agent_result"]  # the relay's counts, the agent's own beside them
        assert usage["n_input_tokens"] == TURNS * ScriptedChat.PROMPT_TOKENS
        assert usage["n_cache_tokens"] == TURNS * CACHED
        assert usage["n_output_tokens"] == TURNS * ScriptedChat.COMPLETION_TOKENS
        assert usage["metadata"]["usage_source"] == "relay"
        assert usage["metadata"]["agent_usage"]["input_tokens"] == usage["n_input_tokens"]
        assert "usage_mismatch" not in usage["metadata"]
        trial_config = json.loads((trial_dir / "config.json").read_text())
        assert trial_config["agent"]["name"] == "terminus-2"
        assert trial_config["job_id"] == job["id"]
        trajectory = json.loads((trial_dir / "agent" / "trajectory.json").read_text())
        assert trajectory["agent"]["name"] == "terminus-2"
    # The real key is on no file of the job (nor in what the CLI printed).
    assert files_holding(job_dir, KEY) == []
    assert KEY not in first.stdout + first.stderr + again.stdout + changed.stdout
