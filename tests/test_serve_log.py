"""A terminal that says what happens (issue 38, point 1): a real ``harbor-exec serve``
prints what it serves, then one line per finished rollout, each named exactly once,
whatever its end (success, a zero reward, a workflow or grader failure, a cancel), and a
periodic summary; ``--log-format json`` gives the same as JSON lines."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.server.report import ServeReport
from tests.server_utils import CHAT_URL, NEVER, PROMPT, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent

# rollout id -> (metadata, the status it ends with, its reward)
LOAD: dict[str, tuple[dict[str, Any], str, float | None]] = {
    **{f"ok-{i}": ({"harbor_task_id": "alpha"}, "success", 1.0) for i in range(6)},
    **{f"zero-{i}": ({"harbor_task_id": "beta", "answer": "5"}, "success", 0.0) for i in range(3)},
    **{f"fail-{i}": ({"task": "gamma", "raise": f"broke\nno {i}"}, "failure", None) for i in range(3)},
    "grader-1": ({"grader_raise": "grader down"}, "failure", None),
    **{f"cancel-{i}": ({"hold": NEVER}, "cancelled", None) for i in range(2)},
}  # fmt: skip


class Serve:
    """``harbor-exec serve`` with a LocalBackend on a free port; its stdout read line by
    line on a thread."""

    def __init__(self, tmp_path: Path, *options: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "harbor_exec.cli", "serve",
                "--workflow", "tests.server_utils:ScriptedWorkflow",
                "--grader", "tests.server_utils:ExactMatchGrader",
                "--port", str(self.port), "--artifact-root", str(tmp_path / "artifacts"),
                "--data-dir", str(tmp_path / "data"), *options,
            ],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env=os.environ.copy(),
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> list[str]:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)
        self._reader.join(timeout=10)
        return self.snapshot()


def run_load(url: str) -> None:
    """Every rollout of ``LOAD``, the held ones cancelled once running; returns once
    every one has finished."""
    with httpx.Client(base_url=url, timeout=10) as http:
        for rollout_id, (metadata, _, _) in LOAD.items():
            admitted = http.post(
                "/rollout",
                json={
                    "initial_messages": PROMPT,
                    "rollout_id": rollout_id,
                    "chat_completions_url": CHAT_URL,
                    "label": "4",
                    "metadata": metadata,
                },
            )
            assert admitted.status_code == 202, admitted.text

        def status(rollout_id: str) -> str:
            return str(http.get(f"/rollout/{rollout_id}/status").json()["status"])

        held = [rollout_id for rollout_id in LOAD if rollout_id.startswith("cancel-")]
        assert wait_until(lambda: all(status(r) == "running" for r in held), timeout=10)
        assert http.post("/rollout/cancel", json={"ids": held}).status_code == 200
        for rollout_id, (_, expected, _) in LOAD.items():
            assert wait_until(lambda r=rollout_id, e=expected: status(r) == e, timeout=10), (
                rollout_id
            )


def test_json_lines_name_every_finished_rollout_once(tmp_path: Path) -> None:
    server = Serve(tmp_path, "--log-format", "json", "--summary-interval", "0.2")
    try:
        assert wait_until(server.up, timeout=30), "serve did not start"
        run_load(server.url)

        def summed_up() -> bool:
            for line in server.snapshot():
                record = json.loads(line)
                if record["event"] == "summary" and record["done"] + record["failed"] + record[
                    "cancelled"
                ] == len(LOAD):
                    return True
            return False

        assert wait_until(summed_up, timeout=10)
    finally:
        lines = server.stop()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    serving = records[0]
    assert serving["event"] == "serving" and serving["url"] == server.url
    assert serving["mode"] == "local (in-process workflows)"
    assert serving["workflow"] == "tests.server_utils:ScriptedWorkflow"
    assert serving["data_dir"] == str(tmp_path / "data")
    finished = [record for record in records if record["event"] == "rollout"]
    assert Counter(record["rollout_id"] for record in finished) == Counter(list(LOAD))
    for record in finished:
        metadata, status, reward = LOAD[record["rollout_id"]]
        assert record["status"] == status and record["reward"] == reward, record
        assert record["task"] == (metadata.get("harbor_task_id") or metadata.get("task"))
        assert record["seconds"] >= 0
        if status == "failure":
            assert record["err_category"] == "agent_error"
            assert "\n" not in record["reason"]
    reasons = {r["rollout_id"]: r["reason"] for r in finished if r["status"] != "success"}
    assert "broke no 0" in reasons["fail-0"] and "grader down" in reasons["grader-1"]
    assert reasons["cancel-0"] == "cancelled"
    summaries = [record for record in records if record["event"] == "summary"]
    assert summaries and all(
        {"queued", "running", "done", "failed", "cancelled", "mean_reward"} <= set(record)
        for record in summaries
    )
    last = summaries[-1]
    assert (last["done"], last["failed"], last["cancelled"]) == (9, 4, 2)
    rewards = [record["reward"] for record in finished if record["reward"] is not None]
    assert sum(s["rewards"] for s in summaries) == len(rewards) == 9


def test_text_lines_name_every_finished_rollout_once(tmp_path: Path) -> None:
    server = Serve(tmp_path, "--summary-interval", "0")
    try:
        assert wait_until(server.up, timeout=30), "serve did not start"
        run_load(server.url)
    finally:
        lines = server.stop()
    assert lines[0] == "harbor-exec serve"
    assert any(line.split() == ["url", server.url] for line in lines[1:8])
    rollouts = [line.split("  ") for line in lines if line.startswith("rollout  ")]
    assert Counter(parts[1] for parts in rollouts) == Counter(list(LOAD))
    by_id = {parts[1]: parts for parts in rollouts}
    assert by_id["ok-0"][2:5] == ["task=alpha", "success", "reward=1"]
    assert by_id["zero-0"][2:5] == ["task=beta", "success", "reward=0"]
    assert by_id["fail-1"][2:5] == ["task=gamma", "failure", "reward=-"]
    assert by_id["fail-1"][6] == "agent_error: broke no 1"
    assert by_id["cancel-0"][3] == "cancelled"
    # With --summary-interval 0 only the last summary, at stop.
    summaries = [line for line in lines if line.startswith("summary")]
    assert len(summaries) == 1
    assert "done=9 failed=4 cancelled=2" in summaries[0]


@pytest.mark.asyncio
async def test_summary_is_skipped_while_idle_and_mean_is_of_the_window() -> None:
    stream = io.StringIO()
    live = [0, 0]
    report = ServeReport(log_format="json", stream=stream, summary_interval_sec=3600)
    report.start(lambda: (live[0], live[1]), {"data_dir": "/d"})
    report.summary(force=False)  # idle: nothing
    for reward in (1.0, 0.0, 0.5):
        report.finished(
            "r", task=None, status="success", reward=reward, seconds=0.1, err_category=None,
            reason=None,
        )  # fmt: skip
    report.summary(force=False)
    live[1] = 2
    report.summary(force=False)  # rollouts running: a line, with no reward in the window
    report.stop()  # nothing new happened, but two still run: a last line
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [record["event"] for record in records] == [
        "serving", "rollout", "rollout", "rollout", "summary", "summary", "summary",
    ]  # fmt: skip
    assert records[4]["mean_reward"] == 0.5 and records[4]["rewards"] == 3
    assert records[5]["mean_reward"] is None and records[5]["running"] == 2


def test_serve_says_what_a_harbor_backend_serves(tmp_path: Path) -> None:
    """The start lines of ``serve --tasks-dir``: tasks found and mode, agent, verifier
    mode, concurrency and queue bound, trials dir, package cache (over FakeRuntime)."""
    from harbor_exec.backends.harbor.backend import HarborBackend
    from harbor_exec.cli.serve import ServeOptions, harbor_config_of, serve_facts
    from harbor_exec.executors.local import LocalExecutor
    from harbor_exec.network.packages.config import PackageCacheConfig
    from tests.fake_runtime import FakeRuntime
    from tests.task_factory import make_task

    dataset = tmp_path / "tasks"
    for name in ("alpha", "beta", "gamma"):
        make_task(dataset, name)
    options = ServeOptions(
        tasks_dir=dataset,
        task_mode="dataset",
        agent="oracle",
        trials_dir=tmp_path / "trials",
        max_concurrent_trials=3,
        max_queue_depth=7,
        package_cache=PackageCacheConfig(root=tmp_path / "cache"),
        url="http://127.0.0.1:8000",
    )
    backend = HarborBackend(harbor_config_of(options), executor=LocalExecutor(FakeRuntime()))
    facts = serve_facts(options, backend)
    assert facts == {
        "url": "http://127.0.0.1:8000",
        "mode": "harbor (a Docker trial per rollout)",
        "tasks": f"3 tasks in {dataset} (dataset mode)",
        "agent": "oracle",
        "verifier": "task",
        "concurrency": "3 trials at once, queue bound 7",
        "trials_dir": str(tmp_path / "trials"),
        "package_cache": f"on ({tmp_path / 'cache'})",
    }
    stream = io.StringIO()

    async def announce() -> None:
        report = ServeReport(stream=stream, facts=facts, summary_interval_sec=0)
        report.start(lambda: (0, 0), {"data_dir": "/d"})
        report.stop()

    asyncio.run(announce())
    lines = stream.getvalue().splitlines()
    assert lines[0] == "harbor-exec serve"
    assert lines[3] == f"  tasks          3 tasks in {dataset} (dataset mode)"
    assert lines[-1] == "  data dir       /d"
