"""The cache rebuilds itself (real Docker): with ``HARBOR_EXEC_CACHE_DIR`` pointed at
an empty directory, the first trials build the read-only runtime on first need, once
for two processes starting at once, and a compose task, a multi-step task and a
workflow rollout succeed with no bootstrap step."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler import Bundle
from harbor_exec.client import RolloutClient
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime_build import load_runtime_build
from harbor_exec.sandbox.runtime_volume import RUNTIME_VOLUME_PREFIX, RuntimeContent
from harbor_exec.server import create_rollout_server
from tests.bundle_utils import EXAMPLE_REFS, bundle_cache, example_bundle
from tests.fake_chat import FakeChat
from tests.server_utils import serve
from tests.task_factory import make_compose_task, make_multi_step_task, make_task

# engine_lane: its own cache, tasks and runtime volume; no timing bounds.
pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]

__all__ = ["bundle_cache", "example_bundle"]  # the session fixtures, used below

#: What the runtime's build logs once, when it runs debootstrap.
BUILD_LINE = "debootstrap --variant=minbase"


def _dataset(root: Path) -> Path:
    dataset = root / "dataset"
    make_compose_task(dataset, "compose")
    make_multi_step_task(
        dataset,
        "steps",
        {
            "one": ("echo 1 > /app/one", "[ -f /app/one ] && echo 1 > /logs/verifier/reward.txt"),
            "two": ("echo 2 > /app/two", "[ -f /app/two ] && echo 1 > /logs/verifier/reward.txt"),
        },
    )
    make_task(
        dataset, "plain", solve="echo ok > /app/ok", test="echo 1 > /logs/verifier/reward.txt"
    )
    return dataset


def test_an_empty_cache_dir_builds_the_runtime_once_on_first_need(
    tmp_path: Path,
    chat: FakeChat,
    example_bundle: Bundle,
    docker_runtime: DockerRuntime,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    dataset = _dataset(tmp_path)
    env = {**os.environ, "HARBOR_EXEC_CACHE_DIR": str(cache)}
    before = runtime_volumes()
    try:
        # Two processes at once, each with the plain command and nothing built.
        command = [sys.executable, "-m", "harbor_exec.cli", "validate", str(dataset), "-n", "3"]
        runs = [
            subprocess.Popen(
                [*command, "--jobs-dir", str(tmp_path / f"jobs-{n}")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for n in range(2)
        ]
        outputs = [run.communicate(timeout=540)[0] for run in runs]
        for run, output in zip(runs, outputs, strict=True):
            assert run.returncode == 0, output[-4000:]
        assert sum(output.count(BUILD_LINE) for output in outputs) == 1, outputs
        built = load_runtime_build(cache)
        assert built is not None
        # A workflow rollout in this process, on the runtime the first process built.
        monkeypatch.setenv("HARBOR_EXEC_CACHE_DIR", str(cache))
        chat.reset("correct")
        backend = HarborBackend(
            tasks_dir=_template_without_tests(tmp_path),
            agent=EXAMPLE_REFS["workflow"],
            grader=EXAMPLE_REFS["grader"],
            bundle=example_bundle,
            trials_dir=tmp_path / "trials",
            artifacts_dir=tmp_path / "artifacts",
        )
        with serve(create_rollout_server(backend=backend, artifact_root=tmp_path / "sa")) as url:
            result: Any = asyncio.run(_rollout(url, chat))
        assert result.status == "success" and result.sample.reward == 1.0, (
            result.err_message,
            result,
        )
        assert RuntimeContent.load(cache).digest == built.digest
    finally:
        for volume in (
            runtime_volumes() - before
        ):  # this cache's runtime, if it differs from the suite's
            docker_runtime.remove_volume(volume)


def runtime_volumes() -> set[str]:
    import docker

    client = docker.from_env()
    try:
        return {v.name for v in client.volumes.list() if v.name.startswith(RUNTIME_VOLUME_PREFIX)}
    finally:
        client.close()


async def _rollout(url: str, chat: FakeChat) -> Any:
    async with httpx.AsyncClient(timeout=120) as http:
        return await RolloutClient(url=url, http_client=http).run_rollout(
            initial_messages=[{"role": "user", "content": "What is 6 * 7?"}],
            chat_completions_url=chat.base_url,
            rollout_id=uuid.uuid4().hex,
            llm_api_key="sk-cache-rebuilds",
            label="42",
        )


def _template_without_tests(root: Path) -> Path:
    from tests.osmosis_side_by_side import template_without_tests

    return template_without_tests(root / f"template-{uuid.uuid4().hex[:6]}")
