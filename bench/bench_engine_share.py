"""The engine's share of an oracle trial: Engine API calls, the daemons' CPU and wall
time per trial, side by side in one run, for each way of running it.

    flock /tmp/docker-tests.lock .venv/bin/python bench/bench_engine_share.py [--trials 12]

Ways (interleaved, one trial at a time, images warm): ``floor``, the same steps
straight through the Docker SDK (``bench/bench_trials.py``'s floor: create, put the
solution, start, exec solve.sh, put the tests, exec test.sh, read the reward,
remove); ``engine exec``, harbor-exec with every command an Engine API exec
(``--no-command-channel``); ``channel``, harbor-exec with its command channel (the
default) and no warm containers (``warm_containers=0``); ``channel + warm``, the
defaults: the command channel and a container the warm pool made ahead of the trial
(``harbor_exec.trial.warm``). API calls are counted where the SDK sends them (every
HTTP request to the engine, the floor's too); the daemons' CPU is ``dockerd``'s and
``containerd``'s (user + system, from ``/proc``). Wall time is the trial's; calls and
CPU run on until the warm pool has made the next trial's container again, so that they
carry what the pool spent for the trial off its path. Printed per trial (medians) and as
ratios to the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import docker
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_trials import floor_trial
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.task import Task, load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest, ensure_task_image
from harbor_exec.trial.warm import WarmPool

ROOT = Path(__file__).resolve().parents[1]
DAEMONS = ("dockerd", "containerd")


class _Calls:
    """Every request any SDK client sends, counted."""

    def __init__(self) -> None:
        self.count = 0
        original = requests.Session.send

        def send(session: requests.Session, *args: object, **kwargs: object) -> object:
            self.count += 1
            return original(session, *args, **kwargs)

        requests.Session.send = send  # type: ignore[method-assign,assignment]


def _daemon_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() in DAEMONS:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _cpu_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12, help="trials per way")
    parser.add_argument("--task", type=Path, default=ROOT / "tasks_examples" / "template")
    args = parser.parse_args()
    calls = _Calls()
    runtime = DockerRuntime()
    api = docker.from_env().api
    task = load_task(args.task)
    image = ensure_task_image(runtime, task)[0]
    scratch = Path(tempfile.mkdtemp(prefix="hx-bench-engine-"))
    daemons = _daemon_pids()

    pool = WarmPool(runtime)

    def ours(channel: bool, warm: bool = False) -> Callable[[Task], None]:
        def trial(task: Task) -> None:
            policy = SandboxPolicy(command_channel=channel, warm_containers=int(warm))
            spec = TrialSpec(task=task, trials_dir=scratch, policy=policy)
            result = run_trial(runtime, TrialRequest(spec, warm_pool=pool if warm else None))
            assert result.reward_valid, result.exception_info

        return trial

    def refilled() -> None:
        deadline = time.monotonic() + 30
        while pool.stats().idle < 1 and time.monotonic() < deadline:
            time.sleep(0.005)

    ways: dict[str, Callable[[Task], object]] = {
        "floor": lambda task: floor_trial(api, image, task),
        "engine exec": ours(False),  # and no warm containers (warm_containers=0)
        "channel": ours(True),
        "channel + warm": ours(True, warm=True),
    }
    settle: dict[str, Callable[[], None]] = {"channel + warm": refilled}
    rows: dict[str, list[tuple[int, float, float]]] = {name: [] for name in ways}
    for name, way in ways.items():  # one of each first: every path warm
        way(task)
        settle.get(name, lambda: None)()
    for _ in range(args.trials):
        for name, way in ways.items():
            before_calls, before_cpu = calls.count, _cpu_seconds(daemons)
            started = time.perf_counter()
            way(task)
            wall = time.perf_counter() - started
            settle.get(name, lambda: None)()
            rows[name].append(
                (calls.count - before_calls, _cpu_seconds(daemons) - before_cpu, wall)
            )
    stats = pool.stats()
    pool.close()
    floor = {
        "calls": statistics.median(r[0] for r in rows["floor"]),
        "cpu": statistics.median(r[1] for r in rows["floor"]),
        "wall": statistics.median(r[2] for r in rows["floor"]),
    }
    print(f"{args.trials} oracle trials of {task.name} per way, interleaved (medians per trial)")
    print(f"{'way':15} {'API calls':>9} {'daemon CPU':>11} {'wall':>8}   ratios to the floor")
    for name, got in rows.items():
        n, cpu, wall = (statistics.median(r[i] for r in got) for i in range(3))
        print(
            f"{name:15} {n:9.0f} {cpu * 1000:8.0f} ms {wall * 1000:5.0f} ms   "
            f"calls {n / floor['calls']:.2f}x, CPU {cpu / max(floor['cpu'], 1e-9):.2f}x, "
            f"wall {wall / floor['wall']:.2f}x"
        )
    print(
        f"warm pool: {stats.hits} hits, {stats.misses} misses, claim p50 "
        f"{(stats.claim_seconds_p50 or 0) * 1000:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
