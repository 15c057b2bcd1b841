"""A hostile compose task configures nothing on the host (real engine, real trials).

Each task attacks ``docker compose config``, which the host runs to load it: an
``env_file`` naming a host file with a key in it, a project ``.env`` that turns on
Compose's remote ``include`` pointing at a loopback server, a Dockerfile that is
``/dev/zero``. Each is refused by name before Compose runs: the key is nowhere in the
trial or the cache, the loopback server gets no request, ``/dev/zero`` is never read.
A sidecar's image, or a Dockerfile's ``FROM``, on a loopback "registry" is not pulled
(no request reaches it), and when the operator allows that registry, what it answered
never reaches the result.
"""

from __future__ import annotations

import http.server
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harbor_exec.cache import cache_root
from harbor_exec.sandbox.docker import DockerRuntime
from tests.task_factory import make_compose_task, make_task
from tests.trial_utils import run_task

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]


BODY = "internal-service-answer-" + uuid.uuid4().hex


class _Probe(http.server.BaseHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self) -> None:
        type(self).requests.append(self.path)
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(f'{{"errors": [{{"message": "{BODY}"}}]}}'.encode())

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def probe() -> Iterator[tuple[int, list[str]]]:
    """A loopback HTTP server that records every request it gets."""
    seen: list[str] = []
    handler = type("Probe", (_Probe,), {"requests": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


def refused(result: object, field: str) -> str:
    info = getattr(result, "exception_info", None)
    assert info is not None, "the hostile task ran"
    assert info.exception_type == "TaskConfigError", info
    assert field in info.exception_message, info.exception_message
    return str(info.exception_message)


def files_holding(root: Path, needle: bytes) -> list[Path]:
    return [
        path
        for path in root.rglob("*")
        if path.is_file() and not path.is_symlink() and needle in path.read_bytes()
    ]


def test_an_env_file_of_a_host_path_is_refused_and_its_key_goes_nowhere(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    key = "sk-host-" + uuid.uuid4().hex
    host_env = tmp_path / "operator" / ".env"
    host_env.parent.mkdir()
    host_env.write_text(f"OPENAI_API_KEY={key}\n")
    task = make_compose_task(
        tmp_path,
        "env-file-attack",
        solve='echo "$OPENAI_API_KEY" > /logs/agent/key.txt; echo 42 > /app/expected',
    )
    compose = task / "environment" / "docker-compose.yaml"
    compose.write_text(
        compose.read_text().replace(
            "services:\n  main:\n",
            f"services:\n  main:\n    env_file:\n      - path: {host_env}\n        required: false\n",
        )
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    refused(result, "services.main.env_file[0]")
    assert files_holding(tmp_path / "trials", key.encode()) == []
    assert files_holding(cache_root() / "compose-config", key.encode()) == []


def test_a_task_env_turning_on_remote_include_fetches_nothing(
    docker_runtime: DockerRuntime, tmp_path: Path, probe: tuple[int, list[str]]
) -> None:
    port, seen = probe
    task = make_compose_task(tmp_path, "remote-include")
    env = task / "environment"
    (env / ".env").write_text(
        "COMPOSE_EXPERIMENTAL_GIT_REMOTE=1\nCOMPOSE_EXPERIMENTAL_OCI_REMOTE=1\n"
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    refused(result, "COMPOSE_EXPERIMENTAL_GIT_REMOTE")
    compose = env / "docker-compose.yaml"
    compose.write_text(
        f"include:\n  - http://127.0.0.1:{port}/internal/repo.git\n" + compose.read_text()
    )
    for dotenv in ("COMPOSE_EXPERIMENTAL_GIT_REMOTE=1\n", "ANSWER=42\n"):
        (env / ".env").write_text(dotenv)
        refused(run_task(docker_runtime, task, tmp_path / "trials"), "include")
    assert seen == []


def test_a_dockerfile_of_dev_zero_is_refused_unread(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    task = make_compose_task(tmp_path, "dev-zero")
    compose = task / "environment" / "docker-compose.yaml"
    compose.write_text(
        compose.read_text().replace(
            "  db:\n    build: ./db\n",
            "  db:\n    build:\n      context: ./db\n      dockerfile: /dev/zero\n",
        )
    )
    started = time.monotonic()
    result = run_task(docker_runtime, task, tmp_path / "trials")
    assert time.monotonic() - started < 30  # the trial's own set-up, no read of /dev/zero
    refused(result, "services.db.build.dockerfile")


def test_a_sidecar_image_on_a_loopback_registry_is_never_pulled(
    tmp_path: Path, probe: tuple[int, list[str]]
) -> None:
    port, seen = probe
    task = make_compose_task(tmp_path, "loopback-image")
    compose = task / "environment" / "docker-compose.yaml"
    image = f"127.0.0.1:{port}/internal/probe:latest"
    compose.write_text(compose.read_text() + f"  probe:\n    image: {image}\n")

    def failure_with(registries: list[str]) -> str:
        runtime = DockerRuntime(pull_registries=registries)
        try:
            result = run_task(runtime, task, tmp_path / "trials")
        finally:
            runtime.remove_owned()
            runtime.close()
        info = result.exception_info
        assert info is not None and image in info.exception_message, info
        return str(info.exception_message)

    failure_with([])  # the default: no registry
    assert seen == []  # the engine never asked the address
    # Allowed by the operator: the engine asks, and its answer stays out of the result.
    assert BODY not in failure_with([f"127.0.0.1:{port}"])
    assert files_holding(tmp_path / "trials", BODY.encode()) == []


def test_a_dockerfile_from_a_loopback_registry_is_never_pulled(
    docker_runtime: DockerRuntime, tmp_path: Path, probe: tuple[int, list[str]]
) -> None:
    port, seen = probe
    task = make_task(tmp_path, "loopback-from")
    image = f"127.0.0.1:{port}/internal/probe:latest"
    (task / "environment" / "Dockerfile").write_text(
        f"ARG BASE={image}\nFROM $BASE\nWORKDIR /app\n"
    )
    result = run_task(docker_runtime, task, tmp_path / "trials")
    info = result.exception_info
    assert info is not None and image in info.exception_message, info
    assert "not one the operator allows" in info.exception_message
    assert seen == []  # the engine never asked the address
