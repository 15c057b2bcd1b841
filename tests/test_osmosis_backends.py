"""Backends written against osmosis-ai 0.3.8 behind our server, their
``rollout_status``/``cancel_rollouts`` pulled by the adapter for the server's status
and cancel routes, and our own backends' pushed status and one cancel path.

A custom backend subclassing osmosis-ai's ``ExecutionBackend`` holds each rollout
until it is told to stop, tracks a status of its own (``grading``) that it never
reports through the rollout context, stops rollouts itself with a message of its
own, and keeps a finished rollout the server never held. Our server runs on
127.0.0.1 and the real osmosis-ai RolloutClient drives it; if the adapter did not
pull the overrides, the status would read ``running``, the cancelled result would
carry the server's ``cancelled`` message and the retained rollout would be 404.
One subclassing ours pushes ``grading`` through its rollout context and stops the
rollout in ``cancel``: the server alone holds the state.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_utils import serve, wait_until

if sys.version_info < (3, 12):
    pytest.skip("osmosis-ai 0.3.8 is installed on Python >= 3.12 only", allow_module_level=True)

from osmosis_ai.rollout import AgentWorkflow as OsmosisAgentWorkflow
from osmosis_ai.rollout import Grader as OsmosisGrader
from osmosis_ai.rollout import LocalBackend as OsmosisLocalBackend
from osmosis_ai.rollout.backend import ExecutionBackend as OsmosisExecutionBackend
from osmosis_ai.rollout.client import RolloutClient
from osmosis_ai.rollout.types import ExecutionOutcome as OsmosisOutcome
from osmosis_ai.rollout.types import ExecutionResult as OsmosisResult

from harbor_exec.authoring import RolloutContext
from harbor_exec.backends.base import ExecutionBackend
from harbor_exec.backends.osmosis import OsmosisBackend, as_backend
from harbor_exec.protocol import (
    POLLING_LEASE_HEADER,
    ExecutionOutcome,
    ExecutionResult,
    RolloutStatus,
)
from harbor_exec.server import create_rollout_server

PROMPT = [{"role": "user", "content": "What is 2+2?"}]
CHAT_URL = "http://127.0.0.1:9/v1"  # never called: these backends do not chat
STOP_MESSAGE = "stopped by the backend itself"
RETAINED_ID = "finished-long-ago"


class _Holding:
    """The logic both custom backends share (run on the server's event loop)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.started: dict[str, threading.Event] = {}
        self._stops: dict[str, asyncio.Future[str]] = {}
        self._states: dict[str, dict[str, Any]] = {
            RETAINED_ID: {"status": "success", "reward": 0.5, "err_message": None}
        }

    def started_event(self, rollout_id: str) -> threading.Event:
        return self.started.setdefault(rollout_id, threading.Event())

    async def hold(self, rollout_id: str) -> str:
        stop: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._stops[rollout_id] = stop
        self._states[rollout_id] = {"status": "grading"}
        self.started_event(rollout_id).set()
        how = await stop
        self._states[rollout_id] = {"status": how, "reward": None, "err_message": STOP_MESSAGE}
        return how

    def rollout_status(self, rollout_id: str) -> dict[str, Any] | None:
        self.calls.append(("rollout_status", rollout_id))
        state = self._states.get(rollout_id)
        return dict(state) if state is not None else None

    def cancel_rollouts(
        self, ids: Sequence[str] | None = None, prefix: str | None = None, all: bool = False
    ) -> dict[str, str]:
        self.calls.append(("cancel_rollouts", list(ids or ())))
        dispositions: dict[str, str] = {}
        for rollout_id in ids or ():
            stop = self._stops.get(rollout_id)
            if stop is None or stop.done():
                dispositions[rollout_id] = "not_found"
            else:
                stop.set_result("cancelled")
                dispositions[rollout_id] = "cancelled_running"
        return dispositions


class OsmosisHoldingBackend(_Holding, OsmosisExecutionBackend):
    async def execute(self, request: Any) -> OsmosisOutcome:
        how = await self.hold(request.id)
        return OsmosisOutcome(workflow=OsmosisResult(status=how, err_message=STOP_MESSAGE))


class OurHoldingBackend(_Holding, ExecutionBackend):
    """Ours: pushes its status, stops a rollout in ``cancel``; never pulled."""

    async def execute(
        self, request: Any, rollout: RolloutContext | None = None
    ) -> ExecutionOutcome:
        assert rollout is not None and rollout.rollout_id == request.id
        assert rollout.chat_completions_url == CHAT_URL  # given, not read from a context
        hold = asyncio.create_task(self.hold(request.id))
        await asyncio.to_thread(self.started_event(request.id).wait, 10)
        rollout.update_status(RolloutStatus.GRADING)
        how = await hold
        return ExecutionOutcome(workflow=ExecutionResult(status=how, err_message=STOP_MESSAGE))

    def cancel(self, rollout_id: str) -> bool:
        self.calls.append(("cancel", rollout_id))
        return bool(self.cancel_rollouts(ids=[rollout_id]).get(rollout_id) != "not_found")


@pytest.mark.parametrize("kind", ["osmosis-ai", "harbor-exec"])
async def test_server_calls_the_backends_status_and_cancel(kind: str, tmp_path: Path) -> None:
    backend: _Holding = OsmosisHoldingBackend() if kind == "osmosis-ai" else OurHoldingBackend()
    pulled = kind == "osmosis-ai"
    app = create_rollout_server(backend=backend, artifact_root=tmp_path, configure_logging=False)
    rollout_id = f"held-{uuid.uuid4().hex}"
    with serve(app) as url:
        client = RolloutClient(url=url, admission_timeout_sec=10)
        try:
            handle = await client.run_rollout_async(
                PROMPT, CHAT_URL, rollout_id, label="4", grade=True
            )
            assert await asyncio.to_thread(backend.started_event(rollout_id).wait, 10)
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                live = await http.get(
                    f"/rollout/{rollout_id}/status", params={"seen": "running", "wait": 10}
                )
                # The backend's own status; the server alone would say "running".
                assert live.json()["status"] == "grading"
                retained = await http.get(f"/rollout/{RETAINED_ID}/status")
                if pulled:
                    assert retained.status_code == 200
                    assert retained.json()["status"] == "success"
                    assert retained.json()["reward"] == 0.5
                else:  # ours are never pulled: the server alone holds rollouts
                    assert retained.status_code == 404
                unknown = await http.get("/rollout/never-seen/status")
                assert unknown.status_code == 404
            await client.cancel_rollout(rollout_id)
            result = await asyncio.wait_for(handle, 10)
        finally:
            await client.aclose()
    assert ("cancel_rollouts", [rollout_id]) in backend.calls
    assert (("rollout_status", rollout_id) in backend.calls) is pulled
    assert (("cancel", rollout_id) in backend.calls) is not pulled
    assert result.status.value == "cancelled"
    # The backend stopped it (its outcome's message), the server did not cancel its task.
    assert result.err_message == STOP_MESSAGE


async def test_not_found_for_unstarted_work_falls_back_to_the_server(tmp_path: Path) -> None:
    """``not_found`` without a terminal ``rollout_status`` means "not mine yet": the
    server cancels the task itself (as osmosis-ai's server does)."""

    class NeverStarted(OsmosisExecutionBackend):
        def __init__(self) -> None:
            self.entered = threading.Event()
            self.asked: list[list[str]] = []

        async def execute(self, request: Any) -> OsmosisOutcome:
            self.entered.set()
            await asyncio.Event().wait()  # until cancelled
            raise AssertionError("unreachable")

        def cancel_rollouts(
            self, ids: Sequence[str] | None = None, prefix: str | None = None, all: bool = False
        ) -> dict[str, str]:
            self.asked.append(list(ids or ()))
            return dict.fromkeys(ids or (), "not_found")

    backend = NeverStarted()
    app = create_rollout_server(backend=backend, artifact_root=tmp_path, configure_logging=False)
    with serve(app) as url:
        client = RolloutClient(url=url, admission_timeout_sec=10)
        try:
            handle = await client.run_rollout_async(PROMPT, CHAT_URL, "unstarted", grade=False)
            assert await asyncio.to_thread(backend.entered.wait, 10)
            await client.cancel_rollout("unstarted")
            result = await asyncio.wait_for(handle, 10)
        finally:
            await client.aclose()
    assert backend.asked == [["unstarted"]]
    assert (result.status.value, result.err_message) == ("cancelled", "cancelled")


def test_osmosis_local_backend_is_wrapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_osmosis_sdk import SDK_REFS

    monkeypatch.setenv("_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", str(tmp_path))
    sdk_backend = OsmosisLocalBackend(**SDK_REFS)
    wrapped = as_backend(sdk_backend)
    assert isinstance(wrapped, OsmosisBackend) and wrapped.backend is sdk_backend
    assert wrapped.artifact_root == tmp_path
    health = wrapped.health().model_dump()
    assert health["status"] == "ok"
    assert health["concurrency"] == sdk_backend.health()["concurrency"]  # passed on
    assert health["backend"] == "osmosis:LocalBackend"
    ours = OurHoldingBackend()
    assert as_backend(ours) is ours
    with pytest.raises(TypeError, match="ExecutionBackend"):
        as_backend(object())
    with pytest.raises(TypeError, match="ExecutionBackend"):
        create_rollout_server(backend=object())


def test_harbor_exec_serves_without_osmosis_ai(tmp_path: Path) -> None:
    """osmosis-ai stays optional: with it unimportable, the server and its backend
    check still work."""
    code = (
        "import sys; sys.modules['osmosis_ai'] = None\n"
        "from harbor_exec.server import create_rollout_server\n"
        "from harbor_exec.backends.osmosis import as_backend, is_osmosis_backend\n"
        "from tests.server_utils import ScriptedWorkflow\n"
        "from harbor_exec.backends.local import LocalBackend\n"
        f"b = LocalBackend(workflow=ScriptedWorkflow, artifact_root={str(tmp_path)!r})\n"
        "assert as_backend(b) is b and not is_osmosis_backend(object())\n"
        "create_rollout_server(backend=b, configure_logging=False)\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


class _SdkAnswer(OsmosisAgentWorkflow):  # type: ignore[type-arg]
    async def run(self, ctx: Any) -> list[dict[str, Any]]:
        return [*ctx.prompt, {"role": "assistant", "content": "4"}]


class _SdkExact(OsmosisGrader):
    async def grade(self, ctx: Any) -> None:
        ctx.set_reward(1.0 if ctx.sample.messages[-1]["content"] == ctx.label else 0.0)


async def _graded_result(http: httpx.AsyncClient, rollout_id: str) -> tuple[str, dict[str, Any]]:
    """Submit over plain HTTP and long-poll to the end (bounded); (lease token, result)."""
    admitted = await http.post(
        "/rollout",
        json={
            "rollout_id": rollout_id,
            "initial_messages": PROMPT,
            "chat_completions_url": CHAT_URL,
            "label": "4",
        },
    )
    assert admitted.status_code == 202, admitted.text
    token = admitted.json()["polling_lease_token"]
    for _ in range(50):
        polled = await http.get(
            f"/rollout/{rollout_id}/result", headers={POLLING_LEASE_HEADER: token}
        )
        body: dict[str, Any] = polled.json()
        if body["status"] in ("success", "failure", "cancelled"):
            return token, body
    raise AssertionError("the rollout never finished")


async def test_osmosis_local_backend_gets_our_servers_state_metrics_and_openapi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """osmosis-ai's LocalBackend behind our server: its rollouts are in our durable
    state (a restarted server serves the result again to the same lease token), our
    metrics and OpenAPI; the trajectory lands beside the SDK backend's artifacts."""
    monkeypatch.setenv("_OSMOSIS_ROLLOUT_ARTIFACT_ROOT", str(tmp_path / "root"))
    data_dir = tmp_path / "state"

    def app() -> Any:
        backend = OsmosisLocalBackend(workflow=_SdkAnswer, grader=_SdkExact)
        return create_rollout_server(backend=backend, data_dir=data_dir, configure_logging=False)

    with serve(app()) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            token, first = await _graded_result(http, "durable-1")
            metrics = (await http.get("/metrics")).text
            openapi = (await http.get("/openapi.json")).json()
            health = (await http.get("/health")).json()
    assert (first["status"], first["sample"]["reward"]) == ("success", 1.0)
    assert "harbor_exec_rollouts_admitted_total 1.0" in metrics
    completed = [
        line
        for line in metrics.splitlines()
        if line.startswith("harbor_exec_rollouts_completed_total{") and 'status="success"' in line
    ]
    assert completed and completed[0].endswith(" 1.0")
    assert "/rollout/{rollout_id}/status" in openapi["paths"]
    assert health["backend"] == "osmosis:LocalBackend" and "concurrency" in health
    assert wait_until((tmp_path / "root" / "durable-1" / "trajectory.json").is_file)
    with serve(app()) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            again = await http.get(
                "/rollout/durable-1/result", headers={POLLING_LEASE_HEADER: token}
            )
    assert again.status_code == 200
    assert again.json() == first
