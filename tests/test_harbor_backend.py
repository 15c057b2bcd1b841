"""HarborBackend end to end: real Docker trials behind the real HTTP server, driven by
our client and by the osmosis-ai 0.3.8 client, with a fake chat endpoint on 127.0.0.1."""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler import build_bundle
from harbor_exec.bundler.errors import BundleBuildError
from harbor_exec.client import RolloutClient
from harbor_exec.executors.local import LocalExecutor
from harbor_exec.sandbox.deps import DEPS_VOLUME_PREFIX
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_ROLLOUT
from harbor_exec.server.app import create_rollout_server
from tests.fake_chat import FakeChat
from tests.server_utils import serve, wait_until

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ROOT / "tasks_examples" / "workflow_project"
TEMPLATE = ROOT / "tasks_examples" / "template"
DATASET = ROOT / "tasks_examples" / "workflow_dataset"
KEY = "sk-test-" + uuid.uuid4().hex
REFS = {
    "agent": "arith_agent.workflow:ArithWorkflow",
    "grader": "arith_agent.grader:ArithGrader",
    "workflow_config": "arith_agent.workflow:workflow_config",
    "grader_config": "arith_agent.grader:grader_config",
}

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]

if sys.version_info >= (3, 12):
    from osmosis_ai.rollout.client import RolloutClient as OsmosisClient
else:  # pragma: no cover - the osmosis-ai client needs Python 3.12
    OsmosisClient = None

CLIENTS = ["ours", "osmosis"]


@pytest.fixture(scope="module")
def bundle() -> Any:
    return build_bundle(
        PROJECT,
        workflow=REFS["agent"],
        grader=REFS["grader"],
        workflow_config=REFS["workflow_config"],
        grader_config=REFS["grader_config"],
    )


@pytest.fixture()
def grader_task(tmp_path: Path) -> Path:
    """The template task without tests/: the bundled grader verifies."""
    task = tmp_path / "grader-template"
    shutil.copytree(TEMPLATE, task)
    shutil.rmtree(task / "tests")
    return task


def make_backend(tmp_path: Path, bundle: Any, tasks_dir: Path, **kwargs: Any) -> HarborBackend:
    return HarborBackend(
        tasks_dir=tasks_dir,
        task_mode=kwargs.pop("task_mode", "template"),
        agent=REFS["agent"],
        grader=REFS["grader"],
        bundle=bundle,
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
        **kwargs,
    )


def client_for(kind: str, url: str, http: httpx.AsyncClient, admission: float | None = None) -> Any:
    if kind == "osmosis":
        assert OsmosisClient is not None
        return OsmosisClient(url=url, http_client=http, admission_timeout_sec=admission)
    return RolloutClient(url=url, http_client=http, admission_timeout_sec=admission)


async def one_rollout(kind: str, url: str, chat: FakeChat, **kwargs: Any) -> Any:
    async with httpx.AsyncClient(timeout=60) as http:
        client = client_for(kind, url, http)
        return await client.run_rollout(
            initial_messages=kwargs.pop("prompt", [{"role": "user", "content": "What is 6 * 7?"}]),
            chat_completions_url=chat.base_url,
            rollout_id=kwargs.pop("rollout_id", uuid.uuid4().hex),
            llm_api_key=KEY,
            **kwargs,
        )


def our_rollout_containers(runtime: DockerRuntime, rollout_id: str) -> list[Any]:
    return [
        c
        for c in runtime.our_containers()
        if (c.get("Labels") or {}).get(LABEL_ROLLOUT) == rollout_id
    ]


@pytest.mark.parametrize("kind", CLIENTS)
def test_template_mode_grader_and_task_tests(
    kind: str, tmp_path: Path, bundle: Any, chat: FakeChat, grader_task: Path
) -> None:
    chat.reset("correct")
    backend = make_backend(tmp_path, bundle, grader_task, cleanup_successful_trials=False)
    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")
    with serve(app) as url:
        right = asyncio.run(one_rollout(kind, url, chat, label="42"))
        wrong = asyncio.run(one_rollout(kind, url, chat, label="41"))
        ungraded = asyncio.run(one_rollout(kind, url, chat, label="42", grade=False))
    assert right.status == "success", right.err_message
    assert right.sample.reward == 1.0
    assert right.sample.messages[-1] == {"role": "assistant", "content": "42"}
    assert wrong.status == "success" and wrong.sample.reward == 0.0
    assert ungraded.status == "success" and ungraded.sample.reward is None
    assert ungraded.sample.messages[-1]["content"] == "42"
    # The key went to the chat endpoint and nowhere on disk.
    assert f"Bearer {KEY}" in chat.authorizations
    for root in (tmp_path / "trials", tmp_path / "artifacts", tmp_path / "server-artifacts"):
        for path in root.rglob("*"):
            if path.is_file():
                assert KEY.encode() not in path.read_bytes(), path
    assert any((tmp_path / "trials").iterdir())

    # The task's own tests verify when the task has them (label via /tests/rollout.json).
    own = make_backend(tmp_path / "own", bundle, TEMPLATE)
    with serve(create_rollout_server(backend=own, artifact_root=tmp_path / "sa")) as url:
        graded = asyncio.run(one_rollout(kind, url, chat, label="42"))
        mismatch = asyncio.run(one_rollout(kind, url, chat, label="7"))
    assert graded.status == "success" and graded.sample.reward == 1.0
    assert mismatch.status == "success" and mismatch.sample.reward == 0.0


def test_separate_verifier_grades_the_sample_in_a_fresh_container(
    tmp_path: Path, bundle: Any, chat: FakeChat, grader_task: Path
) -> None:
    """The bundled grader in separate mode: it sees the agent's sample, nothing else."""
    chat.reset("correct")
    backend = make_backend(tmp_path, bundle, grader_task, verifier_mode="separate")
    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")
    with serve(app) as url:
        right = asyncio.run(one_rollout("ours", url, chat, label="42"))
        wrong = asyncio.run(one_rollout("ours", url, chat, label="41"))
    assert right.status == "success", right.err_message
    assert right.sample.reward == 1.0 and wrong.sample.reward == 0.0


@pytest.mark.parametrize("kind", CLIENTS)
def test_dataset_mode(kind: str, tmp_path: Path, bundle: Any, chat: FakeChat) -> None:
    chat.reset("correct")
    backend = make_backend(tmp_path, bundle, DATASET, task_mode="dataset")
    with serve(create_rollout_server(backend=backend, artifact_root=tmp_path / "sa")) as url:
        solved = asyncio.run(
            one_rollout(kind, url, chat, prompt=[], metadata={"harbor_task_id": "add-numbers"})
        )
        escaping = asyncio.run(
            one_rollout(kind, url, chat, metadata={"harbor_task_id": "../template"}, label="1")
        )
        missing = asyncio.run(one_rollout(kind, url, chat, metadata={"other": 1}, label="1"))
    assert solved.status == "success", solved.err_message
    assert solved.sample.reward == 1.0
    # An empty prompt means "the task's own instruction".
    assert "17 + 25" in solved.sample.messages[1]["content"]
    assert escaping.status == "failure" and escaping.err_category == "validation_error"
    assert "harbor_task_id '../template'" in escaping.err_message
    assert missing.status == "failure" and missing.err_category == "validation_error"
    assert "harbor_task_id" in missing.err_message


@pytest.mark.quiet_engine  # a wall-clock bound on engine work
@pytest.mark.parametrize("kind", CLIENTS)
def test_workflow_error_and_timeout(
    kind: str,
    tmp_path: Path,
    bundle: Any,
    chat: FakeChat,
    grader_task: Path,
    docker_runtime: DockerRuntime,
) -> None:
    backend = make_backend(tmp_path, bundle, grader_task)
    with serve(create_rollout_server(backend=backend, artifact_root=tmp_path / "sa")) as url:
        chat.reset("error")
        failed = asyncio.run(one_rollout(kind, url, chat, label="42"))
        chat.reset("slow")
        rollout_id = uuid.uuid4().hex
        started = time.monotonic()
        timed_out = asyncio.run(
            one_rollout(kind, url, chat, label="42", agent_timeout_sec=3.0, rollout_id=rollout_id)
        )
        elapsed = time.monotonic() - started
    chat.reset("correct")
    assert failed.status == "failure" and failed.err_category == "agent_error"
    assert "500" in failed.err_message
    assert timed_out.status == "failure" and timed_out.err_category == "timeout"
    assert "deadline" in timed_out.err_message
    assert elapsed < 20
    assert our_rollout_containers(docker_runtime, rollout_id) == []


def test_cancel_queued_and_running_and_429(
    tmp_path: Path, bundle: Any, chat: FakeChat, grader_task: Path, docker_runtime: DockerRuntime
) -> None:
    chat.reset("slow")
    backend = make_backend(
        tmp_path, bundle, grader_task, max_concurrent_trials=1, max_queue_depth=1
    )
    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "sa")

    async def scenario(url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=60) as http:
            ours = RolloutClient(url=url, http_client=http)
            kwargs: dict[str, Any] = {
                "chat_completions_url": chat.base_url,
                "llm_api_key": KEY,
                "label": "42",
            }
            prompt = [{"role": "user", "content": "What is 6 * 7?"}]
            running = await ours.run_rollout_async(prompt, rollout_id="run-1", **kwargs)
            await asyncio.wait_for(running.wait_for_running(), 30)
            assert await asyncio.to_thread(
                wait_until, lambda: our_rollout_containers(docker_runtime, "run-1"), 30
            )
            queued = await ours.run_rollout_async(prompt, rollout_id="queued-1", **kwargs)
            # The queue is full: a third admission answers 429 with Retry-After.
            full = await http.post(
                f"{url}/rollout",
                json={"initial_messages": prompt, "rollout_id": "third", **kwargs},
            )
            queue = (await http.get(f"{url}/queue")).json()
            cancel_queued = await ours.cancel_rollout("queued-1")
            started = time.monotonic()
            cancel_running = await ours.cancel_rollout("run-1")
            again = await ours.cancel_rollout("run-1")
            gone = await asyncio.to_thread(
                wait_until, lambda: not our_rollout_containers(docker_runtime, "run-1"), 5
            )
            gone_after = time.monotonic() - started
            results = {
                "full": full,
                "queue": queue,
                "cancel_queued": cancel_queued,
                "cancel_running": cancel_running,
                "again": again,
                "queued_result": await queued,
                "running_result": await running,
                "gone": gone,
                "gone_after": gone_after,
            }
            # With room again, a rollout that met 429 is admitted after the client's retry.
            chat.reset("correct")
            retry_client = RolloutClient(url=url, http_client=http, admission_timeout_sec=60)
            blocker = await ours.run_rollout_async(prompt, rollout_id="block-1", **kwargs)
            await asyncio.wait_for(blocker.wait_for_running(), 30)
            filler = await ours.run_rollout_async(prompt, rollout_id="fill-1", **kwargs)
            results["retried"] = await retry_client.run_rollout(
                prompt, rollout_id="after-429", **kwargs
            )
            await blocker
            await filler
            return results

    with serve(app) as url:
        got = asyncio.run(scenario(url))
    assert got["full"].status_code == 429 and got["full"].headers["Retry-After"]
    assert got["queue"]["queued"] == 1 and got["queue"]["running"] == 1
    assert got["queue"]["max_queue_depth"] == 1
    assert got["cancel_queued"].dispositions == {"queued-1": "cancelled_queued"}
    assert got["cancel_running"].dispositions == {"run-1": "cancelled_running"}
    assert got["again"].dispositions == {"run-1": "not_found"}
    assert got["queued_result"].status == "cancelled"
    assert got["running_result"].status == "cancelled"
    assert got["gone"] and got["gone_after"] < 1.0
    assert got["retried"].status == "success" and got["retried"].sample.reward == 1.0


@pytest.mark.quiet_engine  # a wall-clock bound on engine work
def test_prewarm_then_no_build(
    tmp_path: Path, bundle: Any, chat: FakeChat, grader_task: Path
) -> None:
    chat.reset("correct")
    # A fresh environment, so prewarm has real work to do.
    dockerfile = grader_task / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + f"RUN echo {uuid.uuid4().hex} > /fresh\n")
    backend = make_backend(tmp_path, bundle, grader_task)
    # Installed by an earlier test (one per requirement set): prewarm installs it here.
    DockerRuntime().remove_volume(DEPS_VOLUME_PREFIX + bundle.requirements_digest[:24])
    try:
        with serve(create_rollout_server(backend=backend, artifact_root=tmp_path / "sa")) as url:
            summary = httpx.post(f"{url}/prewarm", json={"all": True}, timeout=300).json()
            builds = backend.image_builds
            started = time.monotonic()
            first = asyncio.run(one_rollout("ours", url, chat, label="42"))
            elapsed = time.monotonic() - started
            health = httpx.get(f"{url}/health").json()
        assert summary["total"] == 1 and summary["built"] == 1 and summary["failed"] == 0
        assert builds == 2  # the task image and the dependency environment
        assert first.status == "success" and first.sample.reward == 1.0
        assert backend.image_builds == builds  # the first rollout built nothing
        assert elapsed < 5
        assert health["backend"] == "harbor" and health["image_builds"] == builds
    finally:
        from harbor_exec.trial.trial import ensure_task_image

        assert isinstance(backend.executor, LocalExecutor) and backend.bundle is not None
        runtime = backend.executor.runtime
        assert isinstance(runtime, DockerRuntime)
        image, _ = ensure_task_image(runtime, backend.resolver.load(grader_task.resolve()))
        runtime.remove_volume(backend.bundle.deps.volume_name)
        runtime.remove_image(image)


def test_failed_prewarm_blocks_the_task(
    tmp_path: Path, bundle: Any, chat: FakeChat, grader_task: Path
) -> None:
    (grader_task / "environment" / "Dockerfile").write_text(
        "FROM debian:bookworm-slim\nRUN exit 9\n"
    )
    backend = make_backend(tmp_path, bundle, grader_task)
    summary = asyncio.run(backend.prewarm())
    assert summary.failed == 1
    with serve(create_rollout_server(backend=backend, artifact_root=tmp_path / "sa")) as url:
        result = asyncio.run(one_rollout("ours", url, chat, label="42"))
    assert result.status == "failure" and "failed prewarm" in result.err_message
    with pytest.raises(RuntimeError, match=r"prewarm failed"):

        async def start() -> None:
            async with backend.prewarm_lifespan()(None):
                pass

        asyncio.run(start())


def test_bundle_build_failure_is_named_before_any_container(
    tmp_path: Path, grader_task: Path
) -> None:
    project = tmp_path / "broken-project"
    shutil.copytree(PROJECT, project)
    (project / "pyproject.toml").write_text(
        (project / "pyproject.toml")
        .read_text()
        .replace(
            'requires = ["setuptools>=68"]',
            'requires = ["setuptools>=68"]\nbackend-path = ["nowhere"]',
        )
    )
    backend = HarborBackend(
        tasks_dir=grader_task,
        agent=REFS["agent"],
        grader=REFS["grader"],
        code_dir=project,
        trials_dir=tmp_path / "trials",
    )
    with pytest.raises(BundleBuildError, match=r"pyproject\.toml|backend"):
        backend.start()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_cli_runs_harbor_rollouts(
    tmp_path: Path, chat: FakeChat, docker_runtime: DockerRuntime
) -> None:
    import signal
    import subprocess

    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "harbor_exec.cli",
        "serve",
        "--port",
        str(port),
        "--tasks-dir",
        str(DATASET),
        "--task-mode",
        "dataset",
        "--agent",
        "oracle",
        "--max-queue-depth",
        "4",
        "--prewarm",
        "--trials-dir",
        str(tmp_path / "trials"),
        "--artifact-root",
        str(tmp_path / "sa"),
    ]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(healthy, timeout=120, interval=0.2), "serve never answered /health"
        result = asyncio.run(
            one_rollout(
                "ours", url, chat, prompt=[], metadata={"harbor_task_id": "subtract-numbers"}
            )
        )
        queue = httpx.get(f"{url}/queue").json()
    finally:
        server.send_signal(signal.SIGTERM)
        output, _ = server.communicate(timeout=60)
    assert result.status == "success" and result.sample.reward == 1.0, output
    assert queue["max_queue_depth"] == 4 and queue["capacity"] == 4
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught.
    assert server.returncode in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output
    # The rollout's container is gone (others' may run beside: the second engine lane).
    assert our_rollout_containers(docker_runtime, result.rollout_id) == []

    broken = tmp_path / "no-project"
    broken.mkdir()
    (broken / "mod.py").write_text("class W: pass\n")
    failed = subprocess.run(
        [
            sys.executable,
            "-m",
            "harbor_exec.cli",
            "serve",
            "--tasks-dir",
            str(TEMPLATE),
            "--agent",
            "mod:W",
            "--code-dir",
            str(broken),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=broken,
    )
    assert failed.returncode == 1
    assert "pyproject.toml" in failed.stderr
