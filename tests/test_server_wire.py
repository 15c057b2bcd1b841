"""The exact bytes each route answers with (statuses, content types, bodies), pinned:
clients that compare or hash bodies see no change when the server's code moves.
Random parts (lease token, instance and process ids) are replaced before comparing."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.server_utils import CHAT_URL, PROMPT, gate, local_app, serve, wait_until

LEASE = "X-Osmosis-Rollout-Lease"
JSON = "application/json"


def test_every_route_answers_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARBOR_EXEC_INSTANCE_ID", "instance-1")
    app = local_app(
        tmp_path,
        max_body_bytes=4096,
        max_timeout_sec=600.0,
        result_wait_timeout_sec=0.3,
        polling_lease_timeout_sec=5.0,
    )
    replacements = {app.state.rollout_service.process_id: "<process>"}

    def body(response: httpx.Response, status: int) -> str:
        assert response.status_code == status, response.text
        assert response.headers["content-type"] == JSON
        text = response.content.decode()
        for value, placeholder in replacements.items():
            text = text.replace(value, placeholder)
        return re.sub(r'"agent_started_at":"[^"]+"', '"agent_started_at":"<time>"', text)

    rollout = {"initial_messages": PROMPT, "chat_completions_url": CHAT_URL, "label": "4"}
    name, held = gate()
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        assert body(http.get("/health"), 200) == (
            '{"status": "ok", "backend": "local", "concurrency": {"max_concurrent": 4, '
            '"queued": 0, "running": 0}, "instance_id": "instance-1", "process_id": '
            '"<process>", "lifecycle": {"accepting_rollouts": true, "active_rollouts": 0}}'
        )

        admitted = http.post(
            "/rollout", json={**rollout, "rollout_id": "w-1", "metadata": {"hold": name}}
        )
        token = admitted.json()["polling_lease_token"]
        replacements[token] = "<token>"
        assert admitted.headers["x-harbor-exec-features"] == "status-wait"
        assert body(admitted, 202) == (
            '{"rollout_id":"w-1","status":"queued","polling_lease_token":"<token>",'
            '"result_wait_timeout_sec":0.3,"polling_lease_timeout_sec":5.0}'
        )
        assert wait_until(lambda: http.get("/rollout/w-1/status").json()["status"] == "running")
        assert body(http.get("/rollout/w-1/result", headers={LEASE: token}), 200) == (
            '{"rollout_id":"w-1","status":"running","sample":null,"err_message":null,'
            '"err_category":null}'
        )
        assert body(http.get("/rollout/w-1/status"), 200) == (
            '{"rollout_id": "w-1", "status": "running", "reward": null, "err_message": null, '
            '"err_category": null}'
        )
        assert body(http.get("/queue"), 200) == (
            '{"queued": 0, "running": 1, "capacity": 4, "max_queue_depth": null}'
        )
        held.open()
        assert wait_until(
            lambda: http.get("/rollout/w-1/status").json()["status"] == "success", timeout=10
        )
        assert body(http.get("/rollout/w-1/result", headers={LEASE: token}), 200) == (
            '{"rollout_id":"w-1","status":"success","sample":{"messages":[{"role":"user",'
            '"content":"What is 2+2?"},{"role":"assistant","content":"4"}],"label":"4",'
            '"reward":1.0,"remove_sample":false,"metrics":{"answer_length":1.0},'
            '"extra_fields":{}},"err_message":null,"err_category":null,'
            '"agent_started_at":"<time>"}'
        )
        assert body(http.get("/rollout/w-1/status"), 200) == (
            '{"rollout_id": "w-1", "status": "success", "reward": 1.0, "err_message": null, '
            '"err_category": null}'
        )
        assert body(http.post("/rollout/cancel", json={"ids": ["w-1", "nope"]}), 200) == (
            '{"dispositions": {"w-1": "not_found", "nope": "not_found"}}'
        )
        assert body(http.post("/prewarm", json={"all": True}), 200) == (
            '{"total": 0, "built": 0, "cached": 0, "failed": 0, "failed_tasks": {}, "seconds": {}}'
        )

        # Errors.
        duplicate = http.post("/rollout", json={**rollout, "rollout_id": "w-1"})
        assert body(duplicate, 409) == '{"detail": "rollout_id is already registered"}'
        forbidden = http.get("/rollout/w-1/result", headers={LEASE: "nope"})
        assert body(forbidden, 403) == '{"detail": "invalid polling lease"}'
        unknown = http.get("/rollout/nope/result", headers={LEASE: "nope"})
        assert body(unknown, 404) == '{"detail": "unknown rollout_id"}'
        assert body(http.get("/rollout/nope/status"), 404) == '{"detail": "unknown rollout_id"}'
        assert body(http.get("/rollout/w-1/result"), 422) == (
            '{"detail": [{"type": "missing", "loc": ["header", "X-Osmosis-Rollout-Lease"], '
            '"msg": "Field required", "input": null}]}'
        )
        assert body(http.get("/rollout/w-1/result", headers={LEASE: ""}), 422) == (
            '{"detail": [{"type": "string_too_short", "loc": ["header", '
            '"X-Osmosis-Rollout-Lease"], "msg": "String should have at least 1 character", '
            '"input": "", "ctx": {"min_length": 1}}]}'
        )
        assert body(http.get("/rollout/w-1/status", params={"status": "bogus"}), 422) == (
            '{"detail": [{"type": "value_error", "loc": ["query", "status"], '
            '"msg": "status must be a rollout status", "input": "bogus"}]}'
        )
        bad_wait = http.get("/rollout/w-1/status", params={"status": "queued", "wait": "nan"})
        assert body(bad_wait, 422) == (
            '{"detail": [{"type": "value_error", "loc": ["query", "wait"], '
            '"msg": "wait must be a finite number of seconds >= 0", "input": "nan"}]}'
        )
        too_long = {**rollout, "rollout_id": "t", "agent_timeout_sec": 601}
        assert body(http.post("/rollout", json=too_long), 422) == (
            '{"detail": [{"type": "less_than_equal", "loc": ["body", "agent_timeout_sec"], '
            '"msg": "agent_timeout_sec must be at most 600 seconds (the server\'s maximum; '
            'null means no deadline)", "input": 601.0, "ctx": {"le": 600.0}}]}'
        )
        # A deadline already passed is a mistake in the request, not a timeout to run into.
        negative = {**rollout, "rollout_id": "t", "agent_timeout_sec": -5}
        assert body(http.post("/rollout", json=negative), 422) == (
            '{"detail": [{"type": "greater_than", "loc": ["body", "agent_timeout_sec"], '
            '"msg": "agent_timeout_sec must be greater than 0 seconds (null means no '
            'deadline)", "input": -5.0, "ctx": {"gt": 0}}]}'
        )
        zero = {**rollout, "rollout_id": "t", "grader_timeout_sec": 0}
        assert '"loc": ["body", "grader_timeout_sec"]' in body(
            http.post("/rollout", json=zero), 422
        )
        assert body(http.post("/rollout/cancel", json={"ids": ["a"], "all": True}), 422) == (
            '{"detail": "pass exactly one selector: ids, prefix, or all"}'
        )
        assert body(http.post("/prewarm", json={}), 422) == (
            '{"detail": "pass exactly one of task_ids or all=true"}'
        )
        for path in ("/rollout", "/rollout/cancel", "/prewarm"):
            assert body(http.post(path, content=b"x" * 5000), 413) == (
                '{"detail": "request body exceeds the 4096-byte limit"}'
            )
