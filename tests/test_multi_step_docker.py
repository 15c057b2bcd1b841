"""Multi-step tasks on a real Docker engine, and beside Harbor 0.26's own ``harbor run``.

What ``test_multi_step.py`` shows over the fake runtime, here with real containers:
the oracle runs each step's solution in one container, each step's tests see what
earlier steps left, a failed ``min_reward`` gate stops later steps, per-step agent
timeouts, ``workdir/`` + ``setup.sh``, and a later step's agent cannot change an
earlier step's recorded reward.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler import Bundle
from harbor_exec.client import RolloutClient
from harbor_exec.errors import policy_for
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.server.app import create_rollout_server
from tests.bundle_utils import EXAMPLE_REFS, bundle_cache, example_bundle
from tests.fake_chat import FakeChat
from tests.server_utils import serve
from tests.task_factory import make_multi_step_task
from tests.test_multi_step import step_rewards
from tests.trial_utils import run_task

# engine_lane: its own tasks and images, no engine-wide counts, no timing bounds.
pytestmark = [
    pytest.mark.docker,
    pytest.mark.engine_lane("b"),
    pytest.mark.usefixtures("base_images"),
]

__all__ = ["bundle_cache", "example_bundle"]  # the session fixtures, used below

ROOT = Path(__file__).resolve().parents[1]
HARBOR = ROOT / ".venv-harbor" / "bin" / "harbor"
DOCKERFILE = "FROM debian:bookworm-slim\nRUN mkdir -p /app\nWORKDIR /app\n"


def three_step_task(root: Path, strategy: str | None) -> Path:
    """Three steps, state carried in /app; the oracle passes each (the last earns 0.5)."""
    toml = f'multi_step_reward_strategy = "{strategy}"\n' if strategy else ""
    task = make_multi_step_task(
        root,
        f"three-{strategy or 'default'}",
        {
            "make": (
                "echo one > /app/one.txt",
                "[ -f /app/one.txt ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt",
            ),
            "extend": (
                "cat /app/one.txt > /app/two.txt; echo two >> /app/two.txt",
                """
                ok=1
                [ "$(cat /app/two.txt)" = "$(printf 'one\\ntwo')" ] || ok=0
                [ -f /app/setup-ran ] || ok=0      # its workdir's setup.sh ran first
                [ -f /app/seed.txt ] || ok=0       # and its workdir was copied in
                [ -e /tests/only-make ] && ok=0    # step make's tests are gone
                [ -f /tests/shared.txt ] || ok=0   # the task's shared tests/ are there
                [ -e /logs/agent/oracle.txt ] || ok=0
                echo $ok > /logs/verifier/reward.txt
                """,
            ),
            "finish": (
                "echo done > /app/done",
                'echo \'{"reward": 0.5, "style": 1}\' > /logs/verifier/reward.json',
            ),
        },
        toml=toml,
        dockerfile=DOCKERFILE,
    )
    (task / "tests").mkdir()
    (task / "tests" / "shared.txt").write_text("shared\n")
    (task / "steps" / "make" / "tests" / "only-make").write_text("x\n")
    workdir = task / "steps" / "extend" / "workdir"
    workdir.mkdir()
    (workdir / "seed.txt").write_text("seed\n")
    (workdir / "setup.sh").write_text("touch /app/setup-ran\n")
    return task


def gated_task(root: Path) -> Path:
    """Step one's agent times out (its own 2 s limit) and earns 0 under a gate of 1."""
    return make_multi_step_task(
        root,
        "gated",
        {
            "slow": (
                "sleep 60; echo late > /app/slow",
                "[ -f /app/slow ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt",
            ),
            "never": ("echo ran > /app/never", "echo 1 > /logs/verifier/reward.txt"),
        },
        step_tables={"slow": "min_reward = 1.0\n[steps.agent]\ntimeout_sec = 2\n"},
        dockerfile=DOCKERFILE,
    )


def separate_task(root: Path) -> Path:
    """Two steps verified in fresh containers: each sees the step's artifacts, not
    the agent's /app; the agent's container (and its /app) lives on into step two."""
    return make_multi_step_task(
        root,
        "separate",
        {
            "first": (
                "echo a > /app/state; echo a > /logs/artifacts/a.txt",
                "[ -f /logs/artifacts/a.txt ] && [ ! -e /app/state ] && r=1 || r=0; echo $r > /logs/verifier/reward.txt",
            ),
            "second": (
                "[ -f /app/state ] && echo b > /logs/artifacts/b.txt",
                "[ -f /logs/artifacts/b.txt ] && [ ! -e /app/state ] && r=1 || r=0; echo $r > /logs/verifier/reward.txt",
            ),
        },
        toml='[verifier]\nenvironment_mode = "separate"\n',
        dockerfile=DOCKERFILE,
    )


def step_summary(steps: list[dict[str, Any]] | None) -> list[tuple[Any, ...]]:
    """What Harbor and harbor-exec must agree on, per step."""
    return [
        (
            s["step_name"],
            sorted(s),
            (s.get("verifier_result") or {}).get("rewards"),
            (s.get("exception_info") or {}).get("exception_type"),
            s.get("agent_execution") is not None,
            s.get("verifier") is not None,
        )
        for s in steps or []
    ]


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [(None, {"reward": 2.5 / 3, "style": 1 / 3}), ("final", {"reward": 0.5, "style": 1})],
)
def test_oracle_passes_every_step(
    docker_runtime: DockerRuntime, tmp_path: Path, strategy: str | None, expected: dict[str, float]
) -> None:
    result = run_task(docker_runtime, three_step_task(tmp_path, strategy), tmp_path / "trials")
    assert result.exception_type is None, result.first_exception
    assert result.step_results is not None
    assert [
        (s.step_name, s.verifier_result.rewards if s.verifier_result else None)
        for s in result.step_results
    ] == [
        ("make", {"reward": 1}),
        ("extend", {"reward": 1}),
        ("finish", {"reward": 0.5, "style": 1}),
    ]
    assert result.verifier_result is not None
    assert result.verifier_result.rewards == pytest.approx(expected)
    assert result.reward_valid and result.verifier_environment_mode is None
    out = tmp_path / "trials" / result.trial_name
    for name in ("make", "extend", "finish"):
        assert (out / "steps" / name / "agent" / "oracle.txt").is_file()
        assert (out / "steps" / name / "verifier" / "test-stdout.txt").is_file()
    assert (out / "steps" / "finish" / "verifier" / "reward.json").is_file()
    assert not (out / "agent").exists() and not (out / "verifier").exists()


def test_failed_gate_stops_later_steps(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    result = run_task(docker_runtime, gated_task(tmp_path), tmp_path / "trials")
    assert result.step_results is not None
    assert [s.step_name for s in result.step_results] == ["slow"]
    slow = result.step_results[0]
    assert slow.exception_info is not None
    assert slow.exception_info.exception_type == "AgentTimeoutError"
    assert slow.verifier_result is not None and slow.verifier_result.rewards == {"reward": 0}
    assert result.exception_info is None
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 0}
    assert result.reward_valid  # an agent timeout keeps a valid reward, as in Harbor
    assert not (tmp_path / "trials" / result.trial_name / "steps" / "never").exists()


def test_later_step_cannot_change_an_earlier_reward(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    """Step two's agent rewrites the reward files step one's verifier wrote and leaves
    a process that keeps rewriting them; step one's recorded reward stands, and the
    process is gone before step two's own verifier runs."""
    task = make_multi_step_task(
        tmp_path,
        "hostile",
        {
            "honest": ("echo ok > /app/ok", "echo 1 > /logs/verifier/reward.txt"),
            "attack": (
                """
                echo 0 > /logs/verifier/reward.txt
                echo '{"reward": 0}' > /logs/verifier/reward.json
                nohup bash -c 'while true; do echo 0 > /logs/verifier/reward.txt; echo "{\\"reward\\": 0}" > /logs/verifier/reward.json; sleep 0.05; done' >/dev/null 2>&1 &
                disown
                sleep 0.5
                """,
                "sleep 1; [ -e /logs/verifier/reward.json ] && exit 0; echo 1 > /logs/verifier/reward.txt",
            ),
        },
        dockerfile=DOCKERFILE,
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert step_rewards(result) == [
        {"reward": 1},
        {"reward": 1},
    ]
    out = tmp_path / "trials" / result.trial_name
    assert (out / "steps" / "honest" / "verifier" / "reward.txt").read_text().strip() == "1"
    assert result.verifier_result is not None and result.verifier_result.rewards == {"reward": 1}


def sabotage_task(root: Path, *, sabotage: bool, mode: str) -> Path:
    """Step one is easy, step two the agent cannot solve; with ``sabotage`` step one's
    agent deletes bash after solving, so step two's ``setup.sh`` cannot run in its
    container (the step it would fail, dropped from the mean unless it counts 0)."""
    delete = "rm -f /usr/bin/bash /bin/bash" if sabotage else "true"
    task = make_multi_step_task(
        root,
        f"{'sabotage' if sabotage else 'control'}-{mode}",
        {
            "easy": (f"echo ok > /app/ok; {delete}", "echo 1 > /logs/verifier/reward.txt"),
            "hard": ("true", "echo 0 > /logs/verifier/reward.txt"),
        },
        toml=f'[verifier]\nenvironment_mode = "{mode}"\n',
        dockerfile=DOCKERFILE,
    )
    workdir = task / "steps" / "hard" / "workdir"
    workdir.mkdir()
    (workdir / "setup.sh").write_text("touch /app/hard-ready\n")
    return task


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_an_agent_cannot_drop_the_step_it_would_fail(
    docker_runtime: DockerRuntime, tmp_path: Path, mode: str
) -> None:
    """Breaking the container so that a later step cannot be prepared makes that step
    count 0: the trial's valid reward is at most the honest control's 0.5, and the job
    sees the agent's ``StepPreparationError``."""
    control = run_task(
        docker_runtime, sabotage_task(tmp_path, sabotage=False, mode=mode), tmp_path / "t"
    )
    assert control.exception_info is None, control.exception_info
    assert control.verifier_result is not None
    assert control.verifier_result.rewards == {"reward": 0.5}
    attack = run_task(
        docker_runtime, sabotage_task(tmp_path, sabotage=True, mode=mode), tmp_path / "t"
    )
    # The trial's valid reward is at most the control's: never step one's 1.0 alone.
    assert attack.reward is None or attack.reward <= 0.5, attack.verifier_result
    if mode == "shared":
        # Without bash step one's own verifier cannot run in the agent's container: no
        # valid reward at all (the verifier's failure, never a 1.0).
        assert attack.reward is None
        return
    assert attack.exception_info is not None
    assert attack.exception_info.exception_type == "StepPreparationError"
    assert policy_for("StepPreparationError").has_valid_reward
    assert attack.verifier_result is not None
    assert attack.verifier_result.rewards == {"reward": 0.5} and attack.reward == 0.5
    hard = (attack.step_results or [])[-1]
    assert hard.step_name == "hard" and hard.exception_info is not None  # Harbor's, on the step
    assert hard.verifier_result is None


def harbor_run(task: Path, jobs: Path) -> dict[str, Any]:
    if not HARBOR.is_file():
        pytest.fail(".venv-harbor is missing: run scripts/setup.sh", pytrace=False)
    env = {**os.environ, "HARBOR_TELEMETRY": "0"}
    done = subprocess.run(
        [
            str(HARBOR),
            "run",
            "-p",
            str(task),
            "-a",
            "oracle",
            "-o",
            str(jobs),
            "--job-name",
            "j",
            "-y",
            "-q",
            "-n",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        check=False,
    )
    results = [p for p in (jobs / "j").glob("*/result.json")]
    assert len(results) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    data: dict[str, Any] = json.loads(results[0].read_text())
    data["_dir"] = str(results[0].parent)
    return data


def test_separate_verifiers_per_step(docker_runtime: DockerRuntime, tmp_path: Path) -> None:
    result = run_task(docker_runtime, separate_task(tmp_path), tmp_path / "trials")
    assert step_rewards(result) == [
        {"reward": 1},
        {"reward": 1},
    ], result.first_exception
    assert result.exception_type is None


@pytest.mark.parametrize("which", ["three", "gated", "separate"])
def test_side_by_side_with_harbor(
    docker_runtime: DockerRuntime, tmp_path: Path, which: str
) -> None:
    makers = {"three": lambda p: three_step_task(p, None), "gated": gated_task}
    task = makers.get(which, separate_task)(tmp_path)
    theirs = harbor_run(task, tmp_path / "harbor-jobs")
    ours = json.loads(
        (
            tmp_path
            / "trials"
            / run_task(docker_runtime, task, tmp_path / "trials").trial_name
            / "result.json"
        ).read_text()
    )
    for key in ("verifier_result", "reward_valid", "verifier_environment_mode"):
        assert ours[key] == theirs[key] or (
            key == "verifier_result"
            and ours[key]["rewards"] == pytest.approx(theirs[key]["rewards"])
        ), key
    assert (ours["exception_info"] or {}).get("exception_type") == (
        theirs["exception_info"] or {}
    ).get("exception_type")
    assert step_summary(ours["step_results"]) == step_summary(theirs["step_results"])
    # Multi-step trials record the agent and verifier on their steps only.
    for key in ("agent_result", "agent_execution", "verifier"):
        assert ours[key] is None and theirs[key] is None, key
    assert ours["agent_setup"] is not None and theirs["agent_setup"] is not None

    # The same step dirs, with the same files in them.
    # A timed-out step's oracle.txt exists in Harbor's only when its `docker compose
    # exec` started within the 2 s (not always, on a loaded machine): left out there.
    timed_out = {
        s["step_name"]
        for s in theirs["step_results"]
        if (s.get("exception_info") or {}).get("exception_type") == "AgentTimeoutError"
    }

    def layout(trial_dir: Path) -> set[str]:
        return {
            p.relative_to(trial_dir).as_posix()
            for p in (trial_dir / "steps").rglob("*")
            if p.is_file()
            and p.name in ("oracle.txt", "test-stdout.txt", "reward.txt", "reward.json")
            and not (p.name == "oracle.txt" and p.parts[-3] in timed_out)
        }

    ours_dir = Path(ours["trial_uri"].removeprefix("file://"))
    assert layout(ours_dir) == layout(Path(theirs["_dir"]))


def test_validate_runs_the_oracle_over_a_multi_step_dataset(tmp_path: Path) -> None:
    from tests.test_validate_resume import CLI, env

    dataset = tmp_path / "ds"
    three_step_task(dataset, "final")
    gated_task(dataset)
    done = subprocess.run(
        [*CLI, "validate", str(dataset), "--jobs-dir", str(tmp_path / "jobs"), "--job-name", "v"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**env(), "PYTHONPATH": str(ROOT)},  # this checkout's harbor_exec
        timeout=400,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr  # neither earns full reward
    results = {
        data["task_name"]: data
        for data in (
            json.loads(p.read_text()) for p in (tmp_path / "jobs" / "v").glob("*/result.json")
        )
    }
    assert set(results) == {"three-final", "gated"}
    assert results["three-final"]["verifier_result"]["rewards"] == {"reward": 0.5, "style": 1}
    assert [s["step_name"] for s in results["gated"]["step_results"]] == ["slow"]
    job = json.loads((tmp_path / "jobs" / "v" / "result.json").read_text())
    evals = next(iter(job["stats"]["evals"].values()))
    assert evals["exception_stats"] == {"AgentTimeoutError": [results["gated"]["trial_name"]]}
    assert "AgentTimeoutError" in done.stdout + done.stderr


def test_a_workflow_runs_each_step_and_its_sample_covers_them(
    tmp_path: Path, chat: FakeChat, example_bundle: Bundle
) -> None:
    """The bundled workflow over HTTP: each step's own instruction as its prompt (step
    two's answer differs from step one's, and its tests check it), the reward the mean
    of the steps', the sample every step's messages in order."""
    chat.reset()
    check = 'got=$(tr -d "[:space:]" < /logs/artifacts/answer.txt); [ "$got" = "{n}" ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt'
    task = make_multi_step_task(
        tmp_path / "ds",
        "arith",
        {"add": ("true", check.format(n=42)), "more": ("true", check.format(n=43))},
        dockerfile=DOCKERFILE,
    )
    (task / "steps" / "add" / "instruction.md").write_text("What is 17 + 25?\n")
    (task / "steps" / "more" / "instruction.md").write_text("What is 40 + 3?\n")
    backend = HarborBackend(
        tasks_dir=tmp_path / "ds",
        task_mode="dataset",
        agent=EXAMPLE_REFS["workflow"],
        bundle=example_bundle,
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
    )

    async def one(url: str) -> Any:
        async with httpx.AsyncClient(timeout=300) as http:
            return await RolloutClient(url=url, http_client=http).run_rollout(
                initial_messages=[],
                chat_completions_url=chat.base_url,
                rollout_id=uuid.uuid4().hex,
                metadata={"harbor_task_id": "arith"},
            )

    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")
    with serve(app) as url:
        done = asyncio.run(one(url))
    assert done.status == "success", done.err_message
    assert done.sample.reward == 1.0
    users = [m["content"] for m in done.sample.messages if m["role"] == "user"]
    assert users == ["What is 17 + 25?\n", "What is 40 + 3?\n"]
    answers = [m["content"] for m in done.sample.messages if m["role"] == "assistant"]
    assert answers == ["42", "43"]
