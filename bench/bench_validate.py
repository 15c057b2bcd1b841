"""``harbor-exec validate`` of 12 oracle trials at concurrency 4 against the direct-SDK
floor doing the same 12 trials at concurrency 4, in one run.

    flock /tmp/docker-tests.lock .venv/bin/python bench/bench_validate.py [--rounds 3]

Rounds alternate: the floor (``bench_trials.floor_trial`` on 4 threads), then
``validate TASK -k 12 -n 4`` as a user runs it (a new CLI process: its start-up counts),
then the same with ``--warm-containers 0`` (no trials started ahead of their slot).
Printed: the wall time of each (median over rounds), the CLI's own start-up apart (the
job's time from its ``result.json``), and the ratios to the floor. Images are warm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import docker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_trials import floor_trial
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.trial import ensure_task_image

ROOT = Path(__file__).resolve().parents[1]
TRIALS, CONCURRENCY = 12, 4


def _validate(task_dir: Path, jobs: Path, name: str, *extra: str) -> tuple[float, float]:
    """(the CLI process's wall seconds, its job's own seconds)."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "harbor_exec.cli", "validate", str(task_dir), "-k", str(TRIALS),
         "-n", str(CONCURRENCY), "--jobs-dir", str(jobs), "--job-name", name, *extra],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"validate failed:\n{done.stdout}\n{done.stderr}")
    result = json.loads((jobs / name / "result.json").read_text())
    job = datetime.fromisoformat(result["finished_at"]) - datetime.fromisoformat(
        result["started_at"]
    )
    return wall, job.total_seconds()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--task", type=Path, default=ROOT / "tasks_examples" / "template")
    args = parser.parse_args()
    task = load_task(args.task)
    runtime = DockerRuntime()
    image, _built = ensure_task_image(runtime, task)
    api = docker.APIClient(timeout=120)

    def floor() -> float:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
            rewards = list(pool.map(lambda _: floor_trial(api, image, task), range(TRIALS)))
        assert all(r == 1.0 for r in rewards), rewards
        return time.perf_counter() - started

    walls: dict[str, list[float]] = {"floor": [], "validate": [], "validate, none ahead": []}
    jobs: dict[str, list[float]] = {"validate": [], "validate, none ahead": []}
    with tempfile.TemporaryDirectory(prefix="bench-validate-") as scratch:
        floor()  # warm: connection pools, page cache
        _validate(args.task, Path(scratch), "warm-up")
        for round_ in range(args.rounds):
            walls["floor"].append(floor())
            ways = (("validate", ()), ("validate, none ahead", ("--warm-containers", "0")))
            for way, extra in ways:
                wall, job = _validate(args.task, Path(scratch), f"{len(way)}-{round_}", *extra)
                walls[way].append(wall)
                jobs[way].append(job)
    runtime.close()
    floor_s = statistics.median(walls["floor"])
    print(f"{TRIALS} oracle trials of {task.name} at concurrency {CONCURRENCY}, "
          f"{args.rounds} rounds (medians)")  # fmt: skip
    print(f"{'way':22} {'wall':>7} {'job':>7} {'wall/floor':>11} {'job/floor':>10}")
    print(f"{'floor':22} {floor_s:6.2f}s {'':>7} {1.0:10.2f}x")
    for way in ("validate", "validate, none ahead"):
        wall, job = statistics.median(walls[way]), statistics.median(jobs[way])
        print(f"{way:22} {wall:6.2f}s {job:6.2f}s {wall / floor_s:10.2f}x {job / floor_s:9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
