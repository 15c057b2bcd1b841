"""HarborBackend over ``FakeRuntime`` behind the real HTTP server: cancel (queued and
running), the queue bound, a task blocked by its failed prewarm, and queue time off
the agent's deadline. No Docker: the agent's command waits at the fake's gate, and
the tests wait on events (the gate, the backend's queue), never on time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.backends.harbor import backend as backend_module
from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.client import RolloutClient
from harbor_exec.executors.local import LocalExecutor
from harbor_exec.sandbox.runtime import LABEL_ROLLOUT
from harbor_exec.server.app import create_rollout_server
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.trial import image_tag_for
from harbor_exec.trial.warm import LABEL_WARM
from tests.fake_runtime import HOLD, FakeRuntime, hold_first_removal
from tests.server_utils import CHAT_URL, PROMPT, serve, wait_until
from tests.task_factory import make_task

#: The task's ``[agent].timeout_sec`` (``task_factory.DEFAULT_TOML``).
TASK_AGENT_TIMEOUT_SEC = 30.0


def held_runtime() -> FakeRuntime:
    """A runtime whose oracle waits at the gate until the test opens it."""
    return FakeRuntime(solve=lambda container: HOLD)


@contextlib.contextmanager
def served(
    tmp_path: Path, runtime: FakeRuntime, **options: Any
) -> Iterator[tuple[HarborBackend, str]]:
    """The template task behind a real server; yields the backend and the base URL."""
    task = make_task(tmp_path / "tasks", "fake-task")
    backend = HarborBackend(
        tasks_dir=task,
        executor=LocalExecutor(runtime),
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        **options,
    )
    app = create_rollout_server(
        backend=backend,
        artifact_root=tmp_path / "server-artifacts",
        shutdown_drain_sec=0.5,
        shutdown_cleanup_sec=5.0,
    )
    with serve(app) as url:
        yield backend, url


async def wait_queued(backend: HarborBackend, count: int) -> None:
    """Until ``count`` rollouts wait for a slot (their admission time is taken by then)."""
    assert await asyncio.to_thread(wait_until, lambda: backend.queue_info().queued == count)


async def wait_held(runtime: FakeRuntime, count: int) -> None:
    assert await asyncio.to_thread(runtime.gate.wait_held, count)


def rollouts_with_containers(runtime: FakeRuntime) -> list[str | None]:
    return [
        c.spec.labels.get(LABEL_ROLLOUT)
        for c in runtime.containers.values()
        if LABEL_WARM not in c.spec.labels  # made ahead by the warm pool: no rollout's yet
    ]


def test_cancel_a_queued_and_a_running_rollout(tmp_path: Path) -> None:
    runtime = held_runtime()

    async def scenario(backend: HarborBackend, url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30) as http:
            client = RolloutClient(url=url, http_client=http)
            running = await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id="run-1")
            await wait_held(runtime, 1)
            queued = await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id="queued-1")
            await wait_queued(backend, 1)
            return {
                "cancel_queued": await client.cancel_rollout("queued-1"),
                "cancel_running": await client.cancel_rollout("run-1"),
                "again": await client.cancel_rollout("run-1"),
                "queued": await queued,
                "running": await running,
                "queue": (await http.get(f"{url}/queue")).json(),
            }

    with served(tmp_path, runtime, max_concurrent_trials=1) as (backend, url):
        got = asyncio.run(scenario(backend, url))
    assert got["cancel_queued"].dispositions == {"queued-1": "cancelled_queued"}
    assert got["cancel_running"].dispositions == {"run-1": "cancelled_running"}
    assert got["again"].dispositions == {"run-1": "not_found"}
    assert got["queued"].status == "cancelled" and got["running"].status == "cancelled"
    assert got["queue"]["queued"] == 0 and got["queue"]["running"] == 0
    # The running trial's container was removed (which ended its held command); the
    # queued rollout never got one.
    assert rollouts_with_containers(runtime) == ["run-1"]
    (container,) = [c for c in runtime.containers.values() if LABEL_WARM not in c.spec.labels]
    assert container.removed and runtime.gate.ended_by_removal == [container]
    assert [e.rollout_id for e in runtime.execs] == ["run-1"]  # nothing ran after the agent


def test_the_queue_bound_answers_429(tmp_path: Path) -> None:
    runtime = held_runtime()

    async def scenario(backend: HarborBackend, url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30) as http:
            client = RolloutClient(url=url, http_client=http)
            running = await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id="run-1")
            await wait_held(runtime, 1)
            queued = await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id="queued-1")
            await wait_queued(backend, 1)
            body = {"initial_messages": PROMPT, "chat_completions_url": CHAT_URL}
            full = await http.post(f"{url}/rollout", json={**body, "rollout_id": "third"})
            queue = (await http.get(f"{url}/queue")).json()
            runtime.gate.open()
            done = [await running, await queued]
            # With the queue empty again, the next admission is accepted.
            after = await client.run_rollout(PROMPT, CHAT_URL, rollout_id="after-429")
            return {"full": full, "queue": queue, "done": done, "after": after}

    with served(tmp_path, runtime, max_concurrent_trials=1, max_queue_depth=1) as (backend, url):
        got = asyncio.run(scenario(backend, url))
    full: httpx.Response = got["full"]
    assert full.status_code == 429 and full.headers["Retry-After"] == "5"  # the default
    assert full.json()["detail"] == "rollout queue is full; retry later"
    assert got["queue"]["queued"] == 1 and got["queue"]["running"] == 1
    assert got["queue"]["capacity"] == 1 and got["queue"]["max_queue_depth"] == 1
    assert [r.status for r in got["done"]] == ["success", "success"]
    assert got["after"].status == "success" and got["after"].sample.reward == 1.0
    assert "third" not in rollouts_with_containers(runtime)


def test_a_failed_prewarm_blocks_the_task_without_a_build(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    runtime.fail_builds.add(image_tag_for(load_task(make_task(tmp_path / "tasks", "fake-task"))))

    async def scenario(url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30) as http:
            summary = (await http.post(f"{url}/prewarm", json={"all": True})).json()
            builds = runtime.calls.count("ensure_image")
            client = RolloutClient(url=url, http_client=http)
            result = await client.run_rollout(PROMPT, CHAT_URL, rollout_id="blocked-1")
            return {"summary": summary, "builds": builds, "result": result}

    with served(tmp_path, runtime) as (_backend, url):
        got = asyncio.run(scenario(url))
    summary = got["summary"]
    assert summary["total"] == 1 and summary["failed"] == 1 and summary["built"] == 0
    reason = summary["failed_tasks"]["fake-task"]
    assert reason.startswith("SandboxBuildFailedError: docker build of ")
    assert reason.endswith(" failed: exit code 42")
    result = got["result"]
    assert result.status == "failure" and result.err_category == "validation_error"
    assert result.err_message == f"task 'fake-task' failed prewarm: {reason}"
    # The rollout asked for no build and created no container.
    assert got["builds"] == 1 and runtime.calls.count("ensure_image") == 1
    assert runtime.builds == [] and runtime.containers == {}


class FakeClock:
    """Stands in for the backend module's ``time``: queue time passes when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("agent_timeout_sec", "queued_sec", "agent_budget_sec", "status"),
    [
        (30.0, 12.5, 17.5, "success"),  # the wait comes off the request's deadline
        # A deadline spent in the queue: the agent times out, and the verifier's reward
        # stands (the timeout is named beside it).
        (30.0, 45.0, 0.0, "timed-out"),
        (None, 12.5, TASK_AGENT_TIMEOUT_SEC, "success"),  # the task's own timeout is kept
    ],
)
def test_queue_time_comes_off_the_agent_deadline(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    agent_timeout_sec: float | None,
    queued_sec: float,
    agent_budget_sec: float,
    status: str,
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(backend_module, "time", clock)
    runtime = held_runtime()

    async def scenario(backend: HarborBackend, url: str) -> list[Any]:
        async with httpx.AsyncClient(timeout=30) as http:
            client = RolloutClient(url=url, http_client=http)
            options: dict[str, Any] = {"agent_timeout_sec": agent_timeout_sec}
            first = await client.run_rollout_async(PROMPT, CHAT_URL, "first", **options)
            await wait_held(runtime, 1)
            second = await client.run_rollout_async(PROMPT, CHAT_URL, "second", **options)
            await wait_queued(backend, 1)
            clock.now += queued_sec
            runtime.gate.open()
            return [await first, await second]

    with served(tmp_path, runtime, max_concurrent_trials=1) as (backend, url):
        first, second = asyncio.run(scenario(backend, url))
    # One at a time, in order (the second's container may be a warm one: no rollout label).
    agent_deadlines = [e.timeout_sec for e in runtime.execs if "/solution/solve.sh" in e.script]
    unqueued = TASK_AGENT_TIMEOUT_SEC if agent_timeout_sec is None else agent_timeout_sec
    assert agent_deadlines == [unqueued, agent_budget_sec]
    assert first.status == "success"
    assert second.status == "success"
    agent_error = second.sample.extra_fields.get("agent_error") if second.sample else None
    if status == "timed-out":
        assert agent_error is not None and agent_error["category"] == "timeout", agent_error
        assert second.sample is not None and second.sample.reward is not None
    else:
        assert agent_error is None


def test_the_queue_bound_holds_for_submissions_at_once(tmp_path: Path) -> None:
    """Six rollouts posted at once at depth 1, one trial at a time: one runs, one waits,
    four get 429 with ``Retry-After: 5``, however the submissions interleave (each one is
    counted at admission, before its trial has taken a slot)."""
    runtime = held_runtime()

    async def scenario(url: str) -> list[httpx.Response]:
        body = {"initial_messages": PROMPT, "chat_completions_url": CHAT_URL}
        async with httpx.AsyncClient(timeout=30) as http:
            answers = await asyncio.gather(
                *(
                    http.post(f"{url}/rollout", json={**body, "rollout_id": f"r{i}"})
                    for i in range(6)
                )
            )
            await wait_held(runtime, 1)
            queue = (await http.get(f"{url}/queue")).json()
            assert queue["running"] == 1 and queue["queued"] == 1, queue
            runtime.gate.open()
            return list(answers)

    with served(tmp_path, runtime, max_concurrent_trials=1, max_queue_depth=1) as (_b, url):
        answers = asyncio.run(scenario(url))
    codes = sorted(a.status_code for a in answers)
    assert codes == [202, 202, 429, 429, 429, 429], codes
    assert all(a.headers["Retry-After"] == "5" for a in answers if a.status_code == 429)


def test_rollout_status_and_cancel_rollouts_answer_as_osmosis_does(tmp_path: Path) -> None:
    """``rollout_status``: queued / running while in flight, unknown after (the server
    owns results);
    ``cancel_rollouts`` by ids, prefix or all: cancelled_queued, cancelled_running,
    not_found (unknown or finished: idempotent)."""
    from harbor_exec.protocol import ExecutionRequest

    runtime = held_runtime()
    backend = HarborBackend(
        tasks_dir=make_task(tmp_path / "tasks", "fake-task"),
        executor=LocalExecutor(runtime),
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        max_concurrent_trials=1,
    )

    async def scenario() -> dict[str, Any]:
        got: dict[str, Any] = {}
        run = asyncio.create_task(backend.execute(ExecutionRequest(id="run-1", prompt=PROMPT)))
        await wait_held(runtime, 1)
        queued = asyncio.create_task(backend.execute(ExecutionRequest(id="q-1", prompt=PROMPT)))
        await asyncio.sleep(0)  # execute registers the rollout before its first await
        got["status"] = (backend.rollout_status("run-1"), backend.rollout_status("q-1"))
        got["unknown"] = backend.rollout_status("nope")
        got["by_ids"] = backend.cancel_rollouts(ids=["q-1", "nope"])
        got["by_prefix"] = backend.cancel_rollouts(prefix="run-")
        got["outcomes"] = [(await run).result.status, (await queued).result.status]
        got["after"] = (backend.rollout_status("run-1"), backend.rollout_status("q-1"))
        got["again"] = backend.cancel_rollouts(all=True), backend.cancel_rollouts(ids=["q-1"])
        await backend.shutdown()
        return got

    got = asyncio.run(scenario())
    assert got["status"] == ({"status": "running"}, {"status": "queued"})
    assert got["unknown"] is None
    assert got["by_ids"] == {"q-1": "cancelled_queued", "nope": "not_found"}
    assert got["by_prefix"] == {"run-1": "cancelled_running"}
    assert got["outcomes"] == ["cancelled", "cancelled"]
    # Finished: the server that ran them holds their results, not the backend.
    assert got["after"] == (None, None)
    assert got["again"] == ({}, {"q-1": "not_found"})


def test_agent_started_at_is_when_the_agent_phase_began(tmp_path: Path) -> None:
    """HarborBackend reports its own agent start: after the container started, not when
    ``execute`` was called (an image build or a queue wait comes first)."""
    from datetime import UTC, datetime

    runtime = FakeRuntime()
    starts: list[datetime] = []
    real_start = runtime.start

    def start(container_id: str) -> None:
        real_start(container_id)
        container = runtime.containers.get(container_id)  # not the cache's build gateway
        if container is not None and LABEL_WARM not in container.spec.labels:
            starts.append(datetime.now(UTC))

    runtime.start = start  # type: ignore[method-assign]

    async def one(url: str) -> Any:
        async with httpx.AsyncClient(timeout=30) as http:
            client = RolloutClient(url=url, http_client=http)
            return await client.run_rollout(PROMPT, CHAT_URL, rollout_id="started-1")

    with served(tmp_path, runtime) as (_backend, url):
        submitted = datetime.now(UTC)
        result = asyncio.run(one(url))
    assert result.status == "success"
    assert result.agent_started_at is not None and len(starts) == 1
    assert submitted < starts[0] <= result.agent_started_at


def test_a_tasks_dir_the_mode_cannot_serve_is_refused_at_start(tmp_path: Path) -> None:
    """A dataset served in template mode (the default), or one task in dataset mode,
    would fail every rollout: refused when the backend is made, saying which mode fits."""
    dataset = tmp_path / "dataset"
    make_task(dataset, "alpha")
    make_task(dataset, "beta")
    with pytest.raises(
        ValueError, match=r"is a dataset \(2 task\(s\): alpha, beta\).*--task-mode dataset"
    ):
        HarborBackend(tasks_dir=dataset, runtime=FakeRuntime())
    with pytest.raises(ValueError, match=r"is one task.*--task-mode template"):
        HarborBackend(tasks_dir=dataset / "alpha", task_mode="dataset", runtime=FakeRuntime())
    # The fitting modes start.
    HarborBackend(tasks_dir=dataset, task_mode="dataset", runtime=FakeRuntime())
    HarborBackend(tasks_dir=dataset / "alpha", runtime=FakeRuntime())


def test_a_rollout_gives_its_slot_back_when_its_reward_is_read(tmp_path: Path) -> None:
    """One trial slot: the next rollout's agent starts while the first rollout's container
    is still being removed (its reward is read; the removal is clean-up), and each still
    gets its own result. Before, the slot was held until the removal ended."""
    runtime = FakeRuntime()
    removal_held, release = hold_first_removal(runtime)

    def solves() -> int:
        return sum("solve.sh" in e.script for e in runtime.execs)

    async def scenario(url: str) -> list[str]:
        async with httpx.AsyncClient(timeout=30) as http:
            client = RolloutClient(url=url, http_client=http)
            first = await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id="first")
            second = await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id="second")
            assert await asyncio.to_thread(removal_held.wait, 10)
            try:
                started = await asyncio.to_thread(wait_until, lambda: solves() == 2, 5)
                assert started, "the second rollout waited for the first one's removal"
            finally:
                release.set()
            return [(await first).status, (await second).status]

    with served(tmp_path, runtime, max_concurrent_trials=1, warm_containers=0) as (_b, url):
        assert asyncio.run(scenario(url)) == ["success", "success"]


def test_a_rollout_keeps_its_slot_while_as_many_others_tear_down(tmp_path: Path) -> None:
    """Trials that gave their slot back at their teardown are at most as many as the
    slots: with one slot and the first two removals held, the second rollout starts (the
    first gave its slot back) but the third waits until a removal ends (a policy that
    makes its teardowns slow cannot have the server run more containers than twice its
    slots)."""
    runtime = FakeRuntime()
    both_held, release = hold_first_removal(runtime, count=2)

    def solves() -> int:
        return sum("solve.sh" in e.script for e in runtime.execs)

    async def scenario(url: str) -> list[str]:
        async with httpx.AsyncClient(timeout=30) as http:
            client = RolloutClient(url=url, http_client=http)
            handles = [
                await client.run_rollout_async(PROMPT, CHAT_URL, rollout_id=f"r{n}")
                for n in range(3)
            ]
            try:
                assert await asyncio.to_thread(both_held.wait, 10)
                assert solves() == 2
                # The third waits for a slot (an absence: a bounded wait).
                assert not await asyncio.to_thread(wait_until, lambda: solves() == 3, 0.5)
            finally:
                release.set()
            return [(await handle).status for handle in handles]

    with served(tmp_path, runtime, max_concurrent_trials=1, warm_containers=0) as (_b, url):
        assert asyncio.run(scenario(url)) == ["success"] * 3
