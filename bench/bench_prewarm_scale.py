"""Prewarm at dataset scale: memory, per-task times, the warm second run, pruning.

    .venv/bin/python bench/bench_prewarm_scale.py [--tasks 1000] [--jobs N] [--prune-build-cache]

Generates ``--tasks`` tasks sharing one base layer (``FROM debian:bookworm-slim``
plus a shared ``RUN``) with one distinct layer each (a copied file), prewarms them
in this process through ``harbor_exec.jobs.prewarm.prewarm_tasks`` and prints the
process's resident memory as it goes (it should stay flat: no build log stays in
memory past its task), per-task build times, the second (warm) run's wall time
(target: under 1 s per 100 tasks), then removes every image it made and says how
much build cache is left (``--prune-build-cache`` prunes the engine's unused
build cache, engine-wide).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from harbor_exec.jobs.prewarm import PrewarmEvent, prewarm_tasks, tally
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.images import build_cache_report
from harbor_exec.tasks.discovery import discover_tasks
from harbor_exec.trial.trial import image_tag_for


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_dataset(root: Path, n: int) -> None:
    shared = uuid.uuid4().hex
    for i in range(n):
        task = root / f"gen-{i:04d}"
        for sub in ("environment", "solution", "tests"):
            (task / sub).mkdir(parents=True)
        (task / "instruction.md").write_text("generated\n")
        (task / "task.toml").write_text("")
        (task / "environment" / "id.txt").write_text(f"{shared} {i}\n")
        (task / "environment" / "Dockerfile").write_text(
            f"FROM debian:bookworm-slim\nRUN echo {shared} > /shared\nCOPY id.txt /id.txt\n"
        )
        (task / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
        (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--prune-build-cache", action="store_true")
    args = parser.parse_args()
    runtime = DockerRuntime()
    jobs = args.jobs or runtime.engine_cpus()
    with tempfile.TemporaryDirectory(prefix="hx-bench-scale-") as scratch:
        root = Path(scratch)
        make_dataset(root, args.tasks)
        started = time.monotonic()
        tasks = discover_tasks(root).tasks
        print(f"{len(tasks)} tasks discovered in {time.monotonic() - started:.2f}s")
        print(f"builder {runtime.builder}, --jobs {jobs}; RSS before: {rss_mb():.1f} MB")
        finished = 0
        samples: list[tuple[int, float]] = [(0, rss_mb())]

        def on_event(event: PrewarmEvent) -> None:
            nonlocal finished
            if event.kind == "finished":
                finished += 1
                if finished % max(1, args.tasks // 10) == 0:
                    samples.append((finished, rss_mb()))
                    print(f"  {finished:>5} done, RSS {samples[-1][1]:.1f} MB", flush=True)

        started = time.monotonic()
        try:
            outcomes = prewarm_tasks(runtime, tasks, jobs=jobs, on_event=on_event)
            cold = time.monotonic() - started
            times = sorted(o.seconds for o in outcomes)
            print(f"cold: {cold:.1f}s wall, {tally(outcomes)}")
            median, p90 = statistics.median(times), times[int(len(times) * 0.9) - 1]
            print(f"per-task seconds: median {median:.2f}, p90 {p90:.2f}, max {times[-1]:.2f}")
            growth = samples[-1][1] - samples[1][1] if len(samples) > 1 else 0.0
            print(
                f"RSS: {samples[0][1]:.1f} MB before, {samples[1][1]:.1f} MB after "
                f"{samples[1][0]} tasks, {samples[-1][1]:.1f} MB after {samples[-1][0]} "
                f"(+{growth:.1f} MB over the last {samples[-1][0] - samples[1][0]} tasks)"
            )
            started = time.monotonic()
            again = prewarm_tasks(runtime, discover_tasks(root).tasks, jobs=jobs)
            warm = time.monotonic() - started
            print(
                f"warm second run (discovery included): {warm:.2f}s, "
                f"{warm / len(tasks) * 100:.2f}s per 100 tasks, {tally(again)}"
            )
        finally:
            started = time.monotonic()
            for task in tasks:
                runtime.remove_image(image_tag_for(task))
            print(f"removed {len(tasks)} images in {time.monotonic() - started:.1f}s")
    print(build_cache_report(runtime, prune=args.prune_build_cache))
    runtime.close()


if __name__ == "__main__":
    main()
