"""The service image (``Dockerfile``): built and started with pytest-docker, it runs one
oracle rollout end to end through the host's Docker socket, on a Python that has
Harbor's agents (the native extra)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.sandbox.runtime import LABEL_ROLLOUT

HERE = Path(__file__).resolve().parent
PORT = int(os.environ.get("HARBOR_EXEC_SERVICE_PORT", "18765"))
URL = f"http://127.0.0.1:{PORT}"

# engine_lane: its own image and server; owner- and rollout-scoped checks.
pytestmark = [
    pytest.mark.docker,
    pytest.mark.engine_lane("b"),
    pytest.mark.usefixtures("base_images"),
    pytest.mark.timeout(900),
]


@pytest.fixture(scope="session")
def docker_compose_file() -> str:
    return str(HERE / "service" / "docker-compose.yml")


@pytest.fixture(scope="session")
def docker_setup() -> list[str]:
    # Collect the image's wheels on the host first: the build then needs no registry.
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, str(HERE.parent / "scripts" / "service_wheels.py")],
        check=True,
        timeout=600,
    )
    return ["up --build -d"]


@pytest.fixture(scope="session")
def docker_compose_command() -> str:
    # Debian ships Compose v1 as docker-compose; scripts/setup.sh installs it.
    return "docker-compose"


@pytest.fixture(scope="session")
def docker_compose_project_name() -> str:
    return "harbor-exec-service-test"


def _healthy() -> bool:
    try:
        return httpx.get(f"{URL}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_service_image_runs_a_rollout(docker_services: Any, docker_runtime: Any) -> None:
    docker_services.wait_until_responsive(check=_healthy, timeout=300.0, pause=0.5)
    health = httpx.get(f"{URL}/health", timeout=5).json()
    assert health["backend"] == "harbor" and health["agent"] == "oracle"
    rollout_id = uuid.uuid4().hex
    admitted = httpx.post(
        f"{URL}/rollout",
        json={
            "initial_messages": [],
            "rollout_id": rollout_id,
            "chat_completions_url": "http://127.0.0.1:9/unused",
            "metadata": {"harbor_task_id": "multiply-numbers"},
        },
        timeout=10,
    )
    assert admitted.status_code == 202, admitted.text
    lease = admitted.json()["polling_lease_token"]
    deadline = time.monotonic() + 300
    result: dict[str, Any] = {}
    while time.monotonic() < deadline:
        result = httpx.get(
            f"{URL}/rollout/{rollout_id}/result",
            headers={"X-Osmosis-Rollout-Lease": lease},
            timeout=60,
        ).json()
        if result["status"] in ("success", "failure", "cancelled"):
            break
    assert result["status"] == "success", result
    assert result["sample"]["reward"] == 1.0
    # The trial ran as a sibling container through the socket, and is gone.
    leftover = [
        c
        for c in docker_runtime.our_containers()
        if (c.get("Labels") or {}).get(LABEL_ROLLOUT) == rollout_id
    ]
    assert leftover == []


def test_service_image_has_harbors_agents(docker_services: Any) -> None:
    import subprocess

    docker_services.wait_until_responsive(check=_healthy, timeout=300.0, pause=0.5)
    (container,) = subprocess.run(
        [
            "docker",
            "ps",
            "-q",
            "--filter",
            "label=com.docker.compose.project=harbor-exec-service-test",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    probe = (
        "import sys; from harbor_exec.agents.native.config import NATIVE_AGENT_NAMES; "
        "import harbor_exec.agents.native.environment; print(sys.version_info[:2] >= (3, 12), "
        "'terminus-2' in NATIVE_AGENT_NAMES)"
    )
    done = subprocess.run(
        [
            "docker",
            "exec",
            "-e",
            "LITELLM_LOCAL_MODEL_COST_MAP=True",
            "-e",
            "LITELLM_OFFLINE_MODE=true",
            container,
            "python",
            "-c",
            probe,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]
