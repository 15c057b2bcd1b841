"""``harbor-exec validate`` of 12 oracle trials at concurrency 4 against the direct-SDK
floor doing the same 12 trials at concurrency 4, in one run.

    flock /tmp/docker-tests.lock .venv/bin/python bench/bench_validate.py [--rounds 3]

Rounds alternate: the floor (``bench_trials.floor_trial`` on 4 threads), then
``validate TASK -k 12 -n 4`` as a user runs it (a new CLI process: its start-up counts),
then the same with ``--warm-containers 0`` (no trials started ahead of their slot).
Printed: the wall time of each (median over rounds), the CLI's own start-up apart (the
job's time from its ``result.json``), and the ratios to the floor; then where the CPU went
in each (medians, seconds for the whole batch): the driver (the floor's threads in this
process, or the ``harbor-exec`` process and what it waited for), the engine's daemons
(``dockerd`` and ``containerd`` with the children they reaped), and the containers'
processes (the engine's cgroup, ``cpuacct`` or ``cpu.stat``). Images are warm.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


DAEMONS = ("dockerd", "containerd")
CONTAINER_CGROUPS = (  # the engine's parent cgroup (cgroupfs driver): v1, then v2
    Path("/sys/fs/cgroup/cpuacct/docker/cpuacct.usage"),
    Path("/sys/fs/cgroup/docker/cpu.stat"),
)


def _daemons_cpu() -> float:
    """The daemons' CPU seconds so far, with the children they reaped (runc)."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or (entry / "comm").read_text().strip() not in DAEMONS:
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _containers_cpu() -> float | None:
    """Every container's processes' CPU seconds so far (the engine's parent cgroup keeps
    what removed containers used); None where the layout is another."""
    for path in CONTAINER_CGROUPS:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.name == "cpuacct.usage":
            return int(text) / 1e9
        return int(text.split("usage_usec", 1)[1].split()[0]) / 1e6
    return None


def _driver_cpu() -> float:
    """This process's CPU and that of the children it waited for."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _machine_cpu() -> float:
    """Every CPU's busy seconds so far (``/proc/stat``: all but idle and iowait), which
    counts what the three above miss: the engine's short-lived helpers (``runc``, the
    shims) and the kernel's own work for namespaces, mounts and cgroups."""
    ticks = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


CpuSample = tuple[float, float, float | None, float]


def _cpu_now() -> CpuSample:
    return _driver_cpu(), _daemons_cpu(), _containers_cpu(), _machine_cpu()


def _cpu_since(before: CpuSample) -> CpuSample:
    after = _cpu_now()
    containers = None if after[2] is None or before[2] is None else after[2] - before[2]
    return after[0] - before[0], after[1] - before[1], containers, after[3] - before[3]


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

    ways = ("floor", "validate", "validate, none ahead")
    walls: dict[str, list[float]] = {way: [] for way in ways}
    jobs: dict[str, list[float]] = {way: [] for way in ways[1:]}
    cpu: dict[str, list[CpuSample]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory(prefix="bench-validate-") as scratch:
        floor()  # warm: connection pools, page cache
        _validate(args.task, Path(scratch), "warm-up")
        for round_ in range(args.rounds):
            before = _cpu_now()
            walls["floor"].append(floor())
            cpu["floor"].append(_cpu_since(before))
            for way, extra in (
                ("validate", ()),
                ("validate, none ahead", ("--warm-containers", "0")),
            ):
                before = _cpu_now()
                wall, job = _validate(args.task, Path(scratch), f"{len(way)}-{round_}", *extra)
                cpu[way].append(_cpu_since(before))
                walls[way].append(wall)
                jobs[way].append(job)
    runtime.close()
    floor_s = statistics.median(walls["floor"])
    print(f"{TRIALS} oracle trials of {task.name} at concurrency {CONCURRENCY}, "
          f"{args.rounds} rounds (medians)")  # fmt: skip
    print(f"{'way':22} {'wall':>7} {'job':>7} {'wall/floor':>11} {'job/floor':>10}")
    print(f"{'floor':22} {floor_s:6.2f}s {'':>7} {1.0:10.2f}x")
    for way in ways[1:]:
        wall, job = statistics.median(walls[way]), statistics.median(jobs[way])
        print(f"{way:22} {wall:6.2f}s {job:6.2f}s {wall / floor_s:10.2f}x {job / floor_s:9.2f}x")
    print(
        f"\nCPU seconds per batch: {'driver':>8} {'daemons':>8} {'containers':>11} {'total':>7}"
        f" {'machine':>8}"
    )
    for way in ways:
        driver = statistics.median(c[0] for c in cpu[way])
        daemons = statistics.median(c[1] for c in cpu[way])
        inside = [c[2] for c in cpu[way] if c[2] is not None]
        containers = statistics.median(inside) if inside else float("nan")
        total = driver + daemons + (containers if inside else 0.0)
        machine = statistics.median(c[3] for c in cpu[way])
        print(
            f"{way:22} {driver:16.2f} {daemons:8.2f} {containers:11.2f} {total:7.2f} {machine:8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
