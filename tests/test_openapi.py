"""``/openapi.json`` describes the real API: request bodies, path, header and query
parameters and every documented status, from the pydantic models. Each schema in
it is generated from the protocol class of that name, the one the route really
serializes (no parallel doc models). Schemathesis fuzzes a live ``harbor-exec
serve`` from that document (bounded in examples and time) and finds no 5xx and no
response that violates the schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter

import harbor_exec.protocol as protocol
import harbor_exec.server.openapi as openapi
from harbor_exec.protocol import (
    CancelRolloutsRequest,
    CancelRolloutsResponse,
    ErrorResponse,
    HealthResponse,
    PrewarmRequest,
    PrewarmSummary,
    QueueInfo,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutResultResponse,
    RolloutStatus,
    RolloutStatusResponse,
    ValidationErrorResponse,
)
from harbor_exec.server.results import AdmissionEncoder, in_progress_body
from tests.server_utils import (
    CHAT_URL,
    PROMPT,
    free_port,
    gate,
    local_app,
    serve,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent
SCHEMATHESIS = Path(sys.executable).parent / "st"


# The protocol model each route answers with on success.
RESPONSE_MODELS: dict[tuple[str, str], type[BaseModel]] = {
    ("GET", "/health"): HealthResponse,
    ("POST", "/rollout"): RolloutInitResponse,
    ("GET", "/rollout/{rollout_id}/result"): RolloutResultResponse,
    ("GET", "/rollout/{rollout_id}/status"): RolloutStatusResponse,
    ("POST", "/rollout/cancel"): CancelRolloutsResponse,
    ("GET", "/queue"): QueueInfo,
    ("POST", "/prewarm"): PrewarmSummary,
}
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/rollout": RolloutInitRequest,
    "/rollout/cancel": CancelRolloutsRequest,
    "/prewarm": PrewarmRequest,
}
REF_TEMPLATE = "#/components/schemas/{model}"


def documented_app(tmp_path: Path) -> FastAPI:
    from harbor_exec.backends.local import LocalBackend
    from harbor_exec.server import create_rollout_server
    from tests.server_utils import ScriptedWorkflow

    return create_rollout_server(
        backend=LocalBackend(workflow=ScriptedWorkflow, artifact_root=tmp_path),
        artifact_root=tmp_path,
        api_key="k" * 8,
        max_timeout_sec=600.0,
    )


def without_null_defaults(schema: Any) -> Any:
    """``schema`` as FastAPI writes it: ``"default": null`` left out (exclude_none)."""
    if isinstance(schema, dict):
        return {
            key: without_null_defaults(value)
            for key, value in schema.items()
            if not (key == "default" and value is None)
        }
    if isinstance(schema, list):
        return [without_null_defaults(item) for item in schema]
    return schema


def schema_of(cls: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``cls``'s JSON schema as FastAPI puts it into components, and its ``$defs``."""
    schema = TypeAdapter(cls).json_schema(mode="serialization", ref_template=REF_TEMPLATE)
    nested = schema.pop("$defs", {})
    return without_null_defaults(schema), without_null_defaults(nested)


def test_every_schema_is_the_protocol_class_of_that_name(tmp_path: Path) -> None:
    """No shadow models: each component is generated from ``harbor_exec.protocol``'s
    class of the same name, and ``server/openapi.py`` declares none of its own."""
    components = documented_app(tmp_path).openapi()["components"]["schemas"]
    for name, documented in components.items():
        cls = getattr(protocol, name, None)
        assert cls is not None, f"{name} is not a protocol model"
        schema, nested = schema_of(cls)
        assert documented == schema, name
        for nested_name, nested_schema in nested.items():
            assert components[nested_name] == nested_schema, (name, nested_name)
    assert "seconds" in components["PrewarmSummary"]["properties"]
    assert not [
        value
        for value in vars(openapi).values()
        if isinstance(value, type)
        and issubclass(value, BaseModel)
        and value.__module__ == openapi.__name__
    ]


def test_each_route_documents_the_model_it_returns_and_accepts(tmp_path: Path) -> None:
    app = documented_app(tmp_path)
    spec = app.openapi()
    routes = {
        (method, route.path): route
        for route in app.routes
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in route.methods or ()
    }
    assert set(RESPONSE_MODELS) <= set(routes)
    for (method, path), model in RESPONSE_MODELS.items():
        route = routes[method, path]
        assert route.response_model is model, path
        operation = spec["paths"][path][method.lower()]
        success = operation["responses"][str(route.status_code or 200)]
        ref = success["content"]["application/json"]["schema"]["$ref"]
        assert ref == REF_TEMPLATE.format(model=model.__name__), path
        # Every error status names the model server/http.py answers with.
        for status, response in operation["responses"].items():
            if status.startswith(("4", "5")):
                ref = response["content"]["application/json"]["schema"]["$ref"]
                error = ValidationErrorResponse if status == "422" else ErrorResponse
                assert ref == REF_TEMPLATE.format(model=error.__name__), (path, status)
    for path, model in REQUEST_MODELS.items():
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        schema = model.model_json_schema()
        if model is RolloutInitRequest:  # plus the server's maximum timeout
            for name in ("agent_timeout_sec", "grader_timeout_sec"):
                schema["properties"][name]["maximum"] = 600.0
        assert body["schema"] == without_null_defaults(schema), path


def test_routes_answer_with_exactly_their_documented_model(tmp_path: Path) -> None:
    """Every answer parses as the route's model and holds nothing else."""

    def check(model: type[BaseModel], response: httpx.Response, status: int = 200) -> Any:
        assert response.status_code == status, response.text
        parsed = model.model_validate_json(response.content)
        # trajectory_messages is never sent; parsing a sample fills it in.
        exclude = {"sample": {"trajectory_messages"}} if model is RolloutResultResponse else None
        dumped = parsed.model_dump(mode="json", exclude_unset=True, exclude=exclude)
        assert response.json() == dumped
        return parsed

    app = local_app(tmp_path, result_wait_timeout_sec=0.2, polling_lease_timeout_sec=5.0)
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        check(HealthResponse, http.get("/health"))
        check(QueueInfo, http.get("/queue"))
        submitted = {"initial_messages": PROMPT, "chat_completions_url": CHAT_URL, "label": "4"}
        name, held = gate()
        admitted = check(
            RolloutInitResponse,
            http.post(
                "/rollout", json={**submitted, "rollout_id": "m-1", "metadata": {"hold": name}}
            ),
            202,
        )
        lease = {"X-Osmosis-Rollout-Lease": admitted.polling_lease_token}
        assert check(
            RolloutResultResponse, http.get("/rollout/m-1/result", headers=lease)
        ).status in (
            RolloutStatus.QUEUED,
            RolloutStatus.RUNNING,
        )
        check(RolloutStatusResponse, http.get("/rollout/m-1/status"))
        held.open()
        assert wait_until(
            lambda: http.get("/rollout/m-1/status").json()["status"] == "success", timeout=10
        )
        final = check(RolloutResultResponse, http.get("/rollout/m-1/result", headers=lease))
        assert final.sample is not None and final.sample.reward == 1.0
        check(RolloutStatusResponse, http.get("/rollout/m-1/status"))
        check(CancelRolloutsResponse, http.post("/rollout/cancel", json={"ids": ["m-1"]}))
        check(PrewarmSummary, http.post("/prewarm", json={"all": True}))
        check(ErrorResponse, http.get("/rollout/nope/status"), 404)
        check(ValidationErrorResponse, http.post("/rollout", json={"rollout_id": "x"}), 422)
        check(ValidationErrorResponse, http.post("/rollout/cancel", json={}), 422)


@pytest.mark.parametrize("rollout_id", ["plain-1", 'quote"back\\slash', "ünïcode-✓", "\u2028"])
def test_hand_assembled_bodies_are_the_models_bytes(rollout_id: str) -> None:
    """The 202 and in-progress bodies skip pydantic for speed; they are byte for byte
    what the model gives (compact ``json.dumps`` of its JSON-mode dump)."""

    def encoded(model: BaseModel) -> bytes:
        data = model.model_dump(mode="json")
        if data.get("agent_started_at", "") is None:  # sent only once an agent ran
            del data["agent_started_at"]
        return json.dumps(data, separators=(",", ":")).encode()

    encoder = AdmissionEncoder(result_wait_timeout_sec=30.0, polling_lease_timeout_sec=120.5)
    admitted = RolloutInitResponse(
        rollout_id=rollout_id,
        status=RolloutStatus.QUEUED,
        polling_lease_token="tok-EN_123",
        result_wait_timeout_sec=30.0,
        polling_lease_timeout_sec=120.5,
    )
    assert encoder.encode(rollout_id, "tok-EN_123") == encoded(admitted)
    for status in (RolloutStatus.QUEUED, RolloutStatus.RUNNING, RolloutStatus.GRADING):
        progress = RolloutResultResponse(rollout_id=rollout_id, status=status)
        assert in_progress_body(rollout_id, status) == encoded(progress)


def test_routes_document_bodies_parameters_and_statuses(tmp_path: Path) -> None:
    spec = documented_app(tmp_path).openapi()
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
