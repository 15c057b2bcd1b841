"""The live console (issue 38, point 3, without the browser test): ``GET /`` serves a page
from files in the package that loads nothing from elsewhere; ``GET /console/data`` has
the counts, the running rollouts, failures grouped by reason (the infrastructure's apart),
phase percentiles, tasks flagged as always failing or passing, and groups whose rewards
all agree; with an API key the page, its files and its data refuse a request without it;
the data's cost does not grow with the rollouts seen (100,000 here)."""

from __future__ import annotations

import gc
import importlib.resources
import re
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from harbor_exec.protocol import RolloutStatus
from harbor_exec.server.console import ConsoleStats
from harbor_exec.server.registry import RolloutEntry
from tests.server_utils import CHAT_URL, PROMPT, gate, harbor_app_over, local_app, serve, wait_until

KEY = "console-key-0123456789"


def submit(http: httpx.Client, rollout_id: str, key: str | None = None, **metadata: Any) -> None:
    response = http.post(
        "/rollout",
        json={
            "initial_messages": PROMPT,
            "rollout_id": rollout_id,
            "chat_completions_url": CHAT_URL,
            "label": "4",
            "metadata": metadata,
        },
        headers={"Authorization": f"Bearer {key}"} if key else None,
    )
    assert response.status_code == 202, response.text


def test_the_page_and_its_files_come_from_the_package_only(tmp_path: Path) -> None:
    assets = importlib.resources.files("harbor_exec.server") / "assets"
    app = local_app(tmp_path)
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.content == (assets / "index.html").read_bytes()
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for name, media in (("console.js", "text/javascript"), ("console.css", "text/css")):
            answer = http.get(f"/console/{name}")
            assert answer.status_code == 200 and answer.headers["content-type"].startswith(media)
            assert answer.content == (assets / name).read_bytes()
        assert http.get("/console/index.html").status_code == 404
        assert http.get("/console/..%2Fapp.py").status_code == 404
    # Every reference is relative (this server); the only URL is SVG's namespace name.
    for name in ("index.html", "console.js", "console.css"):
        text = (assets / name).read_text()
        found = set(re.findall(r"(?:https?:)?//[\w.-]+", text))
        assert found <= {"http://www.w3.org"}, (name, found)
        assert "@import" not in text and "url(" not in text


def test_the_console_refuses_a_request_without_the_key(tmp_path: Path) -> None:
    """With an API key: the page answers 401 (its body the empty shell that asks for the
    key), its data, the listing, a detail and the docs 401 too; only the page's own code
    and style (the wheel's bytes, nothing of the server) come without the key; a wrong key
    is refused like none."""
    assets = importlib.resources.files("harbor_exec.server") / "assets"
    app = local_app(tmp_path, api_key=KEY)
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        submit(http, "r-1", key=KEY)
        refused = (
            "/console/data", "/rollouts", "/rollouts?status=success", "/rollouts/r-1",
            "/rollouts/r-1/files/trajectory", "/docs", "/redoc", "/openapi.json",
            "/console/swagger-ui/swagger-ui-bundle.js", "/console/redoc/redoc.standalone.js",
            "/metrics", "/queue",
        )  # fmt: skip
        for path in refused:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                answer = http.get(path, headers=headers)
                assert answer.status_code == 401, (path, headers)
                assert answer.json() == {"detail": "unauthorized"}
        page = http.get("/")
        assert page.status_code == 401 and page.content == (assets / "index.html").read_bytes()
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert http.post("/", json={}).status_code == 401
        for name in ("console.js", "console.css", "favicon.svg"):
            answer = http.get(f"/console/{name}")
            assert answer.status_code == 200 and answer.content == (assets / name).read_bytes()
            assert http.post(f"/console/{name}").status_code == 401
        allowed = {"Authorization": f"Bearer {KEY}"}
        for path in ("/", "/console/data", "/rollouts", "/rollouts/r-1", "/redoc", "/docs"):
            assert http.get(path, headers=allowed).status_code == 200, path
    # The page takes the key from the address's fragment or a form, keeps it in this tab's
    # sessionStorage only and sends it as the header (tests/test_console_browser_docker.py
    # runs it in a browser).
    script = (assets / "console.js").read_text()
    assert "sessionStorage" in script and "localStorage" not in script
    assert "Authorization: `Bearer ${key}`" in script
    assert "?key=" not in script and "document.cookie" not in script


def test_console_data_under_a_mixed_load(tmp_path: Path) -> None:
    app = local_app(tmp_path, data_dir=tmp_path / "data")
    name, held = gate()
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        for i in range(3):
            submit(http, f"pass-{i}", harbor_task_id="easy", group_id="g-easy")
            submit(http, f"zero-{i}", harbor_task_id="hard", answer="5", group_id="g-hard")
            submit(http, f"crash-{i}", harbor_task_id="broken", **{"raise": f"disk {i}00 full"})
            submit(http, f"mixed-{i}", harbor_task_id="mixed", answer="4" if i else "5")
        submit(http, "held-1", harbor_task_id="slow", hold=name)
        assert held.reached.wait(10)

        def settled() -> dict[str, Any] | None:
            data: dict[str, Any] = http.get("/console/data").json()
            done = sum(data["counts"][s] for s in ("success", "failure", "cancelled"))
            return data if done == 12 else None

        assert wait_until(lambda: settled() is not None, timeout=10)
        data = settled()
        assert data is not None
        held.open()
    counts = data["counts"]
    assert (counts["success"], counts["failure"], counts["running"]) == (9, 3, 1)
    assert [(r["rollout_id"], r["task"], r["status"]) for r in data["running"]] == [
        ("held-1", "slow", "running")
    ]
    assert data["running"][0]["age_sec"] >= 0
    assert data["running"][0]["phase"] == "agent"  # in-process: the workflow is the agent
    assert len(data["recent"]) == 12
    # The three crashes are one failure group, whatever their numbers.
    (failure,) = data["failures"]
    assert failure["reason"] == "disk # full" and failure["count"] == 3
    assert (failure["category"], failure["origin"]) == ("agent_error", "agent")
    tasks = {row["task"]: row for row in data["tasks"]}
    assert tasks["broken"]["flag"] == "always_fails"
    assert tasks["hard"]["flag"] == "always_fails" and tasks["hard"]["mean_reward"] == 0.0
    assert tasks["easy"]["flag"] == "always_passes" and tasks["easy"]["pass_rate"] == 1.0
    assert tasks["mixed"]["flag"] is None
    assert tasks["mixed"]["mean_reward"] == round(2 / 3, 4)
    assert tasks["easy"]["recent_rewards"] == [1.0, 1.0, 1.0]
    assert tasks["broken"]["recent_rewards"] == [None, None, None]
    groups = {row["group"]: row for row in data["groups_all_equal"]}
    assert set(groups) == {"g-easy", "g-hard"}
    assert (groups["g-hard"]["reward"], groups["g-hard"]["rollouts"]) == (0.0, 3)
    assert {"queued", "running"} <= set(data["phases"])
    phase = data["phases"]["running"]
    assert phase["count"] == 12 and phase["p50"] <= phase["p95"] <= phase["p99"]


def test_console_data_costs_the_same_after_100000_rollouts() -> None:
    """100,000 finished rollouts over 1,000 tasks, 20,000 groups, 8 nodes and 40 failure
    reasons, plus 100 running: the page's data costs well under 100 ms of CPU at p95
    (about 7 ms alone on this machine)."""
    stats = ConsoleStats()
    now = time.time()
    for i in range(100_000):
        entry = RolloutEntry(f"r-{i}", b"", 0.0, 0.0, i)
        entry.wall_admitted = now - 10
        entry.wall_running = now - 9
        entry.wall_finished = now
        entry.task_name = f"task-{i % 1000}"
        entry.metadata = {"group_id": f"g-{i // 5}"}
        failed = i % 7 == 0
        stats.finished(
            entry,
            status="failure" if failed else "success",
            reward=None if failed else float(i % 2),
            err_category="internal_error" if failed else None,
            reason=f"cause {i % 40} on host-{i}" if failed else None,
            info={"node": f"node-{i % 8}", "timings_sec": {"agent": 3.0, "verifier": 1.0}},
        )
    live = []
    for i in range(100):
        entry = RolloutEntry(f"live-{i}", b"", 0.0, 0.0, i)
        entry.status = RolloutStatus.RUNNING
        entry.wall_admitted = now - i
        live.append(entry)
    # CPU time of this thread: what answering costs, whatever else the machine runs; the
    # cyclic collector is held off while measuring (its pauses are the whole process's,
    # a test worker's heap included, not the console's).
    took = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            began = time.thread_time()
            data = stats.data(live, {"queued": 0, "running": 100}, nodes=None, package_cache={})
            took.append(time.thread_time() - began)
    finally:
        gc.enable()
    p95 = statistics.quantiles(took, n=20)[-1]
    print(f"console data over 100,000 rollouts: p95 {p95 * 1000:.1f} ms of CPU")
    assert p95 < 0.1
    assert data["tasks_total"] == 1000 and len(data["tasks"]) == 500
    assert len(data["node_phases"]) == 8 and data["phases"]["agent"]["p99"] == 3.0
    assert {f["reason"] for f in data["failures"]} == {"cause # on host-#" for _ in [0]}


def test_a_restarted_console_starts_from_the_store(tmp_path: Path) -> None:
    """What a previous server finished is read back from its store into the console:
    counts, tasks and their flags, groups, failures."""
    data_dir = tmp_path / "data"
    with (
        serve(local_app(tmp_path, data_dir=data_dir)) as url,
        httpx.Client(base_url=url, timeout=10) as http,
    ):
        for i in range(3):
            submit(http, f"a-{i}", harbor_task_id="hard", answer="5", group_id=7)
            submit(http, f"b-{i}", harbor_task_id="easy", **{"raise": f"no {i}"})

        def done() -> bool:
            counts = http.get("/console/data").json()["counts"]
            return bool(counts["success"] + counts["failure"] == 6)

        assert wait_until(done, timeout=10)
    with (
        serve(local_app(tmp_path, data_dir=data_dir)) as url,
        httpx.Client(base_url=url, timeout=10) as http,
    ):
        data = http.get("/console/data").json()
    assert (data["counts"]["success"], data["counts"]["failure"]) == (3, 3)
    assert data["recent"][0]["rollout_id"] == "b-2"
    tasks = {row["task"]: row for row in data["tasks"]}
    assert tasks["hard"]["flag"] == "always_fails" and tasks["hard"]["rollouts"] == 3
    assert tasks["easy"]["failure"] == 3
    assert [(g["group"], g["rollouts"]) for g in data["groups_all_equal"]] == [("7", 3)]
    (failure,) = data["failures"]
    assert (failure["reason"], failure["count"]) == ("no #", 3)
    assert data["phases"]["queued"]["count"] == 6


def test_docs_work_offline(tmp_path: Path) -> None:
    """``/docs`` is Swagger UI and ``/redoc`` ReDoc, each from the package's own copy:
    each page names only this server's files, each of them is served, nothing in the
    page is an external URL, and its policy allows nothing else."""
    with serve(local_app(tmp_path)) as url, httpx.Client(base_url=url, timeout=10) as http:
        pages = {
            "/docs": [
                "/console/favicon.svg",
                "/console/swagger-ui/swagger-ui-bundle.js",
                "/console/swagger-ui/swagger-ui.css",
            ],
            "/redoc": ["/console/favicon.svg", "/console/redoc/redoc.standalone.js"],
        }
        for path, files in pages.items():
            page = http.get(path)
            assert page.status_code == 200, path
            policy = page.headers["content-security-policy"]
            assert policy.startswith("default-src 'self';"), path
            assert "http" not in policy and "*" not in policy, path
            linked = re.findall(r'(?:src|href|spec-url)="([^"]*)"', page.text)
            assert sorted(linked) == sorted(
                [*files, "/openapi.json"] if path == "/redoc" else files
            )
            assert not re.findall(r"(?:https?:)?//[\w.-]", page.text), path
            for linked_path in linked:
                assert http.get(linked_path).status_code == 200, linked_path
        assert "url: '/openapi.json'" in http.get("/docs").text
        assert http.get("/openapi.json").status_code == 200
    assets = importlib.resources.files("harbor_exec.server") / "assets"
    assert "Apache License" in (assets / "swagger-ui" / "LICENSE").read_text()
    assert "The MIT License" in (assets / "redoc" / "LICENSE").read_text()
    # ReDoc's side menu loaded its logo from Redocly's CDN (the browser test saw it).
    assert "cdn.redoc.ly" not in (assets / "redoc" / "redoc.standalone.js").read_text()
    for bundle in ("swagger-ui/swagger-ui-bundle.js", "redoc/redoc.standalone.js"):
        assert "sourceMappingURL=" not in (assets / bundle).read_text().replace(
            "sourceMappingURL=data:", ""
        ), bundle


def test_running_rollouts_show_their_trials_phase(tmp_path: Path) -> None:
    """HarborBackend (over FakeRuntime, its agent held at the gate) behind the server: the
    console shows the running rollout in its agent phase, and the one waiting for the
    single slot as queued; then the finished one under its task."""
    from harbor_exec.backends.harbor.backend import HarborBackend
    from harbor_exec.executors.local import LocalExecutor
    from harbor_exec.server.app import create_rollout_server
    from tests.fake_runtime import HOLD, FakeRuntime
    from tests.task_factory import make_task

    runtime = FakeRuntime(solve=lambda container: HOLD)
    backend = HarborBackend(
        tasks_dir=make_task(tmp_path / "tasks", "fake-task"),
        executor=LocalExecutor(runtime),
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        max_concurrent_trials=1,
    )
    app = create_rollout_server(
        backend=backend,
        artifact_root=tmp_path / "server-artifacts",
        shutdown_drain_sec=0.5,
        shutdown_cleanup_sec=5.0,
    )
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        submit(http, "first")
        assert runtime.gate.wait_held(1)
        submit(http, "second")
        assert wait_until(lambda: backend.queue_info().queued == 1)
        running = {r["rollout_id"]: r for r in http.get("/console/data").json()["running"]}
        assert (running["first"]["phase"], running["second"]["phase"]) == ("agent", "queued")
        # Template mode: the request names no task; the backend says which when it ends.
        assert running["first"]["task"] is None
        assert running["first"]["phase_sec"] >= 0
        runtime.gate.open()
        assert wait_until(
            lambda: http.get("/console/data").json()["counts"]["success"] == 2, timeout=30
        )
        data = http.get("/console/data").json()
    assert data["running"] == []
    assert [row["task"] for row in data["tasks"]] == ["fake-task"]
    assert {"environment_setup", "agent", "verifier"} <= set(data["phases"])


def test_teardown_is_timed(tmp_path: Path) -> None:
    """A trial's teardown (here its container's removal, held until the console shows
    the rollout in it, then 0.3 s slow) is a live phase of the running rollout, then a
    phase of its own in the rollout's detail and the console's percentiles: from the end
    of the trial's last phase to its end, within the trial's total."""
    import threading

    from tests.fake_runtime import FakeRuntime

    release = threading.Event()

    class SlowRemoval(FakeRuntime):
        def remove(self, container_id: str) -> None:
            release.wait(30)
            time.sleep(0.3)
            super().remove(container_id)

    def live_phase(http: httpx.Client) -> str | None:
        running = http.get("/console/data").json()["running"]
        return running[0]["phase"] if running else None

    app = harbor_app_over(SlowRemoval(), tmp_path, "slow-teardown")
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        submit(http, "torn-down")
        assert wait_until(lambda: live_phase(http) == "teardown", timeout=30)
        release.set()
        assert wait_until(
            lambda: http.get("/console/data").json()["counts"]["success"] == 1, timeout=30
        )
        phases = http.get("/console/data").json()["phases"]
        detail = http.get("/rollouts/torn-down").json()
    timed = {p["name"]: p["seconds"] for p in detail["phases"] if p["source"] == "backend"}
    assert 0.3 <= timed["teardown"] < timed["total"]
    assert timed["verifier"] < 0.3  # the removal is teardown's, not the verifier's
    assert phases["teardown"]["count"] == 1 and phases["teardown"]["p50"] >= 0.3
