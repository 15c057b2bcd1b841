"""The real ``osmosis eval run`` (osmosis-ai[eval] 0.3.8) against a harbor-exec entrypoint.

A throwaway Osmosis workspace (a git repository with ``rollouts/``, ``configs/eval/``,
``configs/training/``, ``data/``) holds a rollout whose ``main.py`` is docs/server.md's
entrypoint verbatim. ``osmosis eval run --dataset-file`` (no login, no tunnel, no upload)
syncs the rollout with ``uv``, starts the entrypoint through ``uv run --no-sync --project``
with ``_OSMOSIS_ROLLOUT_PORT`` / ``_OSMOSIS_ROLLOUT_ARTIFACT_ROOT``, drives it with its own
rollout client, and routes the workflow's model calls through its LiteLLM bridge to the
fake model on 127.0.0.1.

Hermetic: the rollout project declares no dependencies, and ``UV_PROJECT_ENVIRONMENT``
points ``uv`` at a fresh venv that sees this checkout's ``.venv`` through a ``.pth``
file (``uv sync`` is exact: pointed at ``.venv`` itself it would uninstall the dev
tools). ``UV_OFFLINE`` keeps ``uv`` off the network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.fake_chat import FakeChat

if sys.version_info < (3, 12):  # osmosis-ai 0.3.8 requires Python >= 3.12
    pytest.skip("osmosis-ai 0.3.8 is installed on Python >= 3.12 only", allow_module_level=True)

SERVER_DOC = Path(__file__).resolve().parent.parent / "docs" / "server.md"
VENV_BIN = Path(sys.executable).parent
OSMOSIS = VENV_BIN / "osmosis"

# docs/server.md's entrypoint ("With `osmosis eval run`"), verbatim.
README_ENTRYPOINT = """\
# rollouts/my_rollout/main.py
from harbor_exec.backends.local import LocalBackend
from harbor_exec.server import create_rollout_server, serve_app

from my_rollout.workflow import Answer, ExactMatch

app = create_rollout_server(backend=LocalBackend(workflow=Answer, grader=ExactMatch))

if __name__ == "__main__":
    serve_app(app)  # 127.0.0.1:$_OSMOSIS_ROLLOUT_PORT (8000 without it)
"""

WORKFLOW = '''\
"""Ask the model (through the rollout's chat endpoint); reward an exact match."""

from __future__ import annotations

import httpx

from harbor_exec.authoring import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    Grader,
    GraderContext,
    get_rollout_context,
)


class Answer(AgentWorkflow[AgentWorkflowConfig]):
    async def run(self, ctx: AgentWorkflowContext[AgentWorkflowConfig]) -> AgentWorkflowOutput:
        rollout = get_rollout_context()
        assert rollout is not None and rollout.chat_completions_url
        messages = [dict(m) for m in ctx.prompt]
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(
                rollout.chat_completions_url.rstrip("/") + "/chat/completions",
                json={"model": "any", "messages": messages},
                headers={"Authorization": f"Bearer {rollout.api_key}"},
            )
            response.raise_for_status()
        reply = response.json()["choices"][0]["message"]["content"]
        return AgentWorkflowOutput(messages=[*messages, {"role": "assistant", "content": reply}])


class ExactMatch(Grader):
    async def grade(self, ctx: GraderContext) -> None:
        assert ctx.sample is not None
        answer = str(ctx.sample.messages[-1]["content"]).strip()
        ctx.set_reward(1.0 if answer == (ctx.label or "").strip() else 0.0)
'''

# (user_prompt, ground_truth); the fake model answers the arithmetic correctly, so the
# row with a wrong label earns 0.
ROWS = [
    ("What is 2+2?", "4"),
    ("What is 3*7?", "21"),
    ("What is 10-4?", "6"),
    ("What is 9+9?", "17"),
    ("What is 6*6?", "36"),
]
EXPECTED_REWARDS = [1.0, 1.0, 1.0, 0.0, 1.0]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _workspace(root: Path) -> Path:
    ws = root / "workspace"
    for sub in ("rollouts", "configs/training", "configs/eval", "data"):
        (ws / sub).mkdir(parents=True)
    rollout = ws / "rollouts" / "my_rollout"
    _write(rollout / "main.py", README_ENTRYPOINT)
    _write(rollout / "my_rollout" / "__init__.py", "")
    _write(rollout / "my_rollout" / "workflow.py", WORKFLOW)
    # No dependencies and no build system (a virtual uv project): the environment
    # below already has harbor-exec.
    _write(
        rollout / "pyproject.toml",
        '[project]\nname = "my-rollout"\nversion = "0.1.0"\nrequires-python = ">=3.11"\n'
        "dependencies = []\n",
    )
    _write(
        ws / "configs" / "eval" / "my_rollout.toml",
        "[experiment]\n"
        'rollout = "my_rollout"\n'
        'entrypoint = "main.py"\n'
        'model_path = "openai/fake-model"\n'
        'dataset = "arith"\n'
        "\n[evaluation]\nbatch_size = 2\nagent_workflow_timeout_s = 60\ngrader_timeout_s = 30\n"
        "\n[secrets]\nrequired = []\n",
    )
    _write(
        ws / "data" / "arith.jsonl",
        "".join(json.dumps({"user_prompt": q, "ground_truth": a}) + "\n" for q, a in ROWS),
    )
    subprocess.run(["git", "init", "-q", str(ws)], check=True, timeout=30)
    return ws


def _rollout_environment(root: Path) -> Path:
    """A fresh venv that imports this checkout's packages (harbor-exec, osmosis-ai)."""
    env_dir = root / "rollout-env"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=60
    )
    site_packages = Path(
        subprocess.run(
            [
                str(env_dir / "bin" / "python"),
                "-c",
                "import sysconfig; print(sysconfig.get_path('purelib'))",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    )
    dev_site = sysconfig.get_path("purelib")
    (site_packages / "_harbor_exec_dev.pth").write_text(
        f"import site; site.addsitedir({dev_site!r})\n"
    )
    return env_dir


@pytest.mark.slow
@pytest.mark.long(8)
def test_osmosis_eval_run_keeps_rows_rewards_and_trajectories(tmp_path: Path) -> None:
    assert README_ENTRYPOINT in SERVER_DOC.read_text(), "docs/server.md's entrypoint changed"
    assert OSMOSIS.is_file(), f"osmosis CLI missing at {OSMOSIS} (pip install -e '.[dev]')"
    assert (VENV_BIN / "uv").is_file(), f"uv missing at {VENV_BIN} (pip install -e '.[dev]')"
    ws = _workspace(tmp_path)
    rollout_env = _rollout_environment(tmp_path)
    out = tmp_path / "evals"
    env = {
        k: v
        for k, v in os.environ.items()
        # Our own settings win over osmosis's; a stray one would hide the fallback.
        if k not in {"VIRTUAL_ENV", "HARBOR_EXEC_ARTIFACT_ROOT", "PYTHONPATH"}
        and not k.startswith(("UV_", "OPENAI_", "OSMOSIS_", "_OSMOSIS_"))
    }
    home = tmp_path / "home"
    home.mkdir()
    with FakeChat() as chat:
        env.update(
            {
                "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
                "HOME": str(home),
                "XDG_CONFIG_HOME": str(home / ".config"),
                "XDG_CACHE_HOME": str(home / ".cache"),
                "XDG_STATE_HOME": str(home / ".local" / "state"),
                "UV_PROJECT_ENVIRONMENT": str(rollout_env),
                "UV_OFFLINE": "1",
                "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
                "UV_PYTHON_DOWNLOADS": "never",
                "UV_NO_CONFIG": "1",
                # litellm's openai provider: a non-OpenAI base URL means plain chat completions.
                "OPENAI_API_BASE": f"{chat.base_url}/v1",
                "OPENAI_API_KEY": "sk-fake-model-key",
                # litellm would fetch its model price map from GitHub (and retry for seconds).
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            }
        )
        started = time.monotonic()
        proc = subprocess.run(
            [
                str(OSMOSIS),
                "--json",
                "eval",
                "run",
                "configs/eval/my_rollout.toml",
                "--dataset-file",
                "data/arith.jsonl",
                "--name",
                "harbor-exec-eval",
                "--output",
                str(out),
                "--yes",
            ],
            cwd=ws,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        elapsed = time.monotonic() - started
        model_requests = len(chat.requests)
    report = (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    )
    assert proc.returncode == 0, report
    result = json.loads(proc.stdout)
    assert result["status"] == "success", report
    resource = result["resource"]
    assert (resource["total_work_items"], resource["succeeded"], resource["failed"]) == (5, 5, 0)
    assert resource["metrics"]["passed"] == 4 and resource["metrics"]["pass_rate"] == 0.8

    run_dir = out / "harbor-exec-eval"
    index = [json.loads(line) for line in (run_dir / "index.jsonl").read_text().splitlines()]
    # Every dataset row came back once, with the reward the grader gave it.
    assert [row["row_index"] for row in index] == list(range(len(ROWS)))
    assert [row["status"] for row in index] == ["success"] * len(ROWS)
    assert [row["reward"] for row in index] == EXPECTED_REWARDS
    # ...and with its trajectory, written by harbor-exec under osmosis's artifact root
    # (_OSMOSIS_ROLLOUT_ARTIFACT_ROOT), where osmosis found it.
    assert all(row.get("trajectory_filename") == "trajectory.json" for row in index), index
    for row, (question, _label) in zip(index, ROWS, strict=True):
        trajectory = json.loads(
            (run_dir / "rollout_trials" / row["rollout_id"] / "trajectory.json").read_text()
        )
        assert trajectory["session_id"] == row["rollout_id"]
        messages = [step["message"] for step in trajectory["steps"]]
        assert messages[0] == question and len(messages) == 2, trajectory
        assert (run_dir / "trajectories" / f"row_{row['row_index']}_run_0.json").is_file()
        # Seconds, not the 30 s osmosis waits for a trajectory that never comes.
        assert row["duration_ms"] < 10_000, row
    logs = (run_dir / "logs.txt").read_text()
    assert "no parseable trajectory" not in logs
    assert elapsed < 90, f"osmosis eval run took {elapsed:.1f} s for {len(ROWS)} rows"
    # The workflow's model calls went through osmosis's bridge to the fake model
    # (one preflight call, then one per row), and no key reached the run's files.
    assert model_requests >= len(ROWS) + 1
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert "sk-fake-model-key" not in path.read_text(errors="replace"), path
