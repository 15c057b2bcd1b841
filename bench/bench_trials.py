"""Oracle trials of the example dataset against a floor of direct Docker SDK calls.

    .venv/bin/python bench/bench_trials.py [--rounds 3] [--package-cache]

The floor does only what any oracle trial must: create the container, put the
solution, start, exec solve.sh, put the tests, exec test.sh, read the reward,
remove. harbor-exec does the same work plus its bookkeeping (task loading,
result.json, logs, deadlines). Printed as ratios (targets: <= 1.3x per trial at
concurrency 1; 12 trials at concurrency 4 in under 3 s). Images are warmed first.

``--package-cache``: also each trial through the package cache (as every command runs
them by default), printed as its ratio to the same trial without it: what the cache
costs a task that fetches nothing (the egress proxy, its forwarder, the trust mounts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import docker.types

from harbor_exec.sandbox.archives import ArchiveEntry, build_archive, tree_entries
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.seccomp import SeccompProfiles
from harbor_exec.tasks.discovery import discover_tasks
from harbor_exec.tasks.task import Task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import ContainerLimits, SandboxPolicy
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest, ensure_task_image

ROOT = Path(__file__).resolve().parent.parent
SECCOMP = SeccompProfiles()
LOG_DIRS = [ArchiveEntry(p, None, 0o777) for p in ("/logs", "/logs/agent", "/logs/verifier")]


def floor_trial(api: docker.APIClient, image: str, task: Task) -> float:
    """The same steps, straight through the SDK: returns the reward."""
    network = "none" if task.config.environment.network_mode == "no-network" else None
    # The limits a trial gets (the task's own, else the defaults), so the ratio is fair.
    limits = ContainerLimits.resolve(SandboxPolicy(), task.config.environment)
    host_config = api.create_host_config(
        init=True,
        network_mode=network,
        nano_cpus=int(limits.cpus * 1e9),
        mem_limit=f"{limits.memory_mb}m",
        memswap_limit=f"{limits.memory_mb}m",
        pids_limit=limits.pids_limit,
        shm_size=f"{limits.shm_mb}m",
        ulimits=[
            docker.types.Ulimit(name="nofile", soft=limits.nofile_limit, hard=limits.nofile_limit)
        ],
        # The profile trials run under (a larger filter than Docker's built-in one).
        security_opt=[SECCOMP.security_opt()],
    )
    container = api.create_container(image, ["sleep", "infinity"], host_config=host_config)["Id"]
    try:
        solution = tree_entries(task.solution_dir, "/solution", executable=["solve.sh"])
        api.put_archive(container, "/", build_archive(LOG_DIRS + solution))
        api.start(container)
        workdir = task.config.environment.workdir
        env = {"DEBIAN_FRONTEND": "noninteractive", **task.config.solution.env}
        env = {
            k: v.replace("${HARBOR_EXEC_EXAMPLE_GREETING:-bonjour}", "bonjour")
            for k, v in env.items()
        }
        solve = api.exec_create(
            container,
            ["bash", "-c", "(/solution/solve.sh) > /logs/agent/oracle.txt 2>&1"],
            environment=env,
            workdir=workdir,
        )
        api.exec_start(solve["Id"])
        api.put_archive(
            container,
            "/",
            build_archive(tree_entries(task.tests_dir, "/tests", executable=["test.sh"])),
        )
        test = api.exec_create(
            container,
            ["bash", "-c", "(/tests/test.sh) > /logs/verifier/test-stdout.txt 2>&1"],
            environment=task.config.verifier.env,
            workdir=workdir,
        )
        api.exec_start(test["Id"])
        stream, _ = api.get_archive(container, "/logs/verifier")
        data = b"".join(stream)
        return 1.0 if data else 0.0
    finally:
        api.remove_container(container, force=True)


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dataset", type=Path, default=ROOT / "tasks_examples" / "dataset")
    parser.add_argument("--package-cache", action="store_true", help="also through the cache")
    args = parser.parse_args()

    runtime = DockerRuntime()
    api = docker.from_env(max_pool_size=32).api
    tasks = discover_tasks(args.dataset).tasks
    images = {task.name: ensure_task_image(runtime, task)[0] for task in tasks}
    scratch = Path(tempfile.mkdtemp(prefix="hx-bench-"))

    def ours(task: Task) -> None:
        result = run_trial(runtime, TrialRequest(TrialSpec(task=task, trials_dir=scratch)))
        assert result.reward_valid, (task.name, result.exception_info)

    def floor(task: Task) -> None:
        floor_trial(api, images[task.name], task)

    # Warm both paths once (connection pools, page cache).
    for task in tasks:
        ours(task)
        floor(task)

    print(f"oracle trials of {len(tasks)} example tasks, {args.rounds} rounds, concurrency 1")
    print(f"{'task':36} {'floor ms':>9} {'ours ms':>9} {'ratio':>6}")
    ratios = []
    for task in tasks:
        floor_s = statistics.median(timed(lambda t=task: floor(t)) for _ in range(args.rounds))
        ours_s = statistics.median(timed(lambda t=task: ours(t)) for _ in range(args.rounds))
        ratios.append(ours_s / floor_s)
        print(f"{task.name:36} {floor_s * 1000:9.0f} {ours_s * 1000:9.0f} {ours_s / floor_s:6.2f}")
    print(f"median ratio per trial: {statistics.median(ratios):.2f}x (target <= 1.3x)")

    batch = (tasks * 12)[:12]
    for label, fn in (("floor", floor), ("ours", ours)):
        walls = []
        for _ in range(args.rounds):
            with ThreadPoolExecutor(max_workers=4) as pool:
                started = time.perf_counter()
                list(pool.map(fn, batch))
                walls.append(time.perf_counter() - started)
        wall = statistics.median(walls)
        print(f"12 trials at concurrency 4, {label}: {wall:.2f}s wall")
        if label == "floor":
            floor_wall = wall
    print(f"concurrency-4 ratio: {wall / floor_wall:.2f}x; target: ours under 3 s")
    if args.package_cache:
        _through_the_cache(runtime, tasks, scratch, args.rounds)
    runtime.close()
    return 0


def _through_the_cache(
    runtime: DockerRuntime, tasks: list[Task], scratch: Path, rounds: int
) -> None:
    from harbor_exec.network.packages.config import PackageCacheConfig
    from harbor_exec.network.packages.service import PackageCacheService

    service = PackageCacheService(PackageCacheConfig(root=scratch / "package-cache"))

    def run(task: Task, cached: bool) -> None:
        spec = TrialSpec(task=task, trials_dir=scratch)
        request = TrialRequest(spec, package_cache=service if cached else None)
        result = run_trial(runtime, request)
        assert result.reward_valid, (task.name, result.exception_info)

    try:
        for task in tasks:
            run(task, True)
        print(f"{'task':36} {'off ms':>9} {'cache ms':>9} {'ratio':>6}")
        ratios = []
        for task in tasks:
            off: list[float] = []
            on: list[float] = []
            for _ in range(max(rounds, 5)):  # interleaved: the machine's drift hits both
                off.append(timed(lambda t=task: run(t, False)))
                on.append(timed(lambda t=task: run(t, True)))
            ratio = statistics.median(on) / statistics.median(off)
            ratios.append(ratio)
            print(
                f"{task.name:36} {statistics.median(off) * 1000:9.0f} "
                f"{statistics.median(on) * 1000:9.0f} {ratio:6.2f}"
            )
        print(
            f"median ratio, through the package cache / without: {statistics.median(ratios):.2f}x"
        )
    finally:
        service.close()


if __name__ == "__main__":
    sys.exit(main())
