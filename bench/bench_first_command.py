"""A served task's rollout: its arrival to its agent's first command, with and without
warm containers, in one run.

    flock /tmp/docker-tests.lock .venv/bin/python bench/bench_first_command.py [--rollouts 40]

Serves a trivial oracle task (its ``solve.sh`` first writes the time) with
HarborBackend behind the real HTTP server on 127.0.0.1, and posts rollouts at a steady
rate (``--rate``, 2/s) after a warm-up; each rollout's latency is from the moment its
``POST /rollout`` was sent to the time its ``solve.sh`` wrote (the container and the
host share the clock). Three servers, one after the other: the defaults (warm
containers), ``warm_containers=0`` (every container created for its rollout: the drained
pool's path) and the path before either (``command_channel=False``: every command an
engine exec, no warm containers). Prints p50, p90 and p99 of each and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harbor_exec.backends.harbor.backend import HarborBackend  # noqa: E402
from harbor_exec.server.app import create_rollout_server  # noqa: E402
from tests.server_utils import serve  # noqa: E402
from tests.task_factory import make_task  # noqa: E402

FIRST = "date +%s.%N > /logs/agent/first.txt\n"


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def steady(url: str, trials: Path, n: int, rate: float, prefix: str) -> list[float]:
    """``n`` rollouts at ``rate`` per second; each one's arrival-to-first-command seconds."""
    sent: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=120) as http:

        async def one(rollout_id: str) -> None:
            body = {
                "rollout_id": rollout_id,
                "initial_messages": [{"role": "user", "content": "go"}],
                "chat_completions_url": "http://127.0.0.1:9/v1",
                "metadata": {"harbor_task_id": "first-command"},
            }
            sent[rollout_id] = time.time()
            answer = await http.post(f"{url}/rollout", json=body)
            assert answer.status_code == 202, answer.text
            while True:
                status = (await http.get(f"{url}/rollout/{rollout_id}/status")).json()
                if status["status"] in ("success", "failure", "cancelled"):
                    assert status["status"] == "success", status
                    return
                await asyncio.sleep(0.05)

        tasks = []
        start = time.monotonic()
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(f"{prefix}-{i}")))
        await asyncio.gather(*tasks)
    return await asyncio.to_thread(_latencies, trials, sent)


def _latencies(trials: Path, sent: dict[str, float]) -> list[float]:
    latencies = []
    for rollout_id, at in sent.items():
        (first,) = trials.glob(f"{rollout_id}__*/agent/first.txt")
        latencies.append(float(first.read_text()) - at)
    return latencies


def run(
    name: str, warm: int, channel: bool, rollouts: int, warmup: int, rate: float, scratch: Path
) -> list[float]:
    tasks = scratch / f"tasks-{name}"
    make_task(
        tasks,
        "first-command",
        solve=FIRST,
        toml='[environment]\nnetwork_mode = "no-network"\n',
    )
    trials = scratch / f"trials-{name}"
    backend = HarborBackend(
        tasks_dir=tasks,
        task_mode="dataset",
        agent="oracle",
        trials_dir=trials,
        artifacts_dir=scratch / f"artifacts-{name}",
        cleanup_successful_trials=False,
        warm_containers=warm,
        command_channel=channel,
    )
    app = create_rollout_server(backend=backend, artifact_root=scratch / f"server-{name}")
    with serve(app) as url:
        asyncio.run(steady(url, trials, warmup, rate, f"warmup-{name}"))
        return asyncio.run(steady(url, trials, rollouts, rate, f"measured-{name}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--rate", type=float, default=2.0, help="rollouts per second")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll otherwise
    scratch = Path(tempfile.mkdtemp(prefix="hx-bench-first-"))
    rows: dict[str, list[float]] = {}
    ways = (
        ("warm containers", 4, True),
        ("cold (warm_containers=0)", 0, True),
        ("before (engine exec, cold)", 0, False),
    )
    for index, (name, warm_containers, channel) in enumerate(ways):
        rows[name] = run(
            f"way{index}", warm_containers, channel, args.rollouts, args.warmup, args.rate, scratch
        )
    print(
        f"{args.rollouts} rollouts at {args.rate:g}/s after {args.warmup} to warm up: "
        "arrival (POST sent) to the agent's first command"
    )
    for name, got in rows.items():
        print(
            f"{name:26} p50 {quantile(got, 0.5) * 1000:6.0f} ms  "
            f"p90 {quantile(got, 0.9) * 1000:6.0f} ms  p99 {quantile(got, 0.99) * 1000:6.0f} ms  "
            f"mean {statistics.mean(got) * 1000:6.0f} ms"
        )
    warm, cold = rows["warm containers"], rows["cold (warm_containers=0)"]
    before = rows["before (engine exec, cold)"]
    for label, got, base in (("warm/cold", warm, cold), ("cold/before", cold, before)):
        print(
            f"{label}: p50 {quantile(got, 0.5) / quantile(base, 0.5):.2f}x, "
            f"p99 {quantile(got, 0.99) / quantile(base, 0.99):.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
