"""Rollouts you can list (issue 38, point 2): ``GET /rollouts`` pages correctly, newest
first, over 10,000 stored rollouts and filters by status, task and time; a rollout's
detail has its phases, result, reward, error and files; both refuse a request without
the server's key and never show a key or secret; ``/metrics`` has the reward histogram
and the failures by category. Every test serves a real uvicorn on 127.0.0.1."""

from __future__ import annotations

import json
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.protocol import RolloutDetail, RolloutList
from harbor_exec.server.store import DB_NAME, RolloutQuery, RolloutStore
from tests.server_utils import (
    CHAT_URL,
    PROMPT,
    gate,
    harbor_app_over,
    local_app,
    metric,
    serve,
    wait_until,
)

STORED = 10_000
TASKS = ("alpha", "beta", "gamma", "delta", None)
STATUSES = ("success", "success", "success", "failure", "cancelled")
NOW = time.time()


def stored_rows(data_dir: Path) -> dict[str, dict[str, Any]]:
    """10,000 finished rollouts written through the store itself, as a server that ran
    them would have: one a second, mixed statuses and tasks (one in five has none); all
    but the newest 100 are past their retention. By id: what each one is."""
    store = RolloutStore(data_dir)
    rows: dict[str, dict[str, Any]] = {}
    start = NOW - STORED - 10
    for i in range(STORED):
        rollout_id = f"stored-{i:05d}"
        status = STATUSES[i % len(STATUSES)]
        task = TASKS[(i // 5) % len(TASKS)]
        admitted = start + i
        finished = admitted + 0.5 if i >= STORED - 100 else admitted - 5000 + 0.5
        store.admitted(rollout_id, b"d" * 32, "{}", task=task, at=admitted)
        store.status(rollout_id, "running", running_at=admitted + 0.1)
        failed = status == "failure"
        store.finished(
            rollout_id,
            status=status,
            body=json.dumps({"rollout_id": rollout_id, "status": status}).encode(),
            reward=1.0 if status == "success" else None,
            err_message="boom" if failed else None,
            err_category="agent_error" if failed else None,
            detail=json.dumps({"reason": "boom", "node": "n1"}) if failed else None,
            at=finished,
        )
        rows[rollout_id] = {"status": status, "task": task, "admitted": admitted, "seq": i}
    store.close()
    return rows


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    data_dir = tmp_path_factory.mktemp("stored") / "data"
    return data_dir, stored_rows(data_dir)


def page_through(http: httpx.Client, limit: int, **filters: Any) -> list[dict[str, Any]]:
    """Every rollout ``GET /rollouts`` lists with ``filters``, page by page."""
    seen: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        params = {**filters, "limit": limit, **({"cursor": cursor} if cursor else {})}
        response = http.get("/rollouts", params=params)
        assert response.status_code == 200, response.text
        page = RolloutList.model_validate_json(response.content)
        assert len(page.rollouts) <= limit
        seen.extend(rollout.model_dump(mode="json") for rollout in page.rollouts)
        if page.next_cursor is None:
            return seen
        assert len(page.rollouts) == limit
        cursor = page.next_cursor


def newest_first(rows: dict[str, dict[str, Any]], **wanted: Any) -> list[str]:
    chosen = [
        (row["seq"], rollout_id)
        for rollout_id, row in rows.items()
        if all(row[key] == value for key, value in wanted.items())
    ]
    return [rollout_id for _, rollout_id in sorted(chosen, reverse=True)]


def test_pages_over_10000_stored_rollouts_with_filters(
    tmp_path: Path, stored: tuple[Path, dict[str, dict[str, Any]]]
) -> None:
    data_dir, rows = stored
    app = local_app(tmp_path, data_dir=data_dir)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        # Every rollout exactly once, newest first, across pages of 700 (the last short).
        listed = page_through(http, 700)
        assert [item["rollout_id"] for item in listed] == newest_first(rows)
        assert Counter(item["status"] for item in listed) == Counter(
            row["status"] for row in rows.values()
        )
        assert all(item["seconds"] == pytest.approx(0.5) for item in listed[:100])
        # By status, by task, by both: what was stored, in order, each once.
        for status in ("success", "failure", "cancelled"):
            found = [item["rollout_id"] for item in page_through(http, 333, status=status)]
            assert found == newest_first(rows, status=status), status
        for task in ("alpha", "delta"):
            found = [item["rollout_id"] for item in page_through(http, 1000, task=task)]
            assert found == newest_first(rows, task=task), task
        both = page_through(http, 50, status="failure", task="beta")
        assert [item["rollout_id"] for item in both] == newest_first(
            rows, status="failure", task="beta"
        )
        assert {(item["reason"], item["node"], item["err_category"]) for item in both} == {
            ("boom", "n1", "agent_error")
        }
        # By time of admission: [since, until).
        since, until = NOW - 2000, NOW - 1000
        timed = page_through(http, 400, since=since, until=until)
        assert [item["rollout_id"] for item in timed] == [
            rollout_id
            for rollout_id in newest_first(rows)
            if since <= rows[rollout_id]["admitted"] < until
        ]
        assert page_through(http, 10, status="queued") == []
        # A page answers fast whatever its filters (the indexes): the slowest of a few.
        slowest = 0.0
        for params in ({}, {"status": "failure"}, {"task": "gamma"}, {"cursor": "5000"}):
            began = time.perf_counter()
            assert http.get("/rollouts", params={**params, "limit": 100}).status_code == 200
            slowest = max(slowest, time.perf_counter() - began)
        print(f"slowest page of 100 over {STORED} rows: {slowest * 1000:.1f} ms")
        assert slowest < 1.0
        # A rollout's detail, from the store.
        detail = RolloutDetail.model_validate_json(http.get("/rollouts/stored-09998").content)
        assert detail.status == "failure" and detail.reason == "boom" and detail.node == "n1"
        assert [phase.name for phase in detail.phases] == ["queued", "running"]
        assert detail.phases[0].seconds == pytest.approx(0.1)
        assert http.get("/rollouts/never-admitted").status_code == 404
        # Bad queries are 422s naming the parameter.
        for bad in ({"status": "done"}, {"limit": "0"}, {"limit": "1001"}, {"cursor": "x"}):
            answer = http.get("/rollouts", params=bad)
            assert answer.status_code == 422, bad
            assert answer.json()["detail"][0]["loc"] == ["query", next(iter(bad))]
        for bad in ({"since": "nan"}, {"until": "soon"}, {"task": ""}):
            assert http.get("/rollouts", params=bad).status_code == 422, bad


def test_the_store_pages_with_its_indexes(stored: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    """The plans use an index for each filter (no full scan, no sort of the table)."""
    data_dir, _ = stored
    with sqlite3.connect(data_dir / DB_NAME) as connection:
        for where, index in (
            ("status = 'failure'", "rollouts_by_status"),
            ("task = 'beta'", "rollouts_by_task"),
            ("id = 'stored-00001'", "rollouts_by_id"),
        ):
            plan = " ".join(
                str(row[-1])
                for row in connection.execute(
                    f"EXPLAIN QUERY PLAN SELECT seq FROM rollouts WHERE {where}"
                    " ORDER BY seq DESC LIMIT 10"
                )
            )
            assert index in plan and "TEMP B-TREE" not in plan, (where, plan)


def test_history_outlives_retention_and_is_bounded(tmp_path: Path) -> None:
    """A rollout whose retention ended stays listed (retired); beyond ``history_rows``
    the oldest retired rows go."""
    store = RolloutStore(tmp_path / "data", history_rows=1000)
    for i in range(2500):
        rollout_id = f"r-{i}"
        store.admitted(rollout_id, b"d", "{}", task="t")
        store.finished(
            rollout_id, status="success", body=b"{}", reward=1.0, err_message=None,
            err_category=None,
        )  # fmt: skip
        store.forget(rollout_id)
    store.flush()
    store.flush()
    kept = store.page(RolloutQuery(limit=5000))
    assert 1000 <= len(kept) < 1000 + 1000 + 1
    assert kept[0].rollout_id == "r-2499"
    # The same id admitted again after its retention: a new row, listed as the newest.
    store.admitted("r-2499", b"d", "{}", task="t")
    found = store.find("r-2499")
    assert found is not None and found.status == "queued"
    assert store.load()[0].rollout_id == "r-2499"  # only the live one comes back
    store.close()


def submit(http: httpx.Client, rollout_id: str, key: str = "sk-llm", **metadata: Any) -> str:
    response = http.post(
        "/rollout",
        json={
            "initial_messages": PROMPT,
            "rollout_id": rollout_id,
            "chat_completions_url": CHAT_URL,
            "label": "4",
            "llm_api_key": key,
            "metadata": metadata,
        },
    )
    assert response.status_code == 202, response.text
    token: str = response.json()["polling_lease_token"]
    return token


def finished(http: httpx.Client, rollout_id: str) -> bool:
    status = http.get(f"/rollout/{rollout_id}/status").json()["status"]
    return status in ("success", "failure", "cancelled")


@pytest.mark.parametrize("durable", [True, False], ids=["store", "registry"])
def test_live_rollouts_list_and_detail(tmp_path: Path, durable: bool) -> None:
    """With a store and without one: live and finished rollouts are listed newest first
    with their task (from metadata), status, reward and reason; a detail has its phases,
    metadata and metrics; ``/metrics`` counts rewards and failures by category."""
    options: dict[str, Any] = {"data_dir": tmp_path / "data"} if durable else {}
    app = local_app(tmp_path / "artifacts", **options)
    name, held = gate()
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        submit(http, "ok-1", harbor_task_id="alpha")
        submit(http, "wrong-1", harbor_task_id="alpha", answer="5")
        submit(http, "raised-1", task="beta", **{"raise": "it broke"})
        submit(http, "held-1", harbor_task="tasks/gamma", hold=name)
        assert held.reached.wait(10)
        for rollout_id in ("ok-1", "wrong-1", "raised-1"):
            assert wait_until(lambda rid=rollout_id: finished(http, rid), timeout=10)
        listed = {item["rollout_id"]: item for item in http.get("/rollouts").json()["rollouts"]}
        assert list(listed) == ["held-1", "raised-1", "wrong-1", "ok-1"]
        assert listed["held-1"]["status"] == "running"
        assert listed["held-1"]["task"] == "tasks/gamma"
        assert listed["ok-1"]["reward"] == 1.0 and listed["wrong-1"]["reward"] == 0.0
        assert listed["raised-1"]["status"] == "failure"
        assert listed["raised-1"]["task"] == "beta"
        assert "it broke" in listed["raised-1"]["reason"]
        alpha = http.get("/rollouts", params={"task": "alpha"}).json()["rollouts"]
        assert [item["rollout_id"] for item in alpha] == ["wrong-1", "ok-1"]
        running = http.get("/rollouts", params={"status": "running"}).json()["rollouts"]
        assert [item["rollout_id"] for item in running] == ["held-1"]
        # Trajectories are written shortly after the result, on the writer's thread.
        assert wait_until(lambda: (tmp_path / "artifacts/ok-1/trajectory.json").exists())
        detail = http.get("/rollouts/ok-1").json()
        assert [phase["name"] for phase in detail["phases"]] == ["queued", "running"]
        assert detail["metadata"] == {"harbor_task_id": "alpha"}
        assert detail["metrics"] == {"answer_length": 1.0}
        assert {file["name"] for file in detail["files"]} >= {"trajectory"}
        (trajectory,) = [file for file in detail["files"] if file["name"] == "trajectory"]
        assert http.get(trajectory["url"]).json()["session_id"] == "ok-1"
        held.open()
        assert wait_until(lambda: finished(http, "held-1"), timeout=10)
        text = http.get("/metrics").text
    assert metric(text, "harbor_exec_rollout_reward_count") == 3.0
    assert metric(text, "harbor_exec_rollout_reward_bucket", le="0.0") == 1.0
    assert metric(text, "harbor_exec_rollout_reward_bucket", le="1.0") == 3.0
    assert metric(text, "harbor_exec_rollout_reward_sum") == 2.0
    assert (
        metric(text, "harbor_exec_rollout_failures_total", category="agent_error", origin="agent")
        == 1.0
    )
    assert "task=" not in text  # no per-task labels


SERVER_KEY = "server-key-0123456789"
LLM_KEY = "sk-llm-secret-abcdefgh"


def test_key_required_and_no_secret_shown(tmp_path: Path) -> None:
    """With an API key, both routes refuse a request without it (401); no key or secret
    appears in a list or a detail, nor in the store: the LLM key the workflow put in its
    error, a key in the metadata, the server's key."""
    app = local_app(tmp_path / "artifacts", data_dir=tmp_path / "data", api_key=SERVER_KEY)
    auth = {"Authorization": f"Bearer {SERVER_KEY}"}
    with serve(app) as url, httpx.Client(base_url=url, timeout=30, headers=auth) as http:
        for path in ("/rollouts", "/rollouts/leaky-1", "/rollouts?status=failure"):
            refused = httpx.get(f"{url}{path}")
            assert refused.status_code == 401 and refused.json() == {"detail": "unauthorized"}
            wrong = httpx.get(f"{url}{path}", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
        submit(
            http,
            "leaky-1",
            key=LLM_KEY,
            **{
                "raise": f"upstream refused {LLM_KEY} and {SERVER_KEY}",
                "api_token": "tok-in-metadata-123456",
                "note": f"the key is {LLM_KEY}",
            },
        )
        submit(http, "leaky-2", key=LLM_KEY, echo_key=True)
        for rollout_id in ("leaky-1", "leaky-2"):
            assert wait_until(lambda rid=rollout_id: finished(http, rid), timeout=10)
        bodies = [
            http.get("/rollouts").text,
            http.get("/rollouts", params={"status": "failure"}).text,
            http.get("/rollouts/leaky-1").text,
            http.get("/rollouts/leaky-2").text,
        ]
        detail = json.loads(bodies[2])
        assert detail["reason"].startswith("upstream refused [REDACTED] and [REDACTED]")
        assert detail["metadata"]["api_token"] == "[REDACTED]"
        assert detail["metadata"]["note"] == "the key is [REDACTED]"
    for body in bodies:
        for secret in (LLM_KEY, SERVER_KEY, "tok-in-metadata-123456"):
            assert secret not in body
    # The stored request keeps no key either (only the wire result may, as it is sent).
    with sqlite3.connect(tmp_path / "data" / DB_NAME) as connection:
        kept = [
            row[0]
            for row in connection.execute("SELECT request || coalesce(detail, '') FROM rollouts")
        ]
    assert kept and all(LLM_KEY not in text and SERVER_KEY not in text for text in kept)


def test_harbor_rollout_detail_has_the_trials_phases(tmp_path: Path) -> None:
    """HarborBackend (over FakeRuntime, no Docker) behind the real server: the detail
    names the task the backend resolved, the trial, its directory and the phase timings
    the trial measured; the list filters by that task."""
    from tests.fake_runtime import FakeRuntime

    app = harbor_app_over(FakeRuntime(), tmp_path, "fake-task")
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        submit(http, "h-1")
        assert wait_until(lambda: finished(http, "h-1"), timeout=30)
        listed = http.get("/rollouts", params={"task": "fake-task"}).json()["rollouts"]
        detail = http.get("/rollouts/h-1").json()
    assert [item["rollout_id"] for item in listed] == ["h-1"]
    assert detail["status"] == "success" and detail["reward"] == 1.0, detail
    assert detail["task"] == "fake-task"
    assert detail["trial"] and detail["trial_dir"].startswith(str(tmp_path / "trials"))
    backend_phases = {p["name"] for p in detail["phases"] if p["source"] == "backend"}
    assert {"environment_setup", "agent", "verifier", "total"} <= backend_phases
    assert [p["name"] for p in detail["phases"] if p["source"] == "server"] == [
        "queued",
        "running",
    ]


def test_a_data_dir_of_an_older_server_is_listed(tmp_path: Path) -> None:
    """A data dir written before listing existed (no task, running_at, detail or
    retired columns, no indexes) gains them: its rollouts are restored and listed."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with sqlite3.connect(data_dir / DB_NAME) as connection:
        connection.execute(
            "CREATE TABLE rollouts (seq INTEGER PRIMARY KEY, id TEXT NOT NULL,"
            " lease_digest BLOB NOT NULL, request TEXT, status TEXT NOT NULL,"
            " admitted_at REAL NOT NULL, finished_at REAL, final_body BLOB, reward REAL,"
            " err_message TEXT, err_category TEXT)"
        )
        connection.execute(
            "INSERT INTO rollouts VALUES (1, 'old-1', x'00', '{\"metadata\": null}', 'success',"
            ' ?, ?, \'{"rollout_id":"old-1","status":"success"}\', 1.0, NULL, NULL)',
            (NOW - 5, NOW - 4),
        )
    app = local_app(tmp_path / "artifacts", data_dir=data_dir)
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        submit(http, "new-1", harbor_task_id="alpha")
        assert wait_until(lambda: finished(http, "new-1"))
        listed = http.get("/rollouts").json()["rollouts"]
        assert [(item["rollout_id"], item["task"]) for item in listed] == [
            ("new-1", "alpha"),
            ("old-1", None),
        ]
        assert http.get("/rollouts/old-1").json()["reward"] == 1.0


def test_a_rollouts_files_are_served_and_only_they(tmp_path: Path) -> None:
    """The detail's files with a ``url`` serve their text: the trial's result and
    verifier output, the agent's logs, the trajectory (scrubbed of the server's key); a
    link planted in the trial directory, a name not listed and another rollout's are 404."""
    from harbor_exec.backends.harbor.backend import HarborBackend
    from harbor_exec.executors.local import LocalExecutor
    from harbor_exec.server.app import create_rollout_server
    from tests.fake_runtime import FakeRuntime
    from tests.task_factory import make_task

    backend = HarborBackend(
        tasks_dir=make_task(tmp_path / "tasks", "fake-task"),
        executor=LocalExecutor(FakeRuntime()),
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        cleanup_successful_trials=False,
    )
    app = create_rollout_server(
        backend=backend,
        artifact_root=tmp_path / "server-artifacts",
        data_dir=tmp_path / "data",
        api_key=SERVER_KEY,
        shutdown_drain_sec=0.5,
        shutdown_cleanup_sec=5.0,
    )
    auth = {"Authorization": f"Bearer {SERVER_KEY}"}
    with serve(app) as url, httpx.Client(base_url=url, timeout=30, headers=auth) as http:
        submit(http, "f-1")
        assert wait_until(lambda: finished(http, "f-1"), timeout=30)
        detail = http.get("/rollouts/f-1").json()
        trial_dir = Path(detail["trial_dir"])
        (trial_dir / "agent" / "note.txt").write_text(f"the key {SERVER_KEY} leaked\n")
        (trial_dir / "agent" / "planted").symlink_to("/etc/hostname")
        files = {f["name"]: f for f in http.get("/rollouts/f-1").json()["files"]}
        assert files["trial_dir"]["url"] is None
        assert {"result", "agent/note.txt", "agent/planted"} <= set(files)
        result = http.get(files["result"]["url"])
        assert result.status_code == 200 and result.headers["content-type"].startswith(
            "application/json"
        )
        assert result.json()["trial_name"] == detail["trial"]
        note = http.get(files["agent/note.txt"]["url"])
        assert note.text == "the key [REDACTED] leaked\n"
        assert files["agent/planted"]["url"] is None
        assert http.get("/rollouts/f-1/files/agent/planted").status_code == 404
        assert http.get("/rollouts/f-1/files/..%2F..%2Fetc%2Fhostname").status_code == 404
        assert http.get("/rollouts/f-1/files/nope").status_code == 404
        assert http.get("/rollouts/other/files/result").status_code == 404
        assert httpx.get(f"{url}{files['result']['url']}").status_code == 401
