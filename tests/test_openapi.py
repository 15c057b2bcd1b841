"""``/openapi.json`` describes the real API: request bodies, path, header and query
parameters and every documented status, from the pydantic models. Schemathesis
fuzzes a live ``harbor-exec serve`` from that document (bounded in examples and
time) and finds no 5xx and no response that violates the schema."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_utils import free_port

ROOT = Path(__file__).resolve().parent.parent
SCHEMATHESIS = Path(sys.executable).parent / "st"


def test_routes_document_bodies_parameters_and_statuses(tmp_path: Path) -> None:
    from harbor_exec.backends.local import LocalBackend
    from harbor_exec.server import create_rollout_server
    from tests.server_utils import ScriptedWorkflow

    app = create_rollout_server(
        backend=LocalBackend(workflow=ScriptedWorkflow, artifact_root=tmp_path),
        artifact_root=tmp_path,
        api_key="k" * 8,
        max_timeout_sec=600.0,
    )
    spec = app.openapi()
    paths = spec["paths"]
    submit = paths["/rollout"]["post"]
    body = submit["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["required"]) == {"initial_messages", "rollout_id", "chat_completions_url"}
    assert body["properties"]["rollout_id"]["maxLength"] == 256
    assert body["properties"]["agent_timeout_sec"]["maximum"] == 600.0
    assert {"202", "401", "409", "413", "422", "429", "503"} <= set(submit["responses"])
    ref = submit["responses"]["202"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/RolloutInitResponse")
    result = paths["/rollout/{rollout_id}/result"]["get"]
    names = {(p["in"], p["name"]) for p in result["parameters"]}
    assert names == {("path", "rollout_id"), ("header", "X-Osmosis-Rollout-Lease")}
    assert {"200", "401", "403", "404", "422"} <= set(result["responses"])
    cancel = paths["/rollout/cancel"]["post"]
    assert "ids" in cancel["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert "RolloutResultResponse" in spec["components"]["schemas"]


@pytest.mark.slow
@pytest.mark.long(6)
def test_schemathesis_finds_no_server_error_or_schema_violation(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [
            sys.executable, "-m", "harbor_exec.cli", "serve",
            "--workflow", "tests.server_utils:ScriptedWorkflow",
            "--grader", "tests.server_utils:ExactMatchGrader",
            "--port", str(port), "--artifact-root", str(tmp_path / "artifacts"),
            "--data-dir", str(tmp_path / "data"),
        ],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert serve.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.1)
        run = subprocess.run(
            [
                str(SCHEMATHESIS), "run", f"{url}/openapi.json",
                "--checks", "not_a_server_error,status_code_conformance,"
                "content_type_conformance,response_schema_conformance",
                "--phases", "examples,coverage,fuzzing",
                "--max-examples", "5", "--seed", "8",
                "--request-timeout", "40", "--no-color",
            ],
            cwd=tmp_path, capture_output=True, text=True, timeout=420,
            env={**os.environ, "SCHEMATHESIS_HOOKS": ""},
        )  # fmt: skip
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "No issues found" in run.stdout or "passed" in run.stdout.lower(), run.stdout[-3000:]
