"""Prewarm of a dataset whose tasks share one workflow bundle (one requirement set).

    .venv/bin/python bench/bench_prewarm_bundle.py [--tasks 20] [--jobs N]

Generates ``--tasks`` tasks (``FROM python:3.11-slim-bookworm`` plus one distinct
layer each), prewarms them through ``HarborBackend.prewarm`` with the example
workflow project's bundle, and prints the wall time, the images built and how many
dependency environments were installed (the read-only runtime installs the bundle's
wheelhouse once per requirement set, not once per task image), then removes what it
made. Only the workflow is bundled, so the script runs unchanged on older checkouts
for a before/after comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path

from harbor_exec.backends.harbor.backend import HarborBackend
from harbor_exec.bundler import build_bundle
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.discovery import discover_tasks
from harbor_exec.trial.trial import image_tag_for

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ROOT / "tasks_examples" / "workflow_project"
WORKFLOW = "arith_agent.workflow:ArithWorkflow"


def make_dataset(root: Path, n: int) -> None:
    nonce = uuid.uuid4().hex
    for i in range(n):
        task = root / f"t{i:03d}"
        for sub in ("environment", "tests", "solution"):
            (task / sub).mkdir(parents=True)
        (task / "instruction.md").write_text("What is 6 * 7?\n")
        (task / "task.toml").write_text("[agent]\ntimeout_sec = 60.0\n")
        (task / "environment" / "Dockerfile").write_text(
            f"FROM python:3.11-slim-bookworm\nRUN echo {nonce} {i} > /id\nWORKDIR /app\n"
        )
        (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
        (task / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hx-bench-prewarm-bundle-") as scratch:
        root = Path(scratch)
        make_dataset(root / "ds", args.tasks)
        bundle = build_bundle(PROJECT, workflow=WORKFLOW, cache_dir=root / "cache")
        backend = HarborBackend(
            tasks_dir=root / "ds",
            task_mode="dataset",
            agent=WORKFLOW,
            bundle=bundle,
            trials_dir=root / "trials",
            artifacts_dir=root / "artifacts",
        )
        runtime = DockerRuntime()
        images_before = {info.tag for info in runtime.list_images()}
        made: list[str] = []
        try:
            started = time.perf_counter()
            summary = asyncio.run(backend.prewarm(jobs=args.jobs))
            wall = time.perf_counter() - started
            made = sorted({info.tag for info in runtime.list_images()} - images_before)
            deps_images = [tag for tag in made if tag.startswith("harbor-exec/deps")]
            print(
                f"{args.tasks} tasks, one requirement set: prewarm {wall:.1f}s wall, "
                f"built {summary.built}, failed {summary.failed}; "
                f"engine builds {backend.image_builds}; images made {len(made)} "
                f"({len(deps_images)} dependency layers)"
            )
        finally:
            asyncio.run(backend.shutdown())
            for tag in made:
                runtime.remove_image(tag)
            for task in discover_tasks(root / "ds").tasks:
                runtime.remove_image(image_tag_for(task))
            remove_volume = getattr(runtime, "remove_volume", None)
            prepared = backend.bundle
            if remove_volume is not None and prepared is not None:
                remove_volume(prepared.deps.volume_name)
            runtime.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
