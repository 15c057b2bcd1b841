"""The migration guide's constructor on real Docker: a bundle wheel built by osmosis-ai
0.3.8's own bundler (``osmosis_ai.packaging.build_bundle``) of the SDK-authored project
(``tasks_examples/osmosis_sdk_project``), given by path with a Harbor ``TrialQueue`` and
Harbor's ``EnvironmentConfig`` resource overrides. The SDK workflow and grader run in the
task containers and give osmosis-ai's rewards; the agent's container runs under the
overrides (its cgroup limits, read while it runs)."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest
from harbor.models.trial.config import EnvironmentConfig
from harbor.trial.queue import TrialQueue

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.client import RolloutClient
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_ROLLOUT
from harbor_exec.server.app import create_rollout_server
from tests.bundle_utils import REPO_ROOT
from tests.fake_chat import FakeChat
from tests.server_utils import serve

# engine_lane: its own backends and tasks; no timing bounds.
pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]

SDK_PROJECT = REPO_ROOT / "tasks_examples" / "osmosis_sdk_project"
TEMPLATE = REPO_ROOT / "tasks_examples" / "template"


def test_an_osmosis_built_bundle_wheel_in_containers(
    tmp_path: Path, chat: FakeChat, docker_runtime: DockerRuntime
) -> None:
    from osmosis_ai.packaging import build_bundle as osmosis_build_bundle

    wheel = osmosis_build_bundle(
        SDK_PROJECT,
        workflow="sdk_arith.workflow:SdkArithWorkflow",
        workflow_config="sdk_arith.workflow:workflow_config",
        grader="sdk_arith.grader:SdkArithGrader",
        grader_config="sdk_arith.grader:grader_config",
        bundles_dir=tmp_path / "osmosis-bundles",
    )
    task = tmp_path / "template"
    shutil.copytree(TEMPLATE, task)
    shutil.rmtree(task / "tests")  # the bundle's SDK grader verifies
    backend = HarborBackend(
        orchestrator=TrialQueue(n_concurrent=1),
        tasks_dir=task,
        bundle=wheel,  # a path; agent and grader are the bundle's
        environment_config=EnvironmentConfig(override_memory_mb=700, override_cpus=1),
        patch_dockerfile_with_sdk=True,
        trials_dir=tmp_path / "trials",
        artifacts_dir=tmp_path / "artifacts",
    )
    key = "sk-test-" + uuid.uuid4().hex
    engine = docker.from_env()

    def limits_while_held() -> list[tuple[int, int]]:
        # The agent's container, while its model call is held: its memory and CPU quota.
        assert chat.wait_for_requests(1, timeout=300)
        found = []
        # This process's own (a second engine lane runs other tests beside this one).
        for summary in docker_runtime.our_containers(owner=docker_runtime.owner):
            if (summary.get("Labels") or {}).get(LABEL_ROLLOUT):
                host = engine.api.inspect_container(summary["Id"])["HostConfig"]
                found.append((host["Memory"], host["NanoCpus"]))
        chat.release_slow()
        return found

    async def one(url: str, label: str) -> Any:
        async with httpx.AsyncClient(timeout=600) as http:
            return await RolloutClient(url=url, http_client=http).run_rollout(
                initial_messages=[{"role": "user", "content": "What is 6 * 7?"}],
                chat_completions_url=chat.base_url,
                rollout_id=uuid.uuid4().hex,
                llm_api_key=key,
                label=label,
            )

    async def held(url: str) -> tuple[Any, list[tuple[int, int]]]:
        right, limits = await asyncio.gather(one(url, "42"), asyncio.to_thread(limits_while_held))
        return right, limits

    app = create_rollout_server(backend=backend, artifact_root=tmp_path / "server-artifacts")
    with serve(app) as url:
        chat.reset("slow")
        right, limits = asyncio.run(held(url))
        chat.reset()
        wrong = asyncio.run(one(url, "41"))
    assert backend.max_concurrent_trials == 1
    assert backend.bundle is not None
    assert backend.bundle.name == "sdk_arith.workflow:SdkArithWorkflow"
    assert right.status == "success", right.err_message
    assert right.sample.reward == 1.0
    assert right.sample.messages[-1] == {"role": "assistant", "content": "42"}
    assert right.sample.metrics["graded_by"] == "sdk"
    assert wrong.status == "success" and wrong.sample.reward == 0.0
    # 700 MiB and one CPU, as the overrides say (the template task's own are other).
    assert limits and all(limit == (700 * 1024 * 1024, 1_000_000_000) for limit in limits)
