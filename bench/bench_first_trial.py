"""The first workflow rollout after the cache was wiped: what share of it is the
read-only runtime's build, and what the same rollout costs once everything is built.

    flock /tmp/docker-tests.lock .venv/bin/python bench/bench_first_trial.py [--keep-bundle]

``HARBOR_EXEC_CACHE_DIR`` points at a new, empty directory, as after ``rm -rf
~/.cache/harbor-exec``. One rollout of the example workflow project
(``tasks_examples/workflow_project``) on the template task (its bundled grader
verifies), through ``HarborBackend`` behind the real server, with the model a local
stand-in; then a second, warm rollout. Reported: the first rollout's wall time and,
within it, the runtime's build (timed where the trial calls it) and the bundle's
(pip fetches its dependencies' wheels from the package index unless ``--keep-bundle``
reuses the ordinary bundle cache); the warm rollout's time; the runtime build's share
of the first rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler import build_bundle
from harbor_exec.cache import CACHE_ENV
from harbor_exec.client import RolloutClient
from harbor_exec.sandbox import runtime_volume
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.server import create_rollout_server
from tests.bundle_utils import EXAMPLE_DIR, EXAMPLE_REFS
from tests.fake_chat import FakeChat
from tests.server_utils import serve
from tests.test_cache_rebuilds_docker import runtime_volumes

ROOT = Path(__file__).resolve().parents[1]


class _Timed:
    """Seconds spent in one function, wrapped where its callers look it up."""

    def __init__(self, module: Any, name: str) -> None:
        self.seconds = 0.0
        original = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.monotonic() - started

        setattr(module, name, timed)


async def _rollout(url: str, chat_url: str) -> tuple[Any, float]:
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=900) as http:
        result = await RolloutClient(url=url, http_client=http).run_rollout(
            initial_messages=[{"role": "user", "content": "What is 6 * 7?"}],
            chat_completions_url=chat_url,
            rollout_id=uuid.uuid4().hex,
            llm_api_key="sk-bench-first-trial",
            label="42",
        )
    return result, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--keep-bundle", action="store_true", help="reuse the ordinary bundle cache"
    )
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hx-bench-first-"))
    cache = scratch / "cache"
    cache.mkdir()
    os.environ[CACHE_ENV] = str(cache)  # read where each cache entry is looked up
    runtime = DockerRuntime()
    volumes_before = runtime_volumes()
    # Where the trial's runtime volume looks the build up: its time within the rollout.
    build = _Timed(runtime_volume, "build_runtime")
    task = scratch / "template"
    shutil.copytree(ROOT / "tasks_examples" / "template", task)
    shutil.rmtree(task / "tests")
    with FakeChat() as chat:
        try:
            started = time.monotonic()
            bundle_cache = None if args.keep_bundle else cache / "bundles"
            bundle = build_bundle(EXAMPLE_DIR, cache_dir=bundle_cache, **EXAMPLE_REFS)
            bundle_sec = time.monotonic() - started
            chat.reset("correct")
            backend = HarborBackend(
                tasks_dir=task,
                agent=EXAMPLE_REFS["workflow"],
                grader=EXAMPLE_REFS["grader"],
                bundle=bundle,
                trials_dir=scratch / "trials",
                artifacts_dir=scratch / "artifacts",
            )
            app = create_rollout_server(backend=backend, artifact_root=scratch / "served")
            with serve(app) as url:
                first, first_rollout_sec = asyncio.run(_rollout(url, chat.base_url))
                first_sec = time.monotonic() - started
                warm, warm_sec = asyncio.run(_rollout(url, chat.base_url))
        finally:
            # This cache's runtime volume, when it differs from the machine's.
            for volume in runtime_volumes() - volumes_before:
                runtime.remove_volume(volume)
            shutil.rmtree(scratch, ignore_errors=True)
    for name, result in (("first", first), ("warm", warm)):
        if result.status != "success" or result.sample.reward != 1.0:
            raise SystemExit(f"the {name} rollout: {result.status} {result.err_message}")
    print(f"first rollout after wiping the cache: {first_sec:7.2f} s")
    print(f"  the bundle's build:                {bundle_sec:7.2f} s")
    print(f"  the rollout itself:                {first_rollout_sec:7.2f} s")
    print(f"    of which the runtime's build:    {build.seconds:7.2f} s")
    print(f"warm rollout:                        {warm_sec:7.2f} s")
    print(f"runtime build's share of the first:  {build.seconds / first_sec:7.2f}")
    print(f"first / warm:                        {first_sec / warm_sec:7.1f}x")


if __name__ == "__main__":
    main()
