"""A compose task's oracle trial end to end: ``harbor-exec validate`` against Harbor's
own ``harbor run -a oracle``, the same task for both.

The task (``tests/task_factory.make_compose_task``) has a ``main`` service and a ``db``
sidecar (python's http.server, built from a local base image, with a healthcheck that
``main`` waits on); its test asks the sidecar by service name and earns 1 from the
oracle. Images are warm for both: one run of each first, not counted; Harbor keeps
its built images (``--no-delete``; its containers, network and volumes go either way)
and harbor-exec its content-addressed ones.

Each repetition is the wall time of the whole CLI process (start to exit, a fresh
job), alternating the two; every run must give reward 1.0. Prints the medians and
the ratio (target: at most 0.5x; Harbor's ``compose down`` stops the services one by
one, 10 s each).

    .venv/bin/python bench/bench_compose.py [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench.harbor_docker import compose_v2_available, print_ratio, remove_harbor_images
from tests.task_factory import make_compose_task

TARGET = 0.5
TASK = "hx-bench-compose"
RUN_TIMEOUT_SEC = 300


def harbor_binary() -> str:
    """Harbor 0.26's CLI: this venv's, else the project's ``.venv-harbor``."""
    found = shutil.which("harbor", path=str(Path(sys.executable).parent))
    if found:
        return found
    local = Path(__file__).resolve().parent.parent / ".venv-harbor" / "bin" / "harbor"
    if local.exists():
        return str(local)
    raise SystemExit("Harbor 0.26 is not installed (.venv-harbor): run scripts/setup.sh")


def harbor_exec_command(dataset: Path, jobs: Path, job: str) -> list[str]:
    command = [sys.executable, "-m", "harbor_exec.cli", "validate", str(dataset), "-n", "1"]
    return [*command, "--jobs-dir", str(jobs), "--job-name", job]


def harbor_command(dataset: Path, jobs: Path, job: str) -> list[str]:
    command = [harbor_binary(), "run", "-p", str(dataset), "-a", "oracle"]
    command += ["--no-delete", "-n", "1", "-y", "-q"]
    return [*command, "-o", str(jobs), "--job-name", job]


def timed_run(command: list[str], jobs: Path, job: str) -> float:
    """The wall time of ``command``, which must have written ``job`` whose one trial
    got reward 1.0."""
    env = {**os.environ, "HARBOR_TELEMETRY": "0"}
    begin = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_SEC)
    seconds = time.perf_counter() - begin
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rewards = [
        (json.loads(result.read_text()).get("verifier_result") or {}).get("rewards")
        for result in (jobs / job).glob("*/result.json")
    ]
    assert rewards == [{"reward": 1.0}], (rewards, done.stdout[-2000:])
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not compose_v2_available():
        raise SystemExit("Harbor's docker environment needs `docker compose` (v2): run setup.sh")
    ours: list[float] = []
    theirs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="hx-bench-compose-") as scratch:
        root = Path(scratch)
        dataset = root / "compose"
        make_compose_task(dataset, TASK)
        jobs = root / "jobs"
        runs: list[tuple[str, Callable[[str], list[str]], list[float]]] = [
            ("harbor-exec", partial(harbor_exec_command, dataset, jobs), ours),
            ("harbor", partial(harbor_command, dataset, jobs), theirs),
        ]
        try:
            for rep in range(args.reps + 1):  # rep 0 warms both (images, caches): not counted
                line = []
                for label, command_for, times in runs:
                    job = f"{label}-{rep}"
                    seconds = timed_run(command_for(job), jobs, job)
                    line.append(f"{label} {seconds:.2f} s")
                    if rep > 0:
                        times.append(seconds)
                print(f"rep {rep}{' (warm-up)' if rep == 0 else ''}: {', '.join(line)}", flush=True)
        finally:
            remove_harbor_images(TASK)
    print_ratio("harbor-exec validate", ours, theirs, TARGET)


if __name__ == "__main__":
    main()
