"""The rollout server over real HTTP: routes, admission, long-poll, leases, cancel,
errors, additions (/status, /queue, /prewarm, /metrics), trajectories, shutdown, CLI."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from harbor_exec.authoring import RolloutContext, RolloutSample
from harbor_exec.backends.base import ExecutionBackend
from harbor_exec.backends.local import LocalBackend
from harbor_exec.client import RolloutClient
from harbor_exec.network.relay import RELAY_TOTALS
from harbor_exec.protocol import (
    ExecutionOutcome,
    ExecutionRequest,
    ExecutionResult,
    PrewarmSummary,
    RolloutStatus,
)
from harbor_exec.server import create_rollout_server
from harbor_exec.server.metrics import PROMETHEUS_CONTENT_TYPE, ServerMetrics
from harbor_exec.server.run import uvicorn_implementations
from harbor_exec.server.trajectory import (
    REDACTED,
    build_trajectory_document,
    encode_redacted,
    redact_secrets,
)
from tests.server_utils import (
    CHAT_URL,
    NEVER,
    PROMPT,
    SINGLE_SLOT,
    ExactMatchGrader,
    FullBackend,
    ScriptedWorkflow,
    ServerThread,
    free_port,
    gate,
    local_app,
    metric,
    metric_samples,
    serve,
    wait_until,
    wait_until_async,
    workflow_was_cancelled,
)

LEASE = "X-Osmosis-Rollout-Lease"


def rollout_body(rollout_id: str | None = None, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "initial_messages": PROMPT,
        "rollout_id": uuid.uuid4().hex if rollout_id is None else rollout_id,
        "chat_completions_url": CHAT_URL,
        "label": "4",
    }
    body.update(fields)
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any, Path]]:
    """A shared server: 1 s long-poll wait, 30 s lease, 60 s retention."""
    root = tmp_path_factory.mktemp("artifacts")
    app = local_app(root, result_wait_timeout_sec=1.0, polling_lease_timeout_sec=30.0)
    with serve(app) as url:
        yield url, app, root


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as client:
        yield client


async def submit(http: httpx.AsyncClient, url: str, **fields: Any) -> tuple[str, str]:
    body = rollout_body(**fields)
    response = await http.post(f"{url}/rollout", json=body)
    assert response.status_code == 202, response.text
    return body["rollout_id"], response.json()["polling_lease_token"]


async def final_result(
    http: httpx.AsyncClient, url: str, rollout_id: str, token: str, limit: int = 40
) -> dict[str, Any]:
    """Poll (bounded) until the rollout is terminal."""
    for _ in range(limit):
        response = await http.get(f"{url}/rollout/{rollout_id}/result", headers={LEASE: token})
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        if result["status"] in ("success", "failure", "cancelled"):
            return result
    raise AssertionError(f"{rollout_id} did not finish")


async def status_of(http: httpx.AsyncClient, url: str, rollout_id: str) -> dict[str, Any]:
    response = await http.get(f"{url}/rollout/{rollout_id}/status")
    assert response.status_code == 200, response.text
    state: dict[str, Any] = response.json()
    return state


async def wait_for_status(
    http: httpx.AsyncClient, url: str, rollout_id: str, wanted: str, within_sec: float = 5.0
) -> None:
    deadline = time.monotonic() + within_sec
    while (await status_of(http, url, rollout_id))["status"] != wanted:
        assert time.monotonic() < deadline, f"{rollout_id} never became {wanted}"
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------------- reference routes


async def test_health(server: tuple[str, Any, Path], http: httpx.AsyncClient) -> None:
    url, app, _ = server
    health = (await http.get(f"{url}/health")).json()
    service = app.state.rollout_service
    assert health["status"] == "ok" and health["backend"] == "local"
    assert health["process_id"] == service.process_id
    assert isinstance(health["instance_id"], str) and health["instance_id"]
    assert set(health["lifecycle"]) == {"accepting_rollouts", "active_rollouts"}
    assert health["lifecycle"]["accepting_rollouts"] is True
    assert health["concurrency"]["max_concurrent"] == 4


async def test_submit_and_fetch_the_result(
    server: tuple[str, Any, Path], http: httpx.AsyncClient
) -> None:
    url, app, _ = server
    body = rollout_body()
    response = await http.post(f"{url}/rollout", json=body)
    assert response.status_code == 202
    admission = response.json()
    assert set(admission) == {
        "rollout_id",
        "status",
        "polling_lease_token",
        "result_wait_timeout_sec",
        "polling_lease_timeout_sec",
    }
    assert admission["status"] == "queued" and admission["rollout_id"] == body["rollout_id"]
    assert (admission["result_wait_timeout_sec"], admission["polling_lease_timeout_sec"]) == (
        1.0,
        30.0,
    )
    assert response.headers["x-harbor-exec-features"] == "status-wait"
    token = admission["polling_lease_token"]
    # Only the token's hash is held.
    entry = app.state.rollout_service.registry.get(body["rollout_id"])
    assert entry.lease_digest == hashlib.sha256(token.encode()).digest()
    assert all(getattr(entry, slot, None) != token for slot in type(entry).__slots__)

    result = await final_result(http, url, body["rollout_id"], token)
    # 0.3.8's fields, plus when the agent started (additive: older clients ignore it).
    assert set(result) == {
        "rollout_id",
        "status",
        "sample",
        "err_message",
        "err_category",
        "agent_started_at",
    }
    started = datetime.fromisoformat(result["agent_started_at"])
    assert started.tzinfo is not None and abs(datetime.now(UTC) - started).total_seconds() < 60
    assert result["status"] == "success" and result["err_message"] is None
    assert set(result["sample"]) == {
        "messages",
        "label",
        "reward",
        "remove_sample",
        "metrics",
        "extra_fields",
    }
    assert result["sample"]["reward"] == 1.0
    # A finished result can be fetched again while retained.
    again = await http.get(f"{url}/rollout/{body['rollout_id']}/result", headers={LEASE: token})
    assert again.json() == result


async def test_duplicate_ids_are_refused_while_active_or_retained(
    server: tuple[str, Any, Path], http: httpx.AsyncClient
) -> None:
    url, _, _ = server
    name, held = gate()
    rollout_id, token = await submit(http, url, metadata={"hold": name})
    duplicate = await http.post(f"{url}/rollout", json=rollout_body(rollout_id))
    assert (duplicate.status_code, duplicate.json()) == (
        409,
        {"detail": "rollout_id is already registered"},
    )
    held.open()
    await final_result(http, url, rollout_id, token)
    retained = await http.post(f"{url}/rollout", json=rollout_body(rollout_id))
    assert retained.status_code == 409


async def test_lease_header_errors(server: tuple[str, Any, Path], http: httpx.AsyncClient) -> None:
    url, _, _ = server
    rollout_id, token = await submit(http, url)
    wrong = await http.get(f"{url}/rollout/{rollout_id}/result", headers={LEASE: "nope"})
    assert (wrong.status_code, wrong.json()) == (403, {"detail": "invalid polling lease"})
    unknown = await http.get(f"{url}/rollout/{uuid.uuid4().hex}/result", headers={LEASE: token})
    assert (unknown.status_code, unknown.json()) == (404, {"detail": "unknown rollout_id"})
    missing = await http.get(f"{url}/rollout/{rollout_id}/result")
    assert missing.status_code == 422
    assert missing.json()["detail"][0]["loc"] == ["header", LEASE]
    empty = await http.get(f"{url}/rollout/{rollout_id}/result", headers={LEASE: ""})
    assert empty.status_code == 422
    assert empty.json()["detail"][0]["type"] == "string_too_short"
    await final_result(http, url, rollout_id, token)


async def test_long_poll_parks_until_the_status_changes_or_the_wait_passes(
    server: tuple[str, Any, Path], http: httpx.AsyncClient
) -> None:
    url, _, _ = server
    # Wall-clock on purpose: that the poll parked is measured.
    rollout_id, token = await submit(http, url, metadata={"sleep": 0.5})
    await wait_for_status(http, url, rollout_id, "running")
    started = time.monotonic()
    result = (await http.get(f"{url}/rollout/{rollout_id}/result", headers={LEASE: token})).json()
    assert result["status"] == "success"
    assert time.monotonic() - started > 0.3  # it parked instead of answering "running"

    rollout_id, token = await submit(http, url, metadata={"hold": NEVER})
    await wait_for_status(http, url, rollout_id, "running")
    started = time.monotonic()
    response = await http.get(f"{url}/rollout/{rollout_id}/result", headers={LEASE: token})
    elapsed = time.monotonic() - started
    assert response.json() == {
        "rollout_id": rollout_id,
        "status": "running",
        "sample": None,
        "err_message": None,
        "err_category": None,
    }
    assert 0.8 < elapsed < 2.5  # the 1 s wait, not an immediate answer
    await http.post(f"{url}/rollout/cancel", json={"ids": [rollout_id]})


BAD_BODIES: list[tuple[str, bytes, str]] = [
    ("malformed JSON", b'{"rollout_id": "x",', "json_invalid"),
    ("not an object", b"[1, 2]", "model_type"),
    ("missing fields", b'{"rollout_id": "x"}', "initial_messages"),
    ("slash in id", json.dumps(rollout_body("a/b")).encode(), "rollout_id"),
    ("dot-dot id", json.dumps(rollout_body("..")).encode(), "rollout_id"),
    ("NUL in id", json.dumps(rollout_body("a\x00b")).encode(), "rollout_id"),
    ("empty id", json.dumps(rollout_body("")).encode(), "rollout_id"),
    (
        "NaN timeout",
        json.dumps(rollout_body(agent_timeout_sec=math.nan)).encode(),
        "agent_timeout_sec",
    ),
    (
        "infinite timeout",
        json.dumps(rollout_body(grader_timeout_sec=math.inf)).encode(),
        "grader_timeout_sec",
    ),
    ("empty llm key", json.dumps(rollout_body(llm_api_key="")).encode(), "llm_api_key"),
    ("wrong type", json.dumps(rollout_body(grade="maybe")).encode(), "grade"),
]


@pytest.mark.parametrize(("case", "body", "named"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
async def test_bad_requests_get_422_naming_the_field(
    server: tuple[str, Any, Path], http: httpx.AsyncClient, case: str, body: bytes, named: str
) -> None:
    url, _, _ = server
    response = await http.post(
        f"{url}/rollout", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 422, (case, response.text)
    assert named in response.text
    detail = response.json()["detail"]
    assert detail[0]["loc"][0] == "body"
    json.dumps(detail, allow_nan=False)  # the error body itself is valid JSON


async def test_oversized_bodies_get_413(tmp_path: Path, http: httpx.AsyncClient) -> None:
    with serve(local_app(tmp_path, max_body_bytes=1024)) as url:
        big = rollout_body(metadata={"pad": "x" * 4096})
        response = await http.post(f"{url}/rollout", json=big)
        assert response.status_code == 413 and "1024-byte limit" in response.json()["detail"]

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(8):
                yield b" " * 512

        chunked = await http.post(f"{url}/rollout", content=chunks())
        assert chunked.status_code == 413
        for path in ("/rollout/cancel", "/prewarm"):
            assert (await http.post(f"{url}{path}", content=b" " * 2048)).status_code == 413
        small = await http.post(f"{url}/rollout", json=rollout_body())
        assert small.status_code == 202


async def test_cancel_selectors_and_idempotent_dispositions(
    server: tuple[str, Any, Path], http: httpx.AsyncClient
) -> None:
    url, _, _ = server
    for body in ({}, {"ids": ["a"], "all": True}, {"ids": ["a"], "prefix": "b"}):
        response = await http.post(f"{url}/rollout/cancel", json=body)
        assert (response.status_code, response.json()) == (
            422,
            {"detail": "pass exactly one selector: ids, prefix, or all"},
        )
    assert (await http.post(f"{url}/rollout/cancel", content=b"{")).status_code == 422
    unknown = uuid.uuid4().hex
    response = await http.post(f"{url}/rollout/cancel", json={"ids": [unknown]})
    assert response.json() == {"dispositions": {unknown: "not_found"}}

    rollout_id, token = await submit(http, url, metadata={"hold": NEVER})
    await wait_for_status(http, url, rollout_id, "running")
    first = await http.post(f"{url}/rollout/cancel", json={"ids": [rollout_id]})
    assert first.json() == {"dispositions": {rollout_id: "cancelled_running"}}
    second = await http.post(f"{url}/rollout/cancel", json={"ids": [rollout_id]})
    assert second.json() == {"dispositions": {rollout_id: "not_found"}}
    result = await final_result(http, url, rollout_id, token)
    assert (result["status"], result["err_message"]) == ("cancelled", "cancelled")
    assert wait_until(lambda: workflow_was_cancelled(rollout_id))
    assert (await http.post(f"{url}/rollout/cancel", json={"ids": [rollout_id]})).json() == {
        "dispositions": {rollout_id: "not_found"}
    }


async def test_cancel_while_queued_and_by_prefix_and_all(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    app = local_app(tmp_path, workflow_config=SINGLE_SLOT, result_wait_timeout_sec=1.0)
    with serve(app) as url:
        running, running_token = await submit(
            http, url, rollout_id="job-run", metadata={"hold": NEVER}
        )
        await wait_for_status(http, url, running, "running")
        queued, queued_token = await submit(
            http, url, rollout_id="job-wait", metadata={"hold": NEVER}
        )

        async def one_queued() -> bool:
            return bool((await http.get(f"{url}/queue")).json()["queued"] == 1)

        assert await wait_until_async(one_queued)
        assert (await status_of(http, url, queued))["status"] == "queued"
        queue = (await http.get(f"{url}/queue")).json()
        assert queue == {"queued": 1, "running": 1, "capacity": 1, "max_queue_depth": None}
        response = await http.post(f"{url}/rollout/cancel", json={"ids": [queued]})
        assert response.json() == {"dispositions": {queued: "cancelled_queued"}}
        assert (await final_result(http, url, queued, queued_token))["status"] == "cancelled"

        response = await http.post(f"{url}/rollout/cancel", json={"prefix": "job-"})
        # The finished-but-retained one is not_found; the running one is cancelled.
        assert response.json() == {
            "dispositions": {running: "cancelled_running", queued: "not_found"}
        }
        assert (await final_result(http, url, running, running_token))["status"] == "cancelled"
        other, other_token = await submit(http, url, metadata={"hold": NEVER})
        response = await http.post(f"{url}/rollout/cancel", json={"all": True})
        assert response.json()["dispositions"][other] in ("cancelled_queued", "cancelled_running")
        assert (await final_result(http, url, other, other_token))["status"] == "cancelled"


async def test_lease_expiry_fails_and_cancels_the_work(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    app = local_app(tmp_path, result_wait_timeout_sec=0.3, polling_lease_timeout_sec=0.8)
    with serve(app) as url:
        rollout_id, token = await submit(http, url, metadata={"hold": NEVER})
        # Runs past the other's lease (0.8 s) while polled: kept alive by the polls.
        kept, kept_token = await submit(http, url, metadata={"sleep": 1.5})
        deadline = time.monotonic() + 10
        # Keep polling one of them: its lease is renewed on every poll.
        kept_result: dict[str, Any] = {}
        while time.monotonic() < deadline:
            response = await http.get(f"{url}/rollout/{kept}/result", headers={LEASE: kept_token})
            kept_result = response.json()
            if kept_result["status"] == "success":
                break
        assert kept_result["status"] == "success"
        state = await status_of(http, url, rollout_id)
        assert (state["status"], state["err_category"], state["err_message"]) == (
            "failure",
            "lease_expired",
            "polling lease expired",
        )
        result = await final_result(http, url, rollout_id, token)
        assert (result["status"], result["err_category"]) == ("failure", "lease_expired")
        assert wait_until(lambda: workflow_was_cancelled(rollout_id))
        metrics = (await http.get(f"{url}/metrics")).text
        completed = "harbor_exec_rollouts_completed_total"
        assert metric(metrics, completed, status="failure", err_category="lease_expired") == 1


async def test_wire_reward_rules(server: tuple[str, Any, Path], http: httpx.AsyncClient) -> None:
    url, _, _ = server
    rollout_id, token = await submit(http, url, metadata={"remove": True})
    removed = await final_result(http, url, rollout_id, token)
    assert removed["status"] == "success"
    assert removed["sample"]["remove_sample"] is True and removed["sample"]["reward"] is None

    rollout_id, token = await submit(http, url, metadata={"grader_raise": "grader broke"})
    failed = await final_result(http, url, rollout_id, token)
    assert (failed["status"], failed["err_message"], failed["err_category"]) == (
        "failure",
        "grader broke",
        "agent_error",
    )
    assert failed["sample"]["reward"] is None and failed["sample"]["messages"]

    rollout_id, token = await submit(http, url, metadata={"raise": "workflow broke"})
    crashed = await final_result(http, url, rollout_id, token)
    assert (crashed["sample"], crashed["err_message"]) == (None, "workflow broke")

    rollout_id, token = await submit(http, url, grade=False)
    ungraded = await final_result(http, url, rollout_id, token)
    assert ungraded["status"] == "success" and ungraded["sample"]["reward"] is None

    rollout_id, token = await submit(http, url, label=None)
    no_label = await final_result(http, url, rollout_id, token)
    assert (no_label["status"], no_label["err_category"]) == ("failure", "validation_error")
    assert "neither a label nor metadata" in no_label["err_message"]


async def test_results_expire_after_retention(tmp_path: Path, http: httpx.AsyncClient) -> None:
    app = local_app(tmp_path, result_wait_timeout_sec=0.5, result_retention_sec=0.3)
    with serve(app) as url:
        rollout_id, token = await submit(http, url, rollout_id="reused")
        assert (await final_result(http, url, rollout_id, token))["status"] == "success"
        assert wait_until(lambda: app.state.rollout_service.registry.get("reused") is None, 3)
        gone = await http.get(f"{url}/rollout/{rollout_id}/result", headers={LEASE: token})
        assert gone.status_code == 404
        again = await http.post(f"{url}/rollout", json=rollout_body("reused"))
        assert again.status_code == 202


# ---------------------------------------------------------------------------- additions


async def test_status_route(server: tuple[str, Any, Path], http: httpx.AsyncClient) -> None:
    url, _, _ = server
    # Wall-clock on purpose: that the status long-poll parked is measured.
    rollout_id, token = await submit(http, url, metadata={"sleep": 0.5})
    await wait_for_status(http, url, rollout_id, "running")
    started = time.monotonic()
    response = await http.get(
        f"{url}/rollout/{rollout_id}/status", params={"status": "running", "wait": "5"}
    )
    # Parked until the change (and never longer than the server's 1 s wait).
    assert response.json()["status"] == "success"
    assert 0.2 < time.monotonic() - started < 1.5
    assert response.json() == {
        "rollout_id": rollout_id,
        "status": "success",
        "reward": 1.0,
        "err_message": None,
        "err_category": None,
    }
    for params in ({"status": "bogus"}, {"wait": "nan"}, {"wait": "-1"}, {"wait": "soon"}):
        bad = await http.get(f"{url}/rollout/{rollout_id}/status", params=params)
        assert bad.status_code == 422
        assert bad.json()["detail"][0]["loc"] == ["query", next(iter(params))]
    unknown = await http.get(f"{url}/rollout/{uuid.uuid4().hex}/status")
    assert unknown.status_code == 404
    assert (await final_result(http, url, rollout_id, token))["status"] == "success"


async def test_queue_and_metrics(server: tuple[str, Any, Path], http: httpx.AsyncClient) -> None:
    url, _, _ = server
    rollout_id, token = await submit(http, url)
    await final_result(http, url, rollout_id, token)
    queue = (await http.get(f"{url}/queue")).json()
    assert set(queue) == {"queued", "running", "capacity", "max_queue_depth"}
    assert queue["capacity"] == 4
    response = await http.get(f"{url}/metrics")
    assert response.headers["content-type"] == PROMETHEUS_CONTENT_TYPE
    assert PROMETHEUS_CONTENT_TYPE.startswith("text/plain; version=0.0.4")
    text = response.text
    # prometheus-client's parser reads every line (it raises on a malformed one).
    samples = metric_samples(text)
    names = {name for name, _ in samples}
    assert (metric(text, "harbor_exec_rollouts_admitted_total") or 0) >= 1
    assert (metric(text, "harbor_exec_result_polls_total") or 0) >= 1
    done = metric(text, "harbor_exec_rollouts_completed_total", status="success", err_category="")
    assert done is not None and done >= 1
    assert metric(text, "harbor_exec_backend_capacity") == 4
    assert metric(text, "harbor_exec_accepting_rollouts") == 1
    assert metric(text, "harbor_exec_rollouts_queued") is not None
    assert metric(text, "harbor_exec_trajectories_dropped_total") == 0
    finished = metric(text, "harbor_exec_rollout_duration_seconds_bucket", le="+Inf")
    assert finished == metric(text, "harbor_exec_rollout_duration_seconds_count") and finished
    assert (metric(text, "harbor_exec_rollout_queued_seconds_count") or 0) >= 1
    # Process-wide metrics from prometheus-client's default registry: the process
    # and the runtime, and the model relays' totals.
    assert (metric(text, "process_cpu_seconds_total") or 0) > 0
    assert (metric(text, "process_resident_memory_bytes") or 0) > 0
    assert "python_gc_collections_total" in names
    assert "python_info" in names
    assert metric(text, "harbor_exec_relay_started_total") == RELAY_TOTALS.relays_started
    assert metric(text, "harbor_exec_relay_tokens_total", kind="prompt") is not None


class PrewarmBackend(LocalBackend):
    def __init__(self, root: Path) -> None:
        super().__init__(workflow=ScriptedWorkflow, grader=ExactMatchGrader, artifact_root=root)
        self.requests: list[list[str] | None] = []

    async def prewarm(self, task_ids: list[str] | None) -> PrewarmSummary:
        self.requests.append(task_ids)
        if task_ids == ["unknown"]:
            raise ValueError("no task 'unknown'")
        return PrewarmSummary(total=len(task_ids or ["a", "b"]), built=1)


async def test_prewarm_route(tmp_path: Path, http: httpx.AsyncClient) -> None:
    with serve(local_app(tmp_path)) as url:
        default = await http.post(f"{url}/prewarm", json={"all": True})
        assert default.json() == {"total": 0, "built": 0, "cached": 0, "failed": 0,
                                  "failed_tasks": {}, "seconds": {}}  # fmt: skip
    backend = PrewarmBackend(tmp_path)
    with serve(local_app(tmp_path, backend=backend)) as url:
        assert (await http.post(f"{url}/prewarm", json={"task_ids": ["t1"]})).json()["total"] == 1
        assert (await http.post(f"{url}/prewarm", json={"all": True})).json()["total"] == 2
        assert backend.requests == [["t1"], None]
        refused = await http.post(f"{url}/prewarm", json={"task_ids": ["unknown"]})
        assert refused.status_code == 400 and "no task 'unknown'" in refused.json()["detail"]
        for body in ({}, {"task_ids": ["a"], "all": True}):
            response = await http.post(f"{url}/prewarm", json=body)
            assert response.status_code == 422
        typed = await http.post(f"{url}/prewarm", json={"task_ids": "t1"})
        assert typed.status_code == 422 and typed.json()["detail"][0]["loc"] == ["body", "task_ids"]


async def test_bearer_key_on_every_route(tmp_path: Path, http: httpx.AsyncClient) -> None:
    with serve(local_app(tmp_path, api_key="server-secret")) as url:
        routes = [
            ("GET", "/health"),
            ("GET", "/queue"),
            ("GET", "/metrics"),
            ("GET", "/docs"),
            ("POST", "/rollout"),
            ("POST", "/rollout/cancel"),
            ("POST", "/prewarm"),
            ("GET", "/rollout/x/result"),
            ("GET", "/rollout/x/status"),
        ]
        for method, path in routes:
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "server-secret"},
            ):
                response = await http.request(method, f"{url}{path}", headers=headers)
                assert (response.status_code, response.json()) == (401, {"detail": "unauthorized"})
        auth = {"Authorization": "Bearer server-secret"}
        assert (await http.get(f"{url}/health", headers=auth)).status_code == 200
        response = await http.post(f"{url}/rollout", json=rollout_body(), headers=auth)
        assert response.status_code == 202


async def test_full_backend_gets_429_and_shutdown_gets_503(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    app = local_app(tmp_path, backend=FullBackend(tmp_path, refusals=1))
    with serve(app) as url:
        full = await http.post(f"{url}/rollout", json=rollout_body())
        assert full.status_code == 429
        assert full.headers["retry-after"] == "1"
        assert full.json() == {"detail": "rollout queue is full; retry later"}
        assert (await http.post(f"{url}/rollout", json=rollout_body())).status_code == 202
        app.state.rollout_service.accepting = False
        closing = await http.post(f"{url}/rollout", json=rollout_body())
        assert (closing.status_code, closing.json()) == (
            503,
            {"detail": "rollout server is shutting down"},
        )
        assert (await http.get(f"{url}/health")).json()["lifecycle"]["accepting_rollouts"] is False
        metrics = (await http.get(f"{url}/metrics")).text
        rejected = "harbor_exec_rollouts_rejected_total"
        assert metric(metrics, rejected, reason="queue_full") == 1
        assert metric(metrics, rejected, reason="shutting_down") == 1


class ScriptedBackend(ExecutionBackend):
    """Returns or raises whatever the test scripted, with diagnostics."""

    def __init__(self) -> None:
        self.shutdowns = 0

    async def execute(
        self, request: ExecutionRequest, rollout: RolloutContext | None = None
    ) -> ExecutionOutcome:
        mode = (request.metadata or {}).get("mode")
        if mode == "raise":
            raise ValueError("backend refused the request")
        if mode == "empty-raise":
            raise RuntimeError()
        status = RolloutStatus.RUNNING if mode == "non-terminal" else RolloutStatus.FAILURE
        return ExecutionOutcome(
            workflow=ExecutionResult(
                status=status,
                err_message="trial failed: key sk-diag-secret-1 leaked",
                extra_fields={"phase": "agent", "api_key": "plain", "note": "sk-diag-secret-1"},
            )
        )

    async def shutdown(self) -> None:
        self.shutdowns += 1


async def test_backend_errors_become_failures_and_diagnostics_are_redacted(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    backend = ScriptedBackend()
    thread = ServerThread(local_app(tmp_path, backend=backend))
    url = thread.start()
    try:
        rollout_id, token = await submit(http, url, metadata={"mode": "raise"})
        result = await final_result(http, url, rollout_id, token)
        assert (result["status"], result["err_message"], result["err_category"]) == (
            "failure",
            "backend refused the request",
            "validation_error",
        )
        rollout_id, token = await submit(http, url, metadata={"mode": "empty-raise"})
        result = await final_result(http, url, rollout_id, token)
        assert (result["err_message"], result["err_category"]) == (
            "Internal server error",
            "agent_error",
        )
        rollout_id, token = await submit(http, url, metadata={"mode": "non-terminal"})
        result = await final_result(http, url, rollout_id, token)
        assert result["err_category"] == "internal_error"
        rollout_id, token = await submit(
            http, url, metadata={"mode": "failure"}, llm_api_key="sk-diag-secret-1"
        )
        result = await final_result(http, url, rollout_id, token)
        assert result["status"] == "failure"
        diagnostics = tmp_path / rollout_id / "diagnostics.json"
        assert wait_until(diagnostics.exists)
        saved = json.loads(diagnostics.read_text())
        assert saved == {"phase": "agent", "api_key": REDACTED, "note": REDACTED}
        assert not (tmp_path / rollout_id / "trajectory.json").exists()
    finally:
        thread.stop()
    assert backend.shutdowns == 1


async def test_trajectory_file_with_secrets_redacted(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    key = "sk-test-secret-123"
    with serve(local_app(tmp_path, api_key="server-secret-456")) as url:
        auth = {"Authorization": "Bearer server-secret-456"}
        body = rollout_body(
            llm_api_key=key,
            metadata={"echo_key": True, "token": "also-secret", "answer": "server-secret-456"},
            extra_fields={"row_index": 3},
        )
        response = await http.post(f"{url}/rollout", json=body, headers=auth)
        token = response.json()["polling_lease_token"]
        result = await http.get(
            f"{url}/rollout/{body['rollout_id']}/result", headers={LEASE: token, **auth}
        )
        # The wire answer is the workflow's own output; only files are scrubbed.
        assert result.json()["sample"]["messages"][-1]["content"].startswith("server-secret-456")
        path = tmp_path / body["rollout_id"] / "trajectory.json"
        assert wait_until(path.exists)
    text = path.read_text()
    assert key not in text and "server-secret-456" not in text and "also-secret" not in text
    document = json.loads(text)
    assert document["schema_version"] == "ATIF-v1.7"
    assert document["session_id"] == body["rollout_id"]
    assert [s["source"] for s in document["steps"]] == ["user", "agent"]
    assert document["steps"][1]["message"] == f"{REDACTED} (key {REDACTED})"
    extra = document["extra"]["harbor_exec"]
    assert extra["request_metadata"]["token"] == REDACTED
    assert extra["request_extra_fields"] == {"row_index": 3}
    assert extra["label"] == "4" and extra["reward"] == 0.0


def test_trajectory_document_and_redaction_units() -> None:
    sample = RolloutSample(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "run ls"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "content": "a.txt", "tool_call_id": "c1"},
            {"role": "critic", "content": "fine"},
        ],
        reward=0.5,
        metrics={"bad": math.nan},
    )
    document = build_trajectory_document("r", sample, label="x", metadata=None, extra_fields=None)
    assert [s["source"] for s in document["steps"]] == ["system", "user", "agent", "user"]
    assert document["steps"][2]["observation"] == {
        "results": [{"content": "a.txt", "source_call_id": "c1"}]
    }
    assert document["steps"][3]["extra"] == {"original_role": "critic"}
    encoded = json.loads(encode_redacted(document, ("zz",)))  # NaN metrics survive as null
    assert encoded["extra"]["harbor_exec"]["sample_metrics"] == {"bad": None}
    redacted = redact_secrets(
        # "ab" is under MIN_SECRET_LEN: not worth mangling every text that holds it.
        {"Authorization": "Bearer x", "my_password": "p", "list": ["has abcdefgh ab"], "n": 1},
        ["abcdefgh", "ab"],
    )
    assert redacted == {
        "Authorization": REDACTED,
        "my_password": REDACTED,
        "list": [f"has {REDACTED} ab"],
        "n": 1,
    }


def test_server_metrics_are_per_server_and_cumulative() -> None:
    first, second = ServerMetrics(), ServerMetrics()
    for seconds in (0.05, 0.5, 0.5, 5.0):
        first.complete("success", None, seconds)
    first.complete("failure", "agent_error", 0.01)
    first.reject("queue_full")
    first.reject("queue_full")
    first.admit()
    second.admit()
    second.admit()
    gauges = {"harbor_exec_rollouts_active": ("Admitted rollouts not finished.", 3)}
    text = first.render({**gauges, "harbor_exec_backend_capacity": ("Unknown here.", None)})
    histogram = "harbor_exec_rollout_duration_seconds"
    assert metric(text, f"{histogram}_bucket", le="0.05") == 2  # 0.01 and 0.05
    assert metric(text, f"{histogram}_bucket", le="1.0") == 4
    assert metric(text, f"{histogram}_bucket", le="+Inf") == 5
    assert metric(text, f"{histogram}_count") == 5
    assert metric(text, f"{histogram}_sum") == pytest.approx(6.06)
    completed = "harbor_exec_rollouts_completed_total"
    assert metric(text, completed, status="success", err_category="") == 4
    assert metric(text, completed, status="failure", err_category="agent_error") == 1
    assert metric(text, "harbor_exec_rollouts_rejected_total", reason="queue_full") == 2
    assert metric(text, "harbor_exec_rollouts_active") == 3
    assert "harbor_exec_backend_capacity" not in text  # None: not exposed
    # One registry per server: the second server's counts are its own.
    assert (first.admitted, second.admitted) == (1, 2)
    assert metric(second.render({}), "harbor_exec_rollouts_admitted_total") == 2
    assert metric(second.render({}), completed, status="success", err_category="") is None


def test_create_rollout_server_rejects_inconsistent_settings(tmp_path: Path) -> None:
    backend = LocalBackend(workflow=ScriptedWorkflow, artifact_root=tmp_path)
    for options, message in (
        ({"result_wait_timeout_sec": 0}, "result_wait_timeout_sec"),
        ({"result_wait_timeout_sec": math.nan}, "result_wait_timeout_sec"),
        ({"result_retention_sec": -1}, "result_retention_sec"),
        ({"result_retention_sec": math.inf}, "result_retention_sec"),
        ({"polling_lease_timeout_sec": 30}, "polling_lease_timeout_sec"),
        ({"api_key": "  "}, "api_key"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
    ):
        with pytest.raises(ValueError, match=message):
            create_rollout_server(backend=backend, **options)


# ---------------------------------------------------------------------------- shutdown and CLI


async def test_graceful_shutdown_drains_then_cancels(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    class Recording(LocalBackend):
        shutdowns = 0

        async def shutdown(self) -> None:
            Recording.shutdowns += 1

    backend = Recording(workflow=ScriptedWorkflow, grader=ExactMatchGrader, artifact_root=tmp_path)
    app = local_app(tmp_path, backend=backend, shutdown_drain_sec=0.5)
    thread = ServerThread(app, graceful_shutdown_sec=0.5)
    url = thread.start()
    slow, _ = await submit(http, url, metadata={"hold": NEVER})
    quick, _ = await submit(http, url, metadata={"sleep": 0.2})  # ends within the drain
    await wait_for_status(http, url, slow, "running")
    started = time.monotonic()
    await asyncio.to_thread(thread.stop)
    assert time.monotonic() - started < 10
    service = app.state.rollout_service
    assert service.registry.get(quick).final.status is RolloutStatus.SUCCESS
    assert service.registry.get(slow).final.status is RolloutStatus.CANCELLED
    assert workflow_was_cancelled(slow)
    assert Recording.shutdowns == 1 and not service.tasks and not service.accepting


def _wait_healthy(url: str, headers: dict[str, str], process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("harbor-exec serve did not come up")


def test_cli_serve_runs_a_workflow(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TEST_SERVE_KEY": "cli-secret"}
    command = [
        sys.executable, "-m", "harbor_exec.cli", "serve",
        "--workflow", "tests.server_utils:ScriptedWorkflow",
        "--grader", "tests.server_utils:ExactMatchGrader",
        "--workflow-config", "tests.server_utils:SINGLE_SLOT",
        "--port", str(port), "--api-key-env", "TEST_SERVE_KEY",
        "--artifact-root", str(tmp_path),
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).parent.parent,
    )

    async def use_it() -> None:
        async with RolloutClient(url=url, api_key="cli-secret") as client:
            result = await client.run_rollout(PROMPT, CHAT_URL, "cli-1", label="4")
            assert result.status is RolloutStatus.SUCCESS
            assert result.sample is not None and result.sample.reward == 1.0
            assert (await client.health())["concurrency"]["max_concurrent"] == 1
            # serve runs uvicorn on uvloop with httptools (the server extra has both).
            stack = await client.run_rollout(
                PROMPT, CHAT_URL, "cli-2", label="uvloop httptools", metadata={"report_stack": 1}
            )
            assert stack.sample is not None and stack.sample.messages[-1]["content"] == (
                "uvloop httptools"
            )

    try:
        _wait_healthy(url, {"Authorization": "Bearer cli-secret"}, process)
        asyncio.run(use_it())
    finally:
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    assert wait_until((tmp_path / "cli-1" / "trajectory.json").exists)
    assert process.stderr is not None
    assert b"event loop uvloop, HTTP parser httptools" in process.stderr.read()


def test_serve_falls_back_without_uvloop_or_httptools(monkeypatch: pytest.MonkeyPatch) -> None:
    assert uvicorn_implementations() == ("uvloop", "httptools")
    # A None entry in sys.modules makes the module unimportable.
    monkeypatch.setitem(sys.modules, "uvloop", None)
    assert uvicorn_implementations() == ("asyncio", "httptools")
    monkeypatch.setitem(sys.modules, "httptools", None)
    assert uvicorn_implementations() == ("asyncio", "h11")
    monkeypatch.delitem(sys.modules, "uvloop")
    assert uvicorn_implementations() == ("uvloop", "h11")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ([], "--workflow"),
        (["--workflow", "tests.server_utils:Missing"], "Missing"),
        (["--workflow", "no_colon"], "module:attr"),
        (["--app", "harbor_exec.authoring:TERMINAL_STATUSES"], "not an ASGI application"),
        (["--app", "x:y", "--workflow", "a:b"], "--app serves an app"),
        (["--workflow", "tests.server_utils:ScriptedWorkflow", "--api-key-env", "NO_SUCH_VAR_X"],
         "NO_SUCH_VAR_X"),
    ],
)  # fmt: skip
def test_cli_serve_explains_bad_options(arguments: list[str], message: str) -> None:
    from harbor_exec.cli.app import app

    # In-process: every one of these is refused before a server would start.
    result = CliRunner().invoke(app, ["serve", "--port", "0", *arguments], terminal_width=400)
    assert result.exit_code == 2, result.output
    # rich draws the message in a box; compare the words only.
    words = " ".join(result.output.replace("│", " ").split())
    assert message in words, words


@pytest.mark.parametrize("configure", [True, False])
def test_configure_logging_installs_a_handler_only_when_asked_and_none_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, configure: bool
) -> None:
    import logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    local_app(tmp_path, configure_logging=configure)
    installed = list(root.handlers)
    root.handlers.clear()  # before monkeypatch restores pytest's own
    assert bool(installed) is configure
