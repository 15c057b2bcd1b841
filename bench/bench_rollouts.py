"""Prewarmed workflow rollouts through the HTTP server, beside the oracle trial floor.

    .venv/bin/python bench/bench_rollouts.py [--rounds 3]

Serves the example workflow project (tasks_examples/workflow_project) with
HarborBackend in template mode on 127.0.0.1, a fake chat endpoint on 127.0.0.1,
and drives it with RolloutClient. Prints:

* the cached ``build_bundle`` call (target: under 50 ms per rollout);
* admission -> workflow start for a prewarmed task's first rollout (target: < 1 s);
* per-rollout wall time at concurrency 1 beside the floor of bench_trials.py
  (direct Docker SDK calls for the same task), i.e. the overhead of the bundle,
  the server and the bookkeeping;
* 16 rollouts at concurrency 4 (target: under 5 s).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import docker
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_trials import floor_trial  # noqa: E402
from harbor_exec.backends.harbor.backend import HarborBackend  # noqa: E402
from harbor_exec.bundler import build_bundle  # noqa: E402
from harbor_exec.client import RolloutClient  # noqa: E402
from harbor_exec.sandbox.docker import DockerRuntime  # noqa: E402
from harbor_exec.server.app import create_rollout_server  # noqa: E402
from harbor_exec.tasks.task import load_task  # noqa: E402
from harbor_exec.trial.trial import ensure_task_image  # noqa: E402
from tests.fake_chat import FakeChat  # noqa: E402
from tests.server_utils import serve, wait_until  # noqa: E402

PROJECT = ROOT / "tasks_examples" / "workflow_project"
TEMPLATE = ROOT / "tasks_examples" / "template"
REFS = {
    "workflow": "arith_agent.workflow:ArithWorkflow",
    "grader": "arith_agent.grader:ArithGrader",
    "workflow_config": "arith_agent.workflow:workflow_config",
    "grader_config": "arith_agent.grader:grader_config",
}


async def rollouts(url: str, chat: FakeChat, n: int, concurrency: int) -> tuple[float, list[float]]:
    semaphore = asyncio.Semaphore(concurrency)
    walls: list[float] = []
    async with httpx.AsyncClient(timeout=120) as http:
        client = RolloutClient(url=url, http_client=http, admission_timeout_sec=300)

        async def one(i: int) -> None:
            async with semaphore:
                started = time.perf_counter()
                result = await client.run_rollout(
                    [{"role": "user", "content": f"What is {i} + 40?"}],
                    chat.base_url,
                    rollout_id=uuid.uuid4().hex,
                    llm_api_key="sk-bench",
                    label=str(i + 40),
                )
                walls.append(time.perf_counter() - started)
                assert result.status == "success" and result.sample is not None, result
                assert result.sample.reward == 1.0, result

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - started, walls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    build_bundle(PROJECT, **REFS)  # cold build, not measured
    cached = []
    for _ in range(20):
        started = time.perf_counter()
        bundle = build_bundle(PROJECT, **REFS)
        cached.append(time.perf_counter() - started)
    print(f"cached build_bundle: median {statistics.median(cached) * 1000:.1f} ms (target < 50 ms)")

    scratch = Path(tempfile.mkdtemp(prefix="hx-bench-rollouts-"))
    task_dir = scratch / "template"
    shutil.copytree(TEMPLATE, task_dir)
    # A fresh environment, so the prewarm below really builds and the first rollout is cold.
    dockerfile = task_dir / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + f"RUN echo {uuid.uuid4().hex} > /bench\n")
    runtime = DockerRuntime()
    backend = HarborBackend(
        runtime=runtime,
        tasks_dir=task_dir,
        agent=REFS["workflow"],
        grader=REFS["grader"],
        bundle=bundle,
        trials_dir=scratch / "trials",
        artifacts_dir=scratch / "artifacts",
        max_concurrent_trials=4,
    )
    app = create_rollout_server(backend=backend, artifact_root=scratch / "artifacts")
    api = docker.from_env().api
    task = load_task(task_dir)
    image, _ = ensure_task_image(runtime, task)
    try:
        with FakeChat() as chat, serve(app) as url:
            summary = httpx.post(f"{url}/prewarm", json={"all": True}, timeout=900).json()
            print(f"prewarm: {summary}")
            builds = backend.image_builds
            # First rollout: admission to workflow start, from the trial's own timings.
            started = time.perf_counter()
            asyncio.run(rollouts(url, chat, 1, 1))
            first = time.perf_counter() - started
            written = wait_until(
                lambda: any((scratch / "artifacts").glob("*/diagnostics.json")), timeout=10
            )
            assert written, "the server wrote no diagnostics.json"
            latest = next((scratch / "artifacts").glob("*/diagnostics.json"))
            import json

            timings = json.loads(latest.read_text())["timings_sec"]
            print(
                f"first rollout after prewarm: {first:.2f}s total; environment ready "
                f"(workflow starts) {timings['environment_setup']:.2f}s after the trial began; "
                f"images built by it: {backend.image_builds - builds} (target: 0, start < 1 s)"
            )

            floor = statistics.median(
                _timed(lambda: floor_trial(api, image, task)) for _ in range(args.rounds)
            )
            walls = []
            for _ in range(args.rounds):
                _total, w = asyncio.run(rollouts(url, chat, 1, 1))
                walls += w
            one = statistics.median(walls)
            print(
                f"concurrency 1: rollout {one * 1000:.0f} ms vs oracle trial floor "
                f"{floor * 1000:.0f} ms: overhead {(one - floor) * 1000:+.0f} ms "
                f"({one / floor:.2f}x)"
            )
            totals = []
            for _ in range(args.rounds):
                total, _w = asyncio.run(rollouts(url, chat, 16, 4))
                totals.append(total)
            print(
                f"16 rollouts at concurrency 4: {statistics.median(totals):.2f}s wall "
                "(target < 5 s)"
            )
    finally:
        asyncio.run(backend.shutdown())
        if backend.bundle is not None:
            runtime.remove_volume(backend.bundle.deps.volume_name)
        runtime.remove_image(image)
        runtime.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _timed(fn: object) -> float:
    started = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(main())
